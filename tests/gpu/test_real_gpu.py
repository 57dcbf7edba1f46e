"""GPUPlane on a real NVIDIA GPU: NVML readings against nvidia-smi, CUDA_VISIBLE_DEVICES
honoured by a real CUDA job, a real CUDA out-of-memory classified OOM with its event,
GPU_UNDERUTILIZED on an idle GPU, and GPU memory attributed to the job holding the card.
Skipped, with the reason, without a GPU (tests/gpu/conftest.py)."""
import subprocess
import textwrap

import pytest

from procs import ServerProc, wait_for


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    s = ServerProc(tmp_path_factory.mktemp("gpu") / "server")
    with open(s.home / "server.toml", "a") as f:     # quick GPU_UNDERUTILIZED for the test
        f.write("\n[events]\ngpu_window_s = 20\ngpu_grace_s = 0\n")
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gpu_agent(gpu_server, tmp_path_factory):
    from procs import AgentProc, kill_leftover_jobs
    a = AgentProc(gpu_server, tmp_path_factory.mktemp("gpu-agent"), "gpu-host", fake_gpus=0)
    a.start()
    yield a
    a.stop()
    kill_leftover_jobs(a.home)


def smi(exe, fields):
    out = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]


def node(server):
    return next(n for n in server.api.get("/api/v1/nodes")["nodes"] if n["name"] == "gpu-host")


def test_nvml_readings_match_nvidia_smi(gpu_server, gpu_agent, nvidia_smi):
    rows = smi(nvidia_smi, "index,uuid,name,memory.total,memory.used")
    n = wait_for(lambda: (x := node(gpu_server))["gpus"] and
                 x["gpus"][0].get("mem_used_mb") is not None and x, 60,
                 what="the agent's first NVML readings")
    assert len(n["gpus"]) == len(rows)
    for g, (index, uuid, name, total, used) in zip(n["gpus"], rows):
        assert g["index"] == int(index) and g["uuid"] == uuid and g["fake"] is False
        assert name in g["name"] or g["name"] in name
        assert abs(g["memory_total_mb"] - int(total)) <= 2, (g, total)
        assert abs(g["mem_used_mb"] - int(used)) <= max(256, int(used) * 0.1), (g, used)
        assert 0 <= g["util"] <= 100 and g["temp_c"] is not None


JOB = textwrap.dedent("""
    import os, sys, time, torch
    print("CVD", os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(),
          torch.cuda.get_device_properties(0).uuid, flush=True)
    mode = sys.argv[1]
    if mode == "hold":          # 4 GiB on the card, idle for a while
        x = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
        time.sleep(float(sys.argv[2]))
    elif mode == "oom":
        chunks = []
        while True:
            chunks.append(torch.empty(2**34, dtype=torch.uint8, device="cuda"))
""")


def submit(server, tmp_path, *args, **fields):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return server.api.submit([fields.pop("python"), str(script), *args], tmp_path, gpus=1,
                             **fields)


def logs(server, job_id):
    return [x["text"] for x in server.api.get(f"/api/v1/jobs/{job_id}/logs?tail=200")["lines"]]


def test_a_cuda_job_sees_only_its_card_and_its_memory_is_its_own(
        gpu_server, gpu_agent, cuda_python, tmp_path):
    job = submit(gpu_server, tmp_path, "hold", "40", python=cuda_python)
    j = gpu_server.api.wait_job(job["id"], states=("RUNNING",), timeout=120)
    line = wait_for(lambda: next((x for x in logs(gpu_server, job["id"])
                                  if x.startswith("CVD")), None), 120, what="the job's line")
    _, cvd, count, uuid = line.split(" ", 3)
    held = j["gpu_indices"][0]
    assert cvd == str(held) and count == "1", line
    card = next(g for g in node(gpu_server)["gpus"] if g["index"] == held)
    assert card["uuid"].removeprefix("GPU-") == uuid.removeprefix("GPU-"), (card, uuid)
    # the card's memory shows on the job's run (sys/gpuN/mem_used_mb): 4 GiB at least
    key = f"sys/gpu{held}/mem_used_mb"

    def used():
        keys = gpu_server.api.get(f"/api/v1/runs/{j['run_id']}/metrics")["keys"]
        k = next((k for k in keys if k["key"] == key), None)
        return k and k["latest"]["value"] >= 4096 and k["latest"]["value"]
    wait_for(used, 60, what=f"{key} >= 4096 on the job's run")
    # ... and, idle, it is GPU_UNDERUTILIZED (gpu_window_s 20 in this server.toml)
    wait_for(lambda: gpu_server.api.get(
        f"/api/v1/events?job={job['id']}&type=GPU_UNDERUTILIZED")["events"], 90,
        what="GPU_UNDERUTILIZED on the idle card")
    gpu_server.api.post(f"/api/v1/jobs/{job['id']}/cancel", {})
    gpu_server.api.wait_job(job["id"], timeout=60)


def test_a_real_cuda_oom_is_classified_oom_with_its_event(
        gpu_server, gpu_agent, cuda_python, tmp_path):
    job = submit(gpu_server, tmp_path, "oom", python=cuda_python, max_attempts=3)
    j = gpu_server.api.wait_job(job["id"], timeout=300)
    assert j["state"] == "FAILED" and j["failure_kind"] == "OOM", j
    assert j["attempt"] == 1, "an OOM is never retried automatically"
    ev = gpu_server.api.get(f"/api/v1/events?job={job['id']}&type=OOM")["events"]
    assert len(ev) == 1 and ev[0]["severity"] == "critical", ev
