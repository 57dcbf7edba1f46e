"""Curve facts: what one metric curve says, computed once, read by every judgement.

`facts(points, direction)` turns a curve (logged points, or the bucket means of a long
series) into plain numbers: where it started, its best and last logged points, its noise,
its smoothed level at the start and at the end, its spikes (judged by rules.spikes, the
LOSS_SPIKE rule itself, on raw points) and whether it recovered from them, how far it ended from where it began, and its trend. `semantic.trend` (run show,
get_metric_summary, the dashboard), `semantic.diagnose_run` and `compare_runs` all read
these facts, so on one curve they tell one story. Pure: no SQL, no I/O, no clock.

Numbers come in two kinds and are named so: `first`, `best`, `last` and the spikes'
values are logged points ({"step", "value"}); `start_level`, `end_level` and `noise` are
smoothed (robust medians of windows) and every text that quotes them says "smoothed".
Thresholds are module constants, documented in docs/mcp.md; they were set on the tuning
half of bench/data/real_runs.json.gz (bench/judgement.py scores both halves).
"""
import bisect
import math
import statistics

from . import vocab

_num = vocab.decode      # a stored or wire value as a float (None, "NaN" -> NaN)

START_SHARE = 0.10        # the start level: the median of the first 10% (at least 3 points)
END_SHARE = 0.10          # the end level: the median of the last 10% (at least 3 points)
TREND_SHARE = 0.10        # trend: the last 10% against the 10% before it
TREND_Z = 3.0             # ... a change beyond 3 standard errors of the two medians
TREND_MIN_REL = 0.005     # ... and beyond 0.5% of the level
TREND_SHARE_APART = 0.7   # ... and 70% of the pairs of points across the windows agree
TREND_APART_Z = 1.5       # ... which on short windows is no chance: a rank-sum z beyond 1.5
DIVERGE_RATIO = 1.5       # diverged: a loss whose end level is 1.5x its first values
NOT_LEARNING_SHARE = 0.10  # learning for sure: the end 10% of its level below the start
LEARN_MIN_SHARE = 0.02     # not learning whatever the noise: the end within 2% of the start
LEARN_Z = 5.0              # between: learning when the fall is beyond 5 standard errors of
                           # the start and end levels (the curve's own noise, not its start)
MIN_POINTS = 10           # fewer points: too early to judge a running run
MIN_FINAL_POINTS = 4      # ... a run that has ended is judged from this many


def finite_points(points):
    """(step, value) pairs with a finite value; values may be wire strings or None."""
    out = []
    for p in points:
        v = _num(p[1])
        if math.isfinite(v):
            out.append((p[0], v))
    return out


def noise(values):
    """A robust width of the step-to-step jitter of one value: the MAD of the first
    differences, scaled to the standard deviation of one point (1.4826 / sqrt 2)."""
    if len(values) < 3:
        return 0.0
    diffs = [b - a for a, b in zip(values, values[1:])]
    med = statistics.median(diffs)
    mad = statistics.median(abs(d - med) for d in diffs)
    return mad * 1.4826 / math.sqrt(2)


def _win(n, share):
    return min(n, max(3, round(n * share)))


def facts(points, direction, head=None, spikes=None):
    """The facts of one curve, or None without a finite point. `direction` 'min' | 'max'
    (None: unknown: no best, no better or worse, trend 'unknown'). Badness is the value
    turned so that lower is better; the *_level fields are in the metric's own units.
    `head` [step, lowest, highest]: the logged extremes of the first bucket of a
    downsampled curve, so its first values count even when the bucket's mean hides them.
    `spikes`: the curve's spikes as LOSS_SPIKE judges them on its raw points
    (rules.spikes, the one spike judgement); None: not judged here (a bucket mean is no
    point to judge a spike on; the run's LOSS_SPIKE events tell)."""
    all_pts = list(points)
    pts = finite_points(all_pts)
    nonfinite = next(({"step": p[0], "value": p[1]} for p in all_pts
                      if not math.isfinite(_num(p[1]))), None)
    if not pts:
        return None
    sign = -1.0 if direction == "max" else 1.0
    steps = [s for s, _ in pts]
    vals = [v for _, v in pts]
    b = [sign * v for v in vals]
    n = len(b)
    ks, ke = _win(n, START_SHARE), _win(n, END_SHARE)
    start = statistics.median(b[:ks])
    # the first values: the best of the first 3 points (of the first one on a short curve,
    # where 3 points are a third of the run)
    first3 = min(b[:max(1, min(3, n // 20))])
    if head is not None and direction is not None:
        h = _num(head[1] if direction == "min" else head[2])
        if math.isfinite(h):
            first3 = min(first3, sign * h)
    end = statistics.median(b[-ke:])
    nz = noise(b[-max(3, n // 2):])        # the noise of the later half: warm-up is not noise
    i_best = min(range(n), key=b.__getitem__)
    scale = max(abs(start), abs(first3), nz, 1e-12)
    out = {
        "points": n,
        "first_step": steps[0],
        "last_step": steps[-1],
        "first": {"step": steps[0], "value": vals[0]},
        "last": {"step": steps[-1], "value": vals[-1]},
        "best": ({"step": steps[i_best], "value": vals[i_best]} if direction else None),
        "start_level": sign * start,           # smoothed
        "first_level": sign * first3,          # the best of the first (up to) 3 points
        "end_level": sign * end,               # smoothed
        "noise": nz,                           # smoothed
        "improvement": start - end,            # > 0: better at the end than at the start
        # from the higher of the start level and the first values: a run that learns within
        # its first 10% has a start level near its end, but not its first values
        "improvement_share": (max(start, first3) - end) / scale,
        # the standard error of the start and end levels (medians of ks and ke points)
        "gain_se": 1.253 * nz * math.sqrt(1.0 / ks + 1.0 / ke),
        "gain": max(start, first3) - end,
        "spikes": [{k: v for k, v in x.items() if k != "finding"} for x in spikes or ()],
        "spikes_judged": spikes is not None,
        "nonfinite": nonfinite,
        "direction": direction,
    }
    out["trend"] = _trend(b, nz, start, first3, direction)
    return out


def _trend(b, nz, start, first3, direction):
    n = len(b)
    if direction is None or n < 4:
        return "unknown"
    k = max(3, round(n * TREND_SHARE))
    if 2 * k > n:
        k = n // 2
    last, prev = b[-k:], b[-2 * k:-k]
    a, p = statistics.median(last), statistics.median(prev)
    # the standard error of a median of k points is about 1.253 sigma / sqrt(k)
    se = 1.253 * nz * math.sqrt(2.0 / k)
    level = max(abs(a), abs(p), 1e-12)
    # Far worse than where it started (a loss far above its first values) is not
    # improving, whatever its last windows do.
    # The noise may ask for more, but never beyond 3x the origin: a loss that ends at 3x its
    # first values is far worse whatever its later half's noise (diverged() alike).
    origin = min(start, first3)
    if a - origin > max(min(TREND_Z * se, 2 * abs(origin)), (DIVERGE_RATIO - 1) * abs(origin),
                        TREND_MIN_REL * level):
        return "worsening"
    d = a - p
    if abs(d) <= max(TREND_Z * se, TREND_MIN_REL * level):
        return "flat"
    # and the windows are apart, not only their medians: most of the last window's points
    # lie on the new side of most of the window before's (what a short eval curve needs)
    # (on 3-point windows 7 of 9 pairs is chance: the rank-sum z must say so too)
    share = _share_below(last, prev)
    nl, np_ = len(last), len(prev)
    z = (share - 0.5) * nl * np_ / math.sqrt(nl * np_ * (nl + np_ + 1) / 12)
    if d < 0 and share >= TREND_SHARE_APART and z >= TREND_APART_Z:
        return "improving"
    if d > 0 and share <= 1 - TREND_SHARE_APART and z <= -TREND_APART_Z:
        return "worsening"
    return "flat"


def _share_below(xs, ys):
    """The share of pairs (x, y) with x < y (ties count half): Mann-Whitney's U / (nx ny)."""
    ys = sorted(ys)
    below = 0.0
    for x in xs:
        lo = bisect.bisect_left(ys, x)
        hi = bisect.bisect_right(ys, x)
        below += (len(ys) - hi) + 0.5 * (hi - lo)
    return below / (len(xs) * len(ys))


def diverged(f):
    """A loss-like curve that ends far above its first values: finite divergence. Losses
    are positive, so the test is a ratio; a curve that goes below zero is not judged so."""
    if f is None or f["direction"] != "min":
        return False
    origin = min(f["first_level"], f["start_level"])
    if origin <= 0:
        return False
    # beyond the noise too, unless it ended far above (a curve in the thousands is noisy)
    return (f["end_level"] > DIVERGE_RATIO * origin
            and (f["end_level"] - origin > 3 * f["noise"] or f["end_level"] > 3 * origin))


def not_learning(f):
    """The curve ends where it started, judged against its own noise and scale: a fall of
    NOT_LEARNING_SHARE of its level is learning; under LEARN_MIN_SHARE it is not, however
    smooth (a loss that creeps 1% towards the mean's); between the two, learning is a fall
    beyond LEARN_Z standard errors of the start and end levels. A fine-tune starts near its
    floor: its slow fall is told from noise, not from a share of where it began."""
    if f is None or f["direction"] is None or f["points"] < MIN_POINTS or diverged(f):
        return False
    share = f["improvement_share"]
    if share >= NOT_LEARNING_SHARE:
        return False
    if share < LEARN_MIN_SHARE:
        return True
    return not f["gain"] > LEARN_Z * f["gain_se"]
