"""Trend, verdicts and rules on REAL training curves: runs of bench/data/real_runs.json.gz
(small torch models trained on CPU by bench/real_corpus.py, labelled by construction and
checked against their values). No torch here: the curves are read from the data file.
Only runs of the tuning half are used, except by the agreement test (a property, every part);
the held-out half and the fresh part are for bench/judgement.py."""
import gzip
import json
import math
import pathlib
import sys

import pytest

from gpuplane import curves, rules, semantic

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "data" / "real_runs.json.gz"


@pytest.fixture(scope="module")
def corpus():
    with gzip.open(DATA, "rt") as f:
        data = json.load(f)
    return [r for r in data["runs"] if r["half"] == "tune"]


def value(v):
    return semantic.num(v)


def pick(corpus, label, where=lambda r: True):
    runs = [r for r in corpus if r["label"] == label and where(r)]
    assert runs, f"no {label} run in the tuning half"
    return runs


def keys_of(r):
    """The run's keys as the semantic layer gets them (raw points: the runs are short)."""
    out = []
    evs = list(zip(r["eval_steps"], r["eval_loss"], r["eval_acc"]))
    for name, pts, d in (
            ("train/loss", [[i + 1, v] for i, v in enumerate(r["train_loss"])], "min"),
            ("eval/loss", [[s, v] for s, v, _ in evs], "min"),
            ("eval/acc", [[s, a] for s, _, a in evs], "max"),
            ("lr", [[i + 1, v] for i, v in enumerate(r["lr"])], None)):
        if not pts:
            continue
        fin = [p for p in pts if math.isfinite(value(p[1]))]
        best = (min if d == "min" else max)(fin, key=lambda p: value(p[1])) if fin else None
        out.append({"key": name, "direction": d, "points": pts, "count": len(pts),
                    "latest": {"step": pts[-1][0], "value": pts[-1][1], "ts": None},
                    "best": best and {"step": best[0], "value": best[1]}})
    return out


def buckets(pts):
    """Points as one-point series buckets [step, min, max, mean, last, count]."""
    return [[s, value(v), value(v), value(v), value(v), 1] for s, v in pts]


JOB = {"command": ["python", "train.py", "--lr", "0.1"], "working_dir": "/work/exp"}


def diagnose(r):
    state = "RUNNING" if r["label"] == "stall" else "SUCCEEDED"
    return semantic.diagnose_run({"id": 1, "job_id": 3, "state": state, "job": JOB},
                                 keys_of(r))


def test_the_corpus_is_real_balanced_and_split():
    with gzip.open(DATA, "rt") as f:
        data = json.load(f)
    runs = data["runs"]
    labels = {}
    for r in runs:
        labels[r["label"]] = labels.get(r["label"], 0) + 1
    assert data["torch"].startswith("2.")
    assert labels["healthy"] >= sum(n for k, n in labels.items() if k != "healthy")
    assert {"spike", "lr_burst", "nan", "diverged", "overfit", "not_learning", "stall"} <= \
        set(labels)
    for lab in labels:
        halves = {r["half"] for r in runs if r["label"] == lab}
        assert halves == {"tune", "holdout"} or labels[lab] == 1, lab
    assert {r["task"] for r in runs} >= {"mlp", "cnn", "lstm", "transformer"}
    assert {r["sched"] for r in runs} == {"constant", "step", "cosine", "sgdr", "onecycle"}
    assert {r["opt"] for r in runs} == {"adam", "sgd"}


# -- trend --------------------------------------------------------------------------------------

def test_noisy_converged_train_loss_is_flat_or_improving_never_worsening(corpus):
    """A converged loss under per-step noise is not 'worsening' (main had it so for 3 of
    5 seeds); whichever it is, it is what its last windows show."""
    for r in pick(corpus, "healthy"):
        pts = [[i + 1, v] for i, v in enumerate(r["train_loss"])]
        t = semantic.trend(buckets(pts), "min")
        assert t in ("flat", "improving"), (r["name"], t)


def test_diverged_loss_is_never_improving(corpus):
    """A loss that ends far above its first values is worsening, whatever its last windows
    do (main called a 0.70 -> 112 loss 'improving')."""
    for r in pick(corpus, "diverged"):
        pts = [[i + 1, v] for i, v in enumerate(r["train_loss"])]
        assert semantic.trend(buckets(pts), "min") == "worsening", r["name"]


def test_a_falling_curve_is_improving_or_within_its_noise(corpus):
    """The first quarter of a healthy run is still falling: 'improving' where the fall over
    its last 10% beats the per-batch noise, else 'flat'; never 'worsening'."""
    got = []
    for r in pick(corpus, "healthy"):
        pts = [[i + 1, v] for i, v in enumerate(r["train_loss"])][:len(r["train_loss"]) // 4]
        got.append(semantic.trend(buckets(pts), "min"))
    assert "worsening" not in got
    assert got.count("improving") >= len(got) // 3, got
    # the eval loss, once an epoch, of a run still learning at its end
    r = next(r for r in pick(corpus, "healthy") if r["eval_loss"][-1] < 0.8 * r["eval_loss"][0]
             and r["sched"] == "constant")
    assert semantic.trend(buckets([[s, v] for s, v in zip(r["eval_steps"][:6],
                                                          r["eval_loss"][:6])]), "min") \
        in ("improving", "flat")


def test_an_unknown_direction_has_no_trend(corpus):
    r = pick(corpus, "healthy")[0]
    pts = [[i + 1, v] for i, v in enumerate(r["train_loss"])]
    assert semantic.trend(buckets(pts), None) == "unknown"


# -- curve facts --------------------------------------------------------------------------------

def test_facts_quote_logged_points(corpus):
    r = pick(corpus, "healthy")[0]
    pts = [[i + 1, v] for i, v in enumerate(r["train_loss"])]
    f = curves.facts(pts, "min")
    logged = {s: v for s, v in pts}
    for k in ("first", "best", "last"):
        assert logged[f[k]["step"]] == f[k]["value"], k
    assert f["best"]["value"] == min(r["train_loss"])


def test_spike_runs_show_their_spike_and_recovery(corpus):
    for r in pick(corpus, "spike"):
        pts = [[i + 1, v] for i, v in enumerate(r["train_loss"])]
        lr = [[i + 1, v] for i, v in enumerate(r["lr"])]
        f = semantic.curve_facts(pts, "min", spike_key="train/loss", lr_points=lr)
        s = r["inject"]["step"]
        assert any(s <= sp["step"] <= s + 6 and sp["recovered"] for sp in f["spikes"]), \
            (r["name"], f["spikes"][:3])


# -- verdicts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("label,verdict", [
    ("healthy", "healthy"), ("diverged", "diverging"), ("nan", "diverging"),
    ("not_learning", "not learning"), ("spike", "unstable"), ("overfit", "overfitting")])
def test_verdicts_on_real_runs(corpus, label, verdict):
    for r in pick(corpus, label):
        d = diagnose(r)
        assert d["verdict"] == verdict, (r["name"], d["verdict"], d["evidence"][:2])
        assert d["confidence"]["level"] in ("high", "medium", "low")


def test_restarting_runs_are_healthy(corpus):
    """SGDR's warm restarts bump the loss; that is no spike and no divergence."""
    runs = pick(corpus, "healthy", lambda r: r["sched"] == "sgdr")
    for r in runs:
        assert diagnose(r)["verdict"] == "healthy", r["name"]


def test_diverging_advice_lowers_the_learning_rate(corpus):
    for r in pick(corpus, "diverged"):
        d = diagnose(r)
        why = " ".join(a["why"] for a in d["next_actions"])
        assert "lower the learning rate" in why and "higher" not in why, why
        assert "lower the learning rate" in d["advice"] and "higher rate only" in d["advice"]
        assert any("(logged)" in e or "smoothed" in e for e in d["evidence"])


def test_not_learning_advice_and_numbers(corpus):
    r = pick(corpus, "not_learning")[0]
    d = diagnose(r)
    assert "learning rate" in d["next_actions"][-1]["why"] and "learning rate" in d["advice"]
    assert "smoothed" in d["summary"]


def test_too_early_is_told_apart_from_bad(corpus):
    r = pick(corpus, "diverged")[0]
    short = dict(r, train_loss=r["train_loss"][:5], eval_steps=[], eval_loss=[], eval_acc=[])
    keys = [k for k in keys_of(short) if k["points"]]
    d = semantic.diagnose_run({"id": 1, "job_id": None, "state": "RUNNING"}, keys)
    assert d["verdict"] == "too early to tell"
    assert d["confidence"]["level"] == "low"


# -- the rules on the same curves ---------------------------------------------------------------

def feed(rule, r):
    """The train loss to a rule in batches of 50 steps, the learning rate first."""
    out = []
    n = len(r["train_loss"])
    for i in range(0, n, 50):
        steps = list(range(i + 1, min(n, i + 50) + 1))
        if hasattr(rule, "lr_points"):
            rule.lr_points(steps, r["lr"][i:i + 50])
        out += rule.extend(steps, [value(v) for v in r["train_loss"][i:i + 50]])
    return out


def test_spike_rule_fires_on_corrupted_batches_not_on_healthy_runs(corpus):
    for r in pick(corpus, "spike"):
        found = feed(rules.Spike("train/loss"), r)
        assert found and abs(found[0]["step"] - r["inject"]["step"]) <= 6, r["name"]
    for r in pick(corpus, "healthy"):
        assert not feed(rules.Spike("train/loss"), r), r["name"]


def test_diverge_rule_fires_without_nan(corpus):
    for r in pick(corpus, "diverged"):
        found = feed(rules.Diverge("train/loss"), r)
        assert found and found[0]["type"] == "LOSS_DIVERGED", r["name"]
    for r in pick(corpus, "healthy") + pick(corpus, "not_learning"):
        assert not feed(rules.Diverge("train/loss"), r), r["name"]


def test_the_benchmark_scores_the_server_path(corpus):
    """bench/judgement.py on a few runs: storage, the event engine, key_data and
    diagnose_run as the server runs them, and the verdicts agree with the events."""
    sys.path.insert(0, str(ROOT / "bench"))
    import judgement
    few = [pick(corpus, lab)[0] for lab in ("healthy", "diverged", "nan", "spike")]
    res = judgement.judge_all(few)
    by = {x["run"]["label"]: x for x in res}
    assert not by["healthy"]["found"] and by["healthy"]["diag"]["verdict"] == "healthy"
    assert "LOSS_DIVERGED" in by["diverged"]["found"]
    assert by["diverged"]["diag"]["verdict"] == "diverging"
    assert by["diverged"]["trends"]["train/loss"] == "worsening"
    assert "LOSS_NAN" in by["nan"]["found"] and by["nan"]["diag"]["verdict"] == "diverging"
    assert "LOSS_SPIKE" in by["spike"]["found"] and by["spike"]["diag"]["verdict"] == "unstable"


def test_every_number_said_to_be_logged_was_logged_at_that_step(corpus):
    """diagnose_run through the server path: each "V at step S (logged)" in its evidence is
    the value the run logged at step S (to the 4 digits quoted); downsampled points say
    they are bucket means, levels say they are smoothed."""
    import re
    sys.path.insert(0, str(ROOT / "bench"))
    import judgement
    few = [pick(corpus, lab)[1] for lab in ("healthy", "diverged", "spike", "overfit",
                                            "not_learning")]
    checked = 0
    for res in judgement.judge_all(few):
        r = res["run"]
        raw = {"train/loss": {i + 1: v for i, v in enumerate(r["train_loss"])},
               "eval/loss": dict(zip(r["eval_steps"], r["eval_loss"])),
               "eval/acc": dict(zip(r["eval_steps"], r["eval_acc"]))}
        for line in res["diag"]["evidence"]:
            key = line.split(":")[0].split(" ")[0]
            if key not in raw:
                continue
            for v, step in re.findall(r"(-?[\d.]+(?:e[-+]?\d+)?) at step (\d+) \(logged", line):
                logged = value(raw[key][int(step)])
                assert float(v) == pytest.approx(logged, rel=1e-3), (r["name"], line)
                checked += 1
    assert checked >= 8


# -- one spike judgement ------------------------------------------------------------------------

SPIKE_MAY_LOSE_TO = ("diverging", "not learning", "stalled", "failed")


def all_runs():
    """Every run of every part: agreement is a property, not a tuned figure."""
    out = []
    for path in sorted((ROOT / "bench" / "data").glob("real_runs*.json.gz")):
        with gzip.open(path, "rt") as f:
            out += json.load(f)["runs"]
    return out


def test_the_unstable_verdict_and_loss_spike_events_never_disagree():
    """diagnose_run's `unstable` and the LOSS_SPIKE rule are one judgement (rules.spikes on
    the raw points): through the server path (events from the engine, key_data's bucket
    means), `unstable` comes with a LOSS_SPIKE event and a LOSS_SPIKE event gives
    `unstable` unless a graver verdict wins; judged from the raw points alone (no events),
    diagnose_run finds the same spikes the rule fed in batches finds."""
    sys.path.insert(0, str(ROOT / "bench"))
    import judgement
    runs = all_runs()
    bad = []
    for res in judgement.judge_all(runs):
        v, spiked = res["diag"]["verdict"], "LOSS_SPIKE" in res["found"]
        if (v == "unstable") != spiked and not (spiked and v in SPIKE_MAY_LOSE_TO):
            bad.append((res["run"]["name"], v, sorted(res["found"])))
    assert not bad, bad
    for r in runs:
        rule = bool(feed(rules.Spike("train/loss"), r))
        pts = [[i + 1, v] for i, v in enumerate(r["train_loss"])]
        lr = [[i + 1, v] for i, v in enumerate(r["lr"])]
        f = semantic.curve_facts(pts, "min", spike_key="train/loss", lr_points=lr)
        assert bool(f["spikes"]) == rule, (r["name"], f["spikes"][:2])
        if r["label"] != "stall":
            v = diagnose(r)["verdict"]
            assert (v == "unstable") == rule or (rule and v in SPIKE_MAY_LOSE_TO), \
                (r["name"], v, rule)


def test_trend_short_converged_window_is_flat_and_far_above_start_is_worsening():
    """Trend against the curve's noise and its start: a converged 8-point eval accuracy
    (the last 3 against the 3 before: 6.5 of 9 pairs agree, chance) is flat; a loss that
    blew up to 150 and came down to 8 against its first 2.5 is worsening though its last
    stretch fell (the noise of the blow-up cannot hide 3x its first values)."""
    acc = [0.62109, 0.8457, 0.91016, 0.94141, 0.97852, 0.97656, 0.97852, 0.97656]
    assert semantic.trend(buckets([[i + 1, v] for i, v in enumerate(acc)]), "max") == "flat"
    rising = [0.5, 0.6, 0.7, 0.75, 0.8, 0.84, 0.87, 0.9, 0.93, 0.95]
    assert semantic.trend(buckets([[i + 1, v] for i, v in enumerate(rising)]), "max") == \
        "improving"
    loss = [2.5, 2.4, 2.6] + [150.0 + 40 * (i % 3) for i in range(100)] + \
        [60.0 - 0.5 * i + 20 * (i % 2) for i in range(100)] + [8.0 + (i % 3) for i in range(30)]
    assert semantic.trend(buckets([[i + 1, v] for i, v in enumerate(loss)]), "min") == \
        "worsening"
