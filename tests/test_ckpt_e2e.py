"""The checkpoint loop end to end through a real server and agent, on examples/cpu:
two trainings with different settings -> checkpoints every epoch -> every checkpoint
evaluated by examples/cpu/eval.py as an EVALUATE job -> the recommendation is the
checkpoint with the best evaluated value; a checkpoint deleted before its evaluation
fails it with DISPATCH_FAILED and a sentence."""
import json
import os
import shutil
import subprocess
import sys

from procs import ROOT, wait_for

EXAMPLE = ROOT / "examples" / "cpu"


def test_submit_checkpoints_evaluate_recommend(live_server, agent_factory, tmp_path):
    agent_factory(live_server, fake_gpus=1, cpu_slots=4)
    api = live_server.api
    jobs = {}
    for lr in ("0.02", "0.5"):
        work = tmp_path / f"lr{lr}"
        work.mkdir()
        for f in ("train.py", "eval.py"):
            shutil.copy(EXAMPLE / f, work / f)
        jobs[lr] = api.submit(
            [sys.executable, "train.py", "--epochs", "2", "--steps-per-epoch", "20",
             "--step-delay", "0", "--lr", lr], work, cpu_only=True, name=f"lr{lr}",
            project="demo", experiment="lr-sweep", watch_dir="checkpoints",
            eval_command=[sys.executable, "eval.py"])
    runs = {}
    for lr, job in jobs.items():
        job = api.wait_job(job["id"], timeout=120)
        assert job["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{job['id']}/logs")
        runs[lr] = job["run_id"]

    def checkpoints(run_id):
        return api.get(f"/api/v1/runs/{run_id}/checkpoints", expect=200)["checkpoints"]
    ckpts = []
    for lr, run_id in runs.items():
        got = wait_for(lambda: len(c := checkpoints(run_id)) == 2 and c, timeout=30,
                       what=f"2 checkpoints of run {run_id}")
        assert [c["epoch"] for c in got] == [0, 1]
        assert all(c["path"].startswith(str(tmp_path)) for c in got)    # made absolute
        ckpts += got

    # a checkpoint deleted before its evaluation: DISPATCH_FAILED with a sentence
    gone = ckpts[0]
    os.rename(gone["path"], gone["path"] + ".moved")
    ev = api.post(f"/api/v1/checkpoints/{gone['id']}/evaluations", expect=201)
    ej = api.wait_job(ev["job_id"], timeout=60)
    assert ej["state"] == "FAILED" and ej["failure_kind"] == "DISPATCH_FAILED"
    assert gone["path"] in ej["message"] and "does not exist" in ej["message"]
    assert api.get(f"/api/v1/evaluations/{ev['id']}")["state"] == "FAILED"
    os.rename(gone["path"] + ".moved", gone["path"])

    # every checkpoint evaluated with the training job's --eval-command
    evals = [api.post(f"/api/v1/checkpoints/{c['id']}/evaluations", expect=201)
             for c in ckpts]
    for e in evals:
        job = api.wait_job(e["job_id"], timeout=120)
        assert job["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{job['id']}/logs")
        assert job["kind"] == "EVALUATE"

    def results(e):
        return api.get(f"/api/v1/evaluations/{e['id']}")["results"]
    evaluated = wait_for(lambda: all("eval/loss" in results(e) for e in evals)
                         and {e["checkpoint_id"]: results(e)["eval/loss"]["value"]
                              for e in evals},
                         timeout=30, what="evaluation results")
    best = min(evaluated, key=evaluated.get)

    api.request("PUT", "/api/v1/metric-definitions", expect=200,
                json={"key": "eval/loss", "project": "demo", "primary": True})
    rec = api.get("/api/v1/checkpoints:recommend?project=demo&experiment=lr-sweep",
                  expect=200)
    assert rec["checkpoint"]["checkpoint_id"] == best, (rec, evaluated)
    assert rec["checkpoint"]["source"] == "evaluation"
    assert rec["metric"]["key"] == "eval/loss" and rec["metric"]["primary_from"] == "project"
    assert rec["evaluated"] == 4 and rec["runner_up"] is not None

    # the same through the CLI
    env = {**os.environ, "GPUCTL_TOKEN": live_server.token}
    out = subprocess.run([sys.executable, "-m", "gpuplane", "--server", live_server.url,
                          "ckpt", "recommend", "--experiment", "lr-sweep", "--json"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["checkpoint"]["checkpoint_id"] == best
    # the leaderboard puts the run of the best checkpoint first; no EVALUATE run in it
    board = api.get("/api/v1/projects/demo/experiments/lr-sweep/runs", expect=200)
    best_run = next(c["run_id"] for c in ckpts if c["id"] == best)
    assert [r["id"] for r in board["runs"]][0] == best_run and len(board["runs"]) == 2


def test_a_file_seen_by_the_watcher_and_the_sdk_is_one_checkpoint(live_server, agent_factory,
                                                                    tmp_path):
    agent_factory(live_server, fake_gpus=1, cpu_slots=2)
    api = live_server.api
    script = tmp_path / "save.py"
    script.write_text(
        "import os\n"
        "from gpuctl import run\n"
        "os.makedirs('ckpt', exist_ok=True)\n"
        "run.log({'train/loss': 0.5}, step=10)\n"
        "with open('ckpt/model_step10.pt', 'wb') as f:\n"
        "    f.write(b'w' * 64)\n"
        "run.log_checkpoint('ckpt/model_step10.pt', step=12, epoch=1)\n"
        "run.log({'train/loss': 0.4}, step=20)\n")
    job = api.submit([sys.executable, "save.py"], tmp_path, cpu_only=True,
                     watch_dir="ckpt", project="dedupe")
    job = api.wait_job(job["id"], timeout=60)
    assert job["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{job['id']}/logs")
    path = str(tmp_path / "ckpt" / "model_step10.pt")

    def seen_by_both():
        cks = api.get(f"/api/v1/runs/{job['run_id']}/checkpoints")["checkpoints"]
        return len(cks) == 1 and cks[0]["fingerprint"] and cks[0]["format"] == "pt" and cks
    # the SDK's record and the watcher's final scan both arrive; one row, the SDK's step
    [c] = wait_for(seen_by_both, timeout=30, what="the watcher's sighting of the SDK's file")
    assert c["path"] == path and c["step"] == 12 and c["step_source"] == "given"
    assert c["size_bytes"] == 64
    shown = api.get(f"/api/v1/checkpoints/{c['id']}")
    assert shown["metrics"]["train/loss"] == {"step": 10, "value": 0.5}
