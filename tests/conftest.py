"""Fixtures with real processes; the classes behind them live in tests/procs.py."""
import pytest

from procs import AgentProc, ServerProc, kill_leftover_jobs

@pytest.fixture
def server_factory(tmp_path):
    made = []

    def make(settings=None, name="server"):
        s = ServerProc(tmp_path / name, settings)
        made.append(s)
        return s.start()
    yield make
    for s in made:
        s.stop()


@pytest.fixture
def live_server(server_factory):
    return server_factory()


@pytest.fixture
def agent_factory(tmp_path):
    made = []

    def make(server, name="node1", fake_gpus=2, cpu_slots=4, extra=(), wait=True):
        a = AgentProc(server, tmp_path / f"agent-{name}", name, fake_gpus, cpu_slots, extra)
        made.append(a)
        return a.start(wait=wait)
    yield make
    for a in made:
        a.stop()
    # Jobs run in their own sessions; make sure none outlives the test.
    for a in made:
        kill_leftover_jobs(a.home)


@pytest.fixture
def agent(live_server, agent_factory):
    return agent_factory(live_server)
