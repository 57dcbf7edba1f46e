"""Issue 25: `run show`, diagnose_run, the events and the metric summary (what the
dashboard draws its table from) tell one story about the same curve. One real server for
the module; each curve is logged once and read through every surface.

The dashboard itself is checked against the same answers in a real Chromium
(tests/browser/test_run_verdict.py); here the surfaces it reads are checked against each
other and against the curve."""
import math
import random
import re

import pytest

from gpuplane import cli, client
from procs import ServerProc, wait_for

STEPS = 400


def converged_noisy(rng):
    # falls, then sits at 0.3 under 15 % per-step noise (the "worsening" of issue 25)
    return [(0.3 + 2.0 * math.exp(-s / 40)) * (1 + 0.15 * rng.gauss(0, 1)) for s in range(STEPS)]


def falling(rng):
    return [2.0 * math.exp(-s / 150) + 0.05 + 0.01 * rng.random() for s in range(STEPS)]


def diverging(rng):
    # 0.70 -> ~112, finite, never NaN (issue 25's learning rate far too high)
    return [0.7 * math.exp(s / STEPS * math.log(160)) * (1 + 0.05 * rng.gauss(0, 1))
            for s in range(STEPS)]


CURVES = {"converged": converged_noisy, "falling": falling, "diverging": diverging}
# what each curve is, whatever words decide it: (trend of train/loss, verdict)
EXPECTED = {"converged": ({"flat"}, {"healthy"}),
            "falling": ({"improving"}, {"healthy"}),
            "diverging": ({"worsening"}, {"diverging"})}


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory):
    server = ServerProc(tmp_path_factory.mktemp("consistency") / "server").start()
    c = client.Client(server.url, server.token)
    out = {}
    try:
        for i, (name, make) in enumerate(CURVES.items()):
            rng = random.Random(i)
            run = c.create_run(project="consistency", name=name)["id"]
            train = make(rng)
            pts = [[0, s, v, 1_700_000_000_000 + s] for s, v in enumerate(train)]
            # an eval curve that follows the train curve at every 20th step
            pts += [[1, s, train[s] * 1.1, 1_700_000_000_000 + s] for s in range(19, STEPS, 20)]
            c.log_run_metrics(run, ["train/loss", "val/loss"], pts)
            c.finish_run(run)
            # the engine judges in the background: wait until it has seen the last point
            wait_for(lambda: c.get_run(run)["state"] == "SUCCEEDED", 30, what="run ended")
            out[name] = {"run": run, "client": c, "server": server}
        yield out
    finally:
        server.stop()


def read_all(s, capsys, monkeypatch):
    c, run, server = s["client"], s["run"], s["server"]
    summary = {k["key"]: k for k in c.list_run_metrics(run)}
    diagnosis = c.get_run_diagnosis(run)
    events = c.list_events(run=run, limit=200)["events"]
    monkeypatch.setenv("GPUCTL_TOKEN", server.token)
    assert cli.main(["--server", server.url, "run", "show", str(run)]) == 0
    shown = capsys.readouterr().out
    return summary, diagnosis, events, shown


@pytest.mark.parametrize("name", sorted(CURVES))
def test_one_story_per_curve(surfaces, name, capsys, monkeypatch):
    summary, d, events, shown = read_all(surfaces[name], capsys, monkeypatch)
    loss = summary["train/loss"]
    # run show prints the server's words, not its own
    assert f"verdict: {d['verdict'].upper()} — {d['summary']}" in shown
    row = next(ln for ln in shown.splitlines() if ln.startswith("train/loss "))
    assert re.search(rf"\smin\s+{loss['trend']}\s", row), row
    # and those words match the curve
    trends, verdicts = EXPECTED[name]
    assert loss["trend"] in trends, (name, loss)
    assert d["verdict"] in verdicts, (name, d)
    # no surface contradicts another
    bad = [e for e in events if e["severity"] in ("warning", "critical")]
    if d["verdict"] == "healthy":
        assert not bad, (name, bad)
        assert loss["trend"] != "worsening", loss
    if d["verdict"] == "diverging":
        assert loss["trend"] != "improving", loss
        text = " ".join([d["summary"], *d["evidence"], str(d["next_actions"])]).lower()
        assert not re.search(r"(higher|raise|increase)( the)? learning rate", text), text
    for e in bad:
        assert e["type"] not in ("LOSS_NAN", "LOSS_DIVERGED") or d["verdict"] == "diverging"
