"""The runner: starting, cancelling, re-adopting and reporting attempts, their logs and exits.

Nothing here waits with sleep(): every wait polls a condition with a deadline.
"""
import json
import os
import signal
import time

import pytest

import agent
from agentutil import GATED, PY, _alive, job_records, log_lines, records, start_msg, wait_until, write_script


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


WARNED = """\
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *a: print("warned: saving a checkpoint", flush=True))
print("training", flush=True)
for _ in range(600):
    time.sleep(0.05)
print("finished", flush=True)
"""


def test_a_job_gets_its_warning_then_is_stopped_at_its_time_limit(tmp_path, hosts):
    h = hosts(tmp_path / "home", kill_grace_s=1.0)
    write_script(tmp_path / "warned.py", WARNED)
    h.runner.handle_start(start_msg(31, [PY, "warned.py"], tmp_path, time_limit_s=2,
                                    time_signal=["USR1", 1]))
    rec = h.wait_exited(31, timeout=30)
    assert rec["failure_kind"] == "TIMEOUT", rec
    assert "time limit of 2s" in rec["message"]
    text = [ln["text"] if isinstance(ln, dict) else ln for ln in log_lines(h.outbox, 31)]
    joined = " ".join(map(str, text))
    assert "warned: saving a checkpoint" in joined and "finished" not in joined


def test_a_job_that_ends_within_its_limit_is_not_touched(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    h.runner.handle_start(start_msg(32, [PY, "-c", "print('done')"], tmp_path,
                                    time_limit_s=30, time_signal=["USR1", 10]))
    rec = h.wait_exited(32)
    assert rec["failure_kind"] is None and rec["exit_code"] == 0


def test_the_default_warning_spares_a_program_that_does_not_handle_it(tmp_path, hosts):
    """SIGUSR1's default action ends a program: the server's warning goes only to one
    that handles it; the limit still stops the other (TIMEOUT), and --signal (asked)
    would send it anyway."""
    h = hosts(tmp_path / "home", kill_grace_s=1.0)
    script = write_script(tmp_path / "plain.py", "import time\nprint('up', flush=True)\n"
                          "time.sleep(60)\n")
    h.runner.handle_start(start_msg(33, [PY, script], tmp_path, time_limit_s=3,
                                    time_signal=["USR1", 2]))
    rec = h.wait_exited(33, timeout=30)
    assert rec["failure_kind"] == "TIMEOUT" and rec["signal"] != 10, rec
    h.runner.handle_start(start_msg(34, [PY, script], tmp_path, time_limit_s=3,
                                    time_signal=["USR1", 2], time_signal_asked=True))
    rec = h.wait_exited(34, timeout=30)
    assert rec["signal"] == 10 and rec["failure_kind"] == "EXIT_CODE", rec   # it asked


def test_a_cancel_with_a_warning_signals_first_and_stops_after_its_lead(tmp_path, hosts):
    """A preemption's stop: the warning to a job that handles it, the stop `lead` seconds
    later; a job that does not handle it is stopped at once, never by the warning."""
    h = hosts(tmp_path / "home", kill_grace_s=1.0)
    write_script(tmp_path / "warned.py", WARNED)
    h.runner.handle_start(start_msg(35, [PY, "warned.py"], tmp_path))
    wait_until(lambda: job_records(h.outbox, 35, "RUNNING"), what="RUNNING")
    wait_until(lambda: any("training" in str(x) for x in log_lines(h.outbox, 35)),
               what="the job's first line")
    h.runner.handle_cancel({"type": "cancel", "job_id": 35, "attempt": 1,
                            "warn": ["USR1", 1]})
    rec = h.wait_exited(35, timeout=30)
    assert rec["failure_kind"] == "CANCELLED" and rec["signal"] == 15, rec
    joined = " ".join(str(x) for x in log_lines(h.outbox, 35))
    assert "warned: saving a checkpoint" in joined and "finished" not in joined
    plain = write_script(tmp_path / "plain2.py", "import time\nprint('up', flush=True)\n"
                         "time.sleep(60)\n")
    h.runner.handle_start(start_msg(36, [PY, plain], tmp_path))
    wait_until(lambda: any("up" in str(x) for x in log_lines(h.outbox, 36)), what="up")
    h.runner.handle_cancel({"type": "cancel", "job_id": 36, "attempt": 1,
                            "warn": ["USR1", 30]})
    rec = h.wait_exited(36, timeout=15)         # not 30 s: it does not handle SIGUSR1
    assert rec["failure_kind"] == "CANCELLED" and rec["signal"] == 15, rec
