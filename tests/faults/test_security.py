"""Security findings of issue 10, each with a test that failed before its fix
(docs/security.md): slow clients, stream caps, the home lock, admin rotation, file modes,
redaction and size caps, and what the HTTP layer does with bodies it did not read."""
import os
import socket
import sqlite3
import stat
import subprocess
import sys
import tomllib

import pytest
import requests

from procs import ROOT, ServerProc, _clean_env
from .helpers import db_path, report, wait_for


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the tests that need no settings of their own and leave nothing
    another test could trip on (each server start and stop costs seconds)."""
    s = ServerProc(tmp_path_factory.mktemp("shared") / "server").start()
    yield s
    s.stop()


def _slow_client(port):
    """A client that sends a request line and part of its headers, then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"GET /api/v1/status HTTP/1.1\r\nHost: x\r\n")
    return s


def _closed_by_server(s):
    try:
        return s.recv(1024) == b""
    except (ConnectionResetError, socket.timeout):
        return True


def test_clients_that_never_finish_their_headers_are_dropped(server_factory):
    # Before: each such client held a pool thread for ever; 8 of them froze the API.
    server = server_factory({"threads": 8, "header_timeout_s": 1})
    slow = [_slow_client(server.port) for _ in range(30)]
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
    try:
        # a partial request line and a client that sent nothing hold no thread either
        for _ in range(5):
            server.api.get("/api/v1/status", expect=200, timeout=5)
        for s in slow:
            s.settimeout(10)
        dropped = sum(_closed_by_server(s) for s in slow)
        report("slow-headers", clients=len(slow), dropped=dropped)
        assert dropped == len(slow)
        server.api.get("/api/v1/status", expect=200, timeout=5)
        # endless headers: a 431 with the error shape once they pass 64 KiB
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as big:
            big.sendall(b"GET / HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 70_000)
            answer = big.recv(4096)
        assert answer.startswith(b"HTTP/1.1 431") and b"HeadersTooLarge" in answer
    finally:
        for s in slow + idle:
            s.close()


def test_long_lived_streams_are_capped_below_the_thread_count(server_factory):
    # threads 8: 2 for REST, 2 reserved for agents, so 4 followers; the 5th gets a 503.
    server = server_factory({"threads": 8, "agent_threads": 2, "rest_threads": 2})
    job = server.api.submit(["python", "-c", "pass"], "/tmp", gpus=1)   # queued: no agent
    url = f"{server.url}/api/v1/jobs/{job['id']}/logs/stream"
    auth = {"Authorization": f"Bearer {server.token}"}
    held = []
    try:
        for _ in range(4):
            r = requests.get(url, headers=auth, stream=True, timeout=5)
            assert r.status_code == 200
            held.append(r)
        refused = requests.get(url, headers=auth, timeout=5)
        assert refused.status_code == 503, refused.text
        assert refused.headers.get("Retry-After")
        assert "threads" in refused.json()["error"]["message"]
        for _ in range(5):
            server.api.get("/api/v1/health", expect=200, timeout=5)
            server.api.get("/api/v1/status", expect=200, timeout=5)
        # a follower that hangs up gives its slot back (within a second, not at the next
        # keepalive 15 s later)
        held.pop().close()

        def admitted():
            r = requests.get(url, headers=auth, stream=True, timeout=5)
            if r.status_code == 200:
                held.append(r)
                return True
            r.close()
        wait_for(admitted, 10, interval=0.2, what="a freed follower slot")
    finally:
        for r in held:
            r.close()


def test_second_server_on_the_same_home_is_refused(live_server):
    # Before: it started, marked the first one's agents disconnected, and 60 s later their
    # jobs were declared lost.
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from gpuplane.server import serve; "
         "serve(sys.argv[1])", str(live_server.home)],
        cwd=ROOT, env=_clean_env(live_server.home), capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "another GPUPlane server" in out.stderr and "is running on the home" in out.stderr
    live_server.api.get("/api/v1/health", expect=200)


def test_a_heartbeat_restores_a_node_marked_disconnected(live_server, agent):
    with sqlite3.connect(db_path(live_server), timeout=30) as c:
        c.execute("UPDATE nodes SET state = 'disconnected', synced = 0")
    wait_for(lambda: (n := agent.node())["state"] == "connected" and n["synced"], 10,
             what="the heartbeat to restore the node")


def test_rotated_admin_token_is_revoked_at_start(server_factory):
    server = server_factory()
    old = server.token
    server.stop()
    path = server.home / "server.toml"
    text = path.read_text().replace(old, "gpa_rotated-admin-token-0123456789")
    path.write_text(text)
    server.start()
    assert server.token == "gpa_rotated-admin-token-0123456789"
    r = requests.get(server.url + "/api/v1/auth/whoami",
                     headers={"Authorization": f"Bearer {old}"}, timeout=5)
    assert r.status_code == 401
    server.api.get("/api/v1/auth/whoami", expect=200)
    assert "revoked admin token" in server.log_path.read_text()


def test_short_admin_token_refused_at_start(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "server.toml").write_text('admin_token = "hunter2"\nport = 1\n')
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from gpuplane.server import serve; "
         "serve(sys.argv[1])", str(home)],
        cwd=ROOT, env=_clean_env(home), capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "admin_token in server.toml must be a string of at least 16" in out.stderr


def test_server_files_are_private(shared):
    home = shared.home
    shared.api.submit(["true"], "/tmp", env={"WANDB_API_KEY": "secret"})
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(home / "server").st_mode) == 0o700
    files = [home / "server.toml", *home.glob("server/gpuctl.db*")]
    assert len(files) >= 3, files            # the database, its WAL and shared memory
    modes = {f.name: oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files}
    assert set(modes.values()) == {"0o600"}, modes


def test_read_tokens_see_env_names_not_values(shared):
    api = shared.api
    job = api.submit(["true"], "/tmp", env={"WANDB_API_KEY": "s3cret", "LR": "0.1"})
    read = api.post("/api/v1/tokens", {"name": "viewer", "scope": "read"}, expect=201)
    viewer = requests.Session()
    viewer.headers["Authorization"] = f"Bearer {read['token']}"
    seen = viewer.get(f"{shared.url}/api/v1/jobs/{job['id']}", timeout=5).json()
    assert seen["env"] == {"WANDB_API_KEY": "<redacted>", "LR": "<redacted>"}
    assert api.job(job["id"])["env"]["WANDB_API_KEY"] == "s3cret"     # a write token sees it
    # list views leave env out for everyone
    for path, key in (("/api/v1/jobs", "jobs"), ("/api/v1/queue", "jobs")):
        listed = viewer.get(shared.url + path, timeout=5).json()[key]
        assert listed and all("env" not in j for j in listed), path
    status = viewer.get(shared.url + "/api/v1/status", timeout=5).json()
    assert "s3cret" not in str(status)
    # the dashboard's stream too (its job and status topics)
    with viewer.get(f"{shared.url}/api/v1/stream?topics=job:{job['id']},status",
                    stream=True, timeout=10) as s:
        seen = {}
        for raw in s.iter_lines(decode_unicode=True):
            if raw.startswith("data: "):
                msg = json.loads(raw[6:])
                seen[msg["topic"]] = msg["data"]
            if len(seen) == 2:
                break
    assert seen[f"job:{job['id']}"]["env"]["WANDB_API_KEY"] == "<redacted>"
    assert "s3cret" not in json.dumps(seen)


def test_job_size_caps_and_nul(shared):
    api = shared.api
    big_env = {f"K{i}": "x" * 1000 for i in range(70)}
    api.post("/api/v1/jobs", {"command": ["true"], "working_dir": "/tmp", "env": big_env},
             expect=413)
    assert "65536" in api.last.json()["error"]["message"]
    api.post("/api/v1/jobs", {"command": ["echo", "x" * 40_000], "working_dir": "/tmp"},
             expect=413)
    assert "32768" in api.last.json()["error"]["message"]
    api.post("/api/v1/jobs", {"command": ["echo", "a\0b"], "working_dir": "/tmp"}, expect=400)
    assert "NUL" in api.last.json()["error"]["message"]
    api.post("/api/v1/jobs", {"command": "echo a\0b", "working_dir": "/tmp"}, expect=400)


def test_last_event_id_out_of_range_is_a_400(shared):
    job = shared.api.submit(["true"], "/tmp", gpus=1)
    for bad in (str(2**63), str(2**70), "-1"):
        r = requests.get(f"{shared.url}/api/v1/jobs/{job['id']}/logs/stream",
                         headers={"Authorization": f"Bearer {shared.token}",
                                  "Last-Event-ID": bad}, timeout=5)
        assert r.status_code == 400, (bad, r.status_code)
    assert "OverflowError" not in shared.log_path.read_text()


@pytest.mark.parametrize("method,path,auth,status", [
    ("POST", "/api/v1/runs/1/metrics", False, 401),
    ("POST", "/api/v1/runs/999999/metrics", True, 404),
    ("PUT", "/api/v1/jobs", True, 405),
])
def test_an_unread_large_body_does_not_break_the_next_request(shared, method, path,
                                                              auth, status):
    # Before: 'Connection: keep-alive', then gunicorn dropped the connection (it drains
    # at most 64 KiB), and the client's next request on it got no answer.
    s = requests.Session()
    if auth:
        s.headers["Authorization"] = f"Bearer {shared.token}"
    body = b'{"points": [' + b'["loss", 1, 0.5],' * 9000 + b'["loss", 2, 0.5]]}'
    assert len(body) > 140_000
    r = s.request(method, shared.url + path, data=body,
                  headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == status
    assert r.json()["error"]["code"]
    # the same session's next request is answered
    assert s.get(shared.url + "/api/v1/health", timeout=10).status_code == 200


def test_a_database_that_cannot_be_written_is_a_503_and_health_says_so(tmp_path):
    # Before: 500 InternalError, and /health said ok. Here SQLite's own read-only switch
    # on the connection every write goes through stands in for a full disk or a read-only
    # file.
    from gpuplane.app import create_app
    app = create_app(tmp_path / "home", start_threads=False)
    token = tomllib.loads((tmp_path / "home" / "server.toml").read_text())["admin_token"]
    client = app.test_client()
    auth = {"Authorization": f"Bearer {token}"}
    db = app.config["DB"]
    db._writer.execute("PRAGMA query_only = ON")
    r = client.post("/api/v1/jobs", json={"command": ["true"], "working_dir": "/tmp"},
                    headers=auth)
    assert r.status_code == 503
    assert "cannot write to its database" in r.json["error"]["message"]
    h = client.get("/api/v1/health")
    assert h.status_code == 503 and h.json["ok"] is False
    assert h.json["writes"].startswith("failing")
    db._writer.execute("PRAGMA query_only = OFF")
    h = client.get("/api/v1/health")
    assert h.status_code == 200 and h.json["writes"] == "ok"


# -- node binding, the agent protocol ----------------------------------------------------------

import json  # noqa: E402
import uuid  # noqa: E402

from simple_websocket import Client, ConnectionClosed  # noqa: E402

PY = sys.executable


class WsAgent:
    """Speaks docs/protocol.md by hand, to act as a node (honest or not)."""

    def __init__(self, server, token, node, gpus=0):
        url = server.url.replace("http://", "ws://") + "/api/v1/agent/ws"
        self.ws = Client.connect(url, headers={"Authorization": f"Bearer {token}"})
        self.node, self.epoch, self.seq = node, uuid.uuid4().hex, 0
        self.gpus = [{"index": i, "name": "fake", "memory_total_mb": 1000, "fake": True}
                     for i in range(gpus)]
        self.inbox = []

    def send(self, msg):
        self.ws.send(json.dumps(msg))

    def recv(self, want, timeout=10):
        """The next message of type `want` (others are kept in inbox); raises
        ConnectionClosed when the server closes."""
        for i, m in enumerate(self.inbox):
            if m["type"] == want:
                return self.inbox.pop(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            raw = self.ws.receive(timeout=0.5)
            if raw is None:
                continue
            m = json.loads(raw)
            if m["type"] == want:
                return m
            self.inbox.append(m)
        raise AssertionError(f"no {want} within {timeout} s (got {self.inbox})")

    def hello(self):
        self.send({"type": "hello", "node": self.node, "epoch": self.epoch, "gpus": self.gpus,
                   "cpu_slots": 0, "fake": True})
        welcome = self.recv("welcome")
        self.seq = welcome["cursor"]
        return welcome

    def batch(self, *records):
        recs = []
        for r in records:
            self.seq += 1
            recs.append({"seq": self.seq, "ts": int(time.time() * 1000), **r})
        self.send({"type": "batch", "epoch": self.epoch, "records": recs})
        return self.recv("ack")

    def close_code(self, timeout=10):
        try:
            while True:
                raw = self.ws.receive(timeout=timeout)
                if raw is None:
                    return "open"
                self.inbox.append(json.loads(raw))
        except ConnectionClosed as e:
            return e.reason

    def close(self):
        try:
            self.ws.close()
        except Exception:
            pass


import time  # noqa: E402


def _agent_token(server, node):
    return server.api.post("/api/v1/tokens", {"name": f"agent {node}", "scope": "agent",
                                              "node": node}, expect=201)["token"]


def _gated(tmp_path, name):
    """A job that writes 'started' and waits for a file; returns its command."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        f"d = pathlib.Path({str(tmp_path)!r})\n"
        f"(d / {name + '.started'!r}).write_text(os.environ.get('GPUCTL_TOKEN', '') + ' '"
        " + os.environ.get('GPUCTL_RUN_ID', ''))\n"
        "print('real line', flush=True)\n"
        f"while not (d / {name + '.go'!r}).exists():\n"
        "    time.sleep(0.05)\n")
    return [PY, str(script)]


def test_agent_tokens_are_bound_to_their_node(shared):
    api = shared.api
    api.post("/api/v1/tokens", {"name": "unbound", "scope": "agent"}, expect=400)
    assert "node" in api.last.json()["error"]["message"]
    token = _agent_token(shared, "node-a")
    assert requests.get(shared.url + "/api/v1/auth/whoami", timeout=5,
                        headers={"Authorization": f"Bearer {token}"}).json()["node"] == "node-a"
    imposter = WsAgent(shared, token, "node-b")
    imposter.send({"type": "hello", "node": "node-b", "epoch": "e", "gpus": []})
    assert imposter.close_code() == 4403
    honest = WsAgent(shared, token, "node-a")
    honest.hello()
    honest.close()
    assert all(n["name"] != "node-b" for n in api.get("/api/v1/nodes")["nodes"])


def test_a_node_cannot_report_about_another_nodes_job(live_server, agent_factory, tmp_path):
    # Before: a node named 'evil' sent EXITED for node1's running job, which became
    # SUCCEEDED with a forged log line while its process kept running.
    api = live_server.api
    agent = agent_factory(live_server, name="node1")
    job = api.submit(_gated(tmp_path, "victim"), tmp_path, gpus=1)
    wait_for(lambda: (tmp_path / "victim.started").exists()
             and api.job(job["id"])["state"] == "RUNNING", 30, what="the job to run")
    run_id = api.job(job["id"])["run_id"]
    evil = WsAgent(live_server, _agent_token(live_server, "evil"), "evil")
    evil.hello()
    ack = evil.batch(
        {"kind": "job", "job_id": job["id"], "attempt": 1, "state": "EXITED", "exit_code": 0},
        {"kind": "log", "job_id": job["id"], "attempt": 1, "lines": [[999, 1, "forged"]]},
        {"kind": "metrics", "run_id": run_id, "source": "tb", "points": [["loss", 1, 9.0, 1]]},
        {"kind": "checkpoint", "run_id": run_id, "path": "/evil.pt", "step": 1},
        {"kind": "event", "run_id": run_id, "type": "NOTE", "message": "forged"})
    assert ack["seq"] == evil.seq            # acked (skipped), so the outbox is not wedged
    evil.close()
    assert api.job(job["id"])["state"] == "RUNNING"
    texts = [line["text"] for line in api.get(f"/api/v1/jobs/{job['id']}/logs")["lines"]]
    assert "forged" not in texts
    assert api.get(f"/api/v1/runs/{run_id}/metrics", expect=200)["keys"] == [] or \
        "loss" not in str(api.last.json())
    # the real node still reports about it
    (tmp_path / "victim.go").touch()
    assert api.wait_job(job["id"])["state"] == "SUCCEEDED"
    assert agent.node()["state"] == "connected"


def test_a_live_node_is_not_pushed_off_by_a_second_connection(live_server, agent_factory,
                                                               tmp_path):
    # Before: connecting as node1 pushed the real agent off (4409) and was handed its
    # running job's start command (ingest token and env included).
    api = live_server.api
    agent = agent_factory(live_server, name="node1")
    job = api.submit(_gated(tmp_path, "held"), tmp_path, gpus=1)
    wait_for(lambda: (tmp_path / "held.started").exists()
             and api.job(job["id"])["state"] == "RUNNING", 30, what="the job to run")
    imposter = WsAgent(live_server, live_server.token, "node1")    # even with admin
    imposter.send({"type": "hello", "node": "node1", "epoch": "other", "gpus": []})
    code = imposter.close_code()
    assert not imposter.inbox, imposter.inbox      # no welcome, no start command
    assert code == 4409
    assert agent.node()["state"] == "connected"
    assert api.job(job["id"])["state"] == "RUNNING" and api.job(job["id"])["attempt"] == 1
    (tmp_path / "held.go").touch()
    assert api.wait_job(job["id"])["state"] == "SUCCEEDED"


def test_ingest_token_revoked_when_the_attempt_ends(live_server, agent, tmp_path):
    api = live_server.api
    job = api.submit(_gated(tmp_path, "ingest"), tmp_path, gpus=1)
    wait_for(lambda: (tmp_path / "ingest.started").exists(), 30, what="the job to start")
    token, run_id = (tmp_path / "ingest.started").read_text().split()
    body = {"keys": ["loss"], "points": [[0, 1, 0.5, 1]]}
    url = f"{live_server.url}/api/v1/runs/{run_id}/metrics"
    auth = {"Authorization": f"Bearer {token}"}
    assert requests.post(url, json=body, headers=auth, timeout=5).status_code == 200
    (tmp_path / "ingest.go").touch()
    api.wait_job(job["id"])
    r = requests.post(url, json=body, headers=auth, timeout=5)
    assert r.status_code == 401, r.text              # before: {"accepted": 1}
    api.post(f"/api/v1/runs/{run_id}/metrics", body, expect=409)
    assert "ended" in api.last.json()["error"]["message"]
    api.post(f"/api/v1/runs/{run_id}/events", {"name": "late"}, expect=409)
    api.post(f"/api/v1/runs/{run_id}/checkpoints", {"path": "/x.pt"}, expect=409)


def test_an_exit_acked_then_lost_is_reconciled(live_server):
    # The agent forgets a record once acked. If the server lost the commit of an EXITED
    # (power cut), the agent's sync lists the attempt as known and not running: the server
    # must not keep the job (and its GPU) RUNNING for ever.
    api = live_server.api
    node = WsAgent(live_server, _agent_token(live_server, "fake1"), "fake1", gpus=1)
    node.hello()
    node.send({"type": "sync", "running": [], "known": []})
    job = api.submit(["true"], "/tmp", gpus=1, max_attempts=2)
    start = node.recv("start", timeout=20)
    assert start["job_id"] == job["id"]
    node.batch({"kind": "job", "job_id": job["id"], "attempt": 1, "state": "RUNNING",
                "pid": 1})
    assert api.job(job["id"])["state"] == "RUNNING"
    node.close()
    wait_for(lambda: next(n for n in api.get("/api/v1/nodes")["nodes"]
                          if n["name"] == "fake1")["state"] == "disconnected", 10,
             what="the node to be seen gone")
    again = WsAgent(live_server, _agent_token(live_server, "fake1"), "fake1", gpus=1)
    again.epoch = node.epoch
    again.hello()
    again.send({"type": "sync", "running": [], "known": [[job["id"], 1]]})
    wait_for(lambda: api.job(job["id"])["state"] != "RUNNING"
             or api.job(job["id"])["attempt"] != 1, 10, what="the lost exit to be reconciled")
    again.close()
    runs = api.get(f"/api/v1/runs?job_id={job['id']}")["runs"]
    first = next(r for r in runs if r["attempt"] == 1)
    assert first["state"] == "FAILED" and first["failure_kind"] in ("LOST", "NODE_LOST"), first


def test_cli_makes_agent_tokens_bound_to_a_node(shared):
    env = dict(_clean_env(shared.home), GPUCTL_TOKEN=shared.token,
               GPUCTL_SERVER=shared.url)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "gpuplane", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
    out = cli("token", "create", "--name", "box", "--agent", "gpu-box", "--json")
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout)
    assert made["scope"] == "agent" and made["node"] == "gpu-box"
    out = cli("token", "create", "--name", "box", "--scope", "agent")
    assert out.returncode == 2 and "--agent NODE" in out.stderr


def test_database_descriptors_return_to_baseline_after_a_burst(server_factory):
    # Before: a SQLite connection per pool thread, and SQLite keeps a closed connection's
    # .db descriptor open while any other connection of the process is open: after a
    # burst the worker held one per thread it had ever run (~110 after bench/fleet.py).
    # Now a fixed pool: the count does not move.
    import threading
    from .helpers import fd_kinds, worker_pid
    server = server_factory({"threads": 32})
    pid = worker_pid(server)
    server.api.get("/api/v1/status", expect=200)
    base = fd_kinds(pid)["db"]
    n = 24
    start, errors, peak = threading.Barrier(n), [], [base]

    def client():
        try:
            start.wait(30)
            for _ in range(8):
                # A connection of its own per request: as many pool threads as the
                # server will start.
                r = requests.get(server.url + "/api/v1/status", timeout=30,
                                 headers={"Authorization": f"Bearer {server.token}",
                                          "Connection": "close"})
                if r.status_code != 200:
                    errors.append(r.status_code)
                peak.append(fd_kinds(pid)["db"])
        except Exception as e:      # noqa: BLE001 (reported below)
            errors.append(repr(e))
    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:5]
    wait_for(lambda: fd_kinds(pid)["db"] <= base, 20,
             what=f"the worker's database descriptors back to {base} (peak {max(peak)})")
    report("db-fds-burst", clients=n, db_fds_base=base, db_fds_peak=max(peak),
           db_fds_after=fd_kinds(pid)["db"])


def test_fleet_bounded(server_factory, monkeypatch):
    """bench/fleet.py at small counts: simulated agents with jobs running and telemetry
    flowing, SSE followers beyond their cap, clients that never finish their headers.
    No node is seen disconnected, no job loses its attempt, /status answers throughout;
    threads and sockets come back (no timing assertions: the figures are in
    docs/benchmarks.md)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import fleet
    from .helpers import worker_pid
    server = server_factory({"threads": 16, "agent_threads": 4, "rest_threads": 4,
                             "header_timeout_s": 1, "heartbeat_s": 1})
    r = fleet.run_fleet(server.url, server.token, worker_pid(server), agents=3, gpus=2,
                        followers=12, slow=40, seconds=3, heartbeat_s=1, settle_s=15,
                        log=lambda *a: None)
    report("fleet-bounded", **r)
    assert r["agent_errors"] == 0 and r["agent_batches"] > 0
    assert r["nodes_seen_not_connected"] == 0 and r["jobs_lost"] == 0
    assert r["status_errors"] == 0 and r["status_requests"] > 0
    assert r["followers_admitted"] == 8 and r["followers_503"] == 4   # 16 - 4 - 4
    assert r["slow_dropped_by_server"] >= 40
    assert r["back_to_baseline_s"] is not None, r      # threads, sockets and database fds
    assert r["db_fds_after"] <= r["db_fds_base"], r


def test_the_ack_transaction_is_durable(tmp_path):
    # The agent forgets what was acked: that commit is fsynced (synchronous=FULL); the
    # others stay NORMAL (WAL: never corrupt, may lose the last commits on power loss).
    from gpuplane.db import Database
    db = Database(tmp_path / "d.db")
    with db.tx(durable=True) as c:
        assert c.execute("PRAGMA synchronous").fetchone()[0] == 2
    with db.tx() as c:
        assert c.execute("PRAGMA synchronous").fetchone()[0] == 1
    # and the gateway's batch apply (the transaction its ack stands for) asks for it
    from gpuplane.config import ServerConfig
    from gpuplane.gateway import Gateway
    from gpuplane.hub import Hub
    from gpuplane.lifecycle import Lifecycle
    hub = Hub()
    lc = Lifecycle(db, publish=hub.publish)
    g = Gateway(db, hub, ServerConfig(home=str(tmp_path)), lc)
    lc.node_up({"node": "n1", "epoch": "E", "gpus": []})
    seen, real_tx = [], db.tx

    def tx(durable=False):
        seen.append(durable)
        return real_tx(durable=durable)
    db.tx = tx
    ack = g.apply_batch("n1", {"type": "batch", "epoch": "E", "records": [
        {"seq": 1, "kind": "node_stats", "gpus": [], "host": {}}]})
    assert ack == {"type": "ack", "seq": 1}
    assert seen[0] is True
