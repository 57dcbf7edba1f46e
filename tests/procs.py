"""Real processes for tests: a gunicorn server on a free port, agents with fake GPUs.

Nothing here sleeps to wait: `wait_for` polls a condition until a deadline.
"""
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import requests

ROOT = pathlib.Path(__file__).resolve().parent.parent
AGENT = ROOT / "agent.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout=30, interval=0.05, what="condition"):
    """Poll cond() until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except Exception as e:      # the thing polled may not be up yet
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                         + (f" (last error: {last_exc!r})" if last_exc else ""))


def route_walk(app):
    """Every route of a Flask app as (method, rule, view), HEAD and OPTIONS left out: the
    walk the scope, auth and bad-input suites share (`rule.arguments` and converters are
    on the Rule)."""
    out = []
    for rule in app.url_map.iter_rules():
        view = app.view_functions[rule.endpoint]
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            out.append((method, rule, view))
    return out


def route_url(rule, run_id=1, job_id=1, path="k0", name=None):
    """A concrete URL for a rule: the given run and job ids, 1 for other ints, `path` for
    path arguments and `name` (default: `path`) for string arguments."""
    import re
    url = rule.replace("<int:run_id>", str(run_id)).replace("<int:job_id>", str(job_id))
    url = re.sub(r"<int:[a-z_]+>", "1", url)
    url = re.sub(r"<path:[a-z_]+>", path, url)
    return re.sub(r"<[a-z_]+>", path if name is None else name, url)


def sigint_as_at_a_terminal():
    """preexec_fn for a child a test stops with SIGINT, as Ctrl-C would: a test run started
    in the background by a non-interactive shell (CI scripts, `make test &`) has SIGINT
    ignored, the child would inherit that, and Python would then never raise
    KeyboardInterrupt in it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _clean_env(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["GPUCTL_HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _stop(proc, sig=signal.SIGTERM, timeout=10):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class Api:
    """A thin requests wrapper: .get/.post return the parsed JSON and keep the status."""

    def __init__(self, url, token):
        self.url = url
        self.token = token
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def request(self, method, path, expect=None, **kw):
        kw.setdefault("timeout", 30)
        try:
            r = self.session.request(method, self.url + path, **kw)
        except requests.ConnectionError as e:
            # A kept-alive connection the server closed (its 5 s keepalive) as this GET
            # went out on it is reset: a GET goes again on a new one, as gpuplane's client.
            if method != "GET" or isinstance(e, requests.Timeout):
                raise
            r = self.session.request(method, self.url + path, **kw)
        if expect is not None:
            assert r.status_code == expect, f"{method} {path}: {r.status_code} {r.text[:500]}"
        self.last = r
        try:
            return r.json()
        except ValueError:
            return r.text

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, json=None, **kw):
        return self.request("POST", path, json=json if json is not None else {}, **kw)

    def job(self, job_id):
        return self.get(f"/api/v1/jobs/{job_id}", expect=200)

    def submit(self, command, working_dir, **fields):
        body = {"command": command, "working_dir": str(working_dir), **fields}
        return self.post("/api/v1/jobs", body, expect=201)

    def wait_job(self, job_id, states=("SUCCEEDED", "FAILED", "CANCELLED"), timeout=60):
        return wait_for(lambda: (j := self.job(job_id))["state"] in states and j,
                        timeout, what=f"job {job_id} to reach {states}")


class ServerProc:
    def __init__(self, home, settings=None):
        self.home = pathlib.Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = {"node_grace_s": 60, "heartbeat_s": 1, **(settings or {})}
        lines = [f"port = {self.port}", 'host = "127.0.0.1"']
        lines += [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"'
                  for k, v in settings.items()]
        (self.home / "server.toml").write_text("\n".join(lines) + "\n")
        self.proc = None
        self.log_path = self.home / "server.log"

    def start(self):
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from gpuplane.server import serve; "
             "serve(sys.argv[1], log_level='info')", str(self.home)],
            cwd=ROOT, env=_clean_env(self.home), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_for(self._up, 30, what=f"server on {self.url} (log {self.log_path})")
        self.token = self._admin_token()
        self.api = Api(self.url, self.token)
        return self

    def _up(self):
        if self.proc.poll() is not None:
            raise AssertionError("server exited:\n" + self.log_path.read_text()[-3000:])
        return requests.get(self.url + "/api/v1/health", timeout=2).ok

    def _admin_token(self):
        import tomllib
        return tomllib.loads((self.home / "server.toml").read_text())["admin_token"]

    def stop(self, sig=signal.SIGTERM):
        _stop(self.proc, sig)

    def kill(self):
        """SIGKILL the whole gunicorn process group (master and worker)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def restart(self):
        self.stop()
        return self.start()


class AgentProc:
    def __init__(self, server, home, name, fake_gpus=2, cpu_slots=4, extra=()):
        self.server = server
        self.home = pathlib.Path(home)
        self.name = name
        # The token goes in agent.toml (0600), as docs/deploy.md says: not on a command
        # line, where `ps` shows it, nor in the environment.
        self.args = ["--name", name,
                     "--home", str(self.home), "--fake-gpus", str(fake_gpus),
                     "--cpu-slots", str(cpu_slots), "--heartbeat", "1",
                     "--stats-interval", "2", *extra]
        self.proc = None
        self.log_path = self.home / f"agent-{name}.log"

    def start(self, wait=True):
        self.home.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.home / "agent.toml", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'server = "{self.server.url}"\ntoken = "{self.server.token}"\n')
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, str(AGENT), *self.args], cwd=ROOT,
                                     env=_clean_env(self.home), stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_connected()
        return self

    def node(self):
        for n in self.server.api.get("/api/v1/nodes", expect=200)["nodes"]:
            if n["name"] == self.name:
                return n
        return None

    def wait_connected(self, timeout=30):
        def up():
            if self.proc.poll() is not None:
                raise AssertionError("agent exited:\n" + self.log_path.read_text()[-3000:])
            n = self.node()
            return n and n["state"] == "connected" and n["synced"]
        wait_for(up, timeout, what=f"agent {self.name} connected (log {self.log_path})")

    def stop(self, sig=signal.SIGTERM):
        _stop(self.proc, sig)

    def kill(self):
        """SIGKILL the agent alone: its jobs run in their own sessions and survive."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


def kill_leftover_jobs(home):
    import json
    for pid_file in pathlib.Path(home).glob("agent/jobs/*/*/pid"):
        try:
            info = json.loads(pid_file.read_text())
            os.killpg(int(info.get("pgid") or info["pid"]), signal.SIGKILL)
        except (ValueError, KeyError, ProcessLookupError, PermissionError, OSError):
            pass
