"""Precision and recall of the event rules on a labelled corpus of generated training runs.

NOT the measure of the rules: these generated curves were made with the rules in mind and
their figures did not carry over to real runs (issue 25). The rules are scored on real
training runs by bench/judgement.py; this stays as a quick check that each rule still fires
on its textbook case, and for GPU_UNDERUTILIZED, which the real corpus has no data for.

Generates (fixed seed) runs with injected anomalies — NaN/inf losses, loss spikes,
overfitting, stalls, idle GPUs — and at least as many clean runs that look like real
training: warm-up, cosine and step schedules, cosine with warm restarts, noisy RL losses,
plateaus, slow divergence, eval pauses, slow starts. Each run has a train loss, an eval
loss, a learning rate, activity times and GPU utilisation samples. Every rule of
gpuplane/rules.py runs on every run (the same code the engine runs, fed in random batch
sizes), and a table gives per rule precision and recall, then the false positives and
misses by name.

    .venv/bin/python bench/event_corpus.py [--per-kind 120] [--clean 700] [--seed 12]
"""
import argparse
import math
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from gpuplane import rules  # noqa: E402

RULES = ("LOSS_NAN", "LOSS_SPIKE", "OVERFITTING_SUSPECTED", "STALLED", "GPU_UNDERUTILIZED")
CLEAN_SHAPES = ("warmup_cosine", "step_schedule", "cosine_restarts", "noisy_rl", "plateau",
                "slow_divergence", "power_law")
IMPROVING = ("warmup_cosine", "step_schedule", "noisy_rl", "power_law")


# -- curve generation -----------------------------------------------------------------

def base_curve(rng, shape, n, log_lr):
    """(loss values, lr values, per-step noise sigma in log space)."""
    l0 = rng.uniform(1.0, 8.0)
    floor = l0 * rng.uniform(0.02, 0.4)
    warm = rng.randint(0, n // 8)
    sigma = rng.uniform(0.005, 0.08)
    lr_max = 10 ** rng.uniform(-5, -2)
    loss, lr = [], []
    restarts = set()
    if shape == "cosine_restarts":
        cycle = rng.randint(n // 6, n // 3)
        restarts = set(range(warm + cycle, n, cycle))
    drops = sorted(rng.sample(range(n // 4, n), 2)) if shape == "step_schedule" else []
    tau = rng.uniform(n / 10, n / 2)
    level = 1.0
    bump = 0.0
    for t in range(n):
        # learning rate
        if t < warm:
            cur_lr = lr_max * (t + 1) / warm
        elif shape == "cosine_restarts" and restarts:
            last = max([r for r in restarts if r <= t] or [warm])
            length = min([r for r in restarts if r > t] or [n]) - last
            cur_lr = lr_max * 0.5 * (1 + math.cos(math.pi * (t - last) / max(length, 1)))
        elif shape == "step_schedule":
            cur_lr = lr_max * 0.1 ** sum(t >= d for d in drops)
        else:
            cur_lr = lr_max * 0.5 * (1 + math.cos(math.pi * (t - warm) / max(n - warm, 1)))
        lr.append(cur_lr)
        # loss
        if shape == "power_law":
            progress = (1 + t / tau) ** -rng.uniform(0.9, 1.1) if t == 0 else (1 + t / tau) ** -1
        else:
            progress = math.exp(-t / tau)
        value = floor + (l0 - floor) * progress
        if t < warm:                       # warm-up: slow start, a small bump
            value *= 1 + 0.15 * math.sin(math.pi * t / max(warm, 1))
        if shape == "step_schedule":
            value *= 0.85 ** sum(t >= d for d in drops)
        if t in restarts:
            # with the LR logged, a restart may jump far; without, as far as real ones go
            bump = rng.uniform(0.1, 1.5) if log_lr else rng.uniform(0.05, 0.35)
        bump *= 0.95
        value *= 1 + bump
        if shape == "plateau" and t > n // 5:
            value = loss[n // 5]           # stuck from a fifth of the way on
        if shape == "slow_divergence":
            level *= 1 + rng.uniform(0.0005, 0.002)
            value *= level
        loss.append(value)
    if shape == "noisy_rl":
        sigma = rng.uniform(0.15, 0.35)
    return loss, lr, sigma, sorted(restarts)


def noisy(rng, values, sigma):
    return [v * math.exp(rng.gauss(0, sigma)) for v in values]


def make_run(rng, idx, label, shape):
    n = rng.randint(400, 1500)
    log_lr = shape == "cosine_restarts" and rng.random() < 0.7 or rng.random() < 0.5
    loss, lr, sigma, restarts = base_curve(rng, shape, n, log_lr)
    train = noisy(rng, loss, sigma)
    eval_every = rng.randint(20, 80)
    eval_steps = list(range(eval_every, n, eval_every))
    gap = rng.uniform(1.0, 1.3)             # eval above train, with a small generalisation gap
    eval_sigma = rng.uniform(0.003, 0.02)
    evals = [loss[s] * gap * math.exp(rng.gauss(0, eval_sigma)) for s in eval_steps]
    detail = shape
    if label == "LOSS_NAN":
        at = rng.randint(30, n - 1)
        bad = rng.choice([math.nan, math.inf, -math.inf])
        if rng.random() < 0.5:
            train[at] = bad                      # one bad value
        else:
            train[at:] = [math.nan] * (n - at)   # diverged for good
        detail += f" nan@{at}"
    elif label == "LOSS_SPIKE":
        # not within the LR grace after a logged restart: no rule can tell those apart
        at = rng.choice([s for s in range(60, n - 5)
                         if not (log_lr and any(0 <= s - r <= 60 for r in restarts))])
        k = math.exp(max(math.log(2.2), 12 * sigma) * rng.uniform(1.0, 2.0))
        width = rng.choice([1, 1, 2, 3])
        for j in range(at, min(n, at + width)):
            train[j] = loss[j] * k
        detail += f" spike@{at}x{k:.1f}"
    elif label == "OVERFITTING_SUSPECTED":
        if len(eval_steps) < 12:
            eval_every = max(10, n // 16)
            eval_steps = list(range(eval_every, n, eval_every))
            evals = [loss[s] * gap * math.exp(rng.gauss(0, eval_sigma)) for s in eval_steps]
        turn = rng.randint(len(eval_steps) // 3, len(eval_steps) * 2 // 3)
        rise = rng.uniform(0.12, 0.6) / max(len(eval_steps) - turn, 1)
        base = evals[turn]
        for j in range(turn + 1, len(evals)):
            evals[j] = base * (1 + rise * (j - turn)) * math.exp(rng.gauss(0, eval_sigma))
        detail += f" overfit@{eval_steps[turn]}"
    # activity (ms): one moment per logged step, the usual interval with jitter, eval pauses
    usual = rng.uniform(200, 30_000)
    t = 1_700_000_000_000
    activity = []
    for s in range(n):
        t += usual * rng.uniform(0.7, 1.3) * (3 if s < 5 else 1)      # slow first steps
        if s and s % eval_every == 0:
            t += usual * rng.uniform(1, 5)                             # eval / checkpoint pause
        activity.append(int(t))
    now = activity[-1] + int(usual)
    if label == "STALLED":
        limit = max(DEF["stall_factor"] * usual, DEF["stall_min_s"] * 1000)
        now = activity[-1] + int(limit * rng.uniform(1.2, 4))
        detail += f" stalled {(now - activity[-1]) / 1000:.0f}s"
    # GPU utilisation, a sample every 10 s over the run's wall time
    start = activity[0]
    gpu = []
    end = max(now, start + 40 * 60_000)
    slow_start = rng.uniform(0, 240_000)
    idle_from = rng.uniform(start + 5 * 60_000, end - 20 * 60_000) if label == \
        "GPU_UNDERUTILIZED" else None
    k = 0
    for ts in range(start, end, 10_000):
        if ts - start < slow_start:
            u = rng.uniform(0, 10)                              # loading data, compiling
        elif idle_from is not None and ts >= idle_from:
            u = max(0.0, rng.gauss(6, 4))                       # input-bound
        elif (ts - start) % (25 * 60_000) < 90_000:
            u = rng.uniform(0, 10)                              # eval on CPU for a while
        else:
            u = min(100.0, max(0.0, rng.gauss(85, 10)))
        gpu.append((k, u, ts))
        k += 1
    if label == "GPU_UNDERUTILIZED":
        detail += f" idle from +{(idle_from - start) / 60000:.0f}min"
    return {"id": f"{idx:04d}-{label or 'clean'}-{shape}", "label": label, "detail": detail,
            "train": train, "lr": lr if log_lr else None, "eval_steps": eval_steps,
            "evals": evals, "activity": activity, "now": now, "gpu": gpu}


DEF = dict(rules.DEFAULTS)


def corpus(seed, per_kind, clean):
    rng = random.Random(seed)
    runs = []
    for label in RULES:
        # overfitting needs a train loss that improves: not on plateaus, divergence, restarts
        shapes = IMPROVING if label == "OVERFITTING_SUSPECTED" else CLEAN_SHAPES
        for _ in range(per_kind):
            runs.append(make_run(rng, len(runs), label, rng.choice(shapes)))
    for i in range(clean):
        runs.append(make_run(rng, len(runs), None, CLEAN_SHAPES[i % len(CLEAN_SHAPES)]))
    return runs


# -- running the rules as the engine does ----------------------------------------------

def batches(rng, n):
    i = 0
    while i < n:
        k = rng.choice([1, 1, 3, 10, 50, 200])
        yield i, min(n, i + k)
        i += k


def detect(run, cfg, rng):
    """The set of rule types that fire on a run."""
    fired = set()
    train, n = run["train"], len(run["train"])
    steps = list(range(n))
    spike = rules.Spike("train/loss", cfg)
    over = rules.Overfit("eval/loss", "train/loss", cfg)
    ev = dict(zip(run["eval_steps"], run["evals"]))
    for lo, hi in batches(rng, n):
        s, v = steps[lo:hi], train[lo:hi]
        if rules.nonfinite("train/loss", s, v):
            fired.add("LOSS_NAN")
        if run["lr"] is not None:
            spike.lr_points(s, run["lr"][lo:hi])
        if spike.extend(s, v):
            fired.add("LOSS_SPIKE")
        over.train_points(s, v)
        es = [x for x in s if x in ev]
        if es and over.eval_points(es, [ev[x] for x in es]):
            fired.add("OVERFITTING_SUSPECTED")
    if rules.find_stall(run["activity"], run["now"], cfg):
        fired.add("STALLED")
    idle = rules.GpuIdle("sys/gpu0/util", cfg)
    for step, u, ts in run["gpu"]:
        if idle.push(step, u, ts):
            fired.add("GPU_UNDERUTILIZED")
            break
    return fired


def evaluate(runs, cfg, seed):
    rng = random.Random(seed + 1)
    table = {r: {"tp": 0, "fp": [], "fn": []} for r in RULES}
    for run in runs:
        fired = detect(run, cfg, rng)
        for r in RULES:
            if r == run["label"] and r in fired:
                table[r]["tp"] += 1
            elif r == run["label"]:
                table[r]["fn"].append(run)
            elif r in fired:
                table[r]["fp"].append(run)
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-kind", type=int, default=120, help="injected runs per rule")
    ap.add_argument("--clean", type=int, default=700, help="clean runs")
    ap.add_argument("--seed", type=int, default=12)
    args = ap.parse_args()
    t0 = time.perf_counter()
    runs = corpus(args.seed, args.per_kind, args.clean)
    points = sum(len(r["train"]) + len(r["evals"]) + len(r["gpu"]) for r in runs)
    t1 = time.perf_counter()
    table = evaluate(runs, DEF, args.seed)
    t2 = time.perf_counter()
    print(f"corpus: {len(runs)} runs ({args.per_kind} injected per rule, {args.clean} clean), "
          f"{points:,} points, seed {args.seed}; generated in {t1 - t0:.1f} s, rules ran in "
          f"{t2 - t1:.1f} s ({points / (t2 - t1):,.0f} points/s)")
    print(f"\n{'rule':<24}{'TP':>5}{'FP':>5}{'FN':>5}{'precision':>11}{'recall':>8}")
    ok = True
    for r in RULES:
        tp, fp, fn = table[r]["tp"], len(table[r]["fp"]), len(table[r]["fn"])
        p = tp / (tp + fp) if tp + fp else 1.0
        rc = tp / (tp + fn) if tp + fn else 1.0
        ok &= p >= 0.95 and rc >= 0.95
        print(f"{r:<24}{tp:>5}{fp:>5}{fn:>5}{p:>11.3f}{rc:>8.3f}")
    print("  (generated curves, not the measure: the rules are scored on real training runs by "
          "bench/judgement.py)")
    for r in RULES:
        for what in ("fp", "fn"):
            for run in table[r][what]:
                print(f"  {'false positive' if what == 'fp' else 'missed'} {r}: {run['id']}"
                      f" ({run['detail']})")
    # A report, not a gate: its generated curves were made with the rules in mind, and the
    # thresholds are set on real runs (bench/judgement.py), where they may differ.
    del ok
    return 0


if __name__ == "__main__":
    sys.exit(main())
