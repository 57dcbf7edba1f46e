"""What the benchmarks share: a real GPUPlane server (gunicorn) in a temp home."""
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import tomllib

import requests

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(home, port, threads=64, extra=""):
    """Start `gpuplane server` on home; returns (process, url, admin token). `extra` is
    appended to its server.toml (tables such as [events])."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "server.toml").write_text(f'host = "127.0.0.1"\nport = {port}\nthreads = {threads}\n'
                                      + extra)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from gpuplane.server import serve; "
         "serve(sys.argv[1], log_level='warning')", str(home)],
        cwd=ROOT, env=env, stdout=open(home / "server.log", "ab"), stderr=subprocess.STDOUT,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("server exited:\n" + (home / "server.log").read_text()[-3000:])
        try:
            if requests.get(url + "/api/v1/health", timeout=1).ok:
                break
        except requests.RequestException:
            pass
        time.sleep(0.1)
    else:
        sys.exit("server did not come up")
    token = tomllib.loads((home / "server.toml").read_text())["admin_token"]
    return proc, url, token


def start_agent(url, token, name, home, *args):
    """Start agent.py for `url` as node `name` with its home and extra flags (--fake-gpus
    4, ...), its output in HOME.log; returns the process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    home = pathlib.Path(home)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "agent.py"), "--server", url, "--token", token,
         "--name", name, "--home", str(home), *map(str, args)],
        cwd=ROOT, env=env, stdout=open(str(home) + ".log", "ab"), stderr=subprocess.STDOUT,
        start_new_session=True)


def stop_agent(proc):
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def stop_server(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def wait(cond, timeout=60, what="condition", every=0.05):
    """cond()'s first truthy value, polled every `every` s (a refused request counts as
    not yet); exits the benchmark with a sentence past `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except requests.RequestException:
            pass
        time.sleep(every)
    raise SystemExit(f"timed out waiting for {what}")
