"""Jobs through GPUPlane to a real Slurm: a real server, a real agent with `--runner
slurm` on a private single-node cluster (conftest.py), jobs submitted over REST.

Slurm's time limits are whole minutes, checked every 30 s: the time-limit job is
submitted by the first test and looked at by the last, so its minute and a half overlaps
everything else in this module.
"""
import json
import re
import subprocess
import sys

import pytest

from procs import wait_for

import agent as agent_mod

FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def submit(server, tmp_path, command, **fields):
    fields.setdefault("gpus", 0)
    return server.api.submit(command, tmp_path, **fields)


def lines(server, job_id):
    return [ln["text"] for ln in server.api.get(f"/api/v1/jobs/{job_id}/logs?tail=5000",
                                                expect=200)["lines"]]


def wait_state(server, job_id, states, timeout=90):
    return wait_for(lambda: (j := server.api.job(job_id))["state"] in states and j, timeout,
                    interval=0.2, what=f"job {job_id} to reach {states}")


def slurm_job(cluster, slurm_id):
    """`scontrol show job` as a dict."""
    out = cluster.run("scontrol", "show", "job", "-o", str(slurm_id)).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def tb_events(directory, series):
    """A TensorBoard event file with v1 scalars ({tag: [(step, value)]}), written with
    tensorboard's own protos and CRC code."""
    import struct
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    def record(data):
        head = struct.pack("<Q", len(data))
        return (head + struct.pack("<I", masked_crc32c(head)) + data
                + struct.pack("<I", masked_crc32c(data)))
    events = [event_pb2.Event(wall_time=1.0, file_version="brain.Event:2")]
    for tag, points in series.items():
        for step, value in points:
            events.append(event_pb2.Event(step=step, wall_time=2.0, summary=summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "events.out.tfevents.1700000000.node.1.0"
    path.write_bytes(b"".join(record(e.SerializeToString()) for e in events))
    return path


@pytest.fixture(scope="module")
def timeout_job(slurm_server, slurm_agent, tmp_path_factory):
    wd = tmp_path_factory.mktemp("timeout")
    return submit(slurm_server, wd, ["sleep", "600"], time_limit_min=1)["id"]


def test_the_time_limit_job_starts_first(slurm_server, timeout_job):
    # the first test so the minute runs under the others; the last one checks its end
    job = wait_state(slurm_server, timeout_job, ("RUNNING",) + FINAL)
    assert job["state"] == "RUNNING", job


def test_node_offers_the_partition(slurm_server, slurm_agent, slurm_cluster):
    node = slurm_agent.node()
    assert node["runner"] == "slurm"
    assert node["slurm"]["partition"] == slurm_cluster.partition
    assert node["slurm"]["max_gpus"] == slurm_cluster.gpus
    assert node["slurm"]["max_jobs"] == 8 and node["cpu_slots"] == 8
    assert node["gpus"] == []


def test_logs_exit_code_environment(slurm_server, slurm_agent, slurm_cluster, tmp_path):
    script = ("echo hello from $(hostname); echo job=$GPUCTL_JOB_ID run=$GPUCTL_RUN_ID; "
              "echo token=${GPUCTL_TOKEN:+set} server=$GPUCTL_SERVER; "
              "env | grep -c '^SLURM_JOB_ID=' ; "
              f"echo agent-token-leaked=$(env | grep -c '{slurm_server.token}'); "
              "echo mine=$MY_SETTING; exit 3")
    job = submit(slurm_server, tmp_path, script, env={"MY_SETTING": "x1"})
    done = wait_state(slurm_server, job["id"], FINAL)
    assert done["state"] == "FAILED" and done["failure_kind"] == "EXIT_CODE", done
    assert done["exit_code"] == 3
    text = lines(slurm_server, job["id"])
    assert text[0].startswith("hello from"), text
    assert f"job={job['id']} run={done['run_id']}" in text
    assert f"token=set server={slurm_server.url}" in text
    assert "agent-token-leaked=0" in text and "mine=x1" in text
    slurm_id = done["slurm_job_id"]
    assert slurm_id and slurm_id.isdigit(), done
    assert [a["slurm_job_id"] for a in done["attempts"]] == [slurm_id]
    info = slurm_job(slurm_cluster, slurm_id)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0"
    assert info["JobName"] == f"gpuplane-login1-{job['id']}-1"
    assert info["WorkDir"] == str(tmp_path)

    ok = submit(slurm_server, tmp_path, ["echo", "fine"])
    assert wait_state(slurm_server, ok["id"], FINAL)["state"] == "SUCCEEDED"
    assert lines(slurm_server, ok["id"]) == ["fine"]


def test_two_gpus_resources_and_cli(slurm_server, slurm_agent, slurm_cluster, tmp_path):
    job = submit(slurm_server, tmp_path, "echo cvd=$CUDA_VISIBLE_DEVICES gpus=$SLURM_JOB_GPUS"
                 " cpus=$SLURM_CPUS_PER_TASK; sleep 1", gpus=2, cpus=3, mem_mb=300)
    done = wait_state(slurm_server, job["id"], FINAL)
    assert done["state"] == "SUCCEEDED", done
    (line,) = lines(slurm_server, job["id"])
    cvd = line.split()[0].split("=")[1].split(",")
    assert len(cvd) == 2 and all(c.isdigit() for c in cvd), line
    assert line.endswith("cpus=3")
    info = slurm_job(slurm_cluster, done["slurm_job_id"])
    assert info["TresPerNode"] == "gres:gpu:2", info
    assert "mem=300M" in info["TRES"] and "cpu=3" in info["TRES"], info["TRES"]
    assert info["Nice"] == "5"          # the agent's --sbatch-arg
    # `gpuplane job show` names the Slurm job; `gpuplane status` what the partition offers
    show = cli(slurm_server, tmp_path, "job", "show", str(job["id"]))
    assert re.search(rf"^  slurm job +{done['slurm_job_id']}$", show, re.M), show
    assert re.search(r"^ATTEMPT .* SLURM ", show, re.M), show
    status = cli(slurm_server, tmp_path, "status")
    assert (f"Slurm partition {slurm_cluster.partition}: 1 nodes, up to 4 GPUs, 16 CPUs, "
            "8000 MiB a node, time limit 1:00:00") in status, status
    assert re.search(r"Slurm jobs \d+/8", status), status


def cli(server, tmp_path, *argv):
    out = subprocess.run([sys.executable, "-m", "gpuplane", *argv, "--server", server.url],
                         capture_output=True, text=True, timeout=60,
                         env={"GPUCTL_TOKEN": server.token, "PATH": "/usr/bin:/bin",
                              "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_over_its_memory_is_oom(slurm_server, slurm_agent, tmp_path):
    hog = "x = bytearray(400 * 1024 * 1024); import time; time.sleep(30)"
    job = submit(slurm_server, tmp_path, [sys.executable, "-c", hog], mem_mb=60)
    done = wait_state(slurm_server, job["id"], FINAL)
    assert done["state"] == "FAILED" and done["failure_kind"] == "OOM", done
    assert "OUT_OF_MEMORY" in done["message"]


def test_cancel_is_scancel(slurm_server, slurm_agent, slurm_cluster, tmp_path):
    job = submit(slurm_server, tmp_path, "trap 'echo got TERM; exit 143' TERM; "
                 "echo started; while true; do sleep 0.2; done")
    wait_for(lambda: "started" in lines(slurm_server, job["id"]), 60, interval=0.2,
             what="the job's first line")
    slurm_server.api.post(f"/api/v1/jobs/{job['id']}/cancel", expect=200)
    done = wait_state(slurm_server, job["id"], FINAL)
    assert done["state"] == "CANCELLED", done
    assert wait_for(lambda: "got TERM" in lines(slurm_server, job["id"]), 10,
                    what="the job's TERM line")
    info = slurm_job(slurm_cluster, done["slurm_job_id"])
    assert info["JobState"] in ("CANCELLED", "FAILED"), info


def test_cancel_kills_a_job_that_ignores_term(slurm_server, slurm_agent, slurm_cluster,
                                              tmp_path):
    job = submit(slurm_server, tmp_path, "trap '' TERM; echo started; "
                 "while true; do sleep 0.2 || true; done")
    wait_for(lambda: "started" in lines(slurm_server, job["id"]), 60, interval=0.2,
             what="the job's first line")
    slurm_server.api.post(f"/api/v1/jobs/{job['id']}/cancel", expect=200)
    done = wait_state(slurm_server, job["id"], FINAL)       # SIGKILL after the 5 s grace
    assert done["state"] == "CANCELLED", done
    assert done["slurm_job_id"] not in slurm_cluster.jobs()


def test_scancel_from_outside(slurm_server, slurm_agent, slurm_cluster, tmp_path):
    job = submit(slurm_server, tmp_path, "echo up; sleep 300")
    running = wait_state(slurm_server, job["id"], ("RUNNING",) + FINAL)
    assert running["state"] == "RUNNING"
    assert slurm_cluster.run("scancel", running["slurm_job_id"]).returncode == 0
    done = wait_state(slurm_server, job["id"], FINAL)
    assert done["state"] == "CANCELLED" and done["failure_kind"] == "CANCELLED", done
    assert "by someone else" in done["message"]


def test_pending_with_slurms_reason(slurm_server, slurm_agent, slurm_cluster, tmp_path):
    # more time than the partition allows: Slurm keeps it PENDING (PartitionTimeLimit)
    job = submit(slurm_server, tmp_path, ["true"],
                 time_limit_min=slurm_cluster.max_time_min + 60)
    waiting = wait_for(lambda: (j := slurm_server.api.job(job["id"]))["pending_reason"]
                       and "PartitionTimeLimit" in j["pending_reason"] and j, 60,
                       interval=0.2, what="Slurm's reason on the job")
    assert waiting["state"] == "DISPATCHED"
    assert waiting["slurm_job_id"] in waiting["pending_reason"]
    assert slurm_job(slurm_cluster, waiting["slurm_job_id"])["JobState"] == "PENDING"
    slurm_server.api.post(f"/api/v1/jobs/{job['id']}/cancel", expect=200)
    assert wait_state(slurm_server, job["id"], FINAL)["state"] == "CANCELLED"


def test_sbatch_refusal_is_dispatch_failed(slurm_server, slurm_agent, tmp_path):
    job = submit(slurm_server, tmp_path, ["true"], mem_mb=10**6)     # the node has 8000 MiB
    done = wait_state(slurm_server, job["id"], FINAL)
    assert done["state"] == "FAILED" and done["failure_kind"] == "DISPATCH_FAILED", done
    assert "sbatch refused the job" in done["message"]


def test_checkpoints_and_sdk_inside_the_job(slurm_server, slurm_agent, tmp_path):
    code = ("from gpuctl import run; import os\n"
            "for step in (1, 2, 3): run.log({'train/loss': 1.0 / step}, step=step)\n"
            "os.makedirs('ckpt', exist_ok=True)\n"
            "open('ckpt/step_3.pt', 'wb').write(b'weights')\n")
    (tmp_path / "tb").mkdir()
    events = tb_events(tmp_path / "made", {"score": [(1, 0.5), (2, 0.25)]})
    # written by the job (a name with its own time: an event file named before the job
    # started is never its, agent.py Writers)
    code += (f"import shutil, time; shutil.copy({str(events)!r}, "
             "f'tb/events.out.tfevents.{int(time.time())}.node.1.0')\n")
    job = submit(slurm_server, tmp_path, [sys.executable, "-c", code], watch_dir="ckpt",
                 tb_dir="tb")
    done = wait_state(slurm_server, job["id"], FINAL)
    assert done["state"] == "SUCCEEDED", (done, lines(slurm_server, job["id"]))
    run_id = done["run_id"]
    keys = wait_for(lambda: {k["key"]: k for k in slurm_server.api.get(
        f"/api/v1/runs/{run_id}/metrics", expect=200)["keys"]}.get("train/loss"), 30,
        what="the SDK's points")
    assert keys["count"] == 3
    ckpts = wait_for(lambda: slurm_server.api.get(f"/api/v1/runs/{run_id}/checkpoints",
                                                  expect=200)["checkpoints"], 30,
                     what="the watched checkpoint")
    assert [c["step"] for c in ckpts] == [3]
    # its TensorBoard file, tailed from the shared working dir
    tb = wait_for(lambda: {k["key"]: k for k in slurm_server.api.get(
        f"/api/v1/runs/{run_id}/metrics", expect=200)["keys"]}.get("score"), 30,
        what="the TensorBoard points")
    assert tb["count"] == 2
    # an evaluation of that checkpoint is a job like any other: it goes to Slurm too
    ev_code = ("from gpuctl import run; import os\n"
               "assert open(os.environ['GPUCTL_CHECKPOINT_PATH'], 'rb').read() == b'weights'\n"
               "run.log({'eval/acc': 0.75}, step=int(os.environ['GPUCTL_CHECKPOINT_STEP']))\n")
    ev = slurm_server.api.post(f"/api/v1/checkpoints/{ckpts[0]['id']}/evaluations",
                               {"command": [sys.executable, "-c", ev_code]}, expect=201)
    ev_job = wait_state(slurm_server, ev["job_id"], FINAL)
    assert ev_job["state"] == "SUCCEEDED" and ev_job["slurm_job_id"], ev_job
    result = wait_for(lambda: (e := slurm_server.api.get(
        f"/api/v1/evaluations/{ev['id']}", expect=200))["results"] and e, 30,
        what="the evaluation's results")
    assert result["results"] == {"eval/acc": {"step": 3, "value": 0.75}}, result


def test_agent_killed_and_restarted_readopts(slurm_server, slurm_agent, slurm_cluster,
                                             tmp_path):
    gate = tmp_path / "gate"
    script = (f"for i in $(seq 1 40); do echo line $i; done; "
              f"while [ ! -e {gate} ]; do sleep 0.1; done; "
              f"for i in $(seq 41 80); do echo line $i; done")
    job = submit(slurm_server, tmp_path, script)
    wait_for(lambda: len(lines(slurm_server, job["id"])) >= 40, 60, interval=0.2,
             what="the first 40 lines")
    before = slurm_server.api.job(job["id"])
    slurm_agent.kill()
    gate.touch()                # the job ends while no agent watches it
    slurm_id = before["slurm_job_id"]
    wait_for(lambda: slurm_job(slurm_cluster, slurm_id).get("JobState") == "COMPLETED", 60,
             interval=0.2, what="Slurm to finish the job")
    slurm_agent.start()
    done = wait_state(slurm_server, job["id"], FINAL)
    assert done["state"] == "SUCCEEDED", done
    assert done["attempt"] == 1 and len(done["attempts"]) == 1
    assert done["slurm_job_id"] == slurm_id
    assert lines(slurm_server, job["id"]) == [f"line {i}" for i in range(1, 81)]
    # sbatch ran once for it
    r = slurm_cluster.run("squeue", "-h", "-t", "all", "--name",
                          f"gpuplane-login1-{job['id']}-1", "-o", "%i")
    assert r.stdout.split() == [slurm_id]


def test_a_start_cut_off_around_sbatch_is_submitted_once(slurm_env, tmp_path):
    """An agent that died after taking a start and before writing sbatch's answer: at
    its restart, a job Slurm has under the attempt's name is adopted, one it does not
    have is submitted now; neither runs twice."""
    home = tmp_path / "agent"
    outbox = agent_mod.Outbox(str(home))
    slurm = agent_mod.Slurm("cut", partition=slurm_env.partition)
    inherited = agent_mod.inherited_environment()
    for job_id in (7, 8):
        path = home / "jobs" / str(job_id) / "1"
        path.mkdir(parents=True)
        msg = {"job_id": job_id, "attempt": 1, "run_id": None, "command": ["sleep", "30"],
               "working_dir": str(tmp_path), "gpus": [], "gpu_count": 0, "cpu_only": True}
        rec = slurm.exec_spec(msg, agent_mod.job_environment(msg, inherited), str(path))
        (path / "spec.json").write_text(json.dumps({"start": msg, "exec": rec}))
        (path / "job.sh").write_text(rec["script"])
        (path / "job.sh").chmod(0o700)
    before = slurm.sbatch(json.loads((home / "jobs/8/1/spec.json").read_text())["exec"])
    runner = agent_mod.Runner(str(home), outbox, slurm=slurm)     # adopts both
    try:
        def ids(job_id):
            r = slurm_env.run("squeue", "-h", "-t", "all", "--name",
                              f"gpuplane-cut-{job_id}-1", "-o", "%i")
            return r.stdout.split()
        assert wait_for(lambda: ids(7), 30, what="job 7 submitted at adoption")
        assert len(ids(7)) == 1 and ids(8) == [before]
        assert json.loads((home / "jobs/8/1/slurm.json").read_text())["job_id"] == before
    finally:
        runner.launcher.close()
        outbox.close()
        slurm_env.run("scancel", "--name", "gpuplane-cut-7-1")
        slurm_env.run("scancel", before)


def test_the_time_limit_job_ends_timeout(slurm_server, timeout_job):
    done = wait_state(slurm_server, timeout_job, FINAL, timeout=240)
    assert done["state"] == "FAILED" and done["failure_kind"] == "TIMEOUT", done
    assert "time limit" in done["message"]


# -- without a cluster: how Slurm's final states map ---------------------------------------

@pytest.mark.parametrize("state,cancel,kind", [
    ("COMPLETED", None, None), ("FAILED", None, None), ("OUT_OF_MEMORY", None, "OOM"),
    ("TIMEOUT", None, "TIMEOUT"), ("NODE_FAIL", None, "LOST"), ("PREEMPTED", None, "LOST"),
    ("BOOT_FAIL", None, "LOST"), ("CANCELLED", None, "CANCELLED"),
    ("CANCELLED", {"requested_at": 1}, None)])
def test_final_states_map(state, cancel, kind):
    rec = agent_mod.slurm_end({"state": state, "exit_code": 0, "signal": None, "node": "n1"},
                              cancel)
    assert rec.get("failure_kind") == kind
    assert rec["slurm_state"] == state


def test_gres_and_sbatch_argv(tmp_path):
    assert agent_mod.gres_gpus("gpu:4") == 4
    assert agent_mod.gres_gpus("gpu:a100:8(S:0-1)") == 8
    assert agent_mod.gres_gpus("(null)") == 0
    s = agent_mod.Slurm("n", partition="p", account="a", qos="q", time_limit="30",
                        sbatch_args=["--exclusive"])
    msg = {"job_id": 4, "attempt": 2, "working_dir": str(tmp_path), "command": ["echo", "a b"],
           "gpu_count": 2, "gpus": [], "cpus": 4, "mem_mb": 2048, "env": {},
           "cpu_only": False}
    env = {"PATH": "/bin", "SLURM_JOB_ID": "9", "SLURM_CONF": "/c", "CUDA_VISIBLE_DEVICES": "0"}
    rec = s.exec_spec(msg, env, str(tmp_path))
    argv = rec["argv"]
    for want in ("--partition=p", "--account=a", "--qos=q", "--gres=gpu:2",
                 "--cpus-per-task=4", "--mem=2048M", "--time=30", "--no-requeue",
                 "--job-name=gpuplane-n-4-2", "--exclusive"):
        assert want in argv
    assert argv[-1] == str(tmp_path / "job.sh")
    assert rec["script"].endswith("exec echo 'a b'\n")
    assert rec["env"] == {"PATH": "/bin", "SLURM_CONF": "/c"}
    with pytest.raises(ValueError, match="--image"):
        s.exec_spec(dict(msg, image="x"), env, str(tmp_path))
    assert json.dumps(rec)        # spec.json holds it
