"""The semantic routes over a real SQLite file (Flask test client): loading and shaping."""
import json
import math
import tomllib

import pytest

from gpuplane.app import create_app
from gpuplane.db import logs, metrics, now_ms

TS = 1_764_403_200_000


@pytest.fixture
def app(tmp_path):
    return create_app(tmp_path, start_threads=False)


@pytest.fixture
def client(app, tmp_path):
    admin = tomllib.loads((tmp_path / "server.toml").read_text())["admin_token"]
    c = app.test_client()
    c.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {admin}"
    return c


def get(client, path, expect=200):
    r = client.get(path)
    assert r.status_code == expect, r.get_data(as_text=True)
    return json.loads(r.get_data(as_text=True))


def make_run(client, db, config, curve, ckpt_steps=()):
    r = client.post("/api/v1/runs", json={"name": "r", "project": "p", "config": config})
    run_id = r.get_json()["id"]
    with db.tx() as c:
        metrics.ingest(c, run_id, ["val/loss"],
                       [[0, i, v, now_ms() - 1000 + i] for i, v in enumerate(curve)])
    for s in ckpt_steps:
        r = client.post(f"/api/v1/runs/{run_id}/checkpoints",
                        json={"path": f"/ck/{run_id}-{s}.pt", "step": s})
        assert r.status_code == 201
    return run_id


def test_diagnosis_compare_and_checkpoints(app, client):
    db = app.config["DB"]
    good = [0.3 + 1.7 * math.exp(-0.03 * i) for i in range(100)]
    worse = [0.6 + 1.4 * math.exp(-0.03 * i) for i in range(100)]
    a = make_run(client, db, {"lr": 0.1}, worse, ckpt_steps=(20, 99))
    b = make_run(client, db, {"lr": 0.01}, good, ckpt_steps=(20, 60, 99))

    d = get(client, f"/api/v1/runs/{b}/diagnosis")
    assert d["verdict"] == "healthy", d
    assert d["primary_key"] == "val/loss" and d["next_actions"]

    c = get(client, f"/api/v1/runs:compare?ids={a},{b}")
    assert c["winner"] == b and c["significant"] is True
    assert c["config_diff"] == {"lr": {str(a): 0.1, str(b): 0.01}}

    k = get(client, f"/api/v1/checkpoints:compare?runs={a},{b}")
    rec = k["recommendation"]
    assert rec["checkpoint"]["run_id"] == b and rec["checkpoint"]["step"] == 99
    assert rec["runner_up"]["step"] in (60, 99) and rec["source"] == "training"
    assert len(k["ranked"]) == 5


def test_explanation_of_a_failed_job(app, client):
    db = app.config["DB"]
    job = client.post("/api/v1/jobs", json={"command": ["python", "t.py"],
                                            "working_dir": "/w", "cpu_only": True}).get_json()
    assert get(client, f"/api/v1/jobs/{job['id']}/explanation")["kind"] == "NOT_FAILED"
    with db.tx() as c:
        logs.append(c, job["id"], 1, [[1, TS, "Traceback (most recent call last):"],
                                      [2, TS, "ModuleNotFoundError: No module named 'torch'"]])
        c.execute("UPDATE jobs SET state = 'FAILED', exit_code = 1, failure_kind = 'EXIT_CODE'"
                  " WHERE id = ?", (job["id"],))
    e = get(client, f"/api/v1/jobs/{job['id']}/explanation")
    assert e["kind"] == "MISSING_MODULE"
    assert e["lines"][-1]["text"].startswith("ModuleNotFoundError")


def test_bad_input_is_a_sentence(app, client):
    for path, status in [("/api/v1/runs/99/diagnosis", 404),
                         ("/api/v1/runs:compare?ids=1", 400),
                         ("/api/v1/runs:compare?ids=a,b", 400),
                         ("/api/v1/runs:compare?ids=98,99", 404),
                         ("/api/v1/jobs/99/explanation", 404),
                         ("/api/v1/checkpoints:compare", 400)]:
        body = get(client, path, expect=status)
        assert body["error"]["message"], path


def test_cli_diagnose_and_explain(live_server, monkeypatch, capsys):
    from gpuplane import cli
    api = live_server.api
    run = api.post("/api/v1/runs", {"project": "p", "name": "r"}, expect=201)
    vals = [0.3 + 1.7 * math.exp(-0.03 * i) for i in range(60)]
    api.post(f"/api/v1/runs/{run['id']}/metrics",
             {"keys": ["train/loss"], "points": [[0, i, v, now_ms()] for i, v in enumerate(vals)]},
             expect=200)
    monkeypatch.setenv("GPUCTL_TOKEN", live_server.token)
    assert cli.main(["--server", live_server.url, "diagnose", str(run["id"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {run['id']}: HEALTHY") and "next:" in out
    job = api.submit(["true"], "/tmp", cpu_only=True)
    assert cli.main(["--server", live_server.url, "explain", str(job["id"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "NOT_FAILED"
    assert cli.main(["--server", live_server.url, "diagnose", "999"]) == 1
    assert "run 999 does not exist" in capsys.readouterr().err
