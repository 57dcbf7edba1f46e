"""What the agent's tests share besides fixtures (those are in conftest.py): a Host (an
outbox and a runner over one agent home), start messages, waits with a deadline, the
records an outbox holds, an Agent against the fake server, `python agent.py` itself."""
import os
import subprocess
import sys
import threading
import time

import psutil

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
for path in (ROOT, TESTS):
    if path not in sys.path:
        sys.path.insert(0, path)

import agent  # noqa: E402

PY = sys.executable


def wait_until(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        pause.wait(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def records(outbox, kind=None, job_id=None):
    recs = outbox.unacked()
    return [r for r in recs if (kind is None or r["kind"] == kind)
            and (job_id is None or r.get("job_id") == job_id)]


def job_records(outbox, job_id, state=None):
    return [r for r in records(outbox, "job", job_id) if state is None or r["state"] == state]


def log_lines(outbox, job_id):
    return [ln for r in records(outbox, "log", job_id) for ln in r["lines"]]


def start_msg(job_id, command, working_dir, attempt=1, **extra):
    msg = {"type": "start", "job_id": job_id, "attempt": attempt, "run_id": 100 + job_id,
           "command": command, "working_dir": str(working_dir), "env": {}, "gpus": [],
           "cpu_only": True, "tb_dir": None, "watch_dir": None,
           "server_url": "http://server.example:8600", "ingest_token": "gpi_test"}
    msg.update(extra)
    return msg


class Host:
    """An outbox and a runner over one agent home, the runner thread ticking fast."""

    def __init__(self, home, kill_grace_s=1.0, thread=True):
        self.agent_dir = os.path.join(str(home), "agent")
        self.outbox = agent.Outbox(self.agent_dir)
        self.runner = agent.Runner(self.agent_dir, self.outbox, kill_grace_s=kill_grace_s,
                                   server_url="http://fallback:8600", hook_interval_s=0.1,
                                   ckpt_interval_s=0.1)
        if thread:
            self.runner.start()
            # the connection hands commands over and moves on; tests wait for them
            for name in ("handle_start", "handle_cancel"):
                setattr(self, name, getattr(self.runner, name))
            self.runner.handle_start = lambda msg: self.handle_start(msg, wait=True)
            self.runner.handle_cancel = lambda msg: self.handle_cancel(msg, wait=True)

    def exited(self, job_id):
        return job_records(self.outbox, job_id, "EXITED")

    def wait_exited(self, job_id, timeout=30):
        return wait_until(lambda: self.exited(job_id), timeout, f"job {job_id} EXITED")[0]

    def stop(self):
        self.runner.stop()
        self.outbox.close()


def write_script(path, body):
    path.write_text(body)
    return str(path)


def make_agent(home, server, token=None):
    cfg = agent.Config(server=server.url, token=token or server.token, name="box",
                       home=str(home), fake_gpus=1, heartbeat_s=0.2, stats_interval_s=3600)
    a = agent.Agent(cfg, kill_grace_s=1.0)
    a.connection.ack_timeout_s = 2.0
    return a


def run_cli(args, home, timeout=30):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["GPUCTL_HOME"] = str(home)
    return subprocess.run([PY, os.path.join(ROOT, "agent.py")] + args, env=env,
                          capture_output=True, text=True, timeout=timeout)


def gated(gate, then=""):
    """argv of a job that waits for `gate` to exist (60 s at the most: then it fails),
    then runs the Python lines `then`."""
    return [PY, "-c", f"""
import os, sys, threading, time
deadline = time.monotonic() + 60
while not os.path.exists({str(gate)!r}):
    if time.monotonic() > deadline:
        sys.exit("the gate never opened")
    threading.Event().wait(0.05)
{then}"""]


GATED = r"""
import os, sys
gate = sys.argv[1]
for i in range(1, 6):
    print(f"line {i}", flush=True)
while not os.path.exists(gate):
    os.stat(os.path.dirname(gate))          # busy-ish wait is fine for a tiny job
    import time; time.sleep(0.05)
for i in range(6, 11):
    print(f"line {i}", flush=True)
sys.exit(4)
"""


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
