"""Fault-injection suite: real servers, real agents, real jobs, faults on purpose.

Runs alone with `pytest tests/faults -q`. The bounded default fits a few minutes on two
cores; `--faults-long` (or FAULTS_LONG=1) runs the issue's full sizes. Each test prints a
one-line `FAULTS name: ...` summary (see it with -s) and appends it as a JSON line to the
file named by FAULTS_REPORT when that is set. docs/reliability.md has the figures.

This directory is a package (its __init__.py) so its modules never shadow the
`conftest` module other test files import helpers from.
"""
import pytest

from .helpers import long_mode


def pytest_addoption(parser):
    # Picked up when tests/faults is on the command line (pytest loads this conftest
    # before parsing options then); from elsewhere use FAULTS_LONG=1.
    parser.addoption("--faults-long", action="store_true", default=False,
                     help="fault-injection suite: run the issue's full sizes (minutes)")


@pytest.fixture
def faults_long(request):
    return long_mode(request.config)


@pytest.fixture
def job_home(tmp_path):
    """A GPUCTL_HOME for the SDK inside jobs, so their spools stay in this test."""
    d = tmp_path / "jobhome"
    d.mkdir()
    return d
