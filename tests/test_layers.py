"""The import contract (issue 15 item 2): imports point one way down the pipeline, no module
imports a cycle back, no private name crosses a module boundary.

The contracts live in pyproject.toml (``[tool.importlinter]``) and are checked by
import-linter. autopar installs ``passes/``, ``cost_model/`` and ``runtime/`` as subpackages of
``autopar`` (pyproject's package-dir), which import-linter cannot see in the source tree, so the
check copies the sources into the installed layout first. Run by hand: ``python tests/test_layers.py``.
"""

import ast
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUT = {"autopar": "autopar", "passes": "autopar/passes", "cost_model": "autopar/cost_model",
          "runtime": "autopar/runtime"}
# Import cycles allowed (none): any cycle fails the test.
KNOWN_CYCLES: set = set()
# Private names imported across modules allowed (none).
KNOWN_PRIVATE: set = set()


def installed_layout(dest: pathlib.Path) -> pathlib.Path:
    """The package sources as installed (``autopar/passes/...``) under ``dest``."""
    for src, dst in LAYOUT.items():
        shutil.copytree(ROOT / src, dest / dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "data",
                                                                                  "passes", "cost_model", "runtime"),
                        dirs_exist_ok=True)
    return dest


def module_imports() -> list[tuple[str, str, str, int]]:
    """(importer, imported module, imported name, line) for every import of autopar's own modules,
    at any depth (lazy imports included)."""
    out = []
    for top, pkg in LAYOUT.items():
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT / top).with_suffix("").parts
            parts = pkg.split("/") + [p for p in rel if p != "__init__"]
            if top == "autopar" and rel[0] in ("passes", "cost_model", "runtime"):
                continue
            module = ".".join(parts)
            package = parts if path.name == "__init__.py" else parts[:-1]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    base = package[:len(package) - node.level + 1] if node.level else []
                    target = ".".join(base + ([node.module] if node.module else []))
                    for alias in node.names:
                        out.append((module, target, alias.name, node.lineno))
                elif isinstance(node, ast.Import):
                    out.extend((module, a.name, "", node.lineno) for a in node.names)
    return [i for i in out if i[1].split(".")[0] == "autopar"]


def _resolve(target: str, name: str, modules: set[str]) -> str:
    """``from target import name``: the module meant (a submodule, or target itself)."""
    return f"{target}.{name}" if f"{target}.{name}" in modules else target


def lint(dest: pathlib.Path) -> subprocess.CompletedProcess:
    installed_layout(dest)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    env = dict(os.environ, PYTHONPATH=str(dest))
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache", "--no-logo"], cwd=dest, env=env, capture_output=True, text=True,
                          timeout=300)


def test_import_contracts_hold(tmp_path):
    proc = lint(tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken" in proc.stdout, proc.stdout[-3000:]


def test_a_broken_contract_fails_the_check(tmp_path):
    """The check can fail: a vocabulary module importing the runtime breaks the layers contract."""
    installed_layout(tmp_path)
    with open(tmp_path / "autopar" / "mesh.py", "a") as f:
        f.write("\nfrom autopar.runtime import collectives as _up  # noqa: E402,F401\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(exe), "--no-cache", "--no-logo"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "autopar.mesh -> autopar.runtime.collectives" in proc.stdout, proc.stdout[-3000:]


def cycles(imports) -> list[frozenset]:
    """The import cycles (strongly connected modules) among ``imports``, lazy imports included."""
    modules = {i[0] for i in imports}
    graph = nx.DiGraph()
    for importer, target, name, _ in imports:
        dst = _resolve(target, name, modules)
        # importing autopar.x.y runs autopar.x's __init__ first: that is not a cycle of y's
        if dst != importer and dst in modules and not importer.startswith(dst + "."):
            graph.add_edge(importer, dst)
    return [frozenset(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def test_no_import_cycles_but_the_known_ones():
    found = cycles(module_imports())
    unexpected = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, unexpected
    # the check sees cycles: a lazy import of the driver from the vocabulary would make one
    broken = cycles(module_imports() + [("autopar.mesh", "autopar.runtime.parallel_module", "parallelize", 0)])
    assert any({"autopar.mesh", "autopar.runtime.parallel_module"} <= c for c in broken), broken


def test_no_private_name_imported_across_modules():
    modules = {i[0] for i in module_imports()}
    found = {(importer, target, name) for importer, target, name, _ in module_imports()
             if name.startswith("_") and not name.startswith("__") and _resolve(target, name, modules) == target}
    assert found <= KNOWN_PRIVATE, sorted(found - KNOWN_PRIVATE)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        p = lint(pathlib.Path(d))
        print(p.stdout, p.stderr)
        sys.exit(p.returncode)
