"""Metrics through a real gunicorn server: concurrent ingest, the rollup thread if the app
runs one, and `gpuplane run list/show`."""
import json
import threading

from procs import wait_for
from gpuplane import cli
from gpuplane.cli.runs import sparkline


def _run(api, name):
    return api.post("/api/v1/runs", {"name": name, "project": "p", "experiment": "e",
                                     "source": "sdk"}, expect=201)["id"]


def test_concurrent_ingest_and_cli(live_server, capsys, monkeypatch):
    api = live_server.api
    run = _run(api, "long")
    other = _run(api, "other")
    errors = []

    def poster(offset):
        try:
            for b in range(10):
                start = offset + b * 500
                pts = [[k, s, 10.0 / (1 + s) if k == 0 else s / 20_000, 1] for s in
                       range(start, start + 500) for k in range(2)]
                r = api.session.post(f"{api.url}/api/v1/runs/{run}/metrics", timeout=30,
                                     data=json.dumps({"keys": ["train/loss", "val/acc"],
                                                      "points": pts}))
                if r.status_code != 200:
                    errors.append(r.text)
        except Exception as e:        # reported below, not lost in the thread
            errors.append(repr(e))

    threads = [threading.Thread(target=poster, args=(i * 5000,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    series = api.get(f"/api/v1/runs/{run}/metrics/train/loss?max_points=100", expect=200)
    assert sum(p[5] for p in series["points"]) == 20_000
    assert 0 < len(series["points"]) <= 100
    summary = wait_for(lambda: (s := api.get(f"/api/v1/runs/{run}/metrics", expect=200))
                       and s["keys"][0]["count"] == 20_000 and s, 30, what="summary")
    loss = {k["key"]: k for k in summary["keys"]}["train/loss"]
    assert loss["trend"] == "improving" and loss["best"]["step"] == 19_999

    monkeypatch.setenv("GPUCTL_TOKEN", live_server.token)
    args = ["--server", live_server.url]
    assert cli.main(["run", "list", "--project", "p", *args]) == 0
    out = capsys.readouterr().out
    assert "long" in out and "other" in out and str(other) in out
    assert cli.main(["run", "show", str(run), *args]) == 0
    out = capsys.readouterr().out
    assert "train/loss" in out and "improving" in out and "▁" in out
    assert cli.main(["run", "show", str(run), "--json", *args]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len({k["key"]: k for k in data["metrics"]}["val/acc"]["sparkline"]) == 20

    assert cli.main(["run", "show", "999", *args]) == 1
    captured = capsys.readouterr()
    assert "run 999 does not exist" in captured.err and "Traceback" not in captured.err
    assert captured.err.count("\n") == 1


def test_sparkline():
    pts = [[i, v, v, v, v, 1] for i, v in enumerate([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])]
    assert sparkline(pts) == "▁▂▃▄▅▆▇█"
    assert sparkline([[0, 1.0, 1.0, 1.0, 1.0, 1], [1, "NaN", "NaN", "NaN", "NaN", 1]]) == "▅ "
    assert sparkline([]) == ""
