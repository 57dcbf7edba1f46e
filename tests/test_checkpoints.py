"""Checkpoints, evaluations, metric definitions, recommend, projects and experiments,
run comparison: the routes through Flask's test client on a real SQLite file (no
server process; tests/test_ckpt_e2e.py runs the loop through a real server and agent)."""
import sqlite3
import tomllib

import pytest

from gpuplane.app import create_app
from gpuplane.db import (Database, MIGRATIONS, SCHEMA_V1, SCHEMA_V2_ROLLUPS,
                         SCHEMA_V3_JOB_DEPENDENCIES, jobs, metrics, now_ms)


@pytest.fixture
def app(tmp_path):
    return create_app(tmp_path, start_threads=False)


@pytest.fixture
def db(app):
    return app.config["DB"]


class Client:
    def __init__(self, app, home):
        admin = tomllib.loads((home / "server.toml").read_text())["admin_token"]
        self.c = app.test_client()
        self.c.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {admin}"

    def call(self, method, url, body=None, expect=200):
        r = self.c.open("/api/v1" + url, method=method, json=body)
        assert r.status_code == expect, (method, url, r.status_code, r.get_data(True)[:500])
        return r.get_json()

    def get(self, url, expect=200):
        return self.call("GET", url, expect=expect)

    def post(self, url, body=None, expect=201):
        return self.call("POST", url, body if body is not None else {}, expect)

    def error(self, method, url, body=None, status=400):
        out = self.call(method, url, body, expect=status)
        assert set(out) == {"error"} and out["error"]["message"]
        return out["error"]["message"]


@pytest.fixture
def api(app, tmp_path):
    return Client(app, tmp_path)


def new_run(api, project="p", experiment="e", name="r", config=None):
    return api.post("/runs", {"project": project, "experiment": experiment, "name": name,
                              "config": config or {}})["id"]


def log(api, run_id, points):
    """points: {key: [(step, value), ...]}"""
    keys = list(points)
    pts = [[i, s, v, now_ms()] for i, k in enumerate(keys) for s, v in points[k]]
    api.call("POST", f"/runs/{run_id}/metrics", {"keys": keys, "points": pts})


def ckpt(api, run_id, path, step=None, expect=201, **kw):
    return api.post(f"/runs/{run_id}/checkpoints", {"path": path, "step": step, **kw},
                    expect=expect)


def finish_evaluation(app, job_id, results, exit_code=0):
    """What the agent would report: the EVALUATE job starts, its run logs results, it exits."""
    db, lifecycle = app.config["DB"], app.config["LIFECYCLE"]
    job = lifecycle.assign(job_id, "n1", [])
    if results:
        metrics.ingest_batch(db, job["run_id"], list(results),
                             [[i, 1, v, now_ms()] for i, v in enumerate(results.values())])
    lifecycle.started(job_id, job["attempt"])
    lifecycle.finished(job_id, job["attempt"], exit_code=exit_code)


# -- registration ---------------------------------------------------------------------------

def test_one_checkpoint_per_file_whoever_registers_it(api, db):
    run = new_run(api)
    first = ckpt(api, run, "/w/ckpt/epoch_1.pt", step=100, size_bytes=10)
    assert first["created"] and first["format"] == "pt" and first["step_source"] == "given"
    # the same file again (SDK twice, or SDK then watcher) is the same checkpoint, updated
    again = ckpt(api, run, "/w/ckpt/../ckpt/epoch_1.pt", step=100, size_bytes=20, expect=200)
    assert again["id"] == first["id"] and not again["created"] and again["size_bytes"] == 20
    from gpuplane.db import checkpoints
    with db.tx() as c:   # the watcher's record: parsed step loses to the SDK's given step
        cid, created = checkpoints.register(c, run, "/w/ckpt/epoch_1.pt", step=1,
                                            step_source="name", fingerprint="9-9",
                                            source="watcher")
    assert (cid, created) == (first["id"], False)
    shown = api.get(f"/checkpoints/{cid}")
    assert shown["step"] == 100 and shown["fingerprint"] == "9-9"
    assert [c["id"] for c in api.get(f"/runs/{run}/checkpoints")["checkpoints"]] == [cid]


def test_step_defaults_to_the_runs_latest_step_and_metrics_are_the_nearest(api):
    run = new_run(api)
    log(api, run, {"train/loss": [(10, 1.0), (20, 0.5), (30, 0.25)],
                   "val/acc": [(18, 0.7)], "sys/cpu_percent": [(500, 3.0)]})
    c = ckpt(api, run, "/w/a.safetensors")
    assert c["step"] == 30 and c["step_source"] == "latest"   # sys/ keys are not steps
    c2 = ckpt(api, run, "/w/b.pt", step=24)
    m = api.get(f"/checkpoints/{c2['id']}")["metrics"]
    assert m == {"train/loss": {"step": 20, "value": 0.5}, "val/acc": {"step": 18, "value": 0.7}}
    # The run's list has them too with ?detail=1 (the run page's one request), not without.
    listed = api.get(f"/runs/{run}/checkpoints?detail=1")["checkpoints"]
    assert {x["id"]: (x["metrics"], x["evaluations"]) for x in listed}[c2["id"]] == (m, [])
    assert "metrics" not in api.get(f"/runs/{run}/checkpoints")["checkpoints"][0]


def test_relative_paths_need_a_job_or_an_absolute_fallback(api):
    run = new_run(api)
    msg = api.error("POST", f"/runs/{run}/checkpoints", {"path": "ckpt/a.pt"})
    assert "absolute" in msg
    c = ckpt(api, run, "ckpt/a.pt", abs_path="/home/me/ckpt/a.pt")
    assert c["path"] == "/home/me/ckpt/a.pt"
    api.error("POST", f"/runs/{run}/checkpoints", {"path": "/a", "step": -1})
    api.error("POST", "/runs/999/checkpoints", {"path": "/a"}, status=404)


# -- metric definitions -----------------------------------------------------------------

def test_definitions_resolve_experiment_then_project_then_global(api):
    new_run(api, "p", "e")
    new_run(api, "p", "e2")
    put = lambda body: api.call("PUT", "/metric-definitions", body)
    assert put({"key": "score"})["effective_direction"] == "max"          # by its name
    put({"key": "score", "direction": "min"})                             # global
    put({"key": "score", "project": "p", "direction": "max", "primary": True})
    d = put({"key": "score", "project": "p", "experiment": "e", "direction": "min"})
    assert d["effective_direction"] == "min" and d["direction_from"] == "experiment"
    got = api.get("/metric-definitions?project=p&experiment=e2")
    assert got["primary"] == {"key": "score", "from": "project"}
    # a new primary in the same scope takes the flag from the old one
    put({"key": "val/loss", "project": "p", "primary": True})
    assert api.get("/metric-definitions?project=p")["primary"]["key"] == "val/loss"
    # The scope a definition names is created: a sweep's metric is set before its runs.
    put({"key": "x", "project": "p", "experiment": "nope", "primary": True})
    put({"key": "x", "project": "zz"})
    assert api.get("/metric-definitions?project=p&experiment=nope")["primary"] == {
        "key": "x", "from": "experiment"}
    assert "zz" in [p["name"] for p in api.get("/projects")["projects"]]
    assert "needs its project" in api.error("PUT", "/metric-definitions",
                                            {"key": "x", "experiment": "e"})
    assert "not usable" in api.error("PUT", "/metric-definitions",
                                     {"key": "x", "project": "a/b"})
    api.error("PUT", "/metric-definitions", {"key": "x", "direction": "up"})
    api.call("DELETE", "/metric-definitions?key=val/loss&project=p")
    api.error("DELETE", "/metric-definitions?key=val/loss&project=p", status=404)


# -- recommend -------------------------------------------------------------------------------

def test_recommend_prefers_evaluation_results_then_training_values(api, app):
    a, b = new_run(api, name="a"), new_run(api, name="b")
    log(api, a, {"val/loss": [(100, 0.9), (200, 0.5)], "train/loss": [(100, 0.3), (200, 0.1)]})
    log(api, b, {"val/loss": [(100, 0.7), (200, 0.45)]})
    ca1, ca2 = ckpt(api, a, "/w/a1.pt", 100), ckpt(api, a, "/w/a2.pt", 200)
    _cb1, cb2 = ckpt(api, b, "/w/b1.pt", 110), ckpt(api, b, "/w/b2.pt", 200)
    r = api.get("/checkpoints:recommend?experiment=e")
    # no primary defined: an evaluation loss is guessed, and the answer says so
    assert r["metric"]["key"] == "val/loss" and r["metric"]["primary_from"] == "guess"
    assert r["checkpoint"]["checkpoint_id"] == cb2["id"]
    assert r["runner_up"]["checkpoint_id"] == ca2["id"]
    assert r["margin"] == pytest.approx(0.05) and r["checkpoint"]["source"] == "training"
    assert "ahead of checkpoint" in r["reason"]
    assert any(a["tool"] == "set_primary_metric" for a in r["next_actions"])

    # evaluated checkpoints come first: an evaluation of a1 wins over training values;
    # the result is what its run logged last
    ev = api.post(f"/checkpoints/{ca1['id']}/evaluations",
                  {"command": ["python", "eval.py"], "working_dir": "/w"})
    assert ev["state"] == "QUEUED" and ev["checkpoint_id"] == ca1["id"]
    job = api.get(f"/checkpoints/{ca1['id']}")["evaluations"][0]["job_id"]
    finish_evaluation(app, job, {"val/loss": 0.6, "val/acc": 0.8})
    ev = api.get(f"/evaluations/{ev['id']}")
    assert ev["state"] == "SUCCEEDED" and ev["results"]["val/loss"]["value"] == 0.6
    r = api.get("/checkpoints:recommend?project=p&experiment=e")
    assert r["checkpoint"]["checkpoint_id"] == ca1["id"]
    assert r["checkpoint"]["source"] == "evaluation" and r["checkpoint"]["value"] == 0.6
    assert r["evaluated"] == 1 and r["candidates"] == 4
    # the semantic layer's checkpoint comparison sees the same evaluation
    k = api.get(f"/checkpoints:compare?runs={a},{b}&key=val/loss")
    assert k["ranked"][0]["checkpoint_id"] == ca1["id"]
    # the leaderboard ranks a run by its evaluated checkpoints first, like recommend;
    # the EVALUATE run is no row of it
    board = api.get("/projects/p/experiments/e/runs")
    assert [row["id"] for row in board["runs"]] == [a, b]
    assert board["runs"][0]["best_evaluated"]["checkpoint_id"] == ca1["id"]
    assert board["runs"][1]["best"]["value"] == 0.45
    # a defined primary wins over the guess
    api.call("PUT", "/metric-definitions", {"key": "train/loss", "project": "p",
                                            "primary": True})
    r = api.get("/checkpoints:recommend?experiment=e")
    assert r["metric"] == {"key": "train/loss", "direction": "min", "primary_from": "project",
                           "direction_from": "name"}
    assert r["checkpoint"]["checkpoint_id"] == ca2["id"]
    assert r["runner_up"]["checkpoint_id"] == ca1["id"]
    assert api.get(f"/checkpoints:recommend?run={b}")["checkpoint"] is None   # no train/loss
    # a direction defined for the experiment turns the ranking around
    api.call("PUT", "/metric-definitions", {"key": "train/loss", "project": "p",
                                            "experiment": "e", "direction": "max"})
    assert api.get("/checkpoints:recommend?experiment=e")["checkpoint"]["checkpoint_id"] == \
        ca1["id"]
    api.error("GET", "/checkpoints:recommend")
    api.error("GET", "/checkpoints:recommend?experiment=nope", status=404)


def test_evaluation_needs_a_command_and_inherits_the_training_job(api, app, db):
    job = api.post("/jobs", {"command": ["python", "train.py"], "working_dir": "/w",
                             "gpus": 2, "env": {"HF_HOME": "/cache"}, "project": "p",
                             "experiment": "e", "eval_command": "python eval.py"})
    assert job["eval_command"] == ["/bin/sh", "-c", "python eval.py"]
    start = app.config["LIFECYCLE"].assign(job["id"], "n1", [0, 1])
    c = ckpt(api, start["run_id"], "ckpt/e1.pt", step=5)
    assert c["path"] == "/w/ckpt/e1.pt"
    ev = api.post(f"/checkpoints/{c['id']}/evaluations")
    ej = jobs.get(db, ev["job_id"])
    assert ej["kind"] == "EVALUATE" and ej["gpus"] == 2 and ej["working_dir"] == "/w"
    assert ej["command"] == ["/bin/sh", "-c", "python eval.py"]
    assert ej["env"] == {"HF_HOME": "/cache", "GPUCTL_CHECKPOINT_ID": str(c["id"]),
                         "GPUCTL_CHECKPOINT_PATH": "/w/ckpt/e1.pt",
                         "GPUCTL_CHECKPOINT_STEP": "5"}
    started = app.config["LIFECYCLE"].assign(ej["id"], "n1", [0, 1])
    cmd = app.config["GATEWAY"].start_message(started, "token")
    assert cmd["require_paths"] == ["/w/ckpt/e1.pt"]
    # a client reads which run saved the checkpoint from the job itself, single or listed
    assert api.get(f"/jobs/{ej['id']}")["checkpoint_run_id"] == start["run_id"]
    listed = {j["id"]: j for j in api.get("/jobs")["jobs"]}
    assert listed[ej["id"]]["checkpoint_run_id"] == start["run_id"]
    assert listed[job["id"]]["checkpoint_run_id"] is None
    # a run no job started has no working dir and no eval command to inherit
    run = new_run(api)
    c2 = ckpt(api, run, "/w/x.pt")
    assert "eval.py" in api.error("POST", f"/checkpoints/{c2['id']}/evaluations", {})
    assert "working_dir" in api.error("POST", f"/checkpoints/{c2['id']}/evaluations",
                                      {"command": ["python", "eval.py"]})
    api.error("POST", f"/checkpoints/{c2['id']}/evaluations", {"command": [1]})
    api.error("POST", "/checkpoints/999/evaluations", {}, status=404)


# -- projects and experiments ------------------------------------------------------------------

def test_projects_and_experiments_crud_rename_and_archive(api):
    api.post("/projects", {"name": "vision", "description": "cnn things"})
    assert "already exists" in api.error("POST", "/projects", {"name": "vision"}, status=409)
    assert "not usable" in api.error("POST", "/projects", {"name": "a/b"})
    api.post("/projects/vision/experiments", {"name": "lr"})
    run = new_run(api, "vision", "lr")
    api.call("PUT", "/metric-definitions", {"key": "acc", "project": "vision",
                                            "experiment": "lr", "primary": True})
    # rename: the runs and definitions follow the name
    api.call("PATCH", "/projects/vision/experiments/lr", {"name": "lr-sweep"})
    api.call("PATCH", "/projects/vision", {"name": "cv"})
    assert api.get(f"/runs/{run}")["project"] == "cv"
    assert api.get(f"/runs/{run}")["experiment"] == "lr-sweep"
    assert api.get("/metric-definitions?project=cv&experiment=lr-sweep")["primary"]["key"] == "acc"
    assert [e["runs"] for e in api.get("/projects/cv/experiments")["experiments"]] == [1]
    # delete is refused while runs are there; archive hides instead
    assert "--archive" in api.error("DELETE", "/projects/cv", status=409)
    api.error("DELETE", "/projects/cv/experiments/lr-sweep", status=409)
    assert api.call("DELETE", "/projects/cv?archive=1")["archived"] is True
    assert "cv" not in [p["name"] for p in api.get("/projects")["projects"]]
    assert "cv" in [p["name"] for p in api.get("/projects?archived=1")["projects"]]
    api.post("/projects", {"name": "empty"})
    api.post("/projects/empty/experiments", {"name": "x"})
    assert api.call("DELETE", "/projects/empty/experiments/x")["deleted"]
    assert api.call("DELETE", "/projects/empty")["deleted"]
    api.error("GET", "/projects/empty", status=404)
    # jobs and SDK runs create the names they use
    api.post("/jobs", {"command": ["true"], "working_dir": "/t", "cpu_only": True,
                       "project": "nlp", "experiment": "bert"})
    assert api.get("/projects/nlp/experiments/bert")["name"] == "bert"


def test_run_config_and_tags(api):
    run = new_run(api, config={"lr": 0.1})
    out = api.call("PATCH", f"/runs/{run}", {"config": {"batch": 32}, "tags": ["baseline"]})
    assert out["config"] == {"lr": 0.1, "batch": 32} and out["tags"] == ["baseline"]
    out = api.post(f"/runs/{run}/config", {"config": {"lr": 0.2}}, expect=200)  # the SDK's
    assert out["config"] == {"lr": 0.2, "batch": 32}
    api.error("PATCH", f"/runs/{run}", {"tags": [1]})


# -- compare -------------------------------------------------------------------------------------

def test_compare_runs_carries_an_aligned_series_and_defined_directions(api):
    a, b = new_run(api, name="a"), new_run(api, name="b")
    log(api, a, {"val/acc": [(s, s / 100) for s in range(0, 100)]})
    log(api, b, {"val/acc": [(s, 0.5) for s in range(50, 300)], "train/loss": [(1, 2.0)]})
    out = api.get(f"/runs:compare?ids={a},{b}&key=val/acc&max_points=20")
    m = next(m for m in out["metrics"] if m["key"] == "val/acc")
    assert m["direction"] == "max" and m["winner"] == a
    s = out["series"]
    assert len(s["steps"]) <= 20 and s["width"] == 16 and s["steps"][0] == 0
    sa, sb = s["runs"]
    assert len(sa["max"]) == len(sb["max"]) == len(s["steps"])
    assert sa["max"][0] == 0.15 and sb["max"][0] is None and sa["max"][-1] is None
    assert sb["min"][-1] == 0.5
    # a metric definition's direction reaches the comparison
    api.call("PUT", "/metric-definitions", {"key": "val/acc", "project": "p",
                                            "direction": "min"})
    out = api.get(f"/runs:compare?ids={a},{b}&keys=val/acc")
    assert out["metrics"][0]["direction"] == "min" and out["metrics"][0]["winner"] == a


# -- migration -----------------------------------------------------------------------------

def test_a_version_3_database_keeps_its_checkpoints_one_per_file(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA_V1 + SCHEMA_V2_ROLLUPS + SCHEMA_V3_JOB_DEPENDENCIES
                       + "PRAGMA user_version=3;")
    conn.execute("INSERT INTO runs (id, source, state, project, experiment, created_at)"
                 " VALUES (1, 'job', 'RUNNING', 'mnist', 'lr', 1)")
    for fp in ("1-1", "2-2"):     # the old table kept one row per fingerprint
        conn.execute("INSERT INTO checkpoints (run_id, path, step, fingerprint, created_at)"
                     " VALUES (1, '/w/a.pt', 5, ?, 1)", (fp,))
    conn.commit()
    conn.close()
    db = Database(path)
    assert db.query_one("PRAGMA user_version")[0] == len(MIGRATIONS)
    rows = db.query("SELECT path, fingerprint, step_source FROM checkpoints")
    assert [tuple(r) for r in rows] == [("/w/a.pt", "2-2", "given")]
    assert db.query_one("SELECT name FROM experiments")[0] == "lr"
    assert {r[0] for r in db.query("SELECT name FROM projects")} == {"mnist", "default"}
