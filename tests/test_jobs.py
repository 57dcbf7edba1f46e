"""The spine end to end: a real gunicorn server, a real agent with fake GPUs, real jobs."""
import json
import sys
import textwrap

import psutil

from procs import wait_for

PY = sys.executable

# A job that records its start (name, CUDA_VISIBLE_DEVICES) and waits to be released.
GATED_JOB = textwrap.dedent("""
    import os, sys, time, pathlib
    name, d = sys.argv[1], pathlib.Path(sys.argv[2])
    with open(d / "starts", "a") as f:
        f.write(f"{name} {os.environ.get('CUDA_VISIBLE_DEVICES')}\\n")
    print("started", name, flush=True)
    while not (d / f"release-{name}").exists() and not (d / "release-all").exists():
        time.sleep(0.02)
    print("done", name, flush=True)
""")


def gated(tmp_path):
    script = tmp_path / "gated.py"
    script.write_text(GATED_JOB)
    return lambda name: [PY, str(script), name, str(tmp_path)]


def starts(tmp_path):
    f = tmp_path / "starts"
    return [line.split() for line in f.read_text().splitlines()] if f.exists() else []


def test_slots_are_exclusive_and_the_queue_runs_by_priority_then_submission(
        live_server, agent, tmp_path):
    api, cmd = live_server.api, gated(tmp_path)
    a = api.submit(cmd("a"), tmp_path, gpus=1)
    b = api.submit(cmd("b"), tmp_path, gpus=1)
    wait_for(lambda: len(starts(tmp_path)) == 2, what="both GPU slots busy")
    # Both slots are held: everything below waits, then runs in priority/submission order.
    low1 = api.submit(cmd("low1"), tmp_path, gpus=1, priority=0)
    high = api.submit(cmd("high"), tmp_path, gpus=1, priority=5)
    low2 = api.submit(cmd("low2"), tmp_path, gpus=1, priority=0)
    mid = api.submit(cmd("mid"), tmp_path, gpus=1, priority=2)
    queue = [j["id"] for j in api.get("/api/v1/queue", expect=200)["jobs"]]
    assert queue == [high["id"], mid["id"], low1["id"], low2["id"]]
    assert api.job(low1["id"])["pending_reason"].startswith("waiting for 1 free GPU")

    order = ["a", "b"]
    for name in ["a", "b", "high", "mid", "low1", "low2"]:
        (tmp_path / f"release-{name}").touch()
        if len(order) < 6:
            wait_for(lambda: len(starts(tmp_path)) == len(order) + 1,
                     what=f"the next job after releasing {name}")
            order.append(starts(tmp_path)[-1][0])
        running = [j for j in api.get("/api/v1/jobs", expect=200)["jobs"]
                   if j["state"] in ("DISPATCHED", "RUNNING")]
        assert len(running) <= 2
        held = [i for j in running for i in j["gpu_indices"]]
        assert len(held) == len(set(held)), f"a GPU was given twice: {running}"
    assert order == ["a", "b", "high", "mid", "low1", "low2"]
    for j in (a, b, low1, high, low2, mid):
        assert api.wait_job(j["id"])["state"] == "SUCCEEDED"


def test_cuda_visible_devices_lists_exactly_the_slots_gpus(live_server, agent_factory,
                                                           tmp_path):
    agent_factory(live_server, fake_gpus=4)
    api, cmd = live_server.api, gated(tmp_path)
    two = api.submit(cmd("two"), tmp_path, gpus=2)
    one = api.submit(cmd("one"), tmp_path, gpus=1)
    cpu = api.submit(cmd("cpu"), tmp_path, cpu_only=True)
    wait_for(lambda: len(starts(tmp_path)) == 3, what="three jobs started")
    seen = {name: cvd for name, *rest in starts(tmp_path) for cvd in (rest or [""])}
    jobs = {n: api.job(j["id"]) for n, j in (("two", two), ("one", one), ("cpu", cpu))}
    assert seen["two"] == ",".join(map(str, jobs["two"]["gpu_indices"]))
    assert len(jobs["two"]["gpu_indices"]) == 2
    assert seen["one"] == str(jobs["one"]["gpu_indices"][0])
    assert not set(jobs["one"]["gpu_indices"]) & set(jobs["two"]["gpu_indices"])
    # a cpu_only job sees no GPU at all (the agent sets the variable empty)
    assert seen.get("cpu", "") in ("", "None") and jobs["cpu"]["gpu_indices"] == []
    (tmp_path / "release-all").touch()
    for j in (two, one, cpu):
        assert api.wait_job(j["id"])["state"] == "SUCCEEDED"


def test_job_environment_is_injected_and_inherited_gpuctl_vars_are_stripped(
        live_server, agent, tmp_path):
    out = tmp_path / "env.json"
    code = ("import os, json, urllib.request as u; e = {k: v for k, v in os.environ.items() "
            "if k.startswith(('GPUCTL_', 'CUDA_', 'MY_'))}; "
            "r = u.Request(e['GPUCTL_SERVER'] + '/api/v1/auth/whoami', "
            "headers={'Authorization': 'Bearer ' + e['GPUCTL_TOKEN']}); "
            "e['whoami'] = json.load(u.urlopen(r)); "
            f"json.dump(e, open({str(out)!r}, 'w'))")
    j = live_server.api.submit([PY, "-c", code], tmp_path, gpus=1,
                               env={"MY_LR": "0.1", "GPUCTL_RUN_ID": "spoofed"})
    j = live_server.api.wait_job(j["id"])
    assert j["state"] == "SUCCEEDED", j
    env = json.loads(out.read_text())
    assert env["MY_LR"] == "0.1"
    assert env["GPUCTL_RUN_ID"] == str(j["run_id"])
    assert env["GPUCTL_JOB_ID"] == str(j["id"])
    assert env["GPUCTL_SERVER"] == live_server.url
    assert env["CUDA_VISIBLE_DEVICES"] == str(j["gpu_indices"][0])
    # the agent runs with GPUCTL_HOME set; the job must not inherit it
    assert "GPUCTL_HOME" not in env
    # The injected token is an ingest token for this run only, while the attempt runs.
    who = env["whoami"]
    assert who["scope"] == "ingest" and who["run_id"] == j["run_id"]
    r = live_server.api.session.get(
        live_server.url + "/api/v1/auth/whoami",
        headers={"Authorization": f"Bearer {env['GPUCTL_TOKEN']}"})
    assert r.status_code == 401          # revoked when the attempt ended


def test_a_job_that_needs_more_gpus_than_any_node_says_so(live_server, agent):
    j = live_server.api.submit([PY, "-c", "pass"], "/tmp", gpus=3)
    reason = wait_for(lambda: live_server.api.job(j["id"])["pending_reason"],
                      what="a pending reason")
    assert "needs 3 GPUs on one node" in reason and "has 2" in reason
    assert live_server.api.job(j["id"])["state"] == "QUEUED"


def test_cancel_kills_the_whole_process_tree(live_server, agent, tmp_path):
    pids = tmp_path / "pids"
    code = textwrap.dedent(f"""
        import os, time, subprocess, sys
        kids = [subprocess.Popen([sys.executable, "-c",
                 "import os,subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(600)']); time.sleep(600)"])
                for _ in range(2)]
        if os.fork() == 0:
            time.sleep(600)
        import psutil
        me = psutil.Process()
        deadline = time.monotonic() + 30   # until all five descendants exist
        while len(me.children(recursive=True)) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        open({str(pids)!r}, "w").write(" ".join(str(p.pid) for p in [me] + me.children(recursive=True)))
        print("tree up", flush=True)
        time.sleep(600)
    """)
    j = live_server.api.submit([PY, "-c", code], tmp_path, gpus=1)
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) >= 6,
             what="the job's process tree")
    tree = [int(p) for p in pids.read_text().split()]
    assert all(psutil.pid_exists(p) for p in tree)
    live_server.api.post(f"/api/v1/jobs/{j['id']}/cancel", expect=200)
    j = live_server.api.wait_job(j["id"], timeout=30)
    assert j["state"] == "CANCELLED" and j["failure_kind"] == "CANCELLED"

    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    wait_for(lambda: all(gone(p) for p in tree), timeout=15, what="every descendant gone")
    # cancelling again is idempotent
    again = live_server.api.post(f"/api/v1/jobs/{j['id']}/cancel", expect=200)
    assert again["state"] == "CANCELLED"


def test_cancel_of_a_queued_job_is_immediate(live_server):
    j = live_server.api.submit([PY, "-c", "pass"], "/tmp", gpus=1)
    out = live_server.api.post(f"/api/v1/jobs/{j['id']}/cancel", expect=200)
    assert out["state"] == "CANCELLED"


def test_failure_kinds_are_final_and_a_manual_retry_makes_a_new_attempt(
        live_server, agent, tmp_path):
    api = live_server.api
    exit3 = api.submit([PY, "-c", "import sys; print('bye'); sys.exit(3)"], tmp_path, gpus=1)
    oom = api.submit([PY, "-c", "import sys; print('torch.OutOfMemoryError: CUDA out of "
                      "memory. Tried to allocate 2.00 GiB', file=sys.stderr); sys.exit(1)"],
                     tmp_path, gpus=1)
    xla = api.submit([PY, "-c", "import sys; print('jaxlib.xla_extension.XlaRuntimeError: "
                      "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1GB'); "
                      "sys.exit(1)"], tmp_path, gpus=1)
    nodir = api.submit([PY, "-c", "pass"], str(tmp_path / "missing"), gpus=1)
    nocmd = api.submit(["no-such-program-xyz", "--flag"], tmp_path, gpus=1)
    expect = {exit3["id"]: "EXIT_CODE", oom["id"]: "OOM", xla["id"]: "OOM",
              nodir["id"]: "DISPATCH_FAILED", nocmd["id"]: "DISPATCH_FAILED"}
    for job_id, kind in expect.items():
        j = api.wait_job(job_id)
        assert (j["state"], j["failure_kind"]) == ("FAILED", kind), j
        assert j["attempt"] == 1, "a final failure kind is never retried automatically"
    assert api.job(exit3["id"])["exit_code"] == 3
    assert "missing" in api.job(nodir["id"])["message"]
    assert "no-such-program-xyz" in api.job(nocmd["id"])["message"]

    retried = api.post(f"/api/v1/jobs/{exit3['id']}/retry", expect=200)
    assert retried["state"] == "QUEUED"
    j = api.wait_job(exit3["id"])
    assert j["attempt"] == 2 and j["state"] == "FAILED"
    runs = [a["run_id"] for a in j["attempts"]]
    assert len(runs) == 2 and runs[0] != runs[1], "every attempt is a new run"
    api.post(f"/api/v1/jobs/{j['id']}/retry", expect=200)
    api.wait_job(j["id"])
    # a succeeded job runs again as a new attempt (issue 9 item 9); a queued one cannot
    ok = api.submit([PY, "-c", "pass"], tmp_path, gpus=1)
    api.wait_job(ok["id"])
    api.post(f"/api/v1/jobs/{ok['id']}/cancel", expect=409)
    again = api.post(f"/api/v1/jobs/{ok['id']}/retry", expect=200)
    assert again["state"] == "QUEUED"
    msg = api.post(f"/api/v1/jobs/{ok['id']}/retry")["error"]["message"]
    assert "once it has ended" in msg or "under way" in msg
    j = api.wait_job(ok["id"])
    assert j["state"] == "SUCCEEDED" and j["attempt"] == 2


def test_logs_tail_and_sse_follow_until_the_end(live_server, agent, tmp_path):
    api, _cmd = live_server.api, gated(tmp_path)
    code = ("import time, pathlib, sys\n"
            "for i in range(30): print('line', i, flush=True)\n"
            f"while not pathlib.Path({str(tmp_path / 'go')!r}).exists(): time.sleep(0.02)\n"
            "for i in range(30, 60): print('line', i, flush=True)\n")
    j = api.submit([PY, "-c", code], tmp_path, gpus=1)
    wait_for(lambda: len(api.get(f"/api/v1/jobs/{j['id']}/logs?tail=100")["lines"]) == 30,
             what="the first 30 lines")
    tail = api.get(f"/api/v1/jobs/{j['id']}/logs?tail=5", expect=200)["lines"]
    assert [t["text"] for t in tail] == [f"line {i}" for i in range(25, 30)]

    # Follow live from the start; then resume from a Last-Event-ID.
    resp = api.session.get(f"{live_server.url}/api/v1/jobs/{j['id']}/logs/stream?tail=2000",
                           stream=True, timeout=60)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    lines, ids, ended = [], [], False
    it = resp.iter_lines(decode_unicode=True)
    for raw in it:
        if raw.startswith("id: "):
            ids.append(int(raw[4:]))
        elif raw.startswith("data: ") and not ended:
            lines.append(json.loads(raw[6:])["text"])
            if len(lines) == 30:
                (tmp_path / "go").touch()
        elif raw == "event: end":
            ended = True
            break
    resp.close()
    assert ended
    assert lines == [f"line {i}" for i in range(60)]
    resumed = api.session.get(f"{live_server.url}/api/v1/jobs/{j['id']}/logs/stream",
                              headers={"Last-Event-ID": str(ids[49])}, stream=True, timeout=30)
    texts = [json.loads(r[6:])["text"] for r in resumed.iter_lines(decode_unicode=True)
             if r.startswith("data: ") and '"text"' in r]
    assert texts == [f"line {i}" for i in range(50, 60)]


def test_server_keeps_only_the_last_2000_lines(live_server, agent, tmp_path):
    j = live_server.api.submit([PY, "-c", "for i in range(2500): print('n', i)"], tmp_path,
                               gpus=1)
    live_server.api.wait_job(j["id"])
    lines = live_server.api.get(f"/api/v1/jobs/{j['id']}/logs?tail=5000")["lines"]
    assert len(lines) == 2000
    assert lines[0]["text"] == "n 500" and lines[-1]["text"] == "n 2499"
    # the agent keeps them all on its disk
    full = next(agent.home.glob(f"agent/jobs/{j['id']}/1/log")).read_text().splitlines()
    assert len(full) == 2500


def test_agent_killed_while_a_job_runs_readopts_it_and_records_its_exit(
        live_server, agent, tmp_path):
    api, cmd = live_server.api, gated(tmp_path)
    j = api.submit(cmd("survivor"), tmp_path, gpus=1)
    wait_for(lambda: api.job(j["id"])["state"] == "RUNNING", what="job running")
    # RUNNING means spawned; the script writes its start line a moment later
    wait_for(lambda: len(starts(tmp_path)) == 1, what="the job's own start line")
    agent.kill()
    wait_for(lambda: agent.node()["state"] == "disconnected", what="node disconnected")
    # RUNNING comes once the process exists, maybe before its first statement ran
    wait_for(lambda: len(starts(tmp_path)) == 1, what="the job's first statement")
    (tmp_path / "release-survivor").touch()        # the job ends while the agent is down
    agent.start()
    j = api.wait_job(j["id"])
    assert j["state"] == "SUCCEEDED" and j["attempt"] == 1
    assert len(starts(tmp_path)) == 1, "the job was launched twice"
    texts = [t["text"] for t in api.get(f"/api/v1/jobs/{j['id']}/logs")["lines"]]
    assert texts == ["started survivor", "done survivor"]


def test_agent_restart_readopts_a_job_that_is_still_running(live_server, agent, tmp_path):
    api, cmd = live_server.api, gated(tmp_path)
    j = api.submit(cmd("long"), tmp_path, gpus=1)
    wait_for(lambda: api.job(j["id"])["state"] == "RUNNING", what="job running")
    agent.kill()
    agent.start()
    assert api.job(j["id"])["state"] == "RUNNING"
    (tmp_path / "release-long").touch()
    j = api.wait_job(j["id"])
    assert j["state"] == "SUCCEEDED" and j["attempt"] == 1 and len(starts(tmp_path)) == 1


def test_server_restart_while_a_job_runs(live_server, agent, tmp_path):
    api, cmd = live_server.api, gated(tmp_path)
    j = api.submit(cmd("steady"), tmp_path, gpus=1)
    wait_for(lambda: api.job(j["id"])["state"] == "RUNNING", what="job running")
    queued = api.submit(cmd("later"), tmp_path, gpus=2)    # waits: one GPU is busy
    live_server.restart()
    api = live_server.api
    assert api.job(j["id"])["state"] == "RUNNING"
    agent.wait_connected()
    (tmp_path / "release-steady").touch()
    assert api.wait_job(j["id"])["state"] == "SUCCEEDED"
    (tmp_path / "release-later").touch()
    assert api.wait_job(queued["id"])["state"] == "SUCCEEDED"
    names = [s[0] for s in starts(tmp_path)]
    assert names == ["steady", "later"], "a job was launched twice or not at all"


def test_node_lost_past_grace_retries_on_another_node_and_stops_the_stale_attempt(
        server_factory, agent_factory, tmp_path):
    server = server_factory({"node_grace_s": 2})
    api, cmd = server.api, gated(tmp_path)
    first = agent_factory(server, name="first", fake_gpus=1)
    j = api.submit(cmd("x"), tmp_path, gpus=1, max_attempts=2)
    wait_for(lambda: api.job(j["id"])["state"] == "RUNNING", what="attempt 1 running")
    first.kill()
    _second = agent_factory(server, name="second", fake_gpus=1)
    j2 = wait_for(lambda: (x := api.job(j["id"]))["attempt"] == 2 and x["state"] == "RUNNING"
                  and x, timeout=30, what="attempt 2 running on the other node")
    assert j2["node"] == "second"
    assert j2["attempts"][0]["failure_kind"] == "NODE_LOST"
    # The old agent comes back with attempt 1 still running: it is told to stop it.
    first.start()
    pid1 = json.loads(next(first.home.glob(f"agent/jobs/{j['id']}/1/pid")).read_text())["pid"]
    wait_for(lambda: not psutil.pid_exists(pid1)
             or psutil.Process(pid1).status() == psutil.STATUS_ZOMBIE,
             timeout=20, what="the stale attempt stopped")
    (tmp_path / "release-all").touch()
    j = api.wait_job(j["id"])
    assert j["state"] == "SUCCEEDED" and j["attempt"] == 2 and j["node"] == "second"


def test_a_log_follower_of_a_job_whose_node_is_lost_ends_with_the_transition(
        server_factory, agent_factory, tmp_path):
    """The NODE_LOST transition publishes like every other: the follower's stream ends
    at once, not at the next 15 s keepalive (the read timeout below is shorter)."""
    server = server_factory({"node_grace_s": 1})
    api, cmd = server.api, gated(tmp_path)
    node = agent_factory(server, name="gone", fake_gpus=1)
    j = api.submit(cmd("x"), tmp_path, gpus=1, max_attempts=1)
    wait_for(lambda: api.job(j["id"])["state"] == "RUNNING", what="the job running")
    resp = api.session.get(f"{server.url}/api/v1/jobs/{j['id']}/logs/stream", stream=True,
                           timeout=(5, 8))
    lines = resp.iter_lines(decode_unicode=True)
    assert next(lines) == ": following"
    node.kill()
    end = None
    for raw in lines:            # a read that waits past 8 s raises: the test fails
        if raw.startswith("data: ") and end is not None:
            end = json.loads(raw[6:])
            break
        if raw == "event: end":
            end = True
    resp.close()
    assert end == {"state": "FAILED"}
    j = api.job(j["id"])
    assert j["failure_kind"] == "NODE_LOST"
    (tmp_path / "release-all").touch()
