"""The CPU example, end to end: its logs, TensorBoard curves, SDK points and checkpoints
all land under its run."""
import sys

from procs import ROOT, wait_for

EXAMPLE = ROOT / "examples" / "cpu"


def test_example_job_yields_tb_curves_sdk_points_and_checkpoints(live_server, agent_factory,
                                                                  tmp_path):
    agent_factory(live_server, fake_gpus=1, extra=("--stats-interval", "1"))
    api = live_server.api
    work = tmp_path / "cpu"
    work.mkdir()
    (work / "train.py").write_text((EXAMPLE / "train.py").read_text())
    job = api.submit([sys.executable, "train.py", "--epochs", "2", "--steps-per-epoch", "40",
                      "--step-delay", "0.02"], work, gpus=1, name="example",
                     project="examples")
    job = api.wait_job(job["id"], timeout=120)
    assert job["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{job['id']}/logs")
    run_id = job["run_id"]

    def keys():
        return {k["key"]: k for k in api.get(f"/api/v1/runs/{run_id}/metrics")["keys"]}
    # TB files are tailed every couple of seconds; the last poll lands after the exit.
    got = wait_for(lambda: (k := keys()) and "tb/val/acc" in k and k, timeout=30,
                   what="TensorBoard scalars under the run")
    # SDK (attached mode through the injected GPUCTL_* variables)
    assert got["train/loss"]["count"] == 80 and got["train/loss"]["last_step"] == 80
    assert got["val/acc"]["count"] == 2 and got["val/acc"]["direction"] == "max"
    # TensorBoard, tailed by the agent from tb/ in the working dir
    assert got["tb/train/loss"]["count"] == 80
    assert abs(got["tb/train/loss"]["latest"]["value"]
               - got["train/loss"]["latest"]["value"]) < 1e-5   # float32 in the event file
    # system metrics of the job's process tree and its GPU slot
    for key in ("sys/cpu_percent", "sys/rss_mb", "sys/disk_free_mb", "sys/gpu0/util"):
        assert key in got, sorted(got)

    series = api.get(f"/api/v1/runs/{run_id}/metrics/train/loss?max_points=10")
    assert 0 < len(series["points"]) <= 10
    assert series["points"][-1][0] <= 80

    logs = [l["text"] for l in api.get(f"/api/v1/jobs/{job['id']}/logs?tail=500")["lines"]]
    assert logs[-1] == "training finished"
    ckpts = live_server.api.get(f"/api/v1/runs/{run_id}")
    assert ckpts["state"] == "SUCCEEDED"
