"""The semantic layer: judgements about runs, metrics, checkpoints and failures. Rules and
statistics, no LLM, no SQL, no I/O: plain functions of plain data, so each can be tested on a
constructed run whose right answer is known. Loading the data is gpuplane/db/semantic.py;
REST (api/semantic.py), the CLI and the MCP server only expose the results.

`direction` says which way a metric should go and `trend` where it is going; then
diagnose_run, compare_runs, compare_checkpoints, get_best_checkpoint, explain_failure.
Every one of those results carries `next_actions`: concrete MCP tool calls with their
arguments ({"tool", "arguments", "why"}), so an agent knows what to do next without polling.

Shapes the functions take:
  key data   {"key", "direction": "min"|"max", "points": [[step, value], ...] (a bounded,
              downsampled series: the bucket means), "count", "latest": {"step", "value",
              "ts"}, "best": {"step", "value"}}; values may be None, NaN or the wire
              strings "NaN" / "Infinity" / "-Infinity".
  run        the REST run object (id, job_id, state, config, started_at, ...).
  checkpoint {"id", "run_id", "step", "path", "training": {key: value},
              "evaluation": {key: value} or None}
"""
import math
import re
import statistics

from . import curves, params, rules, states, vocab
from .next_actions import action, resubmit

# What a key means (its role, loss-like, its direction) is gpuplane/vocab.py's; these
# names stay for the callers. direction(key): "min" | "max" | None (unknown: not judged).
direction = vocab.name_direction
is_step_like = vocab.is_step_like


def trend(series_points, d):
    """'improving' | 'worsening' | 'flat' | 'unknown', from the curve's facts
    (gpuplane/curves.py): the last 10% against the 10% before, beyond the curve's own noise,
    and never 'improving' while far worse than where the curve started. `series_points` are
    the buckets of a downsampled series ([step, min, max, mean, last, count]); `d` is
    'min', 'max' or None (an unknown direction: 'unknown')."""
    pts = [(p[0], p[3]) for p in series_points if p[3] is not None and math.isfinite(p[3])]
    if d is None or len(pts) < 4 or sum(p[5] for p in series_points
                                        if p[3] is not None and math.isfinite(p[3])) < 4:
        return "unknown"
    f = curves.facts(pts, d, head=series_points[0][:3] if series_points else None)
    return f["trend"] if f else "unknown"


# diagnose_run thresholds (docs/mcp.md explains each); the curve's own are in curves.py.
MIN_POINTS = curves.MIN_POINTS   # fewer points in the judged curve: too early to tell
MIN_FINAL_POINTS = curves.MIN_FINAL_POINTS  # ... of a run that has ended: judged from these
MAX_CURVE_POINTS = 2000      # longer curves (raw points) are judged as bucket means
PLATEAU_SHARE = 0.02         # plateaued (a running run): the last 30% gained < 2% ...
PLATEAU_WINDOW = 0.3
OVERFIT_SHARE = 0.15         # overfitting: eval's end level 15% worse than its best ...
OVERFIT_SIGMAS = 3.0         # ... and more than 3 noise widths, while train improved
WORSEN_SHARE = 0.5           # diverging: the train loss's end gave back half its gain
STALL_MIN_S = 300            # stalled: no point for 5 min and ...
STALL_INTERVALS = 10         # ... 10 times the run's usual interval between points
SIGNIFICANT_SIGMAS = 2.0     # compare_runs: a difference beyond 2 combined noise widths

VERDICTS = ("healthy", "diverging", "not learning", "unstable", "overfitting", "plateaued",
            "stalled", "failed", "too early to tell", "no data")
# What to do, per verdict: in every diagnosis as `advice`, whether or not a job ran the run
# (next_actions can resubmit only a job's command).
ADVICE = {
    "healthy": "nothing to fix; keep the best checkpoint once it ends",
    "diverging": "lower the learning rate (by 3-10x) or clip gradients, and check the data "
                 "for NaNs; resume from the last good checkpoint (a higher rate only makes it "
                 "worse)",
    "not learning": "check that the learning rate is not 0 or far too small, that the "
                    "labels match the inputs and that the optimiser steps; a learning-rate "
                    "range test finds a working rate",
    "unstable": "clip gradients (e.g. max norm 1.0), lower the peak learning rate or "
                "lengthen its warm-up, and look at the batch at the spike's step",
    "overfitting": "take the checkpoint near the eval metric's best; retrain with more data "
                   "or regularisation (weight decay, dropout, augmentation) or stop early",
    "plateaued": "stop it and keep its best checkpoint; if it should go lower, a schedule "
                 "that decays the learning rate or a larger model",
    "stalled": "read the job's log; a hung data loader or collective needs a cancel and a "
               "retry",
    "failed": "explain_failure finds the cause in the job's log",
    "too early to tell": "wait for more points, then diagnose again",
    "no data": "GPUPlane saw no curve it can judge: if the script logs to a file GPUPlane "
               "does not watch (a CSV, a trainer_state.json, TensorBoard files outside the "
               "job's working dir), `gpuplane import-run PATH` brings it in; else log the "
               "loss with the SDK (run.log) or to TensorBoard",
}

FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


# -- small helpers ---------------------------------------------------------------------------

num = vocab.decode        # a stored or wire value as a float (None, "NaN" -> NaN)
wire = vocab.encode       # a float for JSON: non-finite values as the wire strings


_words = vocab.words
is_eval_key = vocab.is_eval
is_train_key = vocab.is_train
_is_loss_like = vocab.is_loss
_is_system = vocab.is_system


def _badness(values, direction):
    """Values turned so that lower is better whatever the direction."""
    return [v if direction == "min" else -v for v in values]


def noise(values):
    """A robust width of the curve's step-to-step jitter (curves.noise)."""
    return curves.noise(values)


def curve_facts(points, direction, head=None, spike_key=None, lr_points=()):
    """The facts of one curve (curves.facts); a long raw curve is judged as bucket means,
    since the windows below are not linear in its length. None without a finite point.
    `spike_key`: the points are the key's raw logged points and LOSS_SPIKE watches it: its
    spikes are rules.spikes' (the rule itself, on the same points, with the run's learning
    rate `lr_points`), so a verdict and the events never disagree on a spike."""
    spikes = (rules.spikes(spike_key, points, lr_points)
              if spike_key and rules.spike_watched(spike_key) else None)
    pts = curves.finite_points(points)
    if len(pts) > MAX_CURVE_POINTS:
        bad = next((p for p in points if not math.isfinite(num(p[1]))), None)
        points = _bucket_means(pts, MAX_CURVE_POINTS // 2) + ([bad] if bad else [])
    f = curves.facts(points, direction, head=head, spikes=spikes)
    if f is None:
        return None
    # the best smoothed level (a 5% running median), so one lucky point makes no trough
    b = [v if direction != "max" else -v for _, v in curves.finite_points(points)]
    n = len(b)
    k = max(1, n // 40)
    smooth = [statistics.median(b[max(0, i - k):i + k + 1]) for i in range(n)]
    i_best = min(range(n), key=smooth.__getitem__)
    sign = -1 if direction == "max" else 1
    f["best_level"] = sign * smooth[i_best]           # smoothed
    f["best_level_step"] = curves.finite_points(points)[i_best][0]
    f["best_at"] = i_best / max(1, n - 1)
    w = max(2, round(n * PLATEAU_WINDOW))
    f["late_gain"] = statistics.median(b[-w:][:max(1, w // 3)]) - statistics.median(b[-max(2, w // 3):])
    return f


def _raw(k):
    """The key's points are its logged points, not the bucket means of a longer series."""
    pts = k.get("points") or []
    return k.get("count") is None or k.get("count") == len(pts)


def _bucket_means(pts, n):
    """A long raw curve as n bucket means."""
    size = -(-len(pts) // n)
    out = []
    for i in range(0, len(pts), size):
        chunk = pts[i:i + size]
        out.append((chunk[0][0], sum(v for _, v in chunk) / len(chunk)))
    return out


def _bad(f, key):
    """A value of the curve as badness (lower is better)."""
    return -f[key] if f["direction"] == "max" else f[key]


def _gave_back(f):
    """Learnt, then got much worse and stayed there: the end level gave back more than
    WORSEN_SHARE of the gain from the start to the best level, beyond the noise."""
    gain = _bad(f, "start_level") - _bad(f, "best_level")
    back = _bad(f, "end_level") - _bad(f, "best_level")
    return gain > 0 and back > WORSEN_SHARE * gain and back > 3 * f["noise"] \
        and f["best_at"] < 0.9


def _overfit(fe, ft):
    """Eval's end level worse than its best level by OVERFIT_SHARE and OVERFIT_SIGMAS
    noise widths, while the train curve improved from its start."""
    if fe is None or ft is None or fe["direction"] is None:
        return False
    back = _bad(fe, "end_level") - _bad(fe, "best_level")
    scale = max(abs(fe["best_level"]), 1e-12)
    return (back > OVERFIT_SHARE * scale and back > OVERFIT_SIGMAS * fe["noise"]
            and fe["best_at"] < 0.85 and not curves.not_learning(ft)
            and ft["improvement_share"] > curves.LEARN_MIN_SHARE
            and not curves.diverged(ft))


def _improved(f):
    """The curve ended better than it started, beyond its own noise and a sliver of its
    level (curves.not_learning's tests, for any curve)."""
    return (f["improvement_share"] >= curves.LEARN_MIN_SHARE
            and f["gain"] > curves.LEARN_Z * f["gain_se"])


def _plateaued(f):
    gain = _bad(f, "start_level") - _bad(f, "best_level")
    return f["late_gain"] <= max(PLATEAU_SHARE * gain, f["noise"])


def pick_primary(keys, primary=None):
    """The key that decides: the declared primary metric, else an eval loss-like key,
    else any eval key, else a train loss, else the first non-system key."""
    names = [k["key"] for k in keys]
    if primary and primary in names:
        return primary
    # a key of unknown direction cannot decide (gpuplane/vocab.py): better is undefined
    known = {k["key"] for k in keys if k.get("direction") or vocab.name_direction(k["key"])}
    cands = [n for n in names if not _is_system(n) and n in known]
    for test in (lambda n: is_eval_key(n) and _is_loss_like(n), is_eval_key,
                 _is_loss_like, lambda n: True):
        hit = [n for n in cands if test(n)]
        if hit:
            return sorted(hit)[0]
    return None


def _train_key(keys):
    """The train curve: a train loss, the one logged most often (Lightning's
    `train_loss_step` over its `train_loss_epoch`, `loss` over HF's one-point `train_loss`)."""
    count = {k["key"]: k.get("count") or len(k.get("points") or ()) for k in keys}
    names = [k["key"] for k in keys if not _is_system(k["key"])
             and (k.get("direction") or vocab.name_direction(k["key"]))]
    for test in (lambda n: is_train_key(n) and _is_loss_like(n),
                 lambda n: _is_loss_like(n) and not is_eval_key(n), is_train_key):
        hit = [n for n in names if test(n)]
        if hit:
            return sorted(hit, key=lambda n: (-count[n], n))[0]
    return None


def _eval_losses(keys, main):
    """Every loss-like eval key of the run, the decisive one first: each is judged for
    overfitting against the train loss of the same kind (val/obj_loss with train/obj_loss)."""
    names = sorted(k["key"] for k in keys if is_eval_key(k["key"]) and _is_loss_like(k["key"])
                   and (k.get("direction") or vocab.name_direction(k["key"])))
    return ([main] if main in names else []) + [n for n in names if n != main]


def _train_pair(keys, eval_key):
    """The train key of the same base as an eval key (rules.eval_pair), or None."""
    base = vocab.base(eval_key)
    hit = [k["key"] for k in keys if not is_eval_key(k["key"]) and not _is_system(k["key"])
           and vocab.base(k["key"]) == base and (k.get("direction")
                                                 or vocab.name_direction(k["key"]))]
    return sorted(hit)[0] if hit else None


# -- diagnose_run ----------------------------------------------------------------------------

def diagnose_run(run, keys, events=(), now_ms=None, primary=None):
    """A verdict on one run — healthy, diverging, not learning, unstable, overfitting,
    plateaued, stalled, failed or too early to tell — with the evidence, how sure it is
    (`confidence`: points, noise, margin) and what to do next. The curves are judged from
    their facts (gpuplane/curves.py), the same facts `trend` reads; the run's warning
    events count as evidence, so the verdict never contradicts an event on the run."""
    run_id, job_id = run.get("id"), run.get("job_id")
    state = run.get("state")
    by_key = {k["key"]: k for k in keys}
    main = pick_primary(keys, primary)
    train = _train_key(keys)
    evidence = []
    facts = {}
    # the spike judgement is the LOSS_SPIKE rule's, on raw points only: a key whose points
    # are all there (not bucket means) is run through it with the run's learning rate;
    # a downsampled one is judged by the run's LOSS_SPIKE events (the rule on raw points)
    lr = next((k.get("points") or [] for k in keys if vocab.is_lr(k["key"]) and _raw(k)), [])
    evals = _eval_losses(keys, main)
    pairs = {e: _train_pair(keys, e) for e in evals}
    for name in ({main, train} | set(evals) | set(pairs.values())) - {None}:
        k = by_key[name]
        facts[name] = curve_facts(k.get("points") or [], k["direction"], head=k.get("head"),
                                  spike_key=name if _raw(k) else None, lr_points=lr)
    sure = {"level": "high", "points": 0, "noise": None, "why": ""}

    def result(verdict, summary, actions):
        return {"run_id": run_id, "job_id": job_id, "state": state, "verdict": verdict,
                "summary": summary, "advice": ADVICE[verdict], "primary_key": main,
                "evidence": evidence, "confidence": sure,
                "curves": {k: _wire_facts(f) for k, f in facts.items() if f},
                "next_actions": actions}

    def confident(level, name, why):
        f = facts.get(name)
        sure.update(level=level, points=f["points"] if f else 0,
                    noise=f["noise"] if f else None, why=why)

    bad_events = [e for e in events if e.get("severity") in ("warning", "critical")]
    kinds = {e.get("type") for e in bad_events}
    for e in bad_events[-5:]:
        evidence.append(f"event {e.get('type')}: {e.get('message') or ''}".strip())

    if state == "FAILED":
        evidence.insert(0, f"the run ended FAILED (failure kind {run.get('failure_kind')}, "
                           f"exit code {run.get('exit_code')})")
        sure.update(why="the run's state")
        acts = []
        if job_id:
            acts.append(action("explain_failure", "find the cause in the job's log",
                               job_id=job_id))
            acts.append(action("get_job_logs", "read the last lines yourself",
                               job_id=job_id, tail=100))
        return result("failed", f"run {run_id} failed", acts)

    # Non-finite values in a loss-like or the primary metric: diverging at once.
    for k in keys:
        name = k["key"]
        if _is_system(name) or not (_is_loss_like(name) or name == main):
            continue
        latest = (k.get("latest") or {}).get("value")
        if latest is not None and not math.isfinite(num(latest)):
            evidence.insert(0, f"{name} is {wire(num(latest))} at step "
                               f"{(k.get('latest') or {}).get('step')} (logged)")
            sure.update(why="a logged non-finite value")
            return result("diverging", f"{name} became {wire(num(latest))}: training blew up",
                          _fix_actions(run, job_id, "lower the learning rate, add gradient "
                                       "clipping, check the data for NaNs"))
    if "LOSS_NAN" in kinds:
        e = next(e for e in bad_events if e.get("type") == "LOSS_NAN")
        evidence.insert(0, e.get("message") or "a loss became NaN")
        sure.update(why="a LOSS_NAN event")
        return result("diverging", "a loss became non-finite: training blew up",
                      _fix_actions(run, job_id, "lower the learning rate, add gradient "
                                   "clipping, check the data for NaNs"))

    if state == "RUNNING" and now_ms is not None:
        stall = _stall(run, keys, now_ms)
        if stall:
            evidence.insert(0, stall)
            sure.update(why="the time since the last point")
            acts = [action("get_job_logs", "see whether the process still prints anything",
                           job_id=job_id, tail=50)] if job_id else []
            if job_id:
                acts.append(action("cancel_job", "if it is hung (a dataloader or NCCL "
                                   "deadlock), cancel and retry", job_id=job_id))
            return result("stalled", f"run {run_id} stopped reporting metrics", acts)

    ended = state in FINAL_STATES
    need = MIN_FINAL_POINTS if ended else MIN_POINTS

    def enough(name):
        # a run still running waits for MIN_POINTS; one that has ended is judged from what
        # it logged (an eval once an epoch, a sparse logger), and says how much that was
        return bool(name and facts.get(name) and facts[name]["points"] >= need)

    if not enough(main) and enough(train) and primary is None:
        # An eval metric logged once per epoch is often too short to judge; the train
        # curve is not, and it still tells divergence and plateaus.
        have = facts[main]["points"] if main and facts.get(main) else 0
        evidence.append(f"{main} has only {have} points; judged {train} instead")
        main = train
    if not enough(main) and ended:
        have = facts[main]["points"] if main and facts.get(main) else 0
        logged = sum(k.get("count") or len(k.get("points") or ()) for k in keys
                     if not _is_system(k["key"]))
        if not logged:
            why = (f"the run ended {state} without logging a metric: it was cancelled or "
                   "failed before its first log, or it logs to a place GPUPlane does not "
                   "watch")
        elif main is None:
            why = ("the run logged no metric whose direction is known (a loss, an accuracy, "
                   "or a key with a metric definition)")
        else:
            why = (f"the run ended with {have} points of {main}, fewer than the "
                   f"{MIN_FINAL_POINTS} a curve needs to be judged")
        evidence.insert(0, why)
        sure.update(level="low", points=have, why="no judgeable curve")
        return result("no data", f"run {run_id} has no curve to judge", [
            action("get_metric_summary", "see what the run did log", run_id=run_id)])
    if not enough(main):
        have = facts[main]["points"] if main and facts.get(main) else 0
        evidence.insert(0, f"{main or 'no metric'} has {have} points so far; "
                           f"{MIN_POINTS} are needed to judge a running run's curve")
        sure.update(level="low", points=have, why="too few points")
        acts = []
        if job_id and state not in FINAL_STATES:
            acts.append(action("wait_for_job", "wait for more of the run before judging",
                               job_id=job_id, timeout_s=120))
        acts.append(action("diagnose_run", "diagnose again once more points are in",
                           run_id=run_id))
        return result("too early to tell", f"run {run_id} has too little data to judge", acts)

    f = facts[main]
    ft = facts.get(train) if enough(train) else None
    # the curve that learns: the train loss when there is one, else the primary
    lname, lf = (train, ft) if ft else (main, f)
    few = lf["points"] < 3 * MIN_POINTS
    if lf["points"] < MIN_POINTS:
        evidence.append(f"judged from {lf['points']} points of {lname} (the run ended; "
                        f"{MIN_POINTS} or more make a surer judgement)")

    # Diverging without a NaN: the loss ends far above its first values, or learnt and
    # then gave most of it back and stayed there.
    # The eval curve is judged so only without a train curve: an eval loss that rises while
    # the train loss falls is overfitting, below. A curve that gave back its gain after a
    # spike is unstable, below, unless it ended far above where it started.
    spiked = "LOSS_SPIKE" in kinds or any(s["recovered"] for s in lf["spikes"])
    for name, cf in ((lname, lf),) if lf is not f else ((main, f),):
        if cf and ((cf["direction"] == "min" and curves.diverged(cf)) or
                   (cf["direction"] and _gave_back(cf) and not spiked)):
            evidence.insert(0, _levels_text(name, cf, by_key.get(name)))
            far = curves.diverged(cf)
            ratio = cf["end_level"] / max(min(cf["first_level"], cf["start_level"]), 1e-12)
            confident("medium" if few else "high", name,
                      f"the end level is {ratio:.1f}x the first values" if far else
                      "the end level gave back most of the gain")
            what = (f"ended far above where it started ({_fmt(cf['end_level'])} smoothed, "
                    f"against {_fmt(min(cf['first_level'], cf['start_level']))} at first)"
                    if far else f"got worse after step {cf['best_level_step']} and stayed")
            resume = (f"; resume from a checkpoint at or before step {cf['best_level_step']}, "
                      "where it was best, if one was saved" if cf["best_level_step"] >
                      cf["first_step"] else "; it was never better than at its first "
                      "logged step, so no checkpoint of this run is worth resuming from: "
                      "start again")
            return result("diverging", f"{name} {what}",
                          _fix_actions(run, job_id, "lower the learning rate (by 3-10x) or "
                                       "clip gradients" + resume))

    # A LOSS_DIVERGED event that no longer holds (the loss came back down): the run was
    # unstable, and the verdict says so beside the event instead of calling it healthy.
    div = next((e for e in bad_events if e.get("type") == "LOSS_DIVERGED"), None)
    if div is not None:
        dkey = (div.get("data") or {}).get("key") or lname
        back = _back_below(by_key.get(dkey), div)
        evidence.insert(0, f"{dkey} diverged at step {div.get('step')} (LOSS_DIVERGED)"
                        + (f" and recovered by step {back}" if back is not None else "")
                        + f"; {_levels_text(lname, lf, by_key.get(lname))}")
        confident("high", lname, "a LOSS_DIVERGED event and the curve since")
        acts = resubmit(run.get("job"), "lower the peak learning rate or clip gradients "
                        "(the loss blew up before it came back): change the command before "
                        "submitting")
        return result("unstable", f"{dkey} diverged at step {div.get('step')}"
                      + (f" and recovered by step {back}" if back is not None else ""), acts)

    # Not learning: the train curve ends where it started (within its noise and scale,
    # curves.not_learning), or it fell a little (memorising) while the decisive eval curve
    # did not improve beyond its own noise.
    if (curves.not_learning(lf) and (lf is f or curves.not_learning(f) or
                                     f["improvement_share"] < 3 * curves.NOT_LEARNING_SHARE)) \
            or (f is not lf and lf["improvement_share"] < curves.NOT_LEARNING_SHARE
                and f["points"] >= MIN_POINTS and not _improved(f)):
        evidence.insert(0, _levels_text(lname, lf, by_key.get(lname)))
        share = lf["improvement_share"]
        confident("medium" if few or share > 0.5 * curves.NOT_LEARNING_SHARE else "high",
                  lname, f"it gained {100 * share:.1f}% of its start level, "
                  + (f"under {100 * curves.LEARN_MIN_SHARE:.0f}%" if share <
                     curves.LEARN_MIN_SHARE else f"{lf['gain'] / max(lf['gain_se'], 1e-300):.1f} "
                     "standard errors of its start and end levels, within its noise"))
        acts = []
        if job_id and state not in FINAL_STATES:
            acts.append(action("cancel_job", "it does not learn; stop to free the GPU",
                               job_id=job_id))
        acts += resubmit(run.get("job"), "check that the learning rate is not 0 or far too "
                         "small, that the labels match the inputs, and that the optimiser "
                         "steps (a learning-rate range test finds a working rate): change "
                         "the command before submitting")
        return result("not learning", f"{lname} stays where it started "
                      f"({_fmt(lf['start_level'])} at first, {_fmt(lf['end_level'])} at the "
                      f"end, smoothed)", acts)

    # unstable: exactly when LOSS_SPIKE fires (the run's events, or the rule itself on the
    # raw points here): one spike judgement, so the verdict and the events agree
    spikes = list(lf["spikes"]) if lf else []
    if "LOSS_SPIKE" in kinds or spikes:
        if spikes:
            s = max(spikes, key=lambda x: x["value"] - x["level"])
            evidence.insert(0, f"{lname} jumped to {_fmt(s['value'])} at step {s['step']} "
                               f"(logged; {_fmt(s['level'])} before it, its recent median) "
                               + ("and came back" if s["recovered"] else "and stayed high")
                               + (f"; {len(spikes)} such spikes" if len(spikes) > 1 else ""))
        confident("high" if "LOSS_SPIKE" in kinds and spikes else "medium", lname,
                  "a LOSS_SPIKE event and the curve's own spikes" if "LOSS_SPIKE" in kinds
                  and spikes else "a LOSS_SPIKE event" if "LOSS_SPIKE" in kinds
                  else "the LOSS_SPIKE rule on the curve's logged points")
        step = (s["step"] if spikes else
                next((e.get("step") for e in bad_events if e.get("type") == "LOSS_SPIKE"), None))
        acts = resubmit(run.get("job"), "clip gradients (e.g. max norm 1.0), lower the peak "
                        "learning rate or lengthen its warm-up"
                        + (f"; check the batch at step {step}" if step is not None else "")
                        + ": change the command before submitting")
        if job_id and state not in FINAL_STATES:
            acts.insert(0, action("wait_for_job", "it recovered; watch that it stays so",
                                  job_id=job_id, timeout_s=600))
        return result("unstable", f"{lname} has large spikes it recovers from", acts)

    ov = next((e for e in bad_events if e.get("type") == "OVERFITTING_SUSPECTED"), None)
    ov_key = (ov.get("data") or {}).get("eval_key") if ov else None
    for ek in ([ov_key] if ov_key in facts else []) + evals:
        fe = facts.get(ek)
        tk = pairs.get(ek)
        fp = facts.get(tk) if tk and enough(tk) else (ft or lf)
        if ek == lname or not enough(ek) or not (ek == ov_key or _overfit(fe, fp)):
            continue
        main, f = ek, fe
        lname, lf = (tk, fp) if fp is facts.get(tk) else (lname, lf)
        break
    if is_eval_key(main) and main != lname and (_overfit(f, ft or lf) or main == ov_key
                                                or "OVERFITTING_SUSPECTED" in kinds):
        evidence.insert(0, _levels_text(main, f, by_key.get(main)))
        evidence.insert(1, f"while {lname} kept improving ({_fmt(lf['start_level'])} -> "
                           f"{_fmt(lf['end_level'])}, smoothed)")
        back = _bad(f, "end_level") - _bad(f, "best_level")
        confident("low" if f["points"] < MIN_POINTS else
                  "medium" if f["points"] < MIN_POINTS * 2 else "high", main,
                  f"the end level is {_fmt(back)} worse than the best level "
                  f"({100 * back / max(abs(f['best_level']), 1e-12):.0f}%; noise "
                  f"{_fmt(f['noise'])})")
        acts = [action("list_checkpoints", "pick the checkpoint near the best "
                       f"{main} (step {f['best_level_step']})", run_id=run_id),
                action("get_best_checkpoint", "let the platform pick it by the "
                       "primary metric", run_id=run_id)]
        if job_id and state not in FINAL_STATES:
            acts.append(action("cancel_job", "further training only overfits",
                               job_id=job_id))
        acts += resubmit(run.get("job"), "retrain with more data or regularisation (weight "
                         "decay, dropout, augmentation) or stop early: change the command "
                         "before submitting")
        return result("overfitting", f"{main} is worse than at step {f['best_level_step']} "
                      f"while {lname} still improves", acts)

    if state not in FINAL_STATES and _plateaued(f):
        evidence.insert(0, f"{main} changed by {_fmt(f['late_gain'])} (smoothed) over the "
                           f"last {int(PLATEAU_WINDOW * 100)}% of the run (noise "
                           f"{_fmt(f['noise'])})")
        confident("medium" if few else "high", main, "the last 30% gained less than the "
                  "noise")
        acts = []
        if job_id:
            acts.append(action("cancel_job", "the curve no longer moves; stop to free "
                               "the GPU", job_id=job_id))
        acts.append(action("get_best_checkpoint", "take the best checkpoint so far",
                           run_id=run_id))
        acts += resubmit(run.get("job"), "if it should go lower: a schedule that decays the "
                         "learning rate, or a larger model: change the command before "
                         "submitting")
        return result("plateaued", f"{main} has stopped improving", acts)

    evidence.insert(0, _levels_text(main, f, by_key.get(main)))
    if main != lname:
        evidence.insert(1, _levels_text(lname, lf, by_key.get(lname)))
    if state in FINAL_STATES and _plateaued(f):
        evidence.append(f"{main} converged: the last {int(PLATEAU_WINDOW * 100)}% of the "
                        "run gained little")
    confident("low" if few else "medium" if f["points"] < 3 * MIN_POINTS else "high", main,
              f"{lname} gained {100 * lf['improvement_share']:.0f}% of its start level, no "
              "spike, no rise after its best")
    acts = []
    if job_id and state not in FINAL_STATES:
        acts.append(action("wait_for_job", "keep watching until it ends or an event "
                           "arrives", job_id=job_id, timeout_s=600))
    else:
        acts.append(action("list_checkpoints", "see what the run saved", run_id=run_id))
        acts.append(action("get_best_checkpoint", "pick the checkpoint to keep",
                           run_id=run_id))
    return result("healthy", f"run {run_id} is learning as expected" if state not in
                  FINAL_STATES else f"run {run_id} trained as expected", acts)


def _back_below(k, event):
    """The first logged step after a LOSS_DIVERGED event's step at which its key is back
    under the level the rule calls diverged (diverge_ratio x its first values), or None."""
    data = (event or {}).get("data") or {}
    first, step = data.get("first_level"), event.get("step")
    if not k or first is None or step is None:
        return None
    limit = rules.DEFAULTS["diverge_ratio"] * first
    for s, v in k.get("points") or ():
        if s > step and math.isfinite(num(v)) and num(v) <= limit:
            return s
    return None


def _stall(run, keys, now_ms):
    last_ts, count = None, 0
    for k in keys:
        ts = (k.get("latest") or {}).get("ts")
        if ts is not None and not _is_system(k["key"]):
            last_ts = ts if last_ts is None else max(last_ts, ts)
            count = max(count, k.get("count") or 0)
    started = run.get("started_at") or run.get("created_at")
    if started is None:
        return None
    if last_ts is None:
        idle_s = (now_ms - started) / 1000
        return (f"no metric point in the {idle_s:.0f} s since the run started"
                if idle_s > 2 * STALL_MIN_S else None)
    interval_s = (last_ts - started) / 1000 / max(1, count - 1)
    idle_s = (now_ms - last_ts) / 1000
    limit = max(STALL_MIN_S, STALL_INTERVALS * interval_s)
    if idle_s > limit:
        return (f"no metric point for {idle_s:.0f} s; the run usually reports every "
                f"{interval_s:.1f} s (limit {limit:.0f} s)")
    return None


def _fix_actions(run, job_id, advice):
    acts = []
    if job_id and run.get("state") not in FINAL_STATES:
        acts.append(action("cancel_job", "stop wasting the GPU on a run that diverged",
                           job_id=job_id))
    acts.append(action("list_checkpoints", "find the last good checkpoint",
                       run_id=run.get("id")))
    acts += resubmit(run.get("job"), f"{advice}: change the command before submitting")
    return acts


def _levels_text(name, f, k):
    """The curve in numbers, each said for what it is: logged points (the key's own best
    and latest, the first point when the curve is not downsampled) or smoothed levels."""
    k = k or {}
    downsampled = (k.get("count") or 0) > f["points"]
    first = ("first " + _fmt(f["first"]["value"]) + f" at step {f['first']['step']} "
             + ("(a bucket mean)" if downsampled else "(logged)"))
    best = k.get("best") or {}
    latest = k.get("latest") or {}
    parts = [first]
    if best.get("value") is not None and f["direction"]:
        parts.append(f"best {_fmt(num(best['value']))} at step {best.get('step')} (logged)")
    if latest.get("value") is not None:
        parts.append(f"last {_fmt(num(latest['value']))} at step {latest.get('step')} "
                     "(logged)")
    return (f"{name}: " + ", ".join(parts) + f"; smoothed level {_fmt(f['start_level'])} at "
            f"the start, {_fmt(f['end_level'])} at the end, noise {_fmt(f['noise'])} over "
            f"{f['points']} points")


def _fmt(v):
    if v is None or not math.isfinite(v):
        return str(wire(v))
    return f"{v:.4g}"


def _wire_facts(f):
    if isinstance(f, dict):
        return {k: _wire_facts(v) for k, v in f.items()}
    if isinstance(f, list):
        return [_wire_facts(v) for v in f]
    return wire(f) if isinstance(f, float) else f


# -- compare_runs ----------------------------------------------------------------------------

def compare_runs(runs, keys=None, primary=None):
    """Runs side by side: per metric best / final / step of best for each run, the winner
    by the metric's direction, whether the gap exceeds the runs' own noise; and the config
    keys that differ. `runs`: [{"run": run, "keys": [key data]}]."""
    if len(runs) < 2:
        raise ValueError("compare at least two runs")
    ids = [r["run"]["id"] for r in runs]
    names = {}
    for r in runs:
        for k in r["keys"]:
            if not _is_system(k["key"]):
                names.setdefault(k["key"], k["direction"])
    wanted = [k for k in names if keys is None or k in keys]
    if keys:
        unknown = [k for k in keys if k not in names]
        if unknown:
            raise ValueError(f"no run has the metric(s) {', '.join(unknown)}; "
                             f"they have: {', '.join(sorted(names)) or 'none'}")
    metrics_out = []
    for name in sorted(wanted):
        d = names[name]
        per_run = []
        for r in runs:
            k = next((x for x in r["keys"] if x["key"] == name), None)
            if k is None:
                continue
            f = curve_facts(k.get("points") or [], d)
            best = k.get("best") or {}
            latest = k.get("latest") or {}
            per_run.append({
                "run_id": r["run"]["id"],
                "best": wire(num(best.get("value"))) if best else
                (f["best"]["value"] if f and f["best"] else None),
                "best_step": best.get("step") if best else
                (f["best"]["step"] if f and f["best"] else None),
                "final": wire(num(latest.get("value"))) if latest else None,
                "final_step": latest.get("step"),
                "noise": f["noise"] if f else None,
                "points": k.get("count") or (f and f["points"]) or 0,
            })
        metrics_out.append(_judge_metric(name, d, per_run))
    primary_key = pick_primary([{"key": k, "direction": d} for k, d in names.items()],
                               primary)
    top = next((m for m in metrics_out if m["key"] == primary_key), None)
    diff = config_diff([r["run"] for r in runs])
    acts = []
    if top and top["winner"] is not None:
        acts.append(action("get_best_checkpoint", f"the best checkpoint of the winning "
                           f"run by {primary_key}", run_id=top["winner"]))
        acts.append(action("diagnose_run", "check the winner's curve is healthy",
                           run_id=top["winner"]))
        if not top["significant"]:
            winner = next((r["run"] for r in runs if r["run"]["id"] == top["winner"]), {})
            acts += resubmit(winner.get("job"), "the gap is within noise: repeat the runs "
                             "with other seeds (change the seed) before trusting it")
    return {"run_ids": ids, "primary_key": primary_key,
            "winner": top["winner"] if top else None,
            "significant": top["significant"] if top else False,
            "summary": _compare_summary(top, diff),
            "metrics": metrics_out, "config_diff": diff, "next_actions": acts}


def _judge_metric(name, d, per_run):
    ranked = [p for p in per_run if p["best"] is not None and math.isfinite(num(p["best"]))]
    ranked.sort(key=lambda p: num(p["best"]) if d == "min" else -num(p["best"]))
    out = {"key": name, "direction": d, "runs": per_run, "winner": None, "runner_up": None,
           "margin": None, "noise": None, "significant": False}
    if not ranked or d is None:       # unknown direction: no run is better (vocab.py)
        return out
    out["winner"] = ranked[0]["run_id"]
    if len(ranked) > 1:
        a, b = ranked[0], ranked[1]
        out["runner_up"] = b["run_id"]
        out["margin"] = abs(num(a["best"]) - num(b["best"]))
        nz = math.sqrt((a["noise"] or 0) ** 2 + (b["noise"] or 0) ** 2)
        out["noise"] = nz
        out["significant"] = out["margin"] > SIGNIFICANT_SIGMAS * nz
    return out


def _compare_summary(top, diff):
    if top is None:
        return "the runs share no metric to compare"
    if top["winner"] is None:
        return f"no run has a finite {top['key']}"
    if top["runner_up"] is None:
        return f"only run {top['winner']} has {top['key']}"
    s = (f"run {top['winner']} wins on {top['key']} by {_fmt(top['margin'])} over run "
         f"{top['runner_up']}; " + ("larger than the runs' noise" if top["significant"]
                                    else f"within the runs' noise ({_fmt(top['noise'])})"))
    if diff:
        s += f"; settings that differ: {', '.join(sorted(diff))}"
    return s


def config_diff(runs):
    """{param: {run_id: value}} for the hyperparameters whose values differ between the
    runs (gpuplane/params.py: the command line's flags and the SDK's config; paths and
    bookkeeping flags are not settings)."""
    configs = {r["id"]: params.split(r.get("config") or {})[0] for r in runs}
    keys = set()
    for c in configs.values():
        keys |= set(c)
    out = {}
    for k in sorted(keys):
        vals = {i: c.get(k) for i, c in configs.items()}
        if len({repr(v) for v in vals.values()}) > 1:
            out[k] = {str(i): v for i, v in vals.items()}
    return out


# -- checkpoints -----------------------------------------------------------------------------

def compare_checkpoints(checkpoints, key, direction):
    """Checkpoints ranked by `key`: evaluated ones first (by their evaluation value), then
    those with only a training value at the nearest step; the rest unranked."""
    rows = []
    for c in checkpoints:
        ev = (c.get("evaluation") or {}).get(key)
        tr = (c.get("training") or {}).get(key)
        src, v = None, None
        if ev is not None and math.isfinite(num(ev)):
            src, v = "evaluation", num(ev)
        elif tr is not None and math.isfinite(num(tr)):
            src, v = "training", num(tr)
        rows.append({"checkpoint_id": c["id"], "run_id": c.get("run_id"),
                     "step": c.get("step"), "path": c.get("path"), "value": v,
                     "source": src, "evaluation": c.get("evaluation") or {},
                     "training": c.get("training") or {}})
    sign = 1 if direction == "min" else -1
    order = {"evaluation": 0, "training": 1}
    ranked = sorted((r for r in rows if r["source"]),
                    key=lambda r: (order[r["source"]], sign * r["value"], r["step"] or 0))
    unranked = [r for r in rows if not r["source"]]
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    acts = []
    not_evaluated = [r for r in ranked if r["source"] == "training"][:3]
    for r in not_evaluated:
        acts.append(action("evaluate_checkpoint", f"evaluate it, so the ranking rests on "
                           f"held-out {key} rather than a training value",
                           checkpoint_id=r["checkpoint_id"]))
    if ranked:
        acts.append(action("get_best_checkpoint", "the recommendation with its margin",
                           run_id=ranked[0]["run_id"]))
    return {"key": key, "direction": direction, "ranked": ranked, "unranked": unranked,
            "next_actions": acts}


def get_best_checkpoint(checkpoints, key, direction):
    """The checkpoint to keep by `key`, with the reason, the runner-up and the margin."""
    cmp = compare_checkpoints(checkpoints, key, direction)
    ranked = cmp["ranked"]
    if not ranked:
        reason = (f"no checkpoint has a value of {key}: none is evaluated and none has a "
                  "training value near its step" if checkpoints else "there are no checkpoints")
        return {"key": key, "direction": direction, "checkpoint": None, "runner_up": None,
                "margin": None, "source": None, "reason": reason,
                "next_actions": [action("evaluate_checkpoint", "evaluate it to give it a "
                                        f"value of {key}", checkpoint_id=c["id"])
                                 for c in checkpoints[:3]]}
    best = ranked[0]
    runner = ranked[1] if len(ranked) > 1 and ranked[1]["source"] == best["source"] else None
    margin = abs(best["value"] - runner["value"]) if runner else None
    spread = checkpoint_noise([r for r in ranked if r["source"] == best["source"]])
    significant = (None if spread is None or margin is None
                   else margin > SIGNIFICANCE * math.sqrt(2) * spread)
    word = "lowest" if direction == "min" else "highest"
    reason = (f"checkpoint {best['checkpoint_id']} (run {best['run_id']}, step {best['step']}) "
              f"has the {word} {best['source']} {key}: {_fmt(best['value'])}")
    if runner:
        reason += (f", ahead of checkpoint {runner['checkpoint_id']} "
                   f"({_fmt(runner['value'])}) by {_fmt(margin)}")
        if significant is None:
            reason += (" (whether that is beyond the noise is unknown: it takes two or more "
                       "checkpoints of a run with a value, three in all, to measure it)")
        elif significant:
            reason += f", beyond the noise ({_fmt(spread)} between checkpoints)"
        else:
            reason += (f", within the noise ({_fmt(spread)} between checkpoints): treat them "
                       "as tied")
    else:
        reason += "; it has no runner-up with a comparable value"
    acts = cmp["next_actions"]
    if best["source"] == "training":
        reason += (" — a training value; evaluate the candidates to decide on held-out "
                   "data")
    return {"key": key, "direction": direction, "checkpoint": best, "runner_up": runner,
            "margin": margin, "noise": spread, "significant": significant,
            "source": best["source"], "reason": reason, "ranked": ranked[:10],
            "next_actions": acts}


SIGNIFICANCE = 2.0     # a margin beyond 2 x the noise of the difference of two values


def checkpoint_noise(rows):
    """How much a checkpoint's value moves from one checkpoint of its run to the next,
    pooled over the runs (MAD of the step-to-step differences, as a standard deviation of
    one value); None with fewer than three differences to go by."""
    diffs = []
    by_run = {}
    for r in rows:
        by_run.setdefault(r["run_id"], []).append(r)
    for rs in by_run.values():
        vals = [r["value"] for r in sorted(rs, key=lambda r: r["step"] or 0)]
        diffs += [b - a for a, b in zip(vals, vals[1:])]
    if len(diffs) < 3:
        return None
    med = statistics.median(diffs)
    return statistics.median(abs(d - med) for d in diffs) * 1.4826 / math.sqrt(2)


def nearest_value(points, step):
    """The value of a (step, value) series at the step nearest `step` (None if empty)."""
    best = None
    for s, v in points:
        if best is None or abs(s - step) < abs(best[0] - step):
            best = (s, v)
    return None if best is None else best[1]


# -- explain_failure -------------------------------------------------------------------------

# (kind, pattern, what to try); the first kind found, in this order, names the failure.
FAILURE_PATTERNS = [
    ("CUDA_OOM", re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED"
                            r"|RESOURCE_EXHAUSTED|out of memory", re.I),
     ["halve the batch size (keep the effective batch with gradient accumulation)",
      "use mixed precision (bf16/fp16) or gradient checkpointing",
      "ask for more GPUs or a GPU with more memory"]),
    ("NCCL", re.compile(r"NCCL (error|WARN)|ncclInternalError|ncclSystemError"
                        r"|ProcessGroupNCCL|NCCL_", re.I),
     ["retry: NCCL errors are often a transient peer failure",
      "set NCCL_DEBUG=INFO in the job's env to see which rank failed",
      "check that every rank sees the same CUDA_VISIBLE_DEVICES count"]),
    ("MISSING_MODULE", re.compile(r"ModuleNotFoundError|No module named|ImportError"),
     ["install the missing package into the Python the job runs with",
      "or run the job with the virtual environment's python (an absolute path)"]),
    ("MISSING_FILE", re.compile(r"FileNotFoundError|No such file or directory"
                                r"|can't open file|does not exist", re.I),
     ["check the path: the working dir and relative paths are on the agent's host",
      "submit with an absolute working_dir that exists there"]),
    ("CUDA_ERROR", re.compile(r"CUDA error|device-side assert|cudaError|illegal memory access",
                              re.I),
     ["rerun with CUDA_LAUNCH_BLOCKING=1 in env to find the failing op",
      "a device-side assert is usually an index out of range (labels vs classes)"]),
    ("PERMISSION", re.compile(r"Permission denied|PermissionError", re.I),
     ["make the file or directory readable/writable by the agent's user"]),
    ("KILLED", re.compile(r"\bKilled\b|Segmentation fault|core dumped|SIGKILL|SIGSEGV"
                          r"|killed by signal", re.I),
     ["a kill without a Python error is often the host's OOM killer: use less host "
      "memory (fewer dataloader workers, smaller prefetch)",
      "check the node's memory with get_status"]),
    ("PYTHON_EXCEPTION", re.compile(r"Traceback \(most recent call last\)"),
     ["fix the exception shown; rerun with retry_job once fixed"]),
]

# What to try for the agent's sentences on a job it could not start (agent.py's
# resolve_command), by how the sentence begins.
DISPATCH_TIPS = [
    ("working dir does not exist", "create the directory on the agent's host, or submit "
     "again with a working dir (-d) that exists there"),
    ("working dir must be an absolute path", "submit again with an absolute working dir"),
    ("command not found", "check the program's spelling and that it is installed on the "
     "agent's host, or give its absolute path (e.g. the virtual environment's python)"),
    ("command not executable", "make the file executable (chmod +x) or run it through its "
     "interpreter (python script.py)"),
]

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)|[A-Z]\w+Error)\b"
                       r"(: .*)?$")
_SIGNALS = {9: "SIGKILL", 15: "SIGTERM", 11: "SIGSEGV", 6: "SIGABRT", 2: "SIGINT",
            7: "SIGBUS"}


def explain_failure(job, lines, runs=()):
    """Why a job failed: the failure kind, the relevant log lines, what to try."""
    job_id = job.get("id")
    state = job.get("state")
    kind_platform = job.get("failure_kind")
    exit_code = job.get("exit_code")
    texts = [(ln.get("line_no"), ln.get("text", "")) for ln in lines]
    if state not in ("FAILED", "CANCELLED"):
        acts = [action("wait_for_job", "wait until it ends", job_id=job_id, timeout_s=600)] \
            if state not in ("SUCCEEDED",) else []
        run_id = job.get("run_id")
        if run_id:
            acts.append(action("diagnose_run", "judge the run's curves instead",
                               run_id=run_id))
        return {"job_id": job_id, "state": state, "failure_kind": kind_platform,
                "kind": "NOT_FAILED", "summary": f"job {job_id} is {state}, not failed",
                "exception": None, "lines": [], "suggestions": [], "next_actions": acts}

    reason = states.why_not_succeeded(job)     # what `job show` and `logs` say too
    kind, suggestions, hits = None, [], []
    for name, pat, tips in FAILURE_PATTERNS:
        found = [(no, t) for no, t in texts if pat.search(t)]
        if found:
            kind, suggestions, hits = name, list(tips), found
            break
    exc = None
    tb_start = None
    for i, (no, t) in enumerate(texts):
        if t.startswith("Traceback (most recent call last)"):
            tb_start = i
    for no, t in reversed(texts):
        m = _EXC_LINE.match(t.strip())
        if m:
            exc = t.strip()
            break
    if kind_platform == "OOM" and kind is None:
        kind = "CUDA_OOM"
        suggestions = FAILURE_PATTERNS[0][2]
    if kind is None:
        sig = _signal_of(exit_code)
        if state == "CANCELLED":
            kind, suggestions = "CANCELLED", ["retry_job if it was cancelled by mistake"]
        elif kind_platform == "DISPATCH_FAILED":
            kind = "DISPATCH_FAILED"
            suggestions = [next((tip for start, tip in DISPATCH_TIPS
                                 if (reason or "").startswith(start)),
                                "the agent could not start the command: check working_dir "
                                "and that the program exists on the agent's host")]
        elif kind_platform == "NODE_LOST":
            kind = "NODE_LOST"
            suggestions = ["the agent disconnected; check get_status and retry_job"]
        elif sig:
            kind = "KILLED"
            suggestions = [f"the process was killed by {sig}; if nobody cancelled it, "
                           "suspect the host's OOM killer or a time limit"]
        else:
            kind = "EXIT_CODE"
            suggestions = ["the program exited with an error and no recognised message; "
                           "read the log tail (get_job_logs)"]
    relevant = []
    if tb_start is not None:
        relevant = texts[tb_start:tb_start + 40]
    for h in hits:
        if h not in relevant:
            relevant.append(h)
    relevant = relevant[:60]
    summary = _failure_summary(job_id, kind, exc or reason, exit_code, kind_platform)
    acts = [action("get_job_logs", "read more of the log around the error",
                   job_id=job_id, tail=200)]
    if kind in ("NCCL", "NODE_LOST", "KILLED", "CANCELLED"):
        acts.insert(0, action("retry_job", "these failures are often transient",
                              job_id=job_id))
    else:
        acts += resubmit(job, (suggestions[0] if suggestions else "fix and rerun")
                         + ": change the command before submitting")
    return {"job_id": job_id, "state": state, "failure_kind": kind_platform, "kind": kind,
            "exit_code": exit_code, "summary": summary, "exception": exc,
            "lines": [{"line_no": no, "text": t} for no, t in relevant],
            "suggestions": suggestions, "reason": reason,
            "attempts": len(runs) or job.get("attempt"),
            "next_actions": acts}


def _signal_of(exit_code):
    if exit_code is None:
        return None
    if exit_code < 0:
        return _SIGNALS.get(-exit_code, f"signal {-exit_code}")
    if exit_code > 128 and exit_code - 128 in _SIGNALS:
        return _SIGNALS[exit_code - 128]
    return None


def _failure_summary(job_id, kind, exc, exit_code, kind_platform):
    words = {
        "CUDA_OOM": "ran out of GPU memory",
        "NCCL": "hit an NCCL (multi-GPU communication) error",
        "MISSING_MODULE": "could not import a Python module",
        "MISSING_FILE": "did not find a file it needed",
        "CUDA_ERROR": "hit a CUDA error",
        "PERMISSION": "was refused access to a file",
        "KILLED": "was killed by a signal",
        "PYTHON_EXCEPTION": "raised an exception",
        "CANCELLED": "was cancelled",
        "DISPATCH_FAILED": "could not be started by the agent",
        "NODE_LOST": "lost its node",
        "EXIT_CODE": f"exited with code {exit_code}",
    }
    s = f"job {job_id} {words.get(kind, kind)}"
    if exc:
        s += f": {exc[:300]}"
    return s
