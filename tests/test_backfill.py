"""Backfill on a real server and agent (4 fake GPUs, real child processes): a head job of
4 GPUs waits for a limited 1-GPU job; short limited jobs behind it run on the 3 free GPUs
and end before it starts; a job without a limit does not pass it; the head says when it
is reserved to start, and `job show` gives the estimate."""
import sys

from gpuplane import cli
from procs import AgentProc, ServerProc, kill_leftover_jobs, wait_for


def test_short_limited_jobs_backfill_and_an_unlimited_one_waits(tmp_path, monkeypatch,
                                                                  capsys):
    server = ServerProc(tmp_path / "server").start()
    agent = AgentProc(server, tmp_path / "agent", "box", fake_gpus=4, cpu_slots=0).start()
    api = server.api
    try:
        def job(name, gpus, seconds, limit=None, **kw):
            body = {"name": name, "command": [sys.executable, "-c",
                                              f"import time; time.sleep({seconds})"],
                    "working_dir": str(tmp_path), "gpus": gpus, **kw}
            if limit:
                body["time_limit"] = limit
            return api.post("/api/v1/jobs", body, expect=201)

        first = job("first", 1, 6, limit="20s")
        wait_for(lambda: api.job(first["id"])["state"] == "RUNNING", 30, what="first to run")
        head = job("head", 4, 1)
        shorts = [job(f"short{i}", 1, 0.5, limit="5s") for i in range(3)]
        unlimited = job("unlimited", 1, 0.5)
        done = wait_for(lambda: all(api.job(j["id"])["state"] == "SUCCEEDED"
                                    for j in [first, head, *shorts, unlimited]) and True,
                        120, what="every job to end")
        assert done
        got = {j["id"]: api.job(j["id"]) for j in [first, head, *shorts, unlimited]}
        h = got[head["id"]]
        for s in shorts:            # backfilled: started and ended before the head started
            assert got[s["id"]]["started_at"] < h["started_at"]
            assert got[s["id"]]["ended_at"] <= h["started_at"]
        # no limit: it never passed the head
        assert got[unlimited["id"]]["started_at"] >= h["started_at"]
    finally:
        agent.stop()
        server.stop()
        kill_leftover_jobs(agent.home)


def test_the_head_says_when_it_is_reserved_to_start(tmp_path, monkeypatch, capsys):
    server = ServerProc(tmp_path / "server").start()
    agent = AgentProc(server, tmp_path / "agent", "box", fake_gpus=2, cpu_slots=0).start()
    api = server.api
    try:
        first = api.post("/api/v1/jobs", {"name": "first", "gpus": 1, "time_limit": "1h",
                                          "command": [sys.executable, "-c",
                                                      "import time; time.sleep(60)"],
                                          "working_dir": str(tmp_path)}, expect=201)
        wait_for(lambda: api.job(first["id"])["state"] == "RUNNING", 30, what="first to run")
        head = api.post("/api/v1/jobs", {"name": "head", "gpus": 2, "command": ["true"],
                                         "working_dir": str(tmp_path)}, expect=201)
        waiting = wait_for(lambda: (j := api.job(head["id"]))["expected_start"] and j, 30,
                           what="the head's reservation")
        assert waiting["pending_reason"].startswith("reserved to start at ")
        assert f"when job {first['id']} reaches its time limit" in waiting["pending_reason"]
        started = api.job(first["id"])["started_at"]
        assert abs(waiting["expected_start"] - (started + 3600_000)) < 5_000
        monkeypatch.setenv("GPUCTL_TOKEN", server.token)
        assert cli.main(["--server", server.url, "job", "show", str(head["id"])]) == 0
        out = capsys.readouterr().out
        assert "expected start" in out and "an estimate from the time limits" in out
        assert cli.main(["--server", server.url, "status"]) == 0
        import time
        at = time.strftime("%H:%M:%S", time.localtime(waiting["expected_start"] / 1000))
        row = next(line for line in capsys.readouterr().out.splitlines()
                   if line.split()[:2] == ["1", str(head["id"])])
        assert at in row and "reserved to start at" in row
        api.post(f"/api/v1/jobs/{first['id']}/cancel")
        api.post(f"/api/v1/jobs/{head['id']}/cancel")
    finally:
        agent.stop()
        server.stop()
        kill_leftover_jobs(agent.home)


def test_an_urgent_job_preempts_a_preemptible_run_which_resumes_from_its_checkpoint(
        tmp_path):
    from procs import ROOT
    server = ServerProc(tmp_path / "server", {"preempt_min_run_s": 0}).start()
    agent = AgentProc(server, tmp_path / "agent", "box", fake_gpus=1, cpu_slots=0).start()
    api = server.api
    example = ROOT / "examples" / "cpu"
    try:
        low = api.post("/api/v1/jobs", {
            "name": "low", "gpus": 1, "preemptible": True, "working_dir": str(example),
            "command": [sys.executable, "train.py", "--epochs", "4", "--steps-per-epoch",
                        "20", "--step-delay", "0.05", "--logdir", f"tb-preempt-{tmp_path.name}",
                        "--checkpoint-dir", str(tmp_path / "ckpt-{run}")],
            "watch_dir": None}, expect=201)
        first_run = wait_for(lambda: (j := api.job(low["id"]))["run_id"] and j["run_id"], 30,
                             what="low's run")
        wait_for(lambda: api.get(f"/api/v1/runs/{first_run}/checkpoints")["checkpoints"], 60,
                 what="low's first checkpoint")
        urgent = api.post("/api/v1/jobs", {"name": "urgent", "gpus": 1, "priority": 10,
                                           "command": ["true"], "working_dir": str(tmp_path)},
                          expect=201)
        done = wait_for(lambda: all(api.job(j["id"])["state"] == "SUCCEEDED"
                                    for j in (low, urgent)) and True, 120,
                        what="both to succeed")
        assert done
        low_now, urgent_now = api.job(low["id"]), api.job(urgent["id"])
        assert low_now["attempt"] == 2 and low_now["preempted_by"] == urgent["id"]
        # the urgent job ran while low waited; low's second run resumed where it stopped
        assert urgent_now["started_at"] < low_now["started_at"]
        evs = api.get(f"/api/v1/events?job={low['id']}&limit=50")["events"]
        assert any(e["type"] == "PREEMPTED" and e["data"]["by"] == urgent["id"] for e in evs)
        second = low_now["run_id"]
        run = api.get(f"/api/v1/runs/{second}")
        ckpts = [c["id"] for c in api.get(f"/api/v1/runs/{first_run}/checkpoints")
                 ["checkpoints"]]
        assert run["resumed_from"] in ckpts
        lines = api.get(f"/api/v1/jobs/{low['id']}/logs")["lines"]
        assert any("resumed from" in ln["text"] for ln in lines)
        # its curve goes on from the checkpoint's step, not from 1: fewer points than steps
        keys = {k["key"]: k for k in api.get(f"/api/v1/runs/{second}/metrics")["keys"]}
        loss = keys["train/loss"]
        assert loss["latest"]["step"] == 80 and loss["count"] < 80, loss
    finally:
        agent.stop()
        server.stop()
        kill_leftover_jobs(agent.home)
