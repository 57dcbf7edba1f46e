"""The shim: one process per agent that starts every job and outlives the agent.

Nothing here waits with sleep(): every wait polls a condition with a deadline.
"""
import json
import marshal
import os
import signal
import socket
import subprocess


import agent
from agentutil import PY, _alive, gated, job_records, log_lines, records, start_msg, wait_until


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


def test_the_start_record_on_disk_never_holds_the_secrets(tmp_path, hosts, gate):
    """The shim gets the job's env and token in its message: spec.json is written without
    them from the first byte (not rewritten once the job runs); a record too big for one
    message is read from spec.json, so it keeps them there until the job runs."""
    h = hosts(tmp_path / "home")
    wait = [PY, "-c", f"import os, time\nwhile not os.path.exists({str(gate)!r}): "
            "time.sleep(0.02)"]
    h.runner.handle_start(start_msg(1, wait, tmp_path, env={"KEY": "v4lue"}))
    spec = json.loads((tmp_path / "home/agent/jobs/1/1/spec.json").read_text())
    assert "v4lue" not in json.dumps(spec) and "gpi_test" not in json.dumps(spec)
    assert spec["start"]["env"] == {"KEY": "<redacted>"} and "env" not in spec["exec"]
    big = "x" * (agent.SHIM_RECORD_MAX + 1)
    h.runner.handle_start(start_msg(2, wait, tmp_path, env={"BIG": big}))
    path = tmp_path / "home/agent/jobs/2/1/spec.json"
    wait_until(lambda: "ingest_token" not in json.loads(path.read_text())["start"],
               what="the big record scrubbed once its job runs")
    assert big not in path.read_text()
    gate.touch()
    assert h.wait_exited(1)["exit_code"] == 0 and h.wait_exited(2)["exit_code"] == 0
