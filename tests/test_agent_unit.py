"""The agent (agent.py) against real processes, real files and a small fake server.

Nothing here waits with sleep(): every wait polls a condition with a deadline.
"""
import json
import logging
import marshal
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import agent  # noqa: E402
from fake_server import FakeServer  # noqa: E402

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


def write_script(path, body):
    path.write_text(body)
    return str(path)


# ---------------------------------------------------------------------------------------
# outbox
# ---------------------------------------------------------------------------------------

def test_outbox_append_recover_and_seq(tmp_path):
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d)
    epoch = ob.epoch
    for i in range(5):
        assert ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[i + 1, 0, f"l{i}"]]},
                         att={"key": "1/1", "offset": 10 * (i + 1), "line_no": i + 1}) == i + 1
    # a crash: no close(), the spool is all there is beyond the last state.json
    ob2 = agent.Outbox(d)
    assert ob2.epoch == epoch
    assert ob2.next_seq == 6
    assert [s for s, _w in ob2.pending_after(0)] == [1, 2, 3, 4, 5]
    assert ob2.attempt_state("1/1") == {"offset": 50, "line_no": 5}
    wire = json.loads(ob2.pending_after(0)[0][1])
    assert "_att" not in wire and wire["kind"] == "log" and wire["seq"] == 1


def test_outbox_torn_last_line_skipped_with_one_warning(tmp_path, caplog):
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d)
    ob.append("node_stats", {"gpus": [], "host": {}})
    ob.append("node_stats", {"gpus": [], "host": {}})
    ob._spool.close()
    with open(os.path.join(d, "spool", "outbox.jsonl"), "ab") as f:
        f.write(b'{"seq":3,"kind":"log","lines":[[1,2,"hal')     # crash mid-write
    with caplog.at_level(logging.WARNING, logger="gpuplane.agent"):
        ob2 = agent.Outbox(d)
    torn = [r for r in caplog.records if "torn" in r.getMessage()]
    assert len(torn) == 1
    assert ob2.next_seq == 3
    assert ob2.append("log", {"job_id": 1, "attempt": 1, "lines": []}) == 3
    # the next start reads clean lines only: the torn bytes were not glued to seq 3
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpuplane.agent"):
        ob3 = agent.Outbox(d)
    assert not [r for r in caplog.records if "torn" in r.getMessage()]
    assert [s for s, _w in ob3.pending_after(0)] == [1, 2, 3]


def test_outbox_compaction_keeps_unacked(tmp_path):
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d, compact_min=1)
    for i in range(10):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": []},
                  att={"key": "1/1", "offset": i + 1, "line_no": i + 1})
    ob.ack(7)
    with open(os.path.join(d, "spool", "outbox.jsonl")) as f:
        seqs = [json.loads(line)["seq"] for line in f]
    assert seqs == [8, 9, 10]
    state = json.load(open(os.path.join(d, "state.json")))
    assert state["acked"] == 7 and state["next_seq"] == 11
    ob2 = agent.Outbox(d)
    assert ob2.acked == 7 and ob2.next_seq == 11
    assert [s for s, _w in ob2.pending_after(ob2.acked)] == [8, 9, 10]
    assert ob2.attempt_state("1/1")["offset"] == 10
    ob2.ack(10)
    assert os.path.getsize(os.path.join(d, "spool", "outbox.jsonl")) == 0
    ob3 = agent.Outbox(d)
    assert ob3.next_seq == 11 and ob3.epoch == ob.epoch
    assert ob3.attempt_state("1/1")["line_no"] == 10


def test_outbox_new_epoch_only_without_state(tmp_path):
    d = str(tmp_path / "agent")
    ob = agent.Outbox(d)
    ob.append("node_stats", {"gpus": [], "host": {}})
    ob.close()
    assert agent.Outbox(d).epoch == ob.epoch
    # state lost but spool kept: a new epoch, the spooled record renumbered from 1
    os.remove(os.path.join(d, "state.json"))
    ob2 = agent.Outbox(d)
    assert ob2.epoch != ob.epoch
    assert [s for s, _w in ob2.pending_after(0)] == [1]
    # a fresh home gets its own epoch
    assert agent.Outbox(str(tmp_path / "other")).epoch not in (ob.epoch, ob2.epoch)


def test_outbox_batches_are_bounded(tmp_path):
    ob = agent.Outbox(str(tmp_path / "agent"))
    for _ in range(600):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[1, 1, "x" * 3000]]})
    first = ob.pending_after(0)
    assert len(first) <= agent.BATCH_MAX_RECORDS
    assert sum(len(w) for _s, w in first) <= agent.BATCH_MAX_BYTES
    assert first[0][0] == 1
    second = ob.pending_after(first[-1][0])
    assert second[0][0] == first[-1][0] + 1


# ---------------------------------------------------------------------------------------
# log splitting
# ---------------------------------------------------------------------------------------

def test_split_log_cuts_long_lines_and_keeps_partial_tail():
    big = b"y" * (agent.LINE_MAX + 100)
    items, consumed, skip = agent.split_log(b"a\r\n" + big + b"\nb\npart", False, False)
    assert [i[0] for i in items] == [b"a", big[:agent.LINE_MAX], b"b"]
    assert consumed == len(b"a\r\n" + big + b"\nb\n") and not skip
    items, consumed, skip = agent.split_log(b"part", False, True)
    assert [i[0] for i in items] == [b"part"] and consumed == 4
    # an over-long line still being written: cut now, skip its rest later
    items, consumed, skip = agent.split_log(big, False, False)
    assert [i[0] for i in items] == [big[:agent.LINE_MAX]] and skip
    items, consumed, skip = agent.split_log(b"rest of it\nnext\n", True, False)
    assert [i[0] for i in items] == [b"next"] and not skip


# ---------------------------------------------------------------------------------------
# runner and shim
# ---------------------------------------------------------------------------------------

def test_shim_runs_command_and_writes_exit(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    wd = tmp_path / "wd"
    wd.mkdir()
    h.runner.handle_start(start_msg(1, [PY, "-c", "print('hello'); print('é\\xff'); "
                                        "import sys; sys.stdout.write('no newline'); "
                                        "sys.exit(3)"], wd))
    rec = h.wait_exited(1)
    assert rec["exit_code"] == 3 and rec["failure_kind"] == "EXIT_CODE"
    assert "exited with code 3" in rec["message"]
    d = tmp_path / "home" / "agent" / "jobs" / "1" / "1"
    exit_info = json.loads((d / "exit").read_text())
    assert exit_info["exit_code"] == 3 and exit_info["signal"] is None
    pid = json.loads((d / "pid").read_text())
    assert pid["pid"] == rec["pid"] and pid["create_time"] > 0
    assert [ln[0] for ln in log_lines(h.outbox, 1)] == [1, 2, 3]
    assert [ln[2] for ln in log_lines(h.outbox, 1)] == ["hello", "é\xff", "no newline"]
    running = job_records(h.outbox, 1, "RUNNING")
    assert len(running) == 1 and running[0]["pid"] == rec["pid"]
    # order: RUNNING, all logs, then EXITED
    kinds = [(r["kind"], r.get("state")) for r in records(h.outbox) if r.get("job_id") == 1]
    assert kinds[0] == ("job", "RUNNING") and kinds[-1] == ("job", "EXITED")


def test_success_and_start_idempotent(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    msg = start_msg(2, "echo ok", tmp_path)
    h.runner.handle_start(msg)
    rec = h.wait_exited(2)
    assert rec["exit_code"] == 0 and rec["failure_kind"] is None
    h.runner.handle_start(msg)      # again: only re-reports, never runs twice
    assert len(h.exited(2)) == 2 and h.exited(2)[1]["exit_code"] == 0
    assert [ln[2] for ln in log_lines(h.outbox, 2)] == ["ok"]


def test_dispatch_failed_bad_dir_and_missing_command(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    missing = tmp_path / "nope"
    h.runner.handle_start(start_msg(3, ["true"], missing))
    rec = h.wait_exited(3)
    assert rec["failure_kind"] == "DISPATCH_FAILED" and str(missing) in rec["message"]
    h.runner.handle_start(start_msg(4, ["no-such-binary-xyz", "--x"], tmp_path))
    rec = h.wait_exited(4)
    assert rec["failure_kind"] == "DISPATCH_FAILED"
    assert rec["message"] == "command not found: no-such-binary-xyz"
    (tmp_path / "script.sh").write_text("#!/bin/sh\necho hi\n")     # not executable
    h.runner.handle_start(start_msg(5, ["./script.sh"], tmp_path))
    rec = h.wait_exited(5)
    assert rec["failure_kind"] == "DISPATCH_FAILED" and "./script.sh" in rec["message"]
    assert not job_records(h.outbox, 3, "RUNNING")


def test_dispatch_failed_when_the_shim_cannot_exec(tmp_path, hosts):
    """A NUL byte in the command or env, or a program that vanished between the agent's
    check and the shim's exec: DISPATCH_FAILED with a sentence, never LOST."""
    h = hosts(tmp_path / "home")
    h.runner.handle_start(start_msg(40, ["echo", "a\0b"], tmp_path))
    rec = h.wait_exited(40)
    assert rec["failure_kind"] == "DISPATCH_FAILED" and "NUL byte" in rec["message"]
    h.runner.handle_start(start_msg(41, "echo x", tmp_path, env={"K": "v\0w"}))
    rec = h.wait_exited(41)
    assert rec["failure_kind"] == "DISPATCH_FAILED" and "'K'" in rec["message"]
    # the shim itself, handed an exec record it cannot run
    d = tmp_path / "att"
    d.mkdir()
    for argv, exe, words in ((["gone"], str(tmp_path / "gone"), "No such file"),
                             (["x\0y"], "/bin/echo", "null byte")):
        (d / "spec.json").write_text(json.dumps({"exec": {
            "argv": argv, "executable": exe, "cwd": str(tmp_path), "env": {}}}))
        (d / "exit").unlink(missing_ok=True)
        assert subprocess.run(agent.shim_command() + [str(d)], env={}).returncode == 1
        info = json.loads((d / "exit").read_text())
        assert info["failure_kind"] == "DISPATCH_FAILED" and words in info["message"]
    (d / "spec.json").write_text("{not json")
    (d / "exit").unlink()
    subprocess.run(agent.shim_command() + [str(d)], env={})
    assert json.loads((d / "exit").read_text())["failure_kind"] == "DISPATCH_FAILED"


def test_relative_command_resolves_in_working_dir(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho from-script \"$1\"\n")
    script.chmod(0o755)
    h.runner.handle_start(start_msg(6, ["./run.sh", "arg"], tmp_path))
    rec = h.wait_exited(6)
    assert rec["exit_code"] == 0
    assert [ln[2] for ln in log_lines(h.outbox, 6)] == ["from-script arg"]


def test_oom_classification(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    code = ("import sys\nprint('step 1')\n"
            "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB',"
            " file=sys.stderr)\nsys.exit(1)\n")
    (tmp_path / "t.py").write_text(code)
    h.runner.handle_start(start_msg(7, [PY, "t.py"], tmp_path))
    rec = h.wait_exited(7)
    assert rec["failure_kind"] == "OOM"
    assert "CUDA out of memory" in rec["message"]


@pytest.mark.parametrize("text,kind", [
    ("RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate", "OOM"),
    ("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
     "trying to allocate 1.0G", "OOM"),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE", "OOM"),
    ("ValueError: bad learning rate", "EXIT_CODE"),
])
def test_classify_exit_patterns(tmp_path, text, kind):
    log = tmp_path / "log"
    log.write_text("x" * (agent.OOM_TAIL_BYTES * 2) + "\n" + text + "\n")
    assert agent.classify_exit({"exit_code": 1, "signal": None, "ended_at": 1}, str(log),
                               None)[0] == kind
    # beyond the last 64 KiB it is not looked at
    log.write_text(text + "\n" + "x" * (agent.OOM_TAIL_BYTES * 2) + "\n")
    assert agent.classify_exit({"exit_code": 1, "signal": None, "ended_at": 1}, str(log),
                               None)[0] == "EXIT_CODE"
    assert agent.classify_exit({"exit_code": 0, "signal": None, "ended_at": 1}, str(log),
                               None) == (None, None)


def test_environment_injection(tmp_path, hosts, monkeypatch):
    monkeypatch.setenv("GPUCTL_TOKEN", "agent-secret-must-not-leak")
    monkeypatch.setenv("GPUCTL_SOMETHING", "x")
    monkeypatch.setenv("KEEP_ME", "kept")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    h = hosts(tmp_path / "home")
    code = ("import os, json; print(json.dumps({k: v for k, v in os.environ.items() "
            "if k.startswith(('GPUCTL_', 'CUDA_', 'KEEP_', 'MY_', 'PYTHON'))}))")
    h.runner.handle_start(start_msg(8, [PY, "-c", code], tmp_path, gpus=[1, 3],
                                    cpu_only=False, env={"MY_VAR": "v", "KEEP_ME": "job"}))
    h.wait_exited(8)
    env = json.loads(log_lines(h.outbox, 8)[0][2])
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert env["GPUCTL_TOKEN"] == "gpi_test" and "GPUCTL_SOMETHING" not in env
    assert env["GPUCTL_RUN_ID"] == "108" and env["GPUCTL_JOB_ID"] == "8"
    assert env["GPUCTL_SERVER"] == "http://server.example:8600"
    assert env["MY_VAR"] == "v" and env["KEEP_ME"] == "job"
    assert env["PYTHONUNBUFFERED"] == "1"
    if os.path.isdir(agent.SDK_DIR):
        assert env["PYTHONPATH"] == agent.SDK_DIR
    # cpu_only: empty CUDA_VISIBLE_DEVICES; a job's own PYTHONPATH is left alone
    h.runner.handle_start(start_msg(9, [PY, "-c", code], tmp_path, server_url=None,
                                    env={"PYTHONPATH": "/mine"}))
    h.wait_exited(9)
    env = json.loads(log_lines(h.outbox, 9)[0][2])
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PYTHONPATH"] == "/mine"
    assert env["GPUCTL_SERVER"] == "http://fallback:8600"


def test_string_command_runs_through_sh(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    h.runner.handle_start(start_msg(10, "echo $((2+3)) | tr 5 Z", tmp_path))
    h.wait_exited(10)
    assert [ln[2] for ln in log_lines(h.outbox, 10)] == ["Z"]


FORKER = r"""
import os, signal, sys, time
out = sys.argv[1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)

def note(name):
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))

if os.fork() == 0:                       # child, ignores SIGTERM too
    if os.fork() == 0:                   # grandchild that leaves the process group
        os.setsid()
        note("grandchild")
        while True:
            time.sleep(1)
    note("child")
    while True:
        time.sleep(1)
if os.fork() == 0:                       # a plain child that dies on SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    note("child2")
    while True:
        time.sleep(1)
note("main")
print("all started", flush=True)
while True:
    time.sleep(1)
"""


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cancel_kills_the_whole_tree(tmp_path, hosts):
    h = hosts(tmp_path / "home", kill_grace_s=1.0)
    out = tmp_path / "pids"
    out.mkdir()
    write_script(tmp_path / "forker.py", FORKER)
    h.runner.handle_start(start_msg(11, [PY, "forker.py", str(out)], tmp_path))
    names = ["main", "child", "child2", "grandchild"]
    wait_until(lambda: all((out / n).exists() for n in names), what="all processes up")
    pids = [int((out / n).read_text()) for n in names]
    wait_until(lambda: job_records(h.outbox, 11, "RUNNING"), what="RUNNING")
    assert all(_alive(p) for p in pids)
    h.runner.handle_cancel({"type": "cancel", "job_id": 11, "attempt": 1})
    rec = h.wait_exited(11)
    assert rec["failure_kind"] == "CANCELLED"
    wait_until(lambda: not any(_alive(p) for p in pids), timeout=10, what="no survivors")
    assert not any(_alive(p) for p in pids)
    # a second cancel is a no-op apart from re-reporting
    h.runner.handle_cancel({"type": "cancel", "job_id": 11, "attempt": 1})
    assert all(r["failure_kind"] == "CANCELLED" for r in h.exited(11))


def test_cancel_of_unknown_attempt_is_noop(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    h.runner.handle_cancel({"type": "cancel", "job_id": 99, "attempt": 1})
    assert records(h.outbox) == []


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


def test_readopt_after_restart_reports_exit_once_without_duplicate_lines(tmp_path, hosts):
    home = tmp_path / "home"
    gate = tmp_path / "gate"
    write_script(tmp_path / "gated.py", GATED)
    a = hosts(home)
    a.runner.handle_start(start_msg(12, [PY, "gated.py", str(gate)], tmp_path))
    wait_until(lambda: len(log_lines(a.outbox, 12)) == 5, what="first five lines")
    a.stop()                          # the agent goes away; the job must not notice
    pid = json.load(open(home / "agent" / "jobs" / "12" / "1" / "pid"))["pid"]
    assert _alive(pid)

    b = hosts(home)
    assert "12/1" in b.runner.active
    gate.write_text("go")
    rec = b.wait_exited(12)
    assert rec["exit_code"] == 4 and rec["failure_kind"] == "EXIT_CODE"
    lines = log_lines(b.outbox, 12)
    assert [ln[0] for ln in lines] == list(range(1, 11))
    assert [ln[2] for ln in lines] == [f"line {i}" for i in range(1, 11)]
    assert len(b.exited(12)) == 1 and len(job_records(b.outbox, 12, "RUNNING")) == 1
    b.stop()

    c = hosts(home)                   # a third start: nothing left to report
    assert "12/1" not in c.runner.active
    assert len(c.exited(12)) == 1


def test_job_that_ended_while_agent_was_down(tmp_path, hosts):
    home = tmp_path / "home"
    gate = tmp_path / "gate"
    write_script(tmp_path / "gated.py", GATED)
    a = hosts(home)
    a.runner.handle_start(start_msg(13, [PY, "gated.py", str(gate)], tmp_path))
    wait_until(lambda: job_records(a.outbox, 13, "RUNNING"), what="RUNNING")
    a.stop()
    exit_file = home / "agent" / "jobs" / "13" / "1" / "exit"
    gate.write_text("go")
    wait_until(exit_file.exists, what="exit file")
    b = hosts(home)
    rec = b.wait_exited(13)
    assert rec["exit_code"] == 4
    assert [ln[2] for ln in log_lines(b.outbox, 13)][-1] == "line 10"


def test_lost_when_shim_and_job_vanish(tmp_path, hosts):
    home = tmp_path / "home"
    write_script(tmp_path / "sleepy.py", "import time\nwhile True: time.sleep(1)\n")
    a = hosts(home)
    a.runner.handle_start(start_msg(14, [PY, "sleepy.py"], tmp_path))
    wait_until(lambda: job_records(a.outbox, 14, "RUNNING"), what="RUNNING")
    a.stop()
    info = json.load(open(home / "agent" / "jobs" / "14" / "1" / "pid"))
    # a host reboot, in small: shim and job die together without an exit file
    os.kill(info["shim_pid"], signal.SIGKILL)
    os.killpg(info["pid"], signal.SIGKILL)
    wait_until(lambda: not _alive(info["pid"]) and not _alive(info["shim_pid"]),
               what="processes gone")
    b = hosts(home)
    rec = b.wait_exited(14)
    assert rec["failure_kind"] == "LOST"


def test_sync_message_lists_running_and_known(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    write_script(tmp_path / "sleepy.py", "import time\nwhile True: time.sleep(1)\n")
    h.runner.handle_start(start_msg(15, ["true"], tmp_path))
    h.runner.handle_start(start_msg(16, [PY, "sleepy.py"], tmp_path, attempt=2))
    h.wait_exited(15)
    wait_until(lambda: job_records(h.outbox, 16, "RUNNING"), what="RUNNING")
    # an attempt whose EXITED is in the outbox stays listed until its `reported` marker
    # is written a moment later (harmless: the server waits for that EXITED)
    wait_until(lambda: len(h.runner.sync_message()["running"]) == 1, what="15 reported")
    msg = h.runner.sync_message()
    assert msg["type"] == "sync"
    assert msg["known"] == [[15, 1], [16, 2]]
    assert [(r["job_id"], r["attempt"]) for r in msg["running"]] == [(16, 2)]
    h.runner.handle_cancel({"type": "cancel", "job_id": 16, "attempt": 2})
    h.wait_exited(16)


def _tb_write(tb_dir, points):
    from tensorboard.summary import Writer
    w = Writer(str(tb_dir))
    for tag, step, value in points:
        w.add_scalar(tag, value, step=step)
    w.flush()
    w.close()


def test_tb_hook_emits_metrics_and_persists_offsets(tmp_path, hosts):
    """The real TBTailer inside the runner: points reach the outbox once, and a restarted
    agent carries on from the saved offsets (a second event file appears meanwhile)."""
    tb = tmp_path / "tb"
    write_script(tmp_path / "sleepy.py", "import time\nwhile True: time.sleep(1)\n")
    home = tmp_path / "home"
    a = hosts(home)
    a.runner.handle_start(start_msg(17, [PY, "sleepy.py"], tmp_path, tb_dir="tb"))
    _tb_write(tb, [("loss", 1, 0.5), ("loss", 2, 0.25)])
    wait_until(lambda: sum(len(r["points"]) for r in records(a.outbox, "metrics")
                           if r["source"] == "tb") == 2, what="tb metrics")
    m = [r for r in records(a.outbox, "metrics") if r["source"] == "tb"][0]
    assert m["run_id"] == 117
    assert [p[:3] for p in m["points"]] == [["loss", 1, 0.5], ["loss", 2, 0.25]]
    a.stop()
    _tb_write(tb / "eval", [("acc", 3, 0.75)])
    b = hosts(home)
    wait_until(lambda: [r for r in records(b.outbox, "metrics") if r["source"] == "tb"
                        and r["points"][0][0] == "eval/acc"], what="new tb point")
    tb_points = [p[:3] for r in records(b.outbox, "metrics") if r["source"] == "tb"
                 for p in r["points"]]
    assert tb_points == [["loss", 1, 0.5], ["loss", 2, 0.25], ["eval/acc", 3, 0.75]]
    b.runner.handle_cancel({"type": "cancel", "job_id": 17, "attempt": 1})
    b.wait_exited(17)


def test_checkpoint_watch(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    write_script(tmp_path / "sleepy.py", "import time\nwhile True: time.sleep(1)\n")
    h.runner.handle_start(start_msg(18, [PY, "sleepy.py"], tmp_path, watch_dir="checkpoints"))
    (ck / "model-step=200.pt").write_bytes(b"w" * 100)
    (ck / "ignored.tmp").write_bytes(b"w")
    (ck / "notes.txt").write_bytes(b"not a checkpoint")
    rec = wait_until(lambda: records(h.outbox, "checkpoint"), what="checkpoint")[0]
    assert rec["path"] == str(ck / "model-step=200.pt")
    assert rec["step"] == 200 and rec["size_bytes"] == 100 and rec["run_id"] == 118
    assert rec["format"] == "pt" and rec["step_source"] == "name"
    h.runner.handle_cancel({"type": "cancel", "job_id": 18, "attempt": 1})
    h.wait_exited(18)
    assert len(records(h.outbox, "checkpoint")) == 1


# What the frameworks write, by name (Lightning 2.x ModelCheckpoint with its default
# filename and save_last, and a monitored filename; HF Trainer's output_dir with
# save_steps; Keras ModelCheckpoint; plain torch.save and safetensors).
LIGHTNING = ["lightning_logs/version_0/checkpoints/epoch=3-step=1200.ckpt",
             "lightning_logs/version_0/checkpoints/epoch=4-step=1500-v1.ckpt",
             "lightning_logs/version_0/checkpoints/last.ckpt",
             "lightning_logs/version_0/checkpoints/epoch=2-val_loss=0.12.ckpt",
             "lightning_logs/version_0/hparams.yaml"]
HF_FILES = ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
            "rng_state.pth", "trainer_state.json", "training_args.bin"]


def test_checkpoint_layouts_of_the_frameworks(tmp_path):
    root = tmp_path / "out"
    for rel in LIGHTNING + ["keras/model.05.keras", "keras/weights.h5", "torch/ckpt-1500.pt",
                            "torch/epoch_7.pth", "st/model.safetensors",
                            ".hidden/x.pt", "big.pt.partial"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * 10)
    for step in (500, 1000):
        for name in HF_FILES:
            (root / "hf" / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
            (root / "hf" / f"checkpoint-{step}" / name).write_bytes(b"y" * 7)
    (root / "hf" / "tmp-checkpoint-1500").mkdir()        # HF writes here, then renames
    (root / "hf" / "tmp-checkpoint-1500" / "model.safetensors").write_bytes(b"z")
    att = agent.Attempt(1, 1, str(tmp_path))
    found = agent.CheckpointHook(att).scan(str(root))
    rel = {os.path.relpath(p, root): (fmt, size) for p, (_sig, fmt, size) in found.items()}
    assert rel == {
        LIGHTNING[0]: ("lightning", 10), LIGHTNING[1]: ("lightning", 10),
        LIGHTNING[2]: ("lightning", 10), LIGHTNING[3]: ("lightning", 10),
        "keras/model.05.keras": ("keras", 10), "keras/weights.h5": ("keras", 10),
        "torch/ckpt-1500.pt": ("pt", 10), "torch/epoch_7.pth": ("pt", 10),
        "st/model.safetensors": ("safetensors", 10),
        "hf/checkpoint-500": ("hf", 7 * len(HF_FILES)),
        "hf/checkpoint-1000": ("hf", 7 * len(HF_FILES))}
    steps = {r: agent.checkpoint_step(os.path.basename(r)) for r in rel}
    assert steps[LIGHTNING[0]] == (1200, 3.0) and steps[LIGHTNING[1]] == (1500, 4.0)
    assert steps[LIGHTNING[2]] == (None, None) and steps[LIGHTNING[3]] == (None, 2.0)
    assert steps["hf/checkpoint-500"] == (500, None)
    assert steps["torch/ckpt-1500.pt"] == (1500, None)
    assert steps["torch/epoch_7.pth"] == (None, 7.0)
    assert steps["st/model.safetensors"] == (None, None)


def test_hf_checkpoint_written_just_before_exit_is_one_checkpoint(tmp_path, hosts):
    """The job writes checkpoint-20/ and exits at once: the final scan registers it (the
    process is gone, so it is complete), as ONE checkpoint at step 20, path absolute."""
    h = hosts(tmp_path / "home")
    code = ("import os\n"
            "d = os.path.join('out', 'checkpoint-20')\n"
            "os.makedirs(d)\n"
            f"for n in {HF_FILES!r}:\n"
            "    open(os.path.join(d, n), 'wb').write(b'w' * 5)\n"
            "open('out/final.safetensors', 'wb').write(b'f' * 3)\n")
    h.runner.handle_start(start_msg(30, [PY, "-c", code], tmp_path, watch_dir="out"))
    h.wait_exited(30)
    recs = records(h.outbox, "checkpoint")
    by_path = {r["path"]: r for r in recs}
    assert set(by_path) == {str(tmp_path / "out" / "checkpoint-20"),
                            str(tmp_path / "out" / "final.safetensors")}
    hf = by_path[str(tmp_path / "out" / "checkpoint-20")]
    assert hf["format"] == "hf" and hf["step"] == 20 and hf["size_bytes"] == 5 * len(HF_FILES)
    final = by_path[str(tmp_path / "out" / "final.safetensors")]
    assert final["step"] is None and final["step_source"] == "latest"
    # the final record comes after the checkpoints
    kinds = [r["kind"] for r in records(h.outbox) if r.get("job_id", 30) == 30]
    assert kinds[-1] == "job" and kinds.index("checkpoint") < len(kinds) - 1


@pytest.mark.parametrize("watch", ["missing", "afile", "/", "loop"])
def test_bad_watch_dirs_are_a_logged_skip(tmp_path, hosts, caplog, watch):
    (tmp_path / "afile").write_text("x")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    h = hosts(tmp_path / "home")
    with caplog.at_level(logging.WARNING, logger="gpuplane.agent"):
        h.runner.handle_start(start_msg(31, "echo done", tmp_path, watch_dir=watch))
        rec = h.wait_exited(31)
    assert rec["exit_code"] == 0 and rec["failure_kind"] is None
    assert not records(h.outbox, "checkpoint")
    skips = [r.getMessage() for r in caplog.records if "not watching" in r.getMessage()]
    assert len(skips) == 1 and repr(watch) in skips[0]


def test_checkpoint_scan_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(agent, "CKPT_MAX_ENTRIES", 50)
    monkeypatch.setattr(agent, "CKPT_MAX_DEPTH", 2)
    deep = tmp_path / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    (deep / "deep.pt").write_bytes(b"x")
    (tmp_path / "a" / "b" / "ok.pt").write_bytes(b"x")
    for i in range(200):
        (tmp_path / f"f{i:03d}.pt").write_bytes(b"x")
    found = agent.CheckpointHook(agent.Attempt(1, 1, str(tmp_path))).scan(str(tmp_path))
    assert len(found) <= 50
    assert not any(p.endswith("deep.pt") for p in found)


# ---------------------------------------------------------------------------------------
# bounded while the server is away
# ---------------------------------------------------------------------------------------

def test_log_backlog_is_capped_and_every_line_arrives_once(tmp_path):
    """With the server away, an attempt spools at most backlog_max_bytes of its log; the
    rest waits in the job's own log file. As acks come, it flows on: each line once, in
    order, and EXITED after the last."""
    home = tmp_path / "home"
    agent_dir = str(home / "agent")
    ob = agent.Outbox(agent_dir)
    runner = agent.Runner(agent_dir, ob, server_url="http://x", backlog_max_bytes=64 * 1024)
    runner.start()
    try:
        n = 20_000
        code = f"import sys\nfor i in range({n}): sys.stdout.write('line %06d ' % i + 'x' * 50 + chr(10))\n"
        runner.handle_start(start_msg(50, [PY, "-c", code], tmp_path), wait=True)
        log_path = home / "agent" / "jobs" / "50" / "1" / "log"
        wait_until(lambda: os.path.exists(home / "agent" / "jobs" / "50" / "1" / "exit"),
                   what="the job ended")
        wait_until(lambda: ob.unacked() and sum(len(r.get("lines", ())) for r in ob.unacked())
                   > 0, what="some lines")
        spooled = os.path.getsize(ob.spool_path)
        assert spooled < 4 * 64 * 1024 + 64 * 1024 < os.path.getsize(log_path)
        seen = []
        while True:     # the server comes back: ack everything, repeatedly
            recs = ob.unacked()
            seen.extend(ln[2] for r in recs if r["kind"] == "log" for ln in r["lines"])
            if recs:
                ob.ack(recs[-1]["seq"])
            if any(r["kind"] == "job" and r["state"] == "EXITED" for r in recs):
                break
            wait_until(lambda: ob.last_seq > ob.acked, what="more records")
        assert len(seen) == n and seen == [f"line {i:06d} " + "x" * 50 for i in range(n)]
    finally:
        runner.stop()
        ob.close()


def test_outbox_memory_holds_offsets_not_records(tmp_path):
    ob = agent.Outbox(str(tmp_path / "agent"))
    for i in range(300):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[i, 0, "y" * 1000]]},
                  att={"key": "1/1", "offset": i})
    assert not hasattr(ob, "_pending")
    assert len(ob._offs) == 300 and ob.unacked()[299]["lines"][0][0] == 299
    assert "_att" not in ob.unacked()[0]
    ob.ack(100)
    assert [r["seq"] for r in ob.unacked()][:1] == [101]
    ob.close()
    again = agent.Outbox(str(tmp_path / "agent"))
    assert [r["seq"] for r in again.unacked()] == list(range(101, 301))
    assert again.attempt_state("1/1")["offset"] == 299


def test_retention_removes_old_attempt_files_and_keeps_the_guard(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    h.runner.handle_start(start_msg(60, "echo old", tmp_path))
    h.wait_exited(60)
    d = tmp_path / "home" / "agent" / "jobs" / "60" / "1"
    wait_until(lambda: (d / "reported").exists(), what="the reported marker")
    old = time.time() - 20 * 86400
    os.utime(d / "reported", (old, old))
    assert h.runner.remove_old_attempts() == 1
    assert sorted(os.listdir(d)) == ["reported"]
    h.runner.handle_start(start_msg(60, "echo old", tmp_path))    # never runs again
    wait_until(lambda: len(h.exited(60)) == 2, what="re-reported")
    assert h.runner.remove_old_attempts() == 0


# ---------------------------------------------------------------------------------------
# node stats
# ---------------------------------------------------------------------------------------

def test_fake_gpus_and_system_metrics(tmp_path, hosts):
    probe = agent.GpuProbe(fake_gpus=2, node="box-a")
    facts = probe.facts()
    # two agents on one host simulate two nodes: their GPUs must not look the same
    other = agent.GpuProbe(fake_gpus=2, node="box-b").facts()
    assert len({g["uuid"] for g in facts + other}) == 4
    assert [g["name"] for g in facts] == ["Fake GPU 0", "Fake GPU 1"]
    assert all(g["fake"] and g["memory_total_mb"] == 24576 for g in facts)
    sample = probe.sample({1})
    assert sample[1]["util"] > sample[0]["util"] and sample[1]["mem_used_mb"] > 1000

    h = hosts(tmp_path / "home")
    write_script(tmp_path / "sleepy.py", "import time\nwhile True: time.sleep(1)\n")
    h.runner.handle_start(start_msg(19, [PY, "sleepy.py"], tmp_path, gpus=[1],
                                    cpu_only=False))
    wait_until(lambda: job_records(h.outbox, 19, "RUNNING"), what="RUNNING")
    stats = agent.StatsReporter(h.outbox, h.runner, probe, str(tmp_path))
    stats.tick()
    ns = records(h.outbox, "node_stats")[0]
    assert len(ns["gpus"]) == 2 and ns["gpus"][1]["fake"] is True
    assert ns["host"]["mem_total_mb"] > 0 and ns["host"]["disk_free_mb"] > 0
    m = [r for r in records(h.outbox, "metrics") if r["source"] == "system"][0]
    keys = {p[0] for p in m["points"]}
    assert {"sys/cpu_percent", "sys/rss_mb", "sys/gpu1/util", "sys/gpu1/mem_used_mb"} <= keys
    assert m["run_id"] == 119 and not any(k.startswith("sys/gpu0") for k in keys)
    assert all(p[1] == m["points"][0][1] for p in m["points"])
    h.runner.handle_cancel({"type": "cancel", "job_id": 19, "attempt": 1})
    h.wait_exited(19)


def test_no_driver_logs_once_and_reports_no_gpus(caplog):
    with caplog.at_level(logging.WARNING, logger="gpuplane.agent"):
        probe = agent.GpuProbe(fake_gpus=0)
    if probe.nvml is not None:
        pytest.skip("this host has an NVIDIA driver")
    msgs = [r.getMessage() for r in caplog.records if "no NVIDIA driver" in r.getMessage()]
    assert len(msgs) == 1 and "--fake-gpus" in msgs[0]
    assert probe.facts() == [] and probe.sample() == []


# ---------------------------------------------------------------------------------------
# connection, against the fake server
# ---------------------------------------------------------------------------------------

@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.stop()


def make_agent(home, server, token=None):
    cfg = agent.Config(server=server.url, token=token or server.token, name="box",
                       home=str(home), fake_gpus=1, heartbeat_s=0.2, stats_interval_s=3600)
    a = agent.Agent(cfg, kill_grace_s=1.0)
    a.connection.ack_timeout_s = 2.0
    return a


def test_connection_handshake_replay_and_commands(tmp_path, server):
    home = tmp_path / "home"
    a = make_agent(home, server)
    # records spooled before any connection are replayed after the welcome
    a.outbox.append("event", {"run_id": None, "job_id": None, "type": "AGENT_TEST",
                              "severity": "info", "message": "before connect", "data": {}})
    a.start()
    try:
        server.wait_for(lambda: server.syncs, what="sync")
        hello = server.hellos[0]
        assert hello["node"] == "box" and hello["fake"] is True
        assert hello["gpus"][0]["name"] == "Fake GPU 0" and hello["epoch"] == a.outbox.epoch
        assert server.records()[0]["type"] == "AGENT_TEST"
        assert server.syncs[0] == {"type": "sync", "running": [], "known": []}
        server.wait_for(lambda: server.heartbeats >= 2, what="heartbeats")

        server.send(start_msg(20, [PY, "-c", "print('remote'); raise SystemExit(0)"],
                              tmp_path))
        server.wait_for(lambda: [r for r in server.applied if r["kind"] == "job"
                                 and r["state"] == "EXITED"], what="EXITED at server")
        assert [ln[2] for r in server.records("log") for ln in r["lines"]] == ["remote"]
        seqs = [r["seq"] for r in server.records()]
        assert seqs == list(range(1, len(seqs) + 1))
        server.wait_for(lambda: a.outbox.acked == a.outbox.last_seq, what="all acked")
    finally:
        a.stop()


def test_reconnect_replays_without_loss_or_duplicates(tmp_path, server):
    home = tmp_path / "home"
    write_script(tmp_path / "gated.py", GATED)
    gate = tmp_path / "gate"
    a = make_agent(home, server)
    a.start()
    try:
        server.send(start_msg(21, [PY, "gated.py", str(gate)], tmp_path))
        server.wait_for(lambda: sum(len(r["lines"]) for r in server.records("log")) == 5,
                        what="five lines")
        server.ack = False            # batches vanish: the agent must time out and replay
        gate.write_text("go")
        server.wait_for(lambda: any(r["kind"] == "job" and r["state"] == "EXITED"
                                    for r in server.swallowed), what="EXITED sent, lost")
        assert a.outbox.last_seq > server.cursor
        server.drop()                 # so the replay can only come on a new connection
        server.ack = True
        server.wait_for(lambda: [r for r in server.applied if r["kind"] == "job"
                                 and r["state"] == "EXITED"], what="EXITED after replay")
        lines = [ln for r in server.records("log") for ln in r["lines"]]
        assert [ln[0] for ln in lines] == list(range(1, 11))
        seqs = [r["seq"] for r in server.records()]
        assert seqs == list(range(1, len(seqs) + 1))
        assert len(server.hellos) >= 2
        # the second sync follows the ack of the replayed EXITED record
        server.wait_for(lambda: len(server.syncs) >= 2, what="sync after the reconnect")
        assert server.syncs[-1]["known"] == [[21, 1]]
    finally:
        a.stop()


def test_agent_restart_over_same_home_keeps_epoch_and_cursor(tmp_path, server):
    home = tmp_path / "home"
    a = make_agent(home, server)
    a.start()
    server.send(start_msg(22, "echo one", tmp_path))
    server.wait_for(lambda: server.records("job") and
                    server.records("job")[-1]["state"] == "EXITED", what="first job")
    server.wait_for(lambda: a.outbox.acked == a.outbox.last_seq, what="acked")
    a.stop()
    b = make_agent(home, server)
    assert b.outbox.epoch == a.outbox.epoch
    b.start()
    try:
        server.send(start_msg(22, "echo one", tmp_path))   # a repeated start: re-report only
        server.send(start_msg(23, "echo two", tmp_path))
        server.wait_for(lambda: [r for r in server.records("job") if r["job_id"] == 23
                                 and r["state"] == "EXITED"], what="second job")
        seqs = [r["seq"] for r in server.records()]
        assert seqs == list(range(1, len(seqs) + 1))
        texts = [ln[2] for r in server.records("log") for ln in r["lines"]]
        assert texts == ["one", "two"]
        assert len(server.hellos) == 2 and server.hellos[1]["epoch"] == server.hellos[0]["epoch"]
    finally:
        b.stop()


def test_bad_token_is_retried_until_it_works(tmp_path, server):
    a = make_agent(tmp_path / "home", server, token="wrong")
    a.start()
    try:
        server.wait_for(lambda: server.rejected >= 2, what="rejections with backoff")
        assert not server.hellos
        a.config.token = server.token      # the operator fixes it; no restart needed
        server.wait_for(lambda: server.syncs, timeout=30, what="connected")
    finally:
        a.stop()


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------

def run_cli(args, home, timeout=30):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["GPUCTL_HOME"] = str(home)
    return subprocess.run([PY, os.path.join(ROOT, "agent.py")] + args, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_setting_is_named(tmp_path):
    (tmp_path / "agent.toml").write_text('server = "http://x"\ntoken = "t"\n'
                                         'backlog_mb = "lots"\n')
    r = run_cli(["--home", str(tmp_path)], tmp_path)
    assert r.returncode == 2 and "backlog_mb = 'lots' is not a number" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_missing_server_and_token(tmp_path):
    r = run_cli([], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "--server and --token missing" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_reads_agent_toml_and_stops_on_sigterm(tmp_path, server):
    home = tmp_path / "home"
    home.mkdir()
    (home / "agent.toml").write_text(
        f'server = "{server.url}"\ntoken = "{server.token}"\nname = "tomlbox"\n'
        f'fake_gpus = 2\nheartbeat_s = 0.5\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["GPUCTL_HOME"] = str(home)
    p = subprocess.Popen([PY, os.path.join(ROOT, "agent.py")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        server.wait_for(lambda: server.syncs, what="agent from agent.toml")
        assert server.hellos[0]["node"] == "tomlbox" and len(server.hellos[0]["gpus"]) == 2
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0, out
        assert "Traceback" not in out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_server_cursor_behind_acked_starts_a_new_epoch(tmp_path, server):
    home = tmp_path / "home"
    a = make_agent(home, server)
    for i in range(3):
        a.outbox.append("event", {"run_id": None, "job_id": None, "type": f"E{i}",
                                  "severity": "info", "message": "", "data": {}})
    a.start()
    server.wait_for(lambda: server.syncs, what="first sync")
    server.wait_for(lambda: a.outbox.acked == 3, what="acked")
    a.stop()
    old_epoch = a.outbox.epoch
    with server.lock:                 # the server's database was restored from a backup
        server.cursor = 1
    b = make_agent(home, server)
    b.outbox.append("event", {"run_id": None, "job_id": None, "type": "AFTER",
                              "severity": "info", "message": "", "data": {}})
    b.start()
    try:
        server.wait_for(lambda: len(server.syncs) >= 2, what="sync after new epoch")
        assert b.outbox.epoch != old_epoch and server.epoch == b.outbox.epoch
        assert server.records()[-1]["type"] == "AFTER" and server.records()[-1]["seq"] == 1
    finally:
        b.stop()


def test_job_starts_with_default_signal_dispositions(tmp_path, hosts):
    """The shim ignores SIGHUP and SIGINT (and Python, SIGPIPE) for itself; the job it
    starts gets them back at their defaults, as from a shell."""
    h = hosts(tmp_path / "home")
    h.runner.handle_start(start_msg(7, ["/bin/sh", "-c", "grep SigIgn /proc/self/status"],
                                    tmp_path))
    rec = h.wait_exited(7)
    assert rec["exit_code"] == 0
    [line] = [ln[2] for ln in log_lines(h.outbox, 7)]
    ignored = int(line.split()[1], 16)
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (sig - 1)), f"{sig.name} is ignored in the job"


@pytest.fixture
def gate(tmp_path):
    """A file a job waits for; touched at teardown too, so a test that fails leaves no
    job (and no shim) behind."""
    path = tmp_path / "gate"
    yield path
    path.touch()


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


def test_one_shim_runs_the_jobs_and_a_new_one_replaces_it_when_killed(tmp_path, hosts):
    """The agent's shim is the parent of every job it starts (no interpreter or fork per
    job). Killed between jobs, it is replaced at the next launch; the job of a record too
    big for one message still runs (the shim reads spec.json)."""
    h = hosts(tmp_path / "home")
    parent = [PY, "-c", "import os; print(os.getppid(), os.environ.get('BIG', '')[:3])"]
    for job_id in (1, 2):
        h.runner.handle_start(start_msg(job_id, parent, tmp_path))
        assert h.wait_exited(job_id)["exit_code"] == 0
    shim = h.runner.launcher._server[0]
    for job_id in (1, 2):
        [line] = [ln[2] for ln in log_lines(h.outbox, job_id)]
        info = json.loads((tmp_path / f"home/agent/jobs/{job_id}/1/pid").read_text())
        assert int(line.split()[0]) == info["shim_pid"] == shim.pid
    shim.kill()
    shim.wait()
    big = "x" * (agent.SHIM_RECORD_MAX + 1)
    h.runner.handle_start(start_msg(3, parent, tmp_path, env={"BIG": big}))
    assert h.wait_exited(3)["exit_code"] == 0
    assert [ln[2].split()[1] for ln in log_lines(h.outbox, 3)] == ["xxx"]
    assert h.runner.launcher._server[0].pid != shim.pid


def test_jobs_outlive_the_agent_and_its_shim_ends_after_them(tmp_path, hosts, gate):
    """An agent that stops hands its shim no more jobs; the shim stays until the jobs it
    runs have ended and their exit files are written, then ends. The next agent adopts
    them and reports how they ended."""
    home = tmp_path / "home"
    a = hosts(home)
    a.runner.handle_start(start_msg(5, gated(gate, "raise SystemExit(3)"), tmp_path))
    wait_until(lambda: job_records(a.outbox, 5, "RUNNING"), what="RUNNING")
    shim = a.runner.launcher._server[0]
    a.stop()
    assert shim.poll() is None, "the shim ended with its agent while its job ran"
    b = hosts(home)
    gate.touch()
    assert b.wait_exited(5)["exit_code"] == 3
    assert shim.wait(10) == 0
    assert json.loads((home / "agent/jobs/5/1/exit").read_text())["exit_code"] == 3


def test_a_refused_start_ends_the_attempt_dispatch_failed(tmp_path, hosts):
    """A start the shim refuses ends the attempt DISPATCH_FAILED with the shim's
    sentence, not LOST, and the next job still starts."""
    h = hosts(tmp_path / "home")
    launcher = h.runner.launcher
    real_send = agent.socket.send_fds

    def no_pipe(sock, buffers, fds):      # a request without its pipe: the shim refuses
        return real_send(sock, buffers, [])
    agent.socket.send_fds = no_pipe
    try:
        h.runner.handle_start(start_msg(3, ["true"], tmp_path))
        rec = h.wait_exited(3)
    finally:
        agent.socket.send_fds = real_send
    assert rec["failure_kind"] == "DISPATCH_FAILED" and "needs one pipe" in rec["message"]
    h.runner.handle_start(start_msg(4, ["true"], tmp_path))
    assert h.wait_exited(4)["exit_code"] == 0
    assert launcher._server[0].poll() is None


def test_state_json_forgets_attempts_once_their_end_is_recorded(tmp_path, hosts):
    """state.json carries the attempts still running, not every attempt since the agent
    started: saving it at each compaction must not grow with the number of jobs run."""
    h = hosts(tmp_path / "home")
    for job_id in range(1, 6):
        h.runner.handle_start(start_msg(job_id, ["true"], tmp_path))
    for job_id in range(1, 6):
        h.wait_exited(job_id)
    wait_until(lambda: all((tmp_path / f"home/agent/jobs/{j}/1/reported").exists()
                           for j in range(1, 6)), what="reported markers")
    h.outbox.ack(h.outbox.last_seq)
    state = json.loads((tmp_path / "home/agent/state.json").read_text())
    assert state["acked"] == h.outbox.last_seq and state["attempts"] == {}


def test_outbox_reads_new_records_after_emptying_the_spool(tmp_path):
    """An ack of everything truncates the spool in place; records appended after it are
    read back as written (no stale bytes from before the truncation)."""
    ob = agent.Outbox(str(tmp_path / "agent"))
    for i in range(3):
        ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[i, 0, "old" * 50]]})
    assert len(ob.pending_after(0, max_records=1)) == 1     # the reader buffers the rest
    ob.ack(3)
    assert os.path.getsize(ob.spool_path) == 0
    ob.append("log", {"job_id": 1, "attempt": 1, "lines": [[9, 0, "new"]]})
    [(seq, wire)] = ob.pending_after(3)
    assert seq == 4 and json.loads(wire)["lines"] == [[9, 0, "new"]]
    ob.close()
    again = agent.Outbox(str(tmp_path / "agent"))
    assert [s for s, _w in again.pending_after(again.acked)] == [4]


def test_a_job_inherits_no_descriptor_of_the_shim_or_of_other_jobs(tmp_path, hosts, gate):
    """The shim holds a pipe per running job (its end is how the agent learns the exit):
    a job started while another runs must not inherit it, or the first job's end would
    wait for the second's. A job has /dev/null and its log, nothing else."""
    h = hosts(tmp_path / "home")
    h.runner.handle_start(start_msg(1, gated(gate), tmp_path))
    wait_until(lambda: job_records(h.outbox, 1, "RUNNING"), what="RUNNING")
    h.runner.handle_start(start_msg(2, [PY, "-c", """
import os
for fd in sorted(int(f) for f in os.listdir("/proc/self/fd")):
    try:
        print(fd, os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass"""], tmp_path))
    assert h.wait_exited(2)["exit_code"] == 0
    fds = dict(ln[2].split(" ", 1) for ln in log_lines(h.outbox, 2))
    log = str(tmp_path / "home/agent/jobs/2/1/log")
    assert fds.pop("0") == "/dev/null" and fds.pop("1") == log and fds.pop("2") == log
    # what is left is the listing's own directory handle
    assert all("/proc/" in target for target in fds.values()), fds
    gate.touch()
    assert h.wait_exited(1)["exit_code"] == 0


def test_a_killed_shim_leaves_its_job_running_and_the_job_ends_lost(tmp_path, hosts, gate):
    """Killing the shim does not kill its job (its own session); the job runs to its end,
    whose status nobody saw: LOST, not a guess. The next job gets a new shim."""
    h = hosts(tmp_path / "home")
    h.runner.handle_start(start_msg(8, gated(gate, 'print("finished")'), tmp_path))
    wait_until(lambda: job_records(h.outbox, 8, "RUNNING"), what="RUNNING")
    shim = h.runner.launcher._server[0]
    shim.kill()
    shim.wait()
    info = json.loads((tmp_path / "home/agent/jobs/8/1/pid").read_text())
    assert _alive(info["pid"]) and not h.exited(8)
    gate.touch()
    rec = h.wait_exited(8)
    assert rec["failure_kind"] == "LOST"
    assert [ln[2] for ln in log_lines(h.outbox, 8)] == ["finished"]
    h.runner.handle_start(start_msg(9, ["true"], tmp_path))
    assert h.wait_exited(9)["exit_code"] == 0


def test_the_shim_keeps_its_job_when_the_agent_is_gone_before_the_reply(tmp_path, gate):
    """An agent that dies between handing over a job and reading the reply: the shim's
    answer fails, and it still waits for the job, writes `exit` and then ends."""
    d = tmp_path / "att"
    d.mkdir()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    shim = subprocess.Popen(agent.shim_server_command(), stdin=theirs,
                            start_new_session=True, env=agent.shim_environment())
    theirs.close()
    r, w = os.pipe()
    record = {"argv": gated(gate, "raise SystemExit(4)"), "cwd": str(tmp_path), "env": {}}
    record["executable"] = record["argv"][0]
    socket.send_fds(ours, [os.fsencode(str(d)) + b"\0" + marshal.dumps(record)], [w])
    os.close(w)
    ours.close()                  # gone before the reply
    try:
        with open(r, "rb", buffering=0) as pipe:
            assert pipe.readline() == b"started\n"
            gate.touch()
            assert pipe.read() == b""         # EOF: the exit is written
        assert json.loads((d / "exit").read_text())["exit_code"] == 4
        assert shim.wait(30) == 0
    finally:
        if shim.poll() is None:
            shim.kill()
