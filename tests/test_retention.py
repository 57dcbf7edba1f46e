"""Checkpoint retention: the policy (pure), and a run with 20 checkpoints under keep-best 2
/ keep-last 1 on a real server and agent: exactly those stay on disk, the registry says
why each is kept, the rest are marked deleted with the bytes freed, and a file outside the
working dir registered through the SDK (and a symlink's target) is left alone."""
import os
import sys

import pytest

from gpuplane import retention
from procs import wait_for


def test_a_policy_that_keeps_nothing_is_refused():
    with pytest.raises(retention.PolicyError, match="keeps nothing"):
        retention.parse_policy({"keep_best": 0, "keep_last": 0})
    with pytest.raises(retention.PolicyError, match="keep_best"):
        retention.parse_policy({"keep_best": -1})
    assert retention.parse_policy({"keep_best": 2}) == {"keep_best": 2, "keep_last": 1}


def test_only_the_jobs_with_a_policy_are_read_whole_when_they_end(tmp_path):
    from gpuplane.db import Database, projects
    from gpuplane.lifecycle import Lifecycle
    db = Database(tmp_path / "gpuctl.db")
    lc = Lifecycle(db)

    def job(name, experiment="", **extra):
        return lc.submit({"name": name, "command": ["true"], "working_dir": "/w", "gpus": 1,
                          "cpu_only": False, "priority": 0, "max_attempts": 1, "env": {},
                          "project": "default", "experiment": experiment, **extra})["id"]
    plain = job("plain")
    own = job("own", retention={"keep_best": 1, "keep_last": 1})
    in_exp = job("in-exp", experiment="kept")
    other_exp = job("other-exp", experiment="free")
    evaluate = job("eval", experiment="kept", kind="EVALUATE")
    projects.set_experiment_retention(db, "default", "kept", {"keep_best": 2, "keep_last": 1})
    r = retention.Retention(db, lc, None)
    assert list(r._with_policy(sorted([plain, own, in_exp, other_exp, evaluate]))) == [
        own, in_exp]


def test_plan_keeps_the_best_the_last_evaluated_pinned_and_outside_ones():
    ck = [{"id": i, "run_id": 1 if i < 6 else 2, "path": f"/w/c{i}.pt", "step": i * 10}
          for i in range(1, 9)]
    ck[0]["pinned"] = True
    ck[1]["evaluated"] = True
    ck[2]["path"] = "/elsewhere/c3.pt"
    values = {c["id"]: abs(c["id"] - 4) + 0.5 for c in ck}       # 4 best, then 3 (outside)
    plan = retention.plan(ck, values, "min", {"keep_best": 2, "keep_last": 1}, "/w", "loss")
    kept = {i: why for i, (keep, why) in plan.items() if keep}
    assert kept == {1: "pinned", 2: "evaluated", 3: "outside the job's working dir: never "
                    "deleted", 4: "best 1 by loss (0.5)", 5: "last 1 of run 1",
                    8: "last 1 of run 2"}
    assert not plan[6][0] and not plan[7][0]


TRAIN = """\
import os
from gpuctl import run
os.makedirs("ckpt", exist_ok=True)
for step in range(1, 21):
    run.log({"val/loss": abs(step - 7) + 1.0}, step=step * 10)   # best at 70, then 60 / 80
    path = f"ckpt/step{step * 10}.pt"
    with open(path, "wb") as f:
        f.write(b"w" * 1000)
    run.log_checkpoint(path, step=step * 10)
run.log_checkpoint(os.environ["OUTSIDE"], step=5)                 # registered, not ours
os.symlink(os.environ["TARGET"], "ckpt/link.pt")
run.log_checkpoint("ckpt/link.pt", step=1)
"""


def test_twenty_checkpoints_under_keep_best_2_keep_last_1(live_server, agent, tmp_path,
                                                        monkeypatch, capsys):
    api = live_server.api
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    (work / "train.py").write_text(TRAIN)
    (outside / "keep.pt").write_bytes(b"o" * 10)
    (outside / "target.pt").write_bytes(b"t" * 10)
    bad = api.post("/api/v1/jobs", {"command": ["true"], "working_dir": str(work),
                                    "retention": {"keep_best": 0, "keep_last": 0}})
    assert api.last.status_code == 400 and "keeps nothing" in bad["error"]["message"]
    job = api.submit([sys.executable, "train.py"], work, cpu_only=True,
                     env={"OUTSIDE": str(outside / "keep.pt"),
                          "TARGET": str(outside / "target.pt")},
                     retention={"keep_best": 2, "keep_last": 1}, experiment="retention")
    api.post("/api/v1/metric-definitions", {"key": "val/loss", "direction": "min",
                                            "primary": True, "project": "default"},
             expect=200)
    # --dry-run over the CLI, while nothing is deleted yet
    from gpuplane import cli
    j = api.wait_job(job["id"])
    assert j["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{job['id']}/logs")
    run = j["run_id"]

    def gone():
        cks = api.get(f"/api/v1/runs/{run}/checkpoints")["checkpoints"]
        return len(cks) == 22 and sum(1 for c in cks if c.get("deleted_at")) == 17 and cks
    cks = wait_for(gone, timeout=60, what="retention to delete 17 checkpoints")
    on_disk = sorted(p.name for p in (work / "ckpt").iterdir())
    assert on_disk == ["link.pt", "step200.pt", "step60.pt", "step70.pt"]
    assert (outside / "keep.pt").exists() and (outside / "target.pt").exists()
    why = {os.path.basename(c["path"]): c["keep_reason"] for c in cks if not c["deleted_at"]}
    assert why["step70.pt"] == "best 1 by val/loss (1)"
    assert why["step60.pt"].startswith("best 2 by val/loss")
    assert why["step200.pt"] == f"last 1 of run {run}"
    assert why["keep.pt"] == "outside the job's working dir: never deleted"
    assert why["link.pt"].startswith("not deleted by the agent: a symlink")
    assert all(c["bytes_freed"] == 1000 for c in cks if c["deleted_at"])
    # pin, and a dry run says what would go under a stricter policy, deleting nothing
    monkeypatch.setenv("GPUCTL_TOKEN", live_server.token)
    assert cli.main(["--server", live_server.url, "ckpt", "pin",
                     str(next(c["id"] for c in cks if c["path"].endswith("step60.pt")))]) == 0
    assert cli.main(["--server", live_server.url, "ckpt", "prune", "--job", str(job["id"]),
                     "--keep-best", "1", "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "pinned" in out and "would delete 0 checkpoints" in out, out
    assert sorted(p.name for p in (work / "ckpt").iterdir()) == on_disk

    # the same from an agent's MCP tools: unpin, and the dry run names what would go and
    # the call that deletes it; nothing is deleted
    from test_mcp import mcp_env, ok, session
    step60 = next(c["id"] for c in cks if c["path"].endswith("step60.pt"))

    async def body(call, client):
        r = ok(await call("prune_checkpoints", job_id=job["id"], keep_best=1, keep_last=1))
        assert r["dry_run"] and r["delete"] == [] and r["next_actions"] == [], r
        assert ok(await call("pin_checkpoint", checkpoint_id=step60, pinned=False))[
            "pinned"] is False
        r = ok(await call("prune_checkpoints", job_id=job["id"], keep_best=1, keep_last=1))
        assert [c["checkpoint_id"] for c in r["delete"]] == [step60], r
        assert [(a["tool"], a["arguments"]) for a in r["next_actions"]] == [(
            "prune_checkpoints", {"job_id": job["id"], "keep_best": 1, "keep_last": 1,
                                  "dry_run": False})]
    session(mcp_env(live_server.url, live_server.token, tmp_path), body, in_process=True)
    assert sorted(p.name for p in (work / "ckpt").iterdir()) == on_disk


def test_an_experiments_policy_applies_to_its_jobs_without_one(live_server, agent, tmp_path,
                                                              monkeypatch, capsys):
    from gpuplane import cli
    api = live_server.api
    api.post("/api/v1/projects/default/experiments", {"name": "kept"}, expect=201)
    monkeypatch.setenv("GPUCTL_TOKEN", live_server.token)
    url = ["--server", live_server.url]
    assert cli.main([*url, "exp", "retention", "kept", "--keep-best", "0", "--keep-last",
                     "0"]) == 1
    assert "keeps nothing" in capsys.readouterr().err
    assert cli.main([*url, "exp", "retention", "kept", "--keep-best", "0",
                     "--keep-last", "2"]) == 0
    assert "keep the best 0 and the last 2" in capsys.readouterr().out
    (tmp_path / "t.py").write_text(
        "from gpuctl import run\nimport os\nos.makedirs('c', exist_ok=True)\n"
        "for s in range(5):\n    open(f'c/{s}.pt', 'w').write('x')\n"
        "    run.log_checkpoint(f'c/{s}.pt', step=s)\n")
    job = api.submit([sys.executable, "t.py"], tmp_path, cpu_only=True, experiment="kept")
    assert api.wait_job(job["id"])["state"] == "SUCCEEDED"
    wait_for(lambda: sorted(os.listdir(tmp_path / "c")) == ["3.pt", "4.pt"], timeout=60,
             what="the experiment's policy to keep the last 2")
    assert cli.main([*url, "exp", "retention", "kept", "--off"]) == 0
    assert api.get("/api/v1/projects/default/experiments/kept")["retention"] is None
    # no metric decides here: "the best 1" cannot be told, so nothing is deleted for it
    bad = api.post(f"/api/v1/jobs/{job['id']}/checkpoints:prune",
                   {"keep_best": 1, "keep_last": 1, "dry_run": True})
    assert api.last.status_code == 400, bad
    assert "no metric decides" in bad["error"]["message"] and "keep_best 0" in \
        bad["error"]["message"]
    assert sorted(os.listdir(tmp_path / "c")) == ["3.pt", "4.pt"]


TRIAL = """\
import os, sys
from gpuctl import run
offset, out = float(sys.argv[1]), sys.argv[2]
os.makedirs(out, exist_ok=True)
for step in (10, 20, 30, 40):
    run.log({"val/loss": abs(step - 30) / 10 + offset}, step=step)    # best at 30
    with open(f"{out}/step{step}.pt", "wb") as f:
        f.write(b"w" * 100)
    run.log_checkpoint(f"{out}/step{step}.pt", step=step)
"""


def test_a_sweeps_policy_keeps_the_best_of_the_sweep_not_of_each_trial(live_server, agent,
                                                                      tmp_path):
    """keep-best 2 / keep-last 1 on a sweep of three trials: the two best checkpoints of the
    whole sweep stay (both of trial 0, the best trial), and of the other trials only their
    last; kept each trial's own best two, eleven files would stay instead of five."""
    api = live_server.api
    (tmp_path / "trial.py").write_text(TRIAL)
    s = api.post("/api/v1/sweeps", {
        "name": "kept", "experiment": "kept", "working_dir": str(tmp_path), "parallel": 1,
        "cpu_only": True, "command": f"{sys.executable} trial.py {{offset}} ckpt-{{trial}}",
        "parameters": {"offset": [0, 10, 20]}, "metric": "val/loss", "direction": "min",
        "retention": {"keep_best": 2, "keep_last": 1}}, expect=201)
    wait_for(lambda: api.get(f"/api/v1/sweeps/{s['id']}")["state"] != "RUNNING", 120,
             what="the sweep to end")

    def settled():
        left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("ckpt-*/*.pt"))
        return left if len(left) == 5 else None
    left = wait_for(settled, timeout=60, what="retention to leave five checkpoints")
    assert left == ["ckpt-0/step20.pt", "ckpt-0/step30.pt", "ckpt-0/step40.pt",
                    "ckpt-1/step40.pt", "ckpt-2/step40.pt"]
    trials = api.get(f"/api/v1/sweeps/{s['id']}")["trials_detail"]
    runs = [api.job(t["job_id"])["run_id"] for t in trials]
    why = {c["path"].split("/")[-2] + "/" + c["path"].split("/")[-1]: c["keep_reason"]
           for r in runs for c in api.get(f"/api/v1/runs/{r}/checkpoints")["checkpoints"]
           if not c["deleted_at"]}
    assert why["ckpt-0/step30.pt"] == "best 1 by val/loss (0)"
    assert why["ckpt-0/step20.pt"] == "best 2 by val/loss (1)"
    assert why["ckpt-2/step40.pt"] == f"last 1 of run {runs[2]}"
