"""A private single-node Slurm cluster per test module (tests/slurm/cluster.py), and
GPUPlane's server with an agent on it that runs `--runner slurm`.

Without Slurm (Debian: `apt-get install -y slurm-wlm munge`) the tests skip and say why;
under CI (CI=true), where .ci/run installs it, they fail instead.

This directory is a package (its __init__.py) so its conftest never shadows the
`conftest` module other test files import helpers from.
"""
import os

import pytest

from procs import AgentProc, ServerProc

from .cluster import SlurmCluster, missing


def _unavailable(reason):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {reason} (.ci/run installs slurm-wlm and munge)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    reason = missing()
    if reason:
        _unavailable(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except RuntimeError as e:
        _unavailable(f"the test cluster did not start: {e}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def slurm_env(slurm_cluster):
    """The agent finds the cluster through SLURM_CONF in its environment, as on a login
    node whose Slurm is not at the default path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(slurm_cluster.conf))
        yield slurm_cluster


@pytest.fixture(scope="module")
def slurm_server(tmp_path_factory, slurm_env):
    server = ServerProc(tmp_path_factory.mktemp("server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slurm_agent(tmp_path_factory, slurm_server, slurm_env):
    agent = AgentProc(slurm_server, tmp_path_factory.mktemp("agent"), "login1", 0, 0,
                      ["--runner", "slurm", "--slurm-partition", slurm_env.partition,
                       "--slurm-max-jobs", "8", "--sbatch-arg=--nice=5"])
    agent.start()
    yield agent
    agent.stop()
