"""Plan a model with ``autopar plan --html`` and screenshot the page with headless Chromium.

    python scripts/render_report.py                      # gpt2 on 8 devices -> report.png
    python scripts/render_report.py --model gpt-tiny --gpus 4 --png /tmp/tiny.png

A manual check of the HTML report's layout (the test suite checks its structure without a
browser). Needs a Chromium binary (Debian: ``apt-get install chromium``); the browser gets
a throw-away profile and every background network feature off, and the page itself has no
external references.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("render_report: no chromium on PATH; install it (Debian: apt-get install -y chromium)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--hardware", default="a100-80gb")
    parser.add_argument("--batch", type=int, default=None, help="global batch size (default: the zoo entry's)")
    parser.add_argument("--html", default=os.path.join(tempfile.gettempdir(), "autopar-report.html"))
    parser.add_argument("--png", default="report.png")
    parser.add_argument("--window", default="1400,2400", help="browser window WIDTH,HEIGHT in pixels")
    args = parser.parse_args()

    html_path = os.path.abspath(args.html)
    batch = ["--batch", str(args.batch)] if args.batch else []
    subprocess.run([sys.executable, "-m", "autopar", "plan", args.model, "--gpus", str(args.gpus), "--hardware",
                    args.hardware, *batch, "--html", html_path, "--quiet"], check=True, stdout=subprocess.DEVNULL)
    png_path = os.path.abspath(args.png)
    with tempfile.TemporaryDirectory(prefix="autopar-chromium-") as profile:
        subprocess.run([find_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png_path}",
                        f"--window-size={args.window}", f"file://{html_path}"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    print(f"report {html_path}\nscreenshot {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
