"""Early stopping of sweep trials: pure functions of plain data, no SQL, no I/O.

A curve is a list of (step, value) sorted by step, the metric's own steps (not the count
of logged points); NaN points are left out by the caller. `d` is the direction, "min" or
"max". Each rule returns None (keep going) or a decision: a dict with `rule`, `step`,
`value`, `threshold`, `rung` (ASHA) and a `message` for people.

- median (Optuna's MedianPruner): after `warmup_steps`, a trial whose best value so far is
  worse than the median of the other trials' values at the same step is stopped, once at
  least `min_trials` other trials reached that step. Optuna compares with completed trials
  only; here every other trial that reached the step counts (finished, stopped or still
  running), so a sweep running 4 trials at once can judge its first trials too.
- asha (Optuna's SuccessiveHalvingPruner, asynchronous successive halving): rungs at
  min_steps * eta**k. A trial reaching rung k is promoted if its value there is within the
  top 1/eta of the values every trial had at that rung (itself included), else stopped.
  While fewer than eta trials reached a rung, a trial there goes on: Optuna promotes only
  the best one then, which stops the second of two trials started together as soon as it
  arrives, whatever it would become.
"""
import bisect
import statistics


def better(a, b, d):
    """Whether value a is better than b."""
    return a < b if d == "min" else a > b


def best_so_far(curve, upto=None, d="min"):
    """The best value of the curve at steps <= upto (all steps when None), or None."""
    vals = [v for s, v in curve if upto is None or s <= upto]
    if not vals:
        return None
    return min(vals) if d == "min" else max(vals)


def value_at(curve, step):
    """The value at the last logged step <= step, or None."""
    steps = [s for s, _ in curve]
    i = bisect.bisect_right(steps, step)
    return curve[i - 1][1] if i else None


def is_best_trial(curve, others, d):
    """Whether this trial holds the best value of the whole sweep so far: a rule never
    stops it."""
    mine = best_so_far(curve, d=d)
    if mine is None:
        return False
    for other in others:
        theirs = best_so_far(other, d=d)
        if theirs is not None and better(theirs, mine, d):
            return False
    return True


def _fmt(v):
    return f"{v:.6g}"


def median_rule(curve, others, d, *, warmup_steps=0, min_trials=3, key="metric"):
    """Stop when the trial's best so far is worse than the median of the other trials'
    values at its latest step (each other trial that logged that far, at its last logged
    step <= that step)."""
    if not curve:
        return None
    step = curve[-1][0]
    if step < warmup_steps:
        return None
    mine = best_so_far(curve, d=d)
    at = [value_at(o, step) for o in others if o and o[-1][0] >= step]
    at = [v for v in at if v is not None]
    if len(at) < max(1, min_trials):
        return None
    median = statistics.median(at)
    if not better(median, mine, d):
        return None
    return {"rule": "median", "step": step, "value": mine, "threshold": median,
            "rung": None, "trials": len(at),
            "message": f"median rule at step {step}: best {key} so far {_fmt(mine)} is worse "
                       f"than the median {_fmt(median)} of {len(at)} other trials there"}


def rung_steps(min_steps, eta, upto):
    """The rung steps min_steps * eta**k that are <= upto."""
    out, r = [], min_steps
    while r <= upto:
        out.append(r)
        r *= eta
    return out


def rung_value(curve, step):
    """A trial's value at a rung: at the first logged step >= the rung's step (what the
    trial reported when it got there), or None when it did not get there."""
    steps = [s for s, _ in curve]
    i = bisect.bisect_left(steps, step)
    return curve[i][1] if i < len(curve) else None


def asha(curve, others, d, passed, *, min_steps, eta=3, key="metric"):
    """-> (rungs passed, decision or None). `passed`: the rungs this trial was already
    promoted past (each rung is judged once per trial)."""
    if not curve:
        return passed, None
    rungs = rung_steps(min_steps, eta, curve[-1][0])
    while passed < len(rungs):
        r = rungs[passed]
        mine = rung_value(curve, r)
        competing = [v for v in (rung_value(o, r) for o in others if o) if v is not None]
        competing.append(mine)
        if len(competing) < eta:
            passed += 1
            continue
        keep = len(competing) // eta
        ranked = sorted(competing, reverse=(d == "max"))
        threshold = ranked[keep - 1]
        if better(mine, threshold, d) or mine == threshold:
            passed += 1
            continue
        return passed, {
            "rule": "asha", "step": r, "value": mine, "threshold": threshold,
            "rung": passed, "trials": len(competing),
            "message": f"ASHA rung {passed} (step {r}): {key} {_fmt(mine)} is not in the top "
                       f"1/{eta} of {len(competing)} trials there (threshold {_fmt(threshold)})"}
    return passed, None
