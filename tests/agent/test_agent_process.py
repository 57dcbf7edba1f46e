"""The agent as a real process (`python agent.py`) against the fake server of
tests/fake_server.py: what only a whole agent shows (its threads side by side, its
environment, its files).

Nothing here waits with sleep(): every wait polls a condition with a deadline.
"""
import json
import os
import stat
import struct
import sys
import time



PY = sys.executable


def start_msg(job_id, command, working_dir, **extra):
    msg = {"type": "start", "job_id": job_id, "attempt": 1, "run_id": 100 + job_id,
           "command": command, "working_dir": str(working_dir), "env": {}, "gpus": [],
           "cpu_only": True, "tb_dir": None, "watch_dir": None,
           "server_url": "http://server.example:8600", "ingest_token": "gpi_job_own"}
    msg.update(extra)
    return msg


def exited(server, job_id):
    return [r for r in server.records("job") if r["job_id"] == job_id
            and r["state"] == "EXITED"]


def write_event_file(path, n_scalars, per_event=100):
    """A TensorBoard event file of n_scalars simple values (100 tags an event), framed
    with the C CRC so it is written in well under a second."""
    import google_crc32c
    from tensorboard.compat.proto import event_pb2, summary_pb2

    def masked(b):
        c = google_crc32c.value(b)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    def record(data):
        head = struct.pack("<Q", len(data))
        return head + struct.pack("<I", masked(head)) + data + struct.pack("<I", masked(data))

    t0 = time.time()
    out = [record(event_pb2.Event(wall_time=t0, file_version="brain.Event:2")
                  .SerializeToString())]
    for step in range(n_scalars // per_event):
        values = [summary_pb2.Summary.Value(tag=f"k{k}", simple_value=step + k * 0.5)
                  for k in range(per_event)]
        ev = event_pb2.Event(wall_time=t0 + step, step=step,
                             summary=summary_pb2.Summary(value=values))
        out.append(record(ev.SerializeToString()))
    path.write_bytes(b"".join(out))


def test_tensorboard_backlog_at_exit_never_holds_up_the_heartbeats(tmp_path, fake_server,
                                                                   agent_proc):
    """A job leaves 500 000 scalars behind as it exits; while the agent parses and spools
    them, its heartbeat thread goes on beating and it never reconnects. Told on the agent's
    own clock (each record and heartbeat carries its `ts`), so a loaded machine slows both
    alike: over the span in which the backlog's records were spooled, at least half the
    heartbeats due in it were sent (a parse that held them up would leave none)."""
    src = tmp_path / "prebuilt.tfevents"
    write_event_file(src, 500_000)
    tb = tmp_path / "tb"
    tb.mkdir()
    fake_server.heartbeat_s = 0.1        # the interval the agent is told at its hello
    agent_proc()
    hb_ms = fake_server.heartbeat_s * 1000
    copy = ("import shutil, sys; shutil.copyfile(sys.argv[1], "
            "sys.argv[2] + '/events.out.tfevents.1.host.1.0')")
    fake_server.send(start_msg(1, [PY, "-c", copy, str(src), str(tb)], tmp_path,
                               tb_dir=str(tb)))
    fake_server.wait_for(lambda: exited(fake_server, 1), timeout=120, what="EXITED")
    records = [r for r in fake_server.records("metrics") if r["source"] == "tb"]
    assert sum(r["n_points"] for r in records) == 500_000
    first, last = min(r["ts"] for r in records), max(r["ts"] for r in records)
    assert last - first >= 4 * hb_ms, (
        f"the backlog was spooled in {last - first} ms, under four heartbeats: too short "
        "to tell; make the event file bigger")
    with fake_server.lock:
        during = [t for t in fake_server.heartbeat_sent if t and first < t < last]
    due = (last - first) / hb_ms
    assert len(during) >= due // 2, (len(during), due)
    assert len(fake_server.hellos) == 1 and not fake_server.closes


def test_job_cannot_read_the_agent_token(tmp_path, fake_server, agent_proc):
    """The job's own environment has its ingest token and nothing of the agent's; its
    parent (the shim) was started with a clean one; the agent's /proc/PID/environ is
    closed to it."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "def environ(pid):\n"
        "    try:\n"
        "        with open(f'/proc/{pid}/environ', 'rb') as f:\n"
        "            return f.read().decode('utf-8', 'replace')\n"
        "    except OSError as e:\n"
        "        return 'unreadable: ' + type(e).__name__\n"
        "json.dump({'own': dict(os.environ), 'parent': environ(os.getppid()),\n"
        "           'agent': environ(int(sys.argv[2]))}, open(sys.argv[1], 'w'))\n")
    a = agent_proc()
    out = tmp_path / "env.json"
    fake_server.send(start_msg(2, [PY, str(probe), str(out), str(a.proc.pid)], tmp_path,
                               env={"MY_SETTING": "x"}))
    fake_server.wait_for(lambda: exited(fake_server, 2), what="EXITED")
    seen = json.loads(out.read_text())
    token = fake_server.token
    assert seen["own"]["GPUCTL_TOKEN"] == "gpi_job_own"
    assert seen["own"]["GPUCTL_JOB_ID"] == "2" and seen["own"]["MY_SETTING"] == "x"
    assert "PATH" in seen["own"] and seen["own"]["CUDA_VISIBLE_DEVICES"] == ""
    assert token not in json.dumps(seen["own"])
    assert token not in seen["parent"] and "GPUCTL_HOME" not in seen["parent"]
    assert token not in seen["agent"]


def test_agent_home_is_private(tmp_path, fake_server, agent_proc):
    a = agent_proc()
    fake_server.send(start_msg(3, "echo private", tmp_path))
    fake_server.wait_for(lambda: exited(fake_server, 3), what="EXITED")
    home = a.home / "agent"
    for dirpath, dirnames, filenames in os.walk(home):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
        for name in filenames:
            path = os.path.join(dirpath, name)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
