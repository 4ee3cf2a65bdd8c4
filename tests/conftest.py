import os
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


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``scripts/test.sh``: ``-n 2 --dist loadgroup``) every test of a module
    with ``LAUNCH_CASES`` runs on one worker: the session's launches run once each, one after
    another, while the other worker runs single-process tests on the other core."""
    for item in items:
        if item.module is not None and hasattr(item.module, "LAUNCH_CASES"):
            item.add_marker(pytest.mark.xdist_group("launches"))


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
