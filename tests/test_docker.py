"""Jobs in containers (agent.py's Docker): a real Docker engine, a real server and agent.

The image is made here from the static busybox (no registry is reachable):
`.ci/run` installs docker.io and busybox-static and starts dockerd when they are absent.
"""
import os
import shutil
import subprocess
import tempfile

import pytest

from procs import wait_for

IMAGE = "gpuplane-test/busybox:1"
BUSYBOX = "/usr/bin/busybox"


def _docker(*args, timeout=60):
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def _engine_problem():
    if shutil.which("docker") is None:
        return "the docker CLI is not installed (apt-get install docker.io)"
    try:
        if _docker("info", timeout=20).returncode != 0:
            return "no Docker engine answers (start dockerd)"
    except subprocess.TimeoutExpired:
        return "the Docker engine does not answer"
    if _docker("image", "inspect", IMAGE).returncode == 0:
        return None
    if not os.path.exists(BUSYBOX):
        return "no static busybox to build the test image from (apt-get install busybox-static)"
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(f"{d}/bin")
        shutil.copy(BUSYBOX, f"{d}/bin/busybox")
        for tool in ("sh", "echo", "sleep", "cat", "id", "env", "ls", "true", "touch"):
            os.symlink("busybox", f"{d}/bin/{tool}")
        tar = subprocess.Popen(["tar", "-C", d, "-c", "."], stdout=subprocess.PIPE)
        r = subprocess.run(["docker", "import", "-", IMAGE], stdin=tar.stdout,
                           capture_output=True, text=True, timeout=120)
        tar.wait()
    return None if r.returncode == 0 else f"docker import failed: {r.stderr.strip()}"


@pytest.fixture(scope="module")
def engine():
    problem = _engine_problem()
    if problem:
        pytest.skip(problem)


def _node(name):
    """A node name no other test run on this engine uses at once: the engine is shared, and
    an agent removes its node's containers that it does not own."""
    return f"{name}-{os.getpid()}"


def _containers(node):
    r = _docker("ps", "-a", "--filter", f"label=gpuplane.node={node}", "--format", "{{.Names}}")
    return r.stdout.split()


def _submit(api, tmp_path, command, **fields):
    return api.submit(["/bin/sh", "-c", command], tmp_path, image=IMAGE, **fields)


def test_a_container_job_has_the_bare_process_semantics(engine, live_server, agent_factory,
                                                        tmp_path):
    agent_factory(live_server, name=_node("dock1"))
    api = live_server.api
    job = _submit(api, tmp_path, 'echo "in a container"; '
                  'echo "cuda=$CUDA_VISIBLE_DEVICES run=$GPUCTL_RUN_ID mine=$MINE"; '
                  'echo written > out.txt; exit 3', gpus=1, env={"MINE": "x y"})
    done = api.wait_job(job["id"], timeout=90)
    assert (done["state"], done["failure_kind"], done["exit_code"]) == ("FAILED", "EXIT_CODE", 3)
    lines = [l["text"] for l in api.get(f"/api/v1/jobs/{job['id']}/logs")["lines"]]
    assert "in a container" in lines
    assert f"cuda={done['gpu_indices'][0]} run={done['run_id']} mine=x y" in lines
    assert (tmp_path / "out.txt").read_text() == "written\n"       # the working dir is mounted
    assert _containers(_node("dock1")) == []                       # removed after its exit
    assert api.job(job["id"])["image"] == IMAGE


def test_cancel_stops_the_container(engine, live_server, agent_factory, tmp_path):
    agent_factory(live_server, name=_node("dock2"))
    api = live_server.api
    job = _submit(api, tmp_path, "echo up; sleep 1000", gpus=1)
    wait_for(lambda: any(l["text"] == "up" for l in
                         api.get(f"/api/v1/jobs/{job['id']}/logs")["lines"]), 60,
             what="the container's first line")
    assert _containers(_node("dock2")) == [f"gpuplane-{_node('dock2')}-{job['id']}-1"]
    api.post(f"/api/v1/jobs/{job['id']}/cancel", expect=200)
    assert api.wait_job(job["id"], timeout=60)["state"] == "CANCELLED"
    wait_for(lambda: _containers(_node("dock2")) == [], 30, what="the container gone")


def test_an_oom_killed_container_is_oom(engine, live_server, agent_factory, tmp_path):
    agent_factory(live_server, name=_node("dock3"), extra=("--docker-arg=--memory=32m",))
    job = _submit(live_server.api, tmp_path, "x=0123456789; while true; do x=$x$x; done",
                  gpus=1)
    done = live_server.api.wait_job(job["id"], timeout=120)
    assert (done["state"], done["failure_kind"]) == ("FAILED", "OOM")
    assert "OOM killer" in done["message"]


def test_a_missing_image_is_a_dispatch_failure(engine, live_server, agent_factory, tmp_path):
    agent_factory(live_server, name=_node("dock4"))
    job = live_server.api.submit(["true"], tmp_path, image="gpuplane-test/nope:1", gpus=1)
    done = live_server.api.wait_job(job["id"], timeout=60)
    assert (done["state"], done["failure_kind"]) == ("FAILED", "DISPATCH_FAILED")
    lines = [l["text"] for l in live_server.api.get(f"/api/v1/jobs/{job['id']}/logs")["lines"]]
    assert any("No such image" in l for l in lines)


def test_a_restarted_agent_readopts_its_container_and_removes_lost_ones(
        engine, live_server, agent_factory, tmp_path):
    agent = agent_factory(live_server, name=_node("dock5"))
    api = live_server.api
    job = _submit(api, tmp_path, "echo up; while [ ! -e gate ]; do sleep 0.1; done; echo done",
                  gpus=1)
    wait_for(lambda: any(l["text"] == "up" for l in
                         api.get(f"/api/v1/jobs/{job['id']}/logs")["lines"]), 60,
             what="the container's first line")
    agent.kill()
    lost = f"gpuplane-{_node('dock5')}-9999-1"
    assert _docker("create", "--name", lost, "--label", f"gpuplane.node={_node('dock5')}",
                   IMAGE,
                   "true").returncode == 0
    (tmp_path / "gate").touch()
    agent.start()
    done = api.wait_job(job["id"], timeout=90)
    assert done["state"] == "SUCCEEDED" and done["attempt"] == 1
    assert [l["text"] for l in api.get(f"/api/v1/jobs/{job['id']}/logs")["lines"]] == ["up", "done"]
    wait_for(lambda: _containers(_node("dock5")) == [], 30, what="lost containers removed")


def test_an_image_reference_is_checked_at_submit(live_server, tmp_path):
    r = live_server.api.post("/api/v1/jobs", {"command": ["true"], "working_dir": str(tmp_path),
                                              "image": "bad image; rm -rf /"})
    assert live_server.api.last.status_code == 400 and "image" in r["error"]["message"]


def _event_file(path, tag, points):
    """A TensorBoard event file of v1 scalars, written with tensorboard's protos and CRC."""
    import struct
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    def record(data):
        head = struct.pack("<Q", len(data))
        return (head + struct.pack("<I", masked_crc32c(head)) + data
                + struct.pack("<I", masked_crc32c(data)))
    events = [event_pb2.Event(wall_time=1.0, file_version="brain.Event:2")]
    events += [event_pb2.Event(step=step, wall_time=2.0, summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=tag, simple_value=v)])) for step, v in points]
    path.write_bytes(b"".join(record(e.SerializeToString()) for e in events))


def test_containers_in_one_folder_keep_their_own_event_files(engine, live_server,
                                                             agent_factory, tmp_path):
    """Two container jobs at once in one folder: their processes are in pid namespaces of
    their own, so the event file's host -- the container's hostname -- says whose it is."""
    import time
    agent_factory(live_server, name=_node("dock6"), cpu_slots=4)
    api = live_server.api
    for mark in (1, 2):
        _event_file(tmp_path / f"made{mark}.bin", "loss", [(s, mark + s / 10) for s in range(5)])
    name = f"events.out.tfevents.{int(time.time()) + 2}.$HOSTNAME.1.0"
    jobs = {mark: _submit(api, tmp_path, f"touch ready{mark}; "
                          "while [ ! -e ready1 ] || [ ! -e ready2 ]; do sleep 0.1; done; "
                          f"cat made{mark}.bin > {name}; sleep 2", cpu_only=True)
            for mark in (1, 2)}
    for mark, job in jobs.items():
        done = api.wait_job(job["id"], timeout=90)
        assert done["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{job['id']}/logs")
        got = wait_for(lambda: (r := api.get(f"/api/v1/runs/{done['run_id']}/metrics/loss",
                                             expect=None)) and r.get("points"), 30,
                       what=f"run {done['run_id']}'s points")
        assert [round(p[4], 3) for p in got] == [round(mark + s / 10, 3) for s in range(5)]
