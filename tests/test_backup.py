"""Online backups (gpuplane/db/backup.py): taken while a real server ingests, restored into
a home whose server then starts on it."""
import json
import os
import sqlite3
import subprocess
import sys
import threading

import pytest

from gpuplane.db import backup
from procs import ServerProc, wait_for


def _ingest_until(api, stop, seen):
    """Register runs and post points until told to stop; `seen` records, per run, the
    points the server acknowledged (so everything in it happened before a later backup)."""
    step = 0
    while not stop.is_set():
        run = api.post("/api/v1/runs", {"project": "bk", "name": f"r{len(seen)}"}, expect=201)
        for _ in range(5):
            points = [[0, step + i, float(i), 0] for i in range(200)]
            r = api.post(f"/api/v1/runs/{run['id']}/metrics",
                         {"keys": ["loss"], "points": points}, expect=200)
            step += 200
            seen[run["id"]] = seen.get(run["id"], 0) + r["accepted"]
        api.post("/api/v1/jobs", {"command": ["true"], "working_dir": "/tmp", "name": "bk"},
                 expect=201)


def test_a_backup_during_ingest_restores_to_a_consistent_database(server_factory, tmp_path):
    server = server_factory(name="live")
    stop, seen = threading.Event(), {}
    writer = threading.Thread(target=_ingest_until, args=(server.api, stop, seen))
    writer.start()
    try:
        wait_for(lambda: len(seen) >= 3, 60, what="some runs ingested")
        before = dict(seen)
        jobs_before = {j["id"] for j in server.api.get("/api/v1/jobs?limit=10000")["jobs"]}
        info = backup.take(server.home, keep=3)
        wait_for(lambda: len(seen) > len(before) + 1, 60, what="ingest going on after it")
    finally:
        stop.set()
        writer.join(60)
    assert info["path"].startswith(str(server.home / "backups"))
    assert backup.check(info["path"])["schema_version"] >= 2

    conn = sqlite3.connect(info["path"])
    runs = dict(conn.execute("SELECT r.id, COUNT(p.step) FROM runs r JOIN metric_keys k"
                             " ON k.run_id = r.id JOIN points p ON p.key_id = k.id"
                             " GROUP BY r.id").fetchall())
    job_ids = {r[0] for r in conn.execute("SELECT id FROM jobs")}
    conn.close()
    for run_id, n in before.items():
        assert runs.get(run_id, 0) >= n, f"run {run_id} lost points in the backup"
    assert jobs_before <= job_ids

    server.stop()
    restored = ServerProc(tmp_path / "restored")
    restored_info, kept = backup.restore(restored.home, info["path"])
    assert kept is None and restored_info["jobs"] == len(job_ids)
    restored.start()
    try:
        listed = {j["id"] for j in restored.api.get("/api/v1/jobs?limit=10000")["jobs"]}
        assert jobs_before <= listed
        some_run = next(iter(before))
        assert restored.api.get(f"/api/v1/runs/{some_run}", expect=200)["project"] == "bk"
    finally:
        restored.stop()


def test_keep_prunes_the_oldest_backups(live_server):
    paths = [backup.take(live_server.home, keep=2)["path"] for _ in range(4)]
    left = [b["path"] for b in backup.list_backups(live_server.home)]
    assert left == paths[-2:]


def test_restore_refuses_a_damaged_file_and_keeps_the_database(tmp_path, live_server):
    live_server.api.post("/api/v1/jobs", {"command": ["true"], "working_dir": "/tmp"},
                         expect=201)
    good = backup.take(live_server.home)["path"]
    bad = tmp_path / "bad.db"
    data = bytearray(open(good, "rb").read())
    data[100:4096] = b"\xff" * (4096 - 100)
    bad.write_bytes(bytes(data))
    with pytest.raises(backup.BackupError):
        backup.restore(tmp_path / "home", bad)
    assert not (tmp_path / "home" / "server" / "gpuctl.db").exists()
    with pytest.raises(backup.BackupError, match="not a readable|integrity"):
        backup.check(bad)
    (tmp_path / "empty.db").write_bytes(b"")
    with pytest.raises(backup.BackupError, match="not a GPUPlane database"):
        backup.check(tmp_path / "empty.db")


def test_restore_keeps_the_database_it_replaces(tmp_path, live_server):
    good = backup.take(live_server.home)["path"]
    home = tmp_path / "home2"
    backup.restore(home, good)
    info, kept = backup.restore(home, good)
    assert kept and backup.check(kept)["schema_version"] == info["schema_version"]


def _cli(*argv, home):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    return subprocess.run([sys.executable, "-m", "gpuplane", *argv, "--home", str(home)],
                          capture_output=True, text=True, timeout=120, env=env)


def test_cli_backup_list_and_restore_refused_while_the_server_runs(live_server):
    live_server.api.post("/api/v1/jobs", {"command": ["true"], "working_dir": "/tmp",
                                          "name": "keepme"}, expect=201)
    r = _cli("backup", "--keep", "2", home=live_server.home)
    assert r.returncode == 0, r.stderr
    assert "backed up 1 jobs" in r.stdout and "integrity ok" in r.stdout
    listed = _cli("backup", "--list", "--json", home=live_server.home)
    path = json.loads(listed.stdout)[0]["path"]
    r = _cli("restore", path, home=live_server.home)
    assert r.returncode == 1 and "stop it first" in r.stderr
    live_server.stop()
    r = _cli("restore", path, home=live_server.home)
    assert r.returncode == 0, r.stderr
    assert "restored" in r.stdout and "kept as" in r.stdout
    r = _cli("restore", str(live_server.home / "nope.db"), home=live_server.home)
    assert r.returncode == 1 and "does not exist" in r.stderr and "nothing was changed" in r.stderr


def test_the_schedule_takes_a_backup_when_due_and_not_before(live_server):
    from gpuplane.backups import BackupSchedule
    sched = BackupSchedule(live_server.home, interval_h=1, keep=2)
    assert sched.due == 0.0                         # no backup yet: due at once
    first = sched.tick(now=1000.0)
    assert first and backup.check(first["path"])
    assert sched.tick(now=1000.0 + 3599) is None    # not due again within the hour
    assert sched.tick(now=1000.0 + 3600)
    assert sched.tick(now=1000.0 + 7200)
    assert len(backup.list_backups(live_server.home)) == 2     # keep = 2
    # A restarted server counts from the newest backup on disk, not from zero.
    again = BackupSchedule(live_server.home, interval_h=1, keep=2)
    assert again.due == backup.list_backups(live_server.home)[-1]["mtime"] + 3600
    off = BackupSchedule(live_server.home, interval_h=0, keep=2)
    assert off.tick(now=10**12) is None


def test_a_server_with_a_schedule_backs_up_at_start(server_factory):
    server = server_factory({"backup_interval_h": 24, "backup_keep": 3})
    wait_for(lambda: backup.list_backups(server.home), 30, what="the first scheduled backup")


def test_backup_agent_archives_a_running_host_and_restores(live_server, agent, tmp_path):
    import shutil
    import tarfile
    api = live_server.api
    gate = tmp_path / "gate"
    job = api.submit(["/bin/sh", "-c", f"i=0; while [ ! -e {gate} ]; do echo line $i; "
                      "i=$((i+1)); sleep 0.01; done; echo last"], tmp_path, gpus=1)
    wait_for(lambda: len(api.get(f"/api/v1/jobs/{job['id']}/logs")["lines"]) >= 20, 60,
             what="log lines")
    out = tmp_path / "agent.tar.gz"
    r = _cli("backup-agent", "-o", str(out), home=agent.home)
    assert r.returncode == 0, r.stderr
    assert "files" in r.stdout and oct(out.stat().st_mode & 0o777) == "0o600"
    log_path = f"agent/jobs/{job['id']}/1/log"
    with tarfile.open(out) as tar:
        names = tar.getnames()
        archived = tar.extractfile(log_path).read()
    assert {"agent/state.json", "agent/spool/outbox.jsonl", log_path} <= set(names)
    assert names.index("agent/spool/outbox.jsonl") < names.index("agent/state.json")
    # taken while the job was writing: a prefix of the log as it is now
    live = (agent.home / log_path).read_bytes()
    assert archived and live.startswith(archived)
    gate.touch()
    api.wait_job(job["id"])
    agent.stop()
    # The host loses its agent home; the archive puts it back and the agent carries on.
    shutil.rmtree(agent.home / "agent")
    with tarfile.open(out) as tar:
        tar.extractall(agent.home, filter="data")
    agent.start()
    texts = wait_for(lambda: (ls := [l["text"] for l in api.get(
        f"/api/v1/jobs/{job['id']}/logs?tail=5000")["lines"]]) and ls[-1] == "last" and ls,
        60, what="the log after the restore")
    assert len(texts) == len(set(texts))          # nothing doubled
    assert api.job(job["id"])["state"] == "SUCCEEDED"


def test_backup_agent_of_a_home_without_an_agent_says_so(tmp_path):
    r = _cli("backup-agent", "-o", str(tmp_path / "x.tar.gz"), home=tmp_path / "empty")
    assert r.returncode == 1 and "no agent state" in r.stderr


def test_restore_refused_whenever_the_home_lock_is_held_and_backups_hold_only_backups(
        live_server):
    """Issue 22: restore probed the port in server.toml, so a server started with another
    --port (or --host) was missed and its database replaced under it. Now the home's
    server.lock decides. And `gpuplane backup` left *.partial-wal / *.partial-shm."""
    import re
    from procs import free_port
    toml = live_server.home / "server.toml"
    toml.write_text(re.sub(r"(?m)^port = .*$", f"port = {free_port()}", toml.read_text()))
    r = _cli("backup", "--keep", "3", home=live_server.home)
    assert r.returncode == 0, r.stderr
    backup.take(live_server.home, keep=3)
    left = sorted(p.name for p in (live_server.home / "backups").iterdir())
    assert len(left) == 2 and all(re.fullmatch(r"gpuctl-[0-9-]+\.db", n) for n in left), left
    db = live_server.home / "server" / "gpuctl.db"
    inode = db.stat().st_ino
    r = _cli("restore", str(live_server.home / "backups" / left[0]), home=live_server.home)
    assert r.returncode == 1 and "stop it first" in r.stderr and "server.lock" in r.stderr
    assert db.stat().st_ino == inode            # not replaced under the running server
    live_server.api.get("/api/v1/health", expect=200)


def test_backup_agent_takes_regular_files_only(tmp_path):
    """Issue 22: a job can put a symlink in its attempt dir (the archive then held the file
    it pointed to, ~/.ssh/id_rsa say) or a FIFO (the backup blocked on it for ever)."""
    import tarfile
    home = tmp_path / "home"
    att = home / "agent" / "jobs" / "1" / "1"
    att.mkdir(parents=True)
    (att / "log").write_text("hello\n")
    secret = tmp_path / "secret"
    secret.write_text("private key\n")
    os.symlink(secret, att / "stolen")
    os.mkfifo(att / "fifo")
    out = tmp_path / "a.tar.gz"
    r = subprocess.run([sys.executable, "-m", "agent", "backup", str(out), "--home", str(home)],
                       capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    assert "left out 2 entries" in r.stderr
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        assert "agent/jobs/1/1/log" in names
        assert not {"agent/jobs/1/1/stolen", "agent/jobs/1/1/fifo"} & names
