"""Issue 22: every total a client, job or agent controls is bounded where it is stored,
including what is merged over many requests (docs/security.md, "Limits")."""
import json
import tomllib

import pytest

from gpuplane.app import create_app
from gpuplane.db import checkpoints, metrics

TS = 1_764_403_200_000


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    home = tmp_path_factory.mktemp("limits")
    app = create_app(home, start_threads=False)
    app.config["_home"] = home
    return app


@pytest.fixture
def client(app):
    admin = tomllib.loads((app.config["_home"] / "server.toml").read_text())["admin_token"]
    c = app.test_client()
    c.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {admin}"
    return c


def new_run(client):
    r = client.post("/api/v1/runs", json={"name": "r", "project": "p", "source": "sdk"})
    assert r.status_code == 201
    return r.get_json()["id"]


def test_a_runs_config_is_bounded_in_all_not_only_per_request(client):
    run = new_run(client)
    chunk = "x" * 400_000
    for i in range(2):
        r = client.patch(f"/api/v1/runs/{run}", json={"config": {f"k{i}": chunk}})
        assert r.status_code == 200
    r = client.patch(f"/api/v1/runs/{run}", json={"config": {"k2": chunk}})
    assert r.status_code == 413, r.get_data(as_text=True)
    assert "at most 1000000 bytes in all" in r.get_json()["error"]["message"]
    assert set(client.get(f"/api/v1/runs/{run}").get_json()["config"]) == {"k0", "k1"}


def test_event_data_is_bounded(client):
    run = new_run(client)
    r = client.post(f"/api/v1/runs/{run}/events", json={"name": "big", "data": {
        "x": "y" * 70_000}})
    assert r.status_code == 413 and "at most 65536" in r.get_json()["error"]["message"]
    r = client.post(f"/api/v1/runs/{run}/events", json={"name": "ok", "data": {"x": 1}})
    assert r.status_code == 201


def test_checkpoints_per_run_are_bounded(client, monkeypatch):
    monkeypatch.setattr(checkpoints, "MAX_PER_RUN", 3)
    run = new_run(client)
    for i in range(3):
        r = client.post(f"/api/v1/runs/{run}/checkpoints", json={
            "path": f"/c/{i}.pt", "step": i})
        assert r.status_code == 201
    r = client.post(f"/api/v1/runs/{run}/checkpoints", json={"path": "/c/3.pt", "step": 3})
    assert r.status_code == 413 and "at most 3" in r.get_json()["error"]["message"]
    # the same file again is an update, not a new checkpoint
    assert client.post(f"/api/v1/runs/{run}/checkpoints", json={
        "path": "/c/2.pt", "step": 2}).status_code == 200


@pytest.mark.parametrize("binary", [False, True])
def test_metric_keys_per_run_are_bounded_and_old_keys_keep_taking_points(client, monkeypatch,
                                                                        binary):
    from gpuplane import metricwire
    monkeypatch.setattr(metrics, "MAX_KEYS_PER_RUN", 5)
    run = new_run(client)

    def post(keys, points):
        if binary:
            return client.post(f"/api/v1/runs/{run}/metrics",
                               data=metricwire.encode_binary(keys, points),
                               content_type=metricwire.BINARY_TYPE)
        return client.post(f"/api/v1/runs/{run}/metrics", data=json.dumps(
            {"keys": keys, "points": points}), content_type="application/json")

    keys = [f"k{i}" for i in range(4)]
    assert post(keys, [[i, 0, 1.0, TS] for i in range(4)]).status_code == 200
    keys = ["k0", "k4", "k5", "k6"]
    r = post(keys, [[i, 1, 1.0, TS] for i in range(4)] * 2).get_json()
    assert r["accepted"] == 4 and r["refused"] == 4, r
    assert "at most 5" in r["refusals"][0]["reason"]
    names = [k["key"] for k in client.get(f"/api/v1/runs/{run}/metrics").get_json()["keys"]]
    assert sorted(names) == ["k0", "k1", "k2", "k3", "k4"]
