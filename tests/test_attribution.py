"""A run's data is its own (agent.py's Writers, docs/tensorboard.md "Whose file is it"):
jobs that share a folder, as users' jobs do -- two trainings at once in one repository
folder, torch's default `runs/`, one checkpoint folder -- through a real server and agent
running real child processes.

Each job's script logs values that say which job wrote them; a run holding another job's
value is the bug these tests would catch."""
import json
import sys

import pytest

from procs import wait_for

TB_TRAIN = r"""
import importlib, os, sys, time
lib, mark, others = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
SummaryWriter = importlib.import_module(lib).SummaryWriter
open(f"ready-{sys.argv[2]}", "w").close()
while not all(os.path.exists(f"ready-{m}") for m in others):
    time.sleep(0.05)                 # both jobs write at once
if lib == "tensorboardX" and mark > 1:
    time.sleep(1.2)                  # its names are whole seconds and carry no pid: two
                                     # writers started in one second share one file
w = SummaryWriter()                  # the default: runs/<date>_<host> in the cwd
for step in range(30):
    w.add_scalar("train/loss", mark + step / 1000, step)
    w.flush()
    time.sleep(0.05)
w.close()
"""

CKPT_TRAIN = r"""
import json, os, sys, time
mark = sys.argv[1]
open(f"ready-{mark}", "w").close()
while not all(os.path.exists(f"ready-{m}") for m in sys.argv[2:]):
    time.sleep(0.05)
os.makedirs("checkpoints", exist_ok=True)
for epoch in range(2):
    with open(f"checkpoints/{mark}-epoch{epoch}.pt", "w") as f:
        f.write('{"job": "%s", ' % mark)
        f.flush()
        time.sleep(2.5)                  # a big torch.save holds its file for seconds
        f.write('"epoch": %d}' % epoch)
# a small file renamed into place: nothing shows which job wrote it
with open(f"checkpoints/{mark}-fast.pt.tmp", "w") as f:
    json.dump({"job": mark}, f)
os.replace(f"checkpoints/{mark}-fast.pt.tmp", f"checkpoints/{mark}-fast.pt")
open(f"done-{mark}", "w").close()
while not all(os.path.exists(f"done-{m}") for m in sys.argv[2:]):
    time.sleep(0.05)                     # both still run when the other's lands
"""

REWRITE = r"""
import json, os, sys, time
time.sleep(0.5)                          # some training first
os.makedirs("checkpoints", exist_ok=True)
with open("checkpoints/model.pt", "w") as f:
    json.dump({"weights": sys.argv[1]}, f)
"""


def _series(api, run_id, key):
    r = api.get(f"/api/v1/runs/{run_id}/metrics/{key}?max_points=10000", expect=200)
    return [(p[0], p[4]) for p in r["points"]]          # (step, last value)


def _events(api, run_id):
    return api.get("/api/v1/events", params={"run": run_id, "limit": 1000},
                   expect=200)["events"]


@pytest.mark.parametrize("lib", ["torch.utils.tensorboard", "tensorboardX"])
def test_two_jobs_with_the_default_runs_folder_keep_their_own_curves(
        live_server, agent_factory, tmp_path, lib):
    pytest.importorskip(lib)
    pytest.importorskip("tensorboard")
    agent_factory(live_server, fake_gpus=1, cpu_slots=4)
    api = live_server.api
    (tmp_path / "train.py").write_text(TB_TRAIN)
    jobs = {mark: api.submit([sys.executable, "train.py", lib, mark, "1", "2"], tmp_path,
                             cpu_only=True, name=f"job{mark}", project="attr")
            for mark in ("1", "2")}
    done = {m: api.wait_job(j["id"], timeout=180) for m, j in jobs.items()}
    for j in done.values():
        assert j["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{j['id']}/logs")
    for mark, j in done.items():
        got = wait_for(lambda: len(s := _series(api, j["run_id"], "runs/train/loss")) == 30 and s,
                       60, what=f"run {j['run_id']}'s 30 points")
        assert [step for step, _ in got] == list(range(30))
        # every value is this job's own (mark + step / 1000), none the other's
        assert all(abs(v - (float(mark) + step / 1000)) < 1e-6 for step, v in got), got
    assert not [e for j in done.values() for e in _events(api, j["run_id"])
                if e["type"] == "FILE_NOT_ATTRIBUTED"]


def test_two_jobs_watching_one_checkpoint_folder_register_only_their_own(
        live_server, agent_factory, tmp_path):
    agent_factory(live_server, fake_gpus=1, cpu_slots=4)
    api = live_server.api
    (tmp_path / "train.py").write_text(CKPT_TRAIN)
    jobs = {mark: api.submit([sys.executable, "train.py", mark, "a", "b"], tmp_path,
                             cpu_only=True, name=f"ck-{mark}", project="attr",
                             watch_dir="checkpoints")
            for mark in ("a", "b")}
    done = {m: api.wait_job(j["id"], timeout=120) for m, j in jobs.items()}
    for mark, j in done.items():
        assert j["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{j['id']}/logs")

    def ckpts(run_id):
        return api.get(f"/api/v1/runs/{run_id}/checkpoints", expect=200)["checkpoints"]

    def shared(run_id):
        return [e for e in _events(api, run_id) if e["type"] == "CHECKPOINT_FOLDER_SHARED"]
    for mark, j in done.items():
        # the files its process was seen writing are its own; the renamed-in file is
        # nobody's for sure: not registered, and one event says so and what to do
        said = wait_for(lambda: shared(j["run_id"]), 60, what=f"run {j['run_id']}'s event")
        assert len(said) == 1 and "{run}" in said[0]["message"]
        assert "-fast.pt" in json.dumps(said[0]["data"]["files"])
        names = sorted(c["path"].rsplit("/", 1)[1] for c in ckpts(j["run_id"]))
        assert names == [f"{mark}-epoch0.pt", f"{mark}-epoch1.pt"], names
        for c in ckpts(j["run_id"]):     # the file registered holds the job's own bytes
            assert json.load(open(c["path"]))["job"] == mark


def test_a_checkpoint_rewritten_by_a_later_job_is_no_longer_the_earlier_runs(
        live_server, agent_factory, tmp_path):
    agent_factory(live_server, fake_gpus=1, cpu_slots=4)
    api = live_server.api
    (tmp_path / "train.py").write_text(REWRITE)
    first = api.submit([sys.executable, "train.py", "first"], tmp_path, cpu_only=True,
                       name="first", project="attr", watch_dir="checkpoints",
                       eval_command=[sys.executable, "-c", "print('eval')"])
    first = api.wait_job(first["id"], timeout=60)
    assert first["state"] == "SUCCEEDED"

    def ckpts(run_id):
        return api.get(f"/api/v1/runs/{run_id}/checkpoints", expect=200)["checkpoints"]
    old = wait_for(lambda: ckpts(first["run_id"]), 30, what="the first run's checkpoint")[0]
    second = api.submit([sys.executable, "train.py", "second"], tmp_path, cpu_only=True,
                        name="second", project="attr", watch_dir="checkpoints")
    second = api.wait_job(second["id"], timeout=60)
    assert second["state"] == "SUCCEEDED"
    new = wait_for(lambda: ckpts(second["run_id"]), 30, what="the second run's checkpoint")[0]
    assert new["path"] == old["path"] and new["id"] != old["id"]

    # the first run's record says the file is now another run's; evaluating it is refused
    # with a sentence rather than evaluating the second run's weights as the first's
    mine = wait_for(lambda: (c := ckpts(first["run_id"])) and c[0].get("replaced_at") and c[0],
                    30, what="the first run's checkpoint marked replaced")
    assert mine["replaced_by"] == new["id"]
    r = api.post(f"/api/v1/checkpoints/{old['id']}/evaluations", expect=409)
    assert f"rewritten by run {second['run_id']}" in r["error"]["message"]
    rec = api.get("/api/v1/checkpoints:recommend?project=attr", expect=200)
    assert (rec["checkpoint"] or {}).get("checkpoint_id") != old["id"]


def test_placeholders_give_each_job_a_folder_and_a_shared_one_is_warned(
        live_server, agent_factory, tmp_path):
    agent_factory(live_server, fake_gpus=1, cpu_slots=4)
    api = live_server.api
    # a typo in a folder's placeholder is refused, naming the known ones
    r = api.post("/api/v1/jobs", {"command": ["true"], "working_dir": str(tmp_path),
                                  "cpu_only": True, "tb_dir": "tb/{jbo}"}, expect=400)
    assert "{jbo}" in r["error"]["message"] and "{run}" in r["error"]["message"]

    first = api.submit(["true"], tmp_path, cpu_only=True, held=True, name="first",
                       watch_dir="checkpoints")
    assert not first.get("warnings")
    second = api.submit(["true"], tmp_path, cpu_only=True, held=True, name="second",
                        watch_dir="checkpoints")
    (said,) = second["warnings"]
    assert f"job {first['id']} (first)" in said and "checkpoint" in said and "{run}" in said
    # a folder of its own per job: no warning, and the start fills it in
    own = api.submit(["/bin/sh", "-c", "mkdir -p out/{run} && echo {job}/{attempt} > out/{run}/id"],
                     tmp_path, cpu_only=True, name="own", tb_dir="out/{run}",
                     watch_dir="out/{run}")
    assert not own.get("warnings")
    done = api.wait_job(own["id"], timeout=60)
    assert done["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{own['id']}/logs")
    assert (tmp_path / "out" / str(done["run_id"]) / "id").read_text() == f"{own['id']}/1\n"
    assert api.job(own["id"])["tb_dir"] == "out/{run}"        # the job keeps what was written


SDK_INIT = r"""
from gpuctl import run
run.init(project="examples", experiment="cpu-logreg")
run.log({"loss": 1.0}, step=1)
run.finish()
"""


def test_a_job_and_its_run_agree_on_where_they_live(live_server, agent_factory, tmp_path):
    agent_factory(live_server, fake_gpus=1, cpu_slots=4)
    api = live_server.api
    (tmp_path / "train.py").write_text(SDK_INIT)
    # no project given: the script's run.init names it, for the job and its run alike
    free = api.wait_job(api.submit([sys.executable, "train.py"], tmp_path, cpu_only=True,
                                   name="free")["id"], timeout=60)
    assert free["state"] == "SUCCEEDED", api.get(f"/api/v1/jobs/{free['id']}/logs")
    run = api.get(f"/api/v1/runs/{free['run_id']}", expect=200)
    assert (run["project"], run["experiment"]) == ("examples", "cpu-logreg")
    assert (free["project"], free["experiment"]) == ("examples", "cpu-logreg")
    # a project the submitter named wins; what run.init asked for is kept on the run
    named = api.wait_job(api.submit([sys.executable, "train.py"], tmp_path, cpu_only=True,
                                    name="named", project="mine")["id"], timeout=60)
    run = api.get(f"/api/v1/runs/{named['run_id']}", expect=200)
    assert run["project"] == named["project"] == "mine"
    assert run["experiment"] == named["experiment"] == "cpu-logreg"
    assert json.loads(run["init_wish"]) == {"project": "examples"}


def test_a_sweeps_trials_in_one_folder_keep_their_own_curves_without_trial_folders(
        live_server, agent_factory, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("tensorboard")
    agent_factory(live_server, fake_gpus=1, cpu_slots=4)
    api = live_server.api
    (tmp_path / "trial.py").write_text(r"""
import sys, time
from torch.utils.tensorboard import SummaryWriter
mark = float(sys.argv[1])
w = SummaryWriter()                    # runs/<date>_<host>: the same folder for every trial
for step in range(20):
    w.add_scalar("val/loss", mark + step / 1000, step)
    w.flush()
    time.sleep(0.05)
w.close()
""")
    s = api.post("/api/v1/sweeps", {
        "working_dir": str(tmp_path), "cpu_only": True, "parallel": 3, "project": "attr",
        "experiment": "sw", "metric": "runs/val/loss", "direction": "min",
        "command": [sys.executable, "trial.py", "{x}"],
        "parameters": {"x": [3.0, 1.0, 5.0, 2.0, 6.0, 4.0]}}, expect=201)
    done = wait_for(lambda: (g := api.get(f"/api/v1/sweeps/{s['id']}"))["state"] == "DONE"
                    and g, 180, what="the sweep done")
    for t in done["trials_detail"]:
        got = wait_for(lambda: len(p := _series(api, t["run_id"], "runs/val/loss")) == 20
                       and p, 60, what=f"trial {t['number']}'s points")
        x = t["params"]["x"]
        assert all(abs(v - (x + step / 1000)) < 1e-6 for step, v in got), (t, got)
        assert not [e for e in _events(api, t["run_id"]) if e["type"] == "FILE_NOT_ATTRIBUTED"]
    best = api.get(f"/api/v1/sweeps/{s['id']}")["best"]
    assert (best["params"], best["value"], best["step"]) == ({"x": 1.0}, 1.0, 0)

    # a metric no trial logged: the sweep says so where its best would be
    s = api.post("/api/v1/sweeps", {
        "working_dir": str(tmp_path), "cpu_only": True, "project": "attr",
        "experiment": "sw2", "metric": "val/loss", "direction": "min",
        "command": [sys.executable, "trial.py", "{x}"], "parameters": {"x": [1.0]}},
        expect=201)
    done = wait_for(lambda: (g := api.get(f"/api/v1/sweeps/{s['id']}"))["state"] == "DONE"
                    and g, 60, what="the second sweep done")
    assert done["best"] is None
    assert done["best_missing"] == "no trial logged val/loss; keys seen: runs/val/loss"
