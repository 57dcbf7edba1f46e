"""Resume from the last checkpoint: an agent host killed mid-run comes back, and the
job's next attempt starts from the last registered checkpoint (GPUCTL_RESUME_FROM /
GPUCTL_RESUME_STEP), its run says which, and its curve continues from that step."""
import sys

from procs import kill_leftover_jobs, wait_for

TRAIN = """\
import os, time
from gpuctl import run
start = 0
if os.environ.get("GPUCTL_RESUME_FROM"):
    with open(os.environ["GPUCTL_RESUME_FROM"]) as f:
        start = int(f.read())
    assert start == int(os.environ["GPUCTL_RESUME_STEP"])
    print(f"resumed at {start}", flush=True)
os.makedirs("ckpt", exist_ok=True)
for step in range(start + 1, 41):
    run.log({"loss": 1.0 / step}, step=step)
    if step % 10 == 0:
        path = f"ckpt/step{step}.txt"
        with open(path, "w") as f:
            f.write(str(step))
        run.log_checkpoint(path, step=step)
    time.sleep(0.06)
"""


def test_a_killed_host_comes_back_and_the_next_attempt_resumes(server_factory, agent_factory,
                                                               tmp_path):
    server = server_factory({"node_grace_s": 2})
    api = server.api
    (tmp_path / "train.py").write_text(TRAIN)
    host = agent_factory(server, name="host", fake_gpus=1)
    job = api.submit([sys.executable, "train.py"], tmp_path, gpus=1, max_attempts=3)
    run1 = wait_for(lambda: api.job(job["id"])["run_id"], what="attempt 1's run")

    def saved():
        cks = api.get(f"/api/v1/runs/{run1}/checkpoints")["checkpoints"]
        return [c for c in cks if (c["step"] or 0) >= 20] and cks
    wait_for(saved, timeout=60, what="a checkpoint at step 20")
    host.kill()                          # the host dies: its agent and the job with it
    kill_leftover_jobs(host.home)
    j = wait_for(lambda: (x := api.job(job["id"]))["state"] == "QUEUED" and x, timeout=60,
                 what="attempt 1 declared lost")
    assert j["attempts"][0]["failure_kind"] == "NODE_LOST"
    last = max(api.get(f"/api/v1/runs/{run1}/checkpoints")["checkpoints"],
               key=lambda c: c["step"])
    host.start()                         # the host is back
    j = api.wait_job(job["id"], timeout=90)
    assert j["state"] == "SUCCEEDED" and j["attempt"] == 2, j
    run2 = api.get(f"/api/v1/runs/{j['run_id']}")
    assert run2["resumed_from"] == last["id"]
    keys = {k["key"]: k for k in api.get(f"/api/v1/runs/{run2['id']}/metrics")["keys"]}
    assert keys["loss"]["first_step"] == last["step"] + 1
    assert keys["loss"]["last_step"] == 40
    logs = api.get(f"/api/v1/jobs/{job['id']}/logs?tail=50")["lines"]
    assert any(line["text"] == f"resumed at {last['step']}" for line in logs)

    # `job retry --resume` hands the ended job's newest checkpoint (step 40) to attempt 3
    api.post(f"/api/v1/jobs/{job['id']}/retry", {"resume": True}, expect=200)
    j = api.wait_job(job["id"], timeout=60)
    newest = max(api.get(f"/api/v1/runs/{run2['id']}/checkpoints")["checkpoints"],
                 key=lambda c: c["step"])
    assert newest["step"] == 40
    assert j["attempt"] == 3 and api.get(f"/api/v1/runs/{j['run_id']}")["resumed_from"] == \
        newest["id"]
