"""Job dependencies (--after, --after-any), holds and queued edits, through a real server
and agent."""
import sqlite3

import pytest

from gpuplane import lifecycle
from gpuplane.db import Database
from procs import wait_for

FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def _submit(api, tmp_path, name, command="true", **fields):
    return api.submit(["/bin/sh", "-c", command], tmp_path, name=name, gpus=1, **fields)


def test_a_pipeline_runs_in_order_and_a_failure_fails_its_dependents(live_server, agent,
                                                                      tmp_path):
    api = live_server.api
    train = _submit(api, tmp_path, "train", "echo trained > model.txt")
    evaluate = _submit(api, tmp_path, "evaluate", "cat model.txt", after=[train["id"]])
    export = _submit(api, tmp_path, "export", "true", after=[evaluate["id"]])
    done = api.wait_job(export["id"])
    assert done["state"] == "SUCCEEDED"
    t, e = api.job(train["id"]), api.job(evaluate["id"])
    assert t["ended_at"] <= e["started_at"] and e["ended_at"] <= done["started_at"]

    broken = _submit(api, tmp_path, "broken", "exit 3")
    child = _submit(api, tmp_path, "child", after=[broken["id"]])
    grandchild = _submit(api, tmp_path, "grandchild", after=[child["id"]])
    cleanup = _submit(api, tmp_path, "cleanup", after_any=[broken["id"]])
    for job, want in ((child, "DEPENDENCY_FAILED"), (grandchild, "DEPENDENCY_FAILED")):
        j = api.wait_job(job["id"])
        assert (j["state"], j["failure_kind"]) == ("FAILED", want)
        assert j["attempt"] == 0                       # it never ran
        assert "did not" not in j["message"] and "succeeded" in j["message"]
    assert f"job {broken['id']} (broken) ended FAILED" in api.job(child["id"])["message"]
    assert api.wait_job(cleanup["id"])["state"] == "SUCCEEDED"


def test_the_queue_says_which_dependency_a_job_waits_for(live_server, agent, tmp_path):
    api = live_server.api
    gate = tmp_path / "gate"
    first = _submit(api, tmp_path, "first", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    second = _submit(api, tmp_path, "second", after=[first["id"]])
    reason = wait_for(lambda: api.job(second["id"])["pending_reason"], 30,
                      what="a pending reason")
    assert f"job {first['id']} (first," in reason and "to succeed" in reason
    queue = api.get("/api/v1/status")["queue"]
    assert [j["pending_reason"] for j in queue if j["id"] == second["id"]] == [reason]
    gate.touch()
    assert api.wait_job(second["id"])["state"] == "SUCCEEDED"


def test_unknown_ids_and_cycles_are_refused(live_server, tmp_path):
    api = live_server.api
    r = api.post("/api/v1/jobs", {"command": ["true"], "working_dir": str(tmp_path),
                                  "after": [999]})
    assert api.last.status_code == 400 and "job 999 does not exist" in r["error"]["message"]
    api.post("/api/v1/jobs", {"command": ["true"], "working_dir": str(tmp_path),
                              "after": [1], "after_any": [1]})
    assert api.last.status_code == 400
    a = _submit(api, tmp_path, "a")
    b = _submit(api, tmp_path, "b", after=[a["id"]])
    c = _submit(api, tmp_path, "c", after=[b["id"]])
    r = api.request("PATCH", f"/api/v1/jobs/{a['id']}", json={"after": [c["id"]]})
    assert api.last.status_code == 400 and "cycle" in r["error"]["message"]
    r = api.request("PATCH", f"/api/v1/jobs/{a['id']}", json={"after": [a["id"]]})
    assert api.last.status_code == 400 and "after itself" in r["error"]["message"]
    r = api.request("PATCH", f"/api/v1/jobs/{a['id']}", json={"command": ["x"]})
    assert api.last.status_code == 400 and "only 'priority'" in r["error"]["message"]
    assert api.job(a["id"])["depends_on"] == []


def test_hold_release_and_edit_priority(live_server, agent_factory, tmp_path):
    api = live_server.api
    agent_factory(live_server, fake_gpus=1)
    gate = tmp_path / "gate"
    blocker = _submit(api, tmp_path, "blocker", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    api.wait_job(blocker["id"], states=("RUNNING",))
    held = _submit(api, tmp_path, "held", held=True)
    low = _submit(api, tmp_path, "low")
    high = _submit(api, tmp_path, "high")
    assert api.post(f"/api/v1/jobs/{blocker['id']}/hold") and api.last.status_code == 409
    edited = api.request("PATCH", f"/api/v1/jobs/{high['id']}", json={"priority": 5})
    assert edited["priority"] == 5
    assert "held" in wait_for(lambda: api.job(held["id"])["pending_reason"], 30,
                              what="the held job's reason")
    gate.touch()
    low_done, high_done = api.wait_job(low["id"]), api.wait_job(high["id"])
    assert high_done["started_at"] <= low_done["started_at"]
    assert api.job(held["id"])["state"] == "QUEUED"
    released = api.post(f"/api/v1/jobs/{held['id']}/release", expect=200)
    assert released["held"] is False
    assert api.wait_job(held["id"])["state"] == "SUCCEEDED"
    conn = sqlite3.connect(live_server.home / "server" / "gpuctl.db")
    events = conn.execute("SELECT type, message FROM events WHERE job_id = ? ORDER BY id",
                          (held["id"],)).fetchall()
    conn.close()
    assert events[0] == ("QUEUED", f"job {held['id']} (held) queued held")
    assert [t for t, _ in events].count("RELEASED") == 1
    assert "HELD" not in [t for t, _ in events]          # it was queued held, not held later
    api.post(f"/api/v1/jobs/{low['id']}/release")
    assert api.last.status_code == 409                    # ended jobs cannot be released


def test_check_dependencies_finds_a_cycle_through_several_jobs(tmp_path):
    db = Database(tmp_path / "db.sqlite")
    life = lifecycle.Lifecycle(db)
    spec = {"name": "x", "command": ["true"], "working_dir": "/", "gpus": 0,
            "cpu_only": True, "priority": 0, "max_attempts": 1, "env": {},
            "project": "default", "experiment": ""}
    a = life.submit(spec)["id"]
    b = life.submit({**spec, "depends_on": [a]})["id"]
    c = life.submit({**spec, "depends_on": [b]})["id"]
    with db.tx() as conn:
        with pytest.raises(ValueError, match="cycle"):
            lifecycle.check_dependencies(conn, [c], a)
        lifecycle.check_dependencies(conn, [b], c)     # c after b again: no cycle
        with pytest.raises(ValueError, match="does not exist"):
            lifecycle.check_dependencies(conn, [c + 1], None)


def test_the_pipeline_example_runs_train_evaluate_export(live_server, agent, tmp_path):
    import os
    import shutil
    import subprocess
    import sys
    from procs import ROOT
    work = tmp_path / "pipeline"
    shutil.copytree(ROOT / "examples" / "pipeline", work)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")},
           "GPUCTL_SERVER": live_server.url, "GPUCTL_TOKEN": live_server.token,
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    r = subprocess.run(["sh", str(work / "submit.sh")], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exported.json written" in r.stdout
    assert (work / "exported.json").exists()
