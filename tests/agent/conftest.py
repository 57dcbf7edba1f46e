"""Fixtures of the agent's tests (tests/agent/): hosts (outbox + runner over a home), the
fake server, a gate file for jobs that wait, and the agent as a real process."""
import pytest

from agentutil import Host
from fake_server import FakeServer
from procs import AgentProc, kill_leftover_jobs


@pytest.fixture
def hosts():
    made = []

    def make(home, **kw):
        h = Host(home, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.stop()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.stop()


@pytest.fixture
def gate(tmp_path):
    """A file a job waits for; touched at teardown too, so a test that fails leaves no
    job (and no shim) behind."""
    path = tmp_path / "gate"
    yield path
    path.touch()


@pytest.fixture
def fake_server():
    s = FakeServer(heartbeat_s=0.5, keep_points=False)
    yield s
    s.stop()


@pytest.fixture
def agent_proc(tmp_path, fake_server):
    made = []

    def make(name="box", extra=()):
        a = AgentProc(fake_server, tmp_path / f"agent-{name}", name, 1, 4,
                      ["--heartbeat", "0.5", *extra])
        made.append(a)
        a.start(wait=False)
        fake_server.wait_for(lambda: fake_server.syncs, what=f"agent {name} synced "
                             f"(log {a.log_path})")
        return a
    yield make
    for a in made:
        a.stop()
        kill_leftover_jobs(a.home)
