"""Jobs through node loss and server restarts: each attempt starts exactly once (jobs
write a start marker), a stale attempt is stopped when its node returns, and queued jobs
wait for agents to reconcile after a server restart."""
import os
import random
import textwrap
import time

import psutil

from .helpers import PY, log_rows, report, ro, wait_for

SEED = int(os.environ.get("FAULTS_SEED", "1"))

# Records its start (job, run, pid), prints a numbered line every 20 ms until released.
GATED = textwrap.dedent("""
    import os, sys, time, pathlib
    name, d = sys.argv[1], pathlib.Path(sys.argv[2])
    with open(d / "starts", "a") as f:
        f.write(f"{name} {os.environ['GPUCTL_JOB_ID']} {os.environ['GPUCTL_RUN_ID']} {os.getpid()}\\n")
    i = 0
    while not (d / f"release-{name}").exists() and not (d / "release-all").exists():
        print(f"tick {i}", flush=True)
        i += 1
        time.sleep(0.02)
    print("done", name, flush=True)
""")


def gated(tmp_path):
    script = tmp_path / "gated.py"
    script.write_text(GATED)
    return lambda name: [PY, str(script), name, str(tmp_path)]


def starts(tmp_path):
    f = tmp_path / "starts"
    return [line.split() for line in f.read_text().splitlines()] if f.exists() else []


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _lines_match_file(server, job_id, attempt, log_file):
    """(stored, on the agent's disk, doubled) for one attempt's log."""
    rows = [t for a, _no, t in log_rows(server, job_id) if a == attempt]
    disk = log_file.read_text().splitlines()
    doubled = len(rows) - len(set(rows))
    return len(rows), len(disk), doubled, rows == disk


def test_node_lost_for_real_runs_each_attempt_once_and_stops_the_stale_one(
        server_factory, agent_factory, tmp_path):
    server = server_factory({"node_grace_s": 3, "log_keep_lines": 1_000_000})
    api, cmd = server.api, gated(tmp_path)
    first = agent_factory(server, name="first", fake_gpus=1)
    j = api.submit(cmd("x"), tmp_path, gpus=1, max_attempts=2)
    wait_for(lambda: len(starts(tmp_path)) == 1, what="attempt 1 started")
    first.kill()                       # the host vanishes; attempt 1 keeps running there
    pid1 = int(starts(tmp_path)[0][3])
    second = agent_factory(server, name="second", fake_gpus=1)
    j2 = wait_for(lambda: (x := api.job(j["id"]))["attempt"] == 2 and x["state"] == "RUNNING"
                  and x, timeout=30, what="attempt 2 running on the other node")
    assert not _gone(pid1), "the unreachable node's attempt runs on (nobody can stop it)"
    first.start()                      # the host is back: it must stop attempt 1
    wait_for(lambda: _gone(pid1), timeout=20, what="the stale attempt stopped")
    (tmp_path / "release-all").touch()
    j = api.wait_job(j["id"])
    wait_for(lambda: (r := api.get(f"/api/v1/runs/{j2['attempts'][0]['run_id']}"))
             ["state"] in ("FAILED", "CANCELLED") and r, what="attempt 1's run ended")

    marks = starts(tmp_path)
    runs = [m[2] for m in marks]
    logs = {1: next(first.home.glob(f"agent/jobs/{j['id']}/1/log")),
            2: next(second.home.glob(f"agent/jobs/{j['id']}/2/log"))}
    # the returning agent still reports the rest of attempt 1 (its run keeps them)
    try:
        wait_for(lambda: all(_lines_match_file(server, j["id"], a, f)[3]
                             for a, f in logs.items()), 20, what="both attempts' logs in")
    except AssertionError:
        pass                            # the asserts below say what is missing
    a1, a2 = (_lines_match_file(server, j["id"], a, f) for a, f in logs.items())
    report("node-lost", attempts=j["attempt"], starts=len(marks), distinct_runs=len(set(runs)),
           attempt1_lines_stored=a1[0], attempt1_lines_on_disk=a1[1], attempt1_doubled=a1[2],
           attempt2_lines_stored=a2[0], attempt2_lines_on_disk=a2[1], attempt2_doubled=a2[2],
           failure_kind_1=j["attempts"][0]["failure_kind"], job=j["state"])
    assert j["state"] == "SUCCEEDED" and j["attempt"] == 2 and j["node"] == "second"
    assert j["attempts"][0]["failure_kind"] == "NODE_LOST"
    assert len(marks) == 2 and len(set(runs)) == 2, f"an attempt started twice: {marks}"
    assert runs == [str(a["run_id"]) for a in j["attempts"]]
    # every line each attempt printed is stored once, under its own attempt
    assert a1[2] == 0 and a1[3], a1
    assert a2[2] == 0 and a2[3], a2


def test_node_that_never_returns_after_a_server_crash_is_declared_lost(
        server_factory, agent_factory, tmp_path):
    """The server and the agent's host die together; only the server comes back. The node
    must not stay 'connected' in the database forever: after node_grace_s its job is
    NODE_LOST and runs again elsewhere."""
    server = server_factory({"node_grace_s": 3})
    api, cmd = server.api, gated(tmp_path)
    doomed = agent_factory(server, name="doomed", fake_gpus=1)
    j = api.submit(cmd("y"), tmp_path, gpus=1, max_attempts=2)
    wait_for(lambda: api.job(j["id"])["state"] == "RUNNING" and starts(tmp_path),
             what="attempt 1 running")
    server.kill()
    doomed.kill()
    pid1 = int(starts(tmp_path)[0][3])
    os.killpg(os.getpgid(pid1), 9)     # the host is gone: so are its jobs
    server.start()
    api = server.api
    wait_for(lambda: doomed.node()["state"] == "disconnected", 10,
             what="the node shown disconnected after the restart")
    agent_factory(server, name="spare", fake_gpus=1)
    j = wait_for(lambda: (x := api.job(j["id"]))["attempt"] == 2 and x["state"] == "RUNNING"
                 and x, timeout=30, what="attempt 2 running on the spare node")
    (tmp_path / "release-all").touch()
    j = api.wait_job(j["id"])
    report("node-lost-with-server", job=j["state"], attempts=j["attempt"],
           failure_kind_1=j["attempts"][0]["failure_kind"], starts=len(starts(tmp_path)))
    assert j["state"] == "SUCCEEDED" and j["node"] == "spare"
    assert j["attempts"][0]["failure_kind"] == "NODE_LOST"
    assert len(starts(tmp_path)) == 2


def test_server_killed_around_dispatch_starts_every_attempt_exactly_once(
        server_factory, agent_factory, tmp_path):
    rng = random.Random(SEED)
    server = server_factory()
    api, cmd = server.api, gated(tmp_path)
    agent_factory(server, name="busy", fake_gpus=2)
    names = [f"j{i}" for i in range(5)]
    jobs = {n: api.submit(cmd(n), tmp_path, gpus=1) for n in names}
    wait_for(lambda: len(starts(tmp_path)) == 2, what="two jobs on the two GPUs")
    kills, early = 0, []
    for n in names:
        running = wait_for(lambda: [s[0] for s in starts(tmp_path)
                                    if not (tmp_path / f"release-{s[0]}").exists()],
                           what="a running job")
        (tmp_path / f"release-{running[0]}").touch()
        # SIGKILL a random moment after a slot frees: the next dispatch may be in flight
        time.sleep(rng.uniform(0, 0.4))
        server.kill()
        kills += 1
        with ro(server) as c:
            before = dict(c.execute("SELECT name, state FROM jobs").fetchall())
        server.start()
        # Right after the restart, before the agent reconnected, nothing new is dispatched.
        with ro(server) as c:
            synced = c.execute("SELECT synced FROM nodes WHERE name = 'busy'").fetchone()[0]
            now = dict(c.execute("SELECT name, state FROM jobs").fetchall())
        if not synced:
            early += [k for k, v in now.items() if before[k] == "QUEUED" and v != "QUEUED"]
    (tmp_path / "release-all").touch()
    final = {n: api.wait_job(j["id"], timeout=60) for n, j in jobs.items()}
    marks = starts(tmp_path)
    per_job = {n: sum(1 for m in marks if m[0] == n) for n in names}
    report("server-restart-jobs", seed=SEED, kills=kills, jobs=len(names), starts=len(marks),
           doubled_starts=sum(v - 1 for v in per_job.values() if v > 1),
           attempts=sum(j["attempt"] for j in final.values()),
           dispatched_before_sync=len(early),
           succeeded=sum(j["state"] == "SUCCEEDED" for j in final.values()))
    assert all(v == 1 for v in per_job.values()), per_job
    assert all(j["state"] == "SUCCEEDED" and j["attempt"] == 1 for j in final.values()), final
    assert early == [], f"dispatched before the agent reconciled: {early}"
