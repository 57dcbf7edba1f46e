"""The event rules (gpuplane/rules.py) as pure functions: what fires, what must not."""
import gzip
import json
import math
import pathlib
import random

from gpuplane import rules, vocab

FRESH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "data" / \
    "real_runs_fresh.json.gz"

CFG = rules.DEFAULTS


def smooth_loss(n, seed=0, sigma=0.03, warm=50):
    rng = random.Random(seed)
    out = []
    for t in range(n):
        v = 0.3 + 2.0 * math.exp(-t / 300)
        if t < warm:
            v *= 1 + 0.2 * math.sin(math.pi * t / warm)     # warm-up bump
        out.append(v * math.exp(rng.gauss(0, sigma)))
    return out


def feed_spike(values, lr=None, batch=1):
    s = rules.Spike("train/loss", CFG)
    found = []
    for i in range(0, len(values), batch):
        steps = list(range(i, min(len(values), i + batch)))
        if lr is not None:
            s.lr_points(steps, lr[i:i + batch])
        found += s.extend(steps, values[i:i + batch])
    return found


def test_nonfinite_finds_the_first_bad_value_and_passes_clean_batches():
    assert rules.nonfinite("train/loss", [1, 2, 3], [0.5, 0.4, 0.3]) is None
    f = rules.nonfinite("train/loss", [1, 2, 3, 4], [0.5, math.inf, math.nan, 0.1])
    assert f["type"] == "LOSS_NAN" and f["severity"] == "critical" and f["step"] == 2
    assert f["evidence"] == {"key": "train/loss", "value": "inf"}
    assert rules.nonfinite("loss", list(range(100)), [1e308] * 100) is None   # sum overflows


def test_spike_fires_once_on_a_real_spike_with_evidence():
    values = smooth_loss(600)
    values[400] *= 4
    found = feed_spike(values)
    assert [f["step"] for f in found] == [400]
    ev = found[0]["evidence"]
    assert ev["value"] == values[400] and ev["z"] > CFG["spike_z"]
    assert "train/loss jumped" in found[0]["message"]


def test_spike_verdict_does_not_depend_on_batching():
    values = smooth_loss(800, seed=3)
    values[500] *= 3
    one = [f["step"] for f in feed_spike(values, batch=1)]
    for batch in (7, 64, 1000):
        assert [f["step"] for f in feed_spike(values, batch=batch)] == one == [500]


def test_no_spike_in_warmup_noise_or_plateau():
    for seed in range(20):
        assert feed_spike(smooth_loss(1500, seed=seed, sigma=0.08)) == []
    assert feed_spike([1.0] * 200 + [1.3] + [1.0] * 50) == []      # +30%: under the ratio


def test_lr_restart_is_not_a_spike_but_a_spike_later_is():
    values = smooth_loss(900, seed=5)
    lr = [1e-3 * (0.5 + 0.5 * math.cos(math.pi * (t % 300) / 300)) for t in range(900)]
    for t in range(600, 640):      # restart at 600: the loss doubles, then recovers
        values[t] *= 1 + 1.2 * 0.93 ** (t - 600)
    assert feed_spike(values, lr=lr) == []
    assert feed_spike(values)[0]["step"] == 600      # without the LR it looks alike
    values[800] *= 5
    assert [f["step"] for f in feed_spike(values, lr=lr)] == [800]


def test_a_loss_rise_right_after_a_learning_rate_burst_is_a_spike():
    """An LR x30 for 4 steps lifts an Adam loss 2-3x, inside its own per-step noise: after
    a burst (beyond spike_burst x the run's earlier max rate) a 2x jump suffices; without
    the logged rate, or after an ordinary restart, the same rise is no spike."""
    values = smooth_loss(900, seed=7, sigma=0.25)
    values[:3] = [5.0] * 3                          # the untrained loss: far above the rise
    lr = [1e-3] * 900
    for t in range(600, 604):
        lr[t] = 3e-2
    for t in range(603, 615):
        values[t] *= 2.6
    assert feed_spike(values) == []
    found = feed_spike(values, lr=lr, batch=50)
    assert [f["step"] for f in found] and 603 <= found[0]["step"] <= 620
    assert "learning-rate burst" in found[0]["message"]
    restart = [1e-3] * 600 + [2.5e-3] * 300       # a restart to 2.5x: no burst
    assert feed_spike(values, lr=restart) == []


def test_a_warm_restart_whose_loss_rises_and_comes_back_down_is_not_a_spike():
    """A real SGDR run (SGD, lr 0.1, batch 16; bench/data/real_runs_fresh.json.gz, healthy:
    2.08 -> 0.70): after its restart at step 366 the loss stays near its untrained value for
    over 100 steps while the rate decays. The restart's allowance lasts until the rate is
    back at its level before the restart (at most one previous cycle): there the loss above
    its first values is not a spike (with the fixed 50 steps alone it was, at step 483). A
    corrupted batch in the same stretch still is, and the verdict does not depend on how
    the points are batched."""
    with gzip.open(FRESH, "rt") as f:
        run = next(r for r in json.load(f)["runs"]
                   if r["name"] == "healthy-mlp-sgd-sgdr-lr0.1-b16-s1003")
    loss = [vocab.decode(v) for v in run["train_loss"]]
    pts = [[i + 1, v] for i, v in enumerate(loss)]
    lr = [[i + 1, v] for i, v in enumerate(run["lr"])]
    assert rules.spikes("train/loss", pts, lr) == []
    fixed = dict(CFG, spike_lr_grace_cycles=0)         # the fixed 50-step allowance only
    assert 483 in [s["step"] for s in rules.spikes("train/loss", pts, lr, cfg=fixed)]
    bad = [list(p) for p in pts]
    bad[599][1] = 30 * loss[0]                          # a corrupted batch at step 600
    assert [s["step"] for s in rules.spikes("train/loss", bad, lr)] == [600]
    lrv = [v for _, v in lr]
    for batch in (1, 50):
        assert [f["step"] for f in feed_spike([v for _, v in bad], lr=lrv, batch=batch)
                ] == [599]                                 # feed_spike counts from 0


def test_warm_up_reports_a_corrupted_batch_but_not_an_early_jump():
    """In the first spike_min_points only a jump above the first values and
    spike_warmup_jump x the recent level counts (early Adam CNNs jump 2-6x and recover)."""
    values = smooth_loss(400, seed=3, sigma=0.05, warm=0)
    values[100] = values[99] * 3.0                  # an early jump, below its first values
    assert feed_spike(values) == []
    values[110] = 20 * values[0]                    # a corrupted batch at step 110
    assert [f["step"] for f in feed_spike(values)] == [110]
    assert [f["step"] for f in feed_spike(values, batch=50)] == [110]


def overfit_run(rise, eval_key="eval/loss", train_key="train/loss", direction=None):
    o = rules.Overfit(eval_key, train_key, CFG, direction=direction)
    found = []
    for step in range(0, 2000, 10):
        o.train_points([step], [2.0 * math.exp(-step / 700) + 0.1])
        if step % 100 == 0 and step:
            e = 1.0 * math.exp(-step / 500) + 0.5
            if step > 1000:
                e = (1.0 * math.exp(-1000 / 500) + 0.5) * (1 + rise * (step - 1000) / 1000)
            found += o.eval_points([step], [e])
    return found


def test_overfitting_when_eval_worsens_while_train_improves():
    # eval 60% worse by the end (overfit_worse is 20%: real runs' eval curves under cosine
    # and SGDR wander by 10-15% without overfitting; bench/judgement.py)
    found = overfit_run(0.6)
    assert found and found[0]["type"] == "OVERFITTING_SUSPECTED"
    assert found[0]["evidence"]["best_step"] in (900, 1000)
    assert overfit_run(0.15) == []          # under the threshold
    assert overfit_run(0.0) == []           # eval on a plateau: not overfitting


def test_overfitting_reads_the_direction_of_the_vocabulary():
    """A name that says nothing of its direction is never judged worse; a metric
    definition's direction wins over the name's (gpuplane/vocab.py)."""
    assert overfit_run(0.6, "eval/compare", "train/compare") == []
    found = overfit_run(0.6, "eval/compare", "train/compare", direction="min")
    assert found and found[0]["evidence"]["best_step"] in (900, 1000)
    # defined as higher-is-better, a rising eval/loss is getting better, not overfitting
    assert overfit_run(0.6, direction="max") == []


def test_overfitting_not_when_train_gets_worse_too():
    o = rules.Overfit("eval/loss", "train/loss", CFG)
    found = []
    for step in range(0, 2000, 10):
        o.train_points([step], [1.0 + step / 1000])                 # diverging
        if step % 100 == 0 and step:
            found += o.eval_points([step], [1.2 + step / 900])
    assert found == []


def test_eval_pairs_and_loss_keys():
    assert rules.eval_pair("train/loss") == ("train", "loss")
    assert rules.eval_pair("eval/loss") == ("eval", "loss")
    assert rules.eval_pair("val_loss") == ("eval", "loss")
    assert rules.is_loss("train/loss") and not rules.is_loss("train/acc")
    assert not rules.is_loss("sys/gpu0/util")
    assert vocab.direction("eval/accuracy") == "max" and vocab.direction("eval/loss") == "min"


def test_stall_uses_the_jobs_own_interval():
    regular = [i * 2000 for i in range(100)]                  # every 2 s
    assert rules.find_stall(regular, regular[-1] + 60_000) is None    # 60 s < 120 s minimum
    f = rules.find_stall(regular, regular[-1] + 200_000)
    assert f["type"] == "STALLED" and f["evidence"]["usual_interval_s"] == 2.0
    slow = [i * 60_000 for i in range(30)]                    # every minute: 10 min is normal-ish
    assert rules.find_stall(slow, slow[-1] + 300_000) is None
    assert rules.find_stall(slow, slow[-1] + 700_000)["evidence"]["threshold_s"] == 600
    with_pause = regular + [regular[-1] + 100_000 + i * 2000 for i in range(10)]
    assert rules.find_stall(with_pause, with_pause[-1] + 1000) is None   # a pause < threshold
    assert rules.find_stall([0, 1000], 10**9) is None         # too few intervals to judge


def test_gpu_idle_after_grace_and_a_full_window():
    g = rules.GpuIdle("sys/gpu0/util", CFG)
    fired = [g.push(i, 3.0, i * 10_000) for i in range(200)]
    first = next(i for i, f in enumerate(fired) if f)
    # grace 300 s, then 0.8 of a 600 s window
    assert first * 10 >= 300 + 480
    busy = rules.GpuIdle("sys/gpu0/util", CFG)
    assert not any(busy.push(i, 3.0 if i % 60 < 9 else 90.0, i * 10_000) for i in range(400))


def test_disk_low_and_oom_lines():
    assert rules.disk_low(10_000, "node n1") is None
    assert rules.disk_low(1000, "node n1")["severity"] == "warning"
    assert rules.disk_low(100, "node n1")["severity"] == "critical"
    assert rules.oom_line(["step 1", "torch.OutOfMemoryError: CUDA out of memory. Tried"])
    assert rules.oom_line(["all good", "memory: 3 GB"]) is None
