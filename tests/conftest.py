import os
import re
import sys

import pytest

# Many simulated ranks share two cores; one thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, os.path.dirname(__file__))
from launcher import Launches  # noqa: E402

_SUMMARY = pytest.StashKey[list]()
_LAUNCHES = pytest.StashKey[Launches]()


@pytest.fixture
def report_line(pytestconfig):
    """Call with a line to print in the run's closing summary (figures a person should see)."""
    lines = pytestconfig.stash.setdefault(_SUMMARY, [])
    return lines.append


@pytest.fixture(scope="session")
def launches(request, tmp_path_factory) -> Launches:
    """The session's multi-process launches (tests/launcher.py): one per world size, shared by
    every collected test module that declares ``LAUNCH_CASES``."""
    modules = {item.module for item in request.session.items
               if item.module is not None and hasattr(item.module, "LAUNCH_CASES")}
    made = Launches(modules, tmp_path_factory.mktemp("launches"))
    request.config.stash[_LAUNCHES] = made
    return made


@pytest.fixture
def launched(request, launches):
    """``launched(world)``: this test module's case results at ``world`` gloo ranks."""
    return lambda world: launches.results(request.module, world)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, on the controller
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``scripts/test.sh``: ``-n 2 --dist loadgroup``) every test module that
    declares ``LAUNCH_CASES`` (or starts process groups of its own) runs on one worker: the
    session's launches run once each, one after another, while the other worker runs the
    single-process modules on the other core.

    xdist's own loadgroup marks groups by renaming node ids, which pytest 9.2 no longer reads
    (``Node.nodeid`` comes from ``_id``), so the group is made here: xdist's load-by-scope
    scheduler with one scope for the launch modules and one per test elsewhere."""
    # These start process groups of their own (calibration's timed gloo ranks, torchrun, the
    # scheduler's real resize run): on the launch worker too, so they never run beside a launch.
    own_processes = {"tests/test_calibrate.py", "tests/test_resume.py", "tests/test_scheduler_real.py"}
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    declares: dict[str, bool] = {}

    def launch_module(path: str) -> bool:
        if path in own_processes:
            return True
        if path not in declares:
            text = (config.rootpath / path).read_text() if (config.rootpath / path).is_file() else ""
            declares[path] = re.search(r"^LAUNCH_CASES\b", text, re.M) is not None
        return declares[path]

    class LaunchesOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # as xdist's own load-by-file scheduler does
            return "launches" if launch_module(nodeid.split("::", 1)[0]) else nodeid

    return LaunchesOnOneWorker(config, log)


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its summary lines go to the controller
        made = session.config.stash.get(_LAUNCHES, None)
        workeroutput["autopar_summary"] = session.config.stash.get(_SUMMARY, []) + (made.summary if made else [])


@pytest.hookimpl(optionalhook=True)  # an xdist hook, called on the controller as a worker ends
def pytest_testnodedown(node, error):
    node.config.stash.setdefault(_SUMMARY, []).extend(getattr(node, "workeroutput", {}).pop("autopar_summary", []))


def pytest_terminal_summary(terminalreporter, config):
    made = config.stash.get(_LAUNCHES, None)
    for line in config.stash.get(_SUMMARY, []) + (made.summary if made else []):
        terminalreporter.write_line(line)
