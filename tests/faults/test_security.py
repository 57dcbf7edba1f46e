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

from procs import ROOT, _clean_env
from .helpers import db_path, report, wait_for


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


def test_server_files_are_private(live_server):
    home = live_server.home
    live_server.api.submit(["true"], "/tmp", env={"WANDB_API_KEY": "secret"})
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(home / "server").st_mode) == 0o700
    files = [home / "server.toml", *home.glob("server/gpuctl.db*")]
    assert len(files) >= 3, files            # the database, its WAL and shared memory
    modes = {f.name: oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files}
    assert set(modes.values()) == {"0o600"}, modes


def test_read_tokens_see_env_names_not_values(live_server):
    api = live_server.api
    job = api.submit(["true"], "/tmp", env={"WANDB_API_KEY": "s3cret", "LR": "0.1"})
    read = api.post("/api/v1/tokens", {"name": "viewer", "scope": "read"}, expect=201)
    viewer = requests.Session()
    viewer.headers["Authorization"] = f"Bearer {read['token']}"
    seen = viewer.get(f"{live_server.url}/api/v1/jobs/{job['id']}", timeout=5).json()
    assert seen["env"] == {"WANDB_API_KEY": "<redacted>", "LR": "<redacted>"}
    assert api.job(job["id"])["env"]["WANDB_API_KEY"] == "s3cret"     # a write token sees it
    # list views leave env out for everyone
    for path, key in (("/api/v1/jobs", "jobs"), ("/api/v1/queue", "jobs")):
        listed = viewer.get(live_server.url + path, timeout=5).json()[key]
        assert listed and all("env" not in j for j in listed), path
    status = viewer.get(live_server.url + "/api/v1/status", timeout=5).json()
    assert "s3cret" not in str(status)


def test_job_size_caps_and_nul(live_server):
    api = live_server.api
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


def test_last_event_id_out_of_range_is_a_400(live_server):
    job = live_server.api.submit(["true"], "/tmp", gpus=1)
    for bad in (str(2**63), str(2**70), "-1"):
        r = requests.get(f"{live_server.url}/api/v1/jobs/{job['id']}/logs/stream",
                         headers={"Authorization": f"Bearer {live_server.token}",
                                  "Last-Event-ID": bad}, timeout=5)
        assert r.status_code == 400, (bad, r.status_code)
    assert "OverflowError" not in live_server.log_path.read_text()


@pytest.mark.parametrize("method,path,auth,status", [
    ("POST", "/api/v1/runs/1/metrics", False, 401),
    ("POST", "/api/v1/runs/999999/metrics", True, 404),
    ("PUT", "/api/v1/jobs", True, 405),
])
def test_an_unread_large_body_does_not_break_the_next_request(live_server, method, path,
                                                              auth, status):
    # Before: 'Connection: keep-alive', then gunicorn dropped the connection (it drains
    # at most 64 KiB), and the client's next request on it got no answer.
    s = requests.Session()
    if auth:
        s.headers["Authorization"] = f"Bearer {live_server.token}"
    body = b'{"points": [' + b'["loss", 1, 0.5],' * 9000 + b'["loss", 2, 0.5]]}'
    assert len(body) > 140_000
    r = s.request(method, live_server.url + path, data=body,
                  headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == status
    assert r.json()["error"]["code"]
    # the same session's next request is answered
    assert s.get(live_server.url + "/api/v1/health", timeout=10).status_code == 200


def test_a_database_that_cannot_be_written_is_a_503_and_health_says_so(tmp_path):
    # Before: 500 InternalError, and /health said ok. Here SQLite's own read-only switch
    # on the request thread's connection stands in for a full disk or a read-only file.
    from gpuplane.app import create_app
    app = create_app(tmp_path / "home", start_threads=False)
    token = tomllib.loads((tmp_path / "home" / "server.toml").read_text())["admin_token"]
    client = app.test_client()
    auth = {"Authorization": f"Bearer {token}"}
    db = app.config["DB"]
    db.conn.execute("PRAGMA query_only = ON")
    r = client.post("/api/v1/jobs", json={"command": ["true"], "working_dir": "/tmp"},
                    headers=auth)
    assert r.status_code == 503
    assert "cannot write to its database" in r.json["error"]["message"]
    h = client.get("/api/v1/health")
    assert h.status_code == 503 and h.json["ok"] is False
    assert h.json["writes"].startswith("failing")
    db.conn.execute("PRAGMA query_only = OFF")
    h = client.get("/api/v1/health")
    assert h.status_code == 200 and h.json["writes"] == "ok"
