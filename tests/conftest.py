import os

import pytest

# Many simulated ranks share two cores; one thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_SUMMARY = pytest.StashKey[list]()


@pytest.fixture
def report_line(pytestconfig):
    """Call with a line to print in the run's closing summary (figures a person should see)."""
    lines = pytestconfig.stash.setdefault(_SUMMARY, [])
    return lines.append


def pytest_terminal_summary(terminalreporter, config):
    for line in config.stash.get(_SUMMARY, []):
        terminalreporter.write_line(line)
