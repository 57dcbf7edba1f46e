"""Deciding from runs: the recommended checkpoint, run comparisons, an experiment's
leaderboard. Each function reads through gpuplane.db and returns a plain dict that the
REST routes answer as is (docs/checkpoints.md)."""
import heapq

from . import metricwire, semantic, series as planner, vocab
from .db import checkpoints, metric_defs, metrics, runs


TOP = 12      # candidates of each kind handed to the ranking


def _encode(v):
    return metricwire.encode(v) if v is not None else None


def resolve_metric(db, key, project, experiment, keys_of_scope=None):
    """(key, direction, {"key", "direction", "primary_from", "direction_from"}).
    keys_of_scope: the scope's (key, count) rows, or a callable giving them (called only
    when no primary metric is defined), for a guess by name."""
    primary_from = "request"
    if key is None:
        key, primary_from = metric_defs.resolve_primary(db, project or "", experiment or "")
        if key is None:
            if callable(keys_of_scope):
                keys_of_scope = keys_of_scope()
            keys = [{"key": k} for k, _ in (keys_of_scope or [])]
            key, primary_from = semantic.pick_primary(keys), "guess"
    if key is None:
        return None, None, {"key": None}
    d, d_from = metric_defs.resolve_direction(db, key, project or "", experiment or "")
    return key, d, {"key": key, "direction": d, "primary_from": primary_from,
                    "direction_from": d_from}


def unknown_direction(key):
    return (f"the direction of {key} is unknown: its name says neither lower nor higher is "
            f"better and no metric definition gives one; define it with `gpuplane metric "
            f"set {key} --direction min` (or max), or pick a key whose name says")


def recommend(db, *, run_id=None, project=None, experiment=None, key=None, sweep=None):
    """The checkpoint to keep in a scope (one run, an experiment, a project) by the primary
    metric: evaluated checkpoints first (their last successful evaluation's result), then
    the training value at the nearest step. The ranking, reason, runner-up and margin are
    semantic.get_best_checkpoint's; this adds the metric's resolution and the counts."""
    scope = {"run_id": run_id, "project": project, "experiment": experiment}
    if sweep is not None:
        # A sweep's trials: its own metric and direction when it names them (the
        # experiment's primary metric otherwise, as for any experiment).
        project, experiment = sweep["project"], sweep["experiment"]
        scope = {"sweep_id": sweep["id"], "project": project, "experiment": experiment}
        key = key or sweep["spec"].get("metric")
        q = {"sweep_id": sweep["id"]}
    elif run_id is not None:
        run = runs.get(db, run_id)
        project, experiment = run["project"], run["experiment"]
        q = {"run_id": run_id}
    else:
        q = {"project": project, "experiment": experiment}
    # no primary metric defined: guess from what the evaluations logged, else the trainings
    key, d, metric = resolve_metric(
        db, key, project, experiment,
        keys_of_scope=lambda: checkpoints.evaluated_keys(db, project, experiment)
        or checkpoints.scope_keys(db, **q))
    if sweep is not None and key is not None and key == sweep["spec"].get("metric") \
            and sweep["spec"].get("direction"):
        d = metric["direction"] = sweep["spec"]["direction"]
        metric["direction_from"] = "sweep"
    if key is None:
        return {"scope": scope, "metric": metric, "key": None, "direction": None,
                "checkpoint": None, "runner_up": None, "margin": None, "source": None,
                "candidates": 0, "evaluated": 0,
                "reason": "no checkpoint in this scope belongs to a run with metrics; "
                          "register checkpoints (run.log_checkpoint, job submit --watch) and "
                          "log metrics first",
                "next_actions": []}
    if d is None:
        return {"scope": scope, "metric": metric, "key": key, "direction": None,
                "checkpoint": None, "runner_up": None, "margin": None, "source": None,
                "candidates": 0, "evaluated": 0,
                "reason": unknown_direction(key), "next_actions": []}
    cands = checkpoints.candidates(db, key, **q)
    # semantic.get_best_checkpoint ranks evaluated checkpoints first, then training
    # values, each by value, and looks at the top few of each kind (its `ranked` holds
    # 10); handing it those alone gives the same answer as handing it thousands.
    sign = 1 if d == "min" else -1
    evaluated = heapq.nsmallest(TOP, (c for c in cands if c["evaluation"] is not None),
                                key=lambda c: (sign * c["evaluation"], c["step"] or 0))
    trained = heapq.nsmallest(TOP, (c for c in cands if c["evaluation"] is None
                                    and c["training"] is not None),
                              key=lambda c: (sign * c["training"], c["step"] or 0))
    chosen = evaluated[:TOP] + trained[:TOP] or cands[:3]
    where = checkpoints.paths(db, [c["id"] for c in chosen])
    rows = [{"id": c["id"], "run_id": c["run_id"], "step": c["step"],
             "path": where.get(c["id"], (None, None))[0],
             "evaluation": {key: c["evaluation"]} if c["evaluation"] is not None else {},
             "training": {key: c["training"]} if c["training"] is not None else {}}
            for c in chosen]
    best = semantic.get_best_checkpoint(rows, key, d)
    for pick in (best.get("checkpoint"), best.get("runner_up")):
        if pick and pick["source"] == "evaluation":
            # every result of the deciding evaluation, not only the ranking metric's
            results = checkpoints.latest_results(db, pick["checkpoint_id"]) or {}
            pick["evaluation"] = {k: _encode(v) for k, v in results.items()}
    best.update(scope=scope, metric=metric, candidates=len(cands),
                evaluated=sum(1 for c in cands if c["evaluation"] is not None))
    best["next_actions"], hint = _workable(db, best.get("next_actions") or [], key,
                                           project, experiment, sweep, scope)
    if hint:
        best["reason"] = f"{best['reason']}; {hint}" if best.get("reason") else hint
    if metric["primary_from"] == "guess":
        best["next_actions"] = list(best.get("next_actions") or []) + [semantic.action(
            "set_primary_metric", "no primary metric is defined for this scope; "
            f"{key} was picked by its name", key=key, project=project or "",
            experiment=experiment or "")]
    return best


def _scope_arguments(scope):
    """get_best_checkpoint's arguments for the same scope: the sweep, else the run, else
    the project and experiment."""
    for one in ("sweep_id", "run_id"):
        if scope.get(one) is not None:
            return {one: scope[one]}
    return {k: scope[k] for k in ("project", "experiment") if scope.get(k)}


def _workable(db, acts, key, project, experiment, sweep=None, scope=None):
    """(the recommendation's next actions, a sentence or None): each action one that can
    work as given — never the same question again; no evaluation of a checkpoint already
    evaluated; an evaluation only where the training job has a command for it (where it
    has none, the sentence says how to give one, on the call or on the sweep or job); and
    where the scope's evaluations log another metric than `key`, the same recommendation
    ranked by that metric (the one of the same base, eval/loss for val/loss, if any)."""
    acts = [a for a in acts if a["tool"] != "get_best_checkpoint"]
    logged = [k for k, _ in checkpoints.evaluated_keys(db, project or "", experiment)]
    out = []
    if logged and key not in logged:
        alt = next((k for k in logged if vocab.base(k) == vocab.base(key)),
                   next((k for k in logged if vocab.is_loss(k) == vocab.is_loss(key)),
                        logged[0]))
        out.append(semantic.action(
            "get_best_checkpoint", f"the evaluations here log {', '.join(logged[:4])}, not "
            f"{key}: rank by what they measured", key=alt,
            **_scope_arguments(scope or {})))
    ids = [a["arguments"]["checkpoint_id"] for a in acts if a["tool"] == "evaluate_checkpoint"]
    commands = checkpoints.eval_commands(db, ids) if ids else {}
    lacking = []
    for a in acts:
        if a["tool"] == "evaluate_checkpoint":
            cid = a["arguments"]["checkpoint_id"]
            if checkpoints.latest_results(db, cid) is not None:
                continue            # evaluated already (by another metric than key)
            if not commands.get(cid):
                lacking.append(cid)     # a call without a command would be refused
                continue
        out.append(a)
    hint = None
    if lacking:
        where = ("create the sweep with an evaluation command (`gpuplane sweep create ... "
                 "--eval-command 'python eval.py'`)" if sweep is not None else
                 "submit the training job with one (`--eval-command 'python eval.py'`)")
        hint = (f"to rank on held-out data, evaluate checkpoint(s) "
                f"{', '.join(map(str, lacking))}: their jobs have no evaluation command, so "
                f"give it with the evaluation (`gpuplane ckpt evaluate {lacking[0]} -- "
                f"python eval.py`), or {where}")
    return out, hint


def overlay(db, run_ids, key, max_points=500):
    """One metric of several runs cut into the same step buckets, for overlaid curves."""
    w, steps, series = planner.aligned_series(
        db, {r: metrics.key_id(db, r, key) for r in run_ids}, max_points)
    return {"key": key, "width": w, "steps": steps,
            "runs": [{"run_id": rid,
                      "min": [p and _encode(p[0]) for p in pts],
                      "max": [p and _encode(p[1]) for p in pts],
                      "mean": [p and _encode(p[2]) for p in pts],
                      "last": [p and _encode(p[3]) for p in pts]}
                     for rid, pts in series.items()]}


def _best_evaluated(db, key, d, project, experiment):
    """{run_id: {"value", "checkpoint_id", "step"}}: each run's best evaluation result of
    `key` among its checkpoints, by direction d."""
    sign = 1 if d == "min" else -1
    evaluated = {}
    for c in checkpoints.candidates(db, key, project=project, experiment=experiment):
        v = c["evaluation"]
        if v is not None and v == v:
            old = evaluated.get(c["run_id"])
            if old is None or sign * v < sign * old["value"]:
                evaluated[c["run_id"]] = {"value": v, "checkpoint_id": c["id"],
                                          "step": c["step"]}
    return evaluated


def with_best_evaluation(db, rs, key=None):
    """The runs, each TRAIN run with `best_evaluation`: {"key", "value", "checkpoint_id",
    "step"} of its best evaluated checkpoint by `key` (else its scope's primary metric,
    else a guess from the evaluations' keys), or None when none was evaluated."""
    scopes = {}
    for r in rs:
        if r.get("kind", "TRAIN") == "TRAIN":
            scopes.setdefault((r["project"], r["experiment"]), []).append(r["id"])
    best = {}
    for (project, experiment), ids in scopes.items():
        k, d, _ = resolve_metric(db, key, project, experiment, keys_of_scope=lambda p=project,
                                 e=experiment: checkpoints.evaluated_keys(db, p, e))
        d = d or (k and semantic.direction(k))
        if k is None or d is None:      # no metric, or one whose direction is unknown
            continue
        for run_id, v in _best_evaluated(db, k, d, project, experiment or None).items():
            best[run_id] = {"key": k, "direction": d, **v,
                            "value": metricwire.encode(v["value"])}
    return [dict(r, best_evaluation=best.get(r["id"])) if r.get("kind", "TRAIN") == "TRAIN"
            else r for r in rs]


def leaderboard(db, project, experiment, key=None, limit=200):
    """The runs of an experiment, best first by the primary metric: a run's value is the
    best evaluation result among its checkpoints when it has one (as in recommend), else
    the best value it logged; runs with neither come last. EVALUATE runs are left out."""
    rs = runs.list_runs(db, project=project, experiment=experiment, limit=limit, kind="TRAIN")
    def keys():
        return [(k, 1) for k in sorted({k for r in rs for k in metrics.key_names(db, r["id"])
                                        if not vocab.is_system(k)})]
    key, d, metric = resolve_metric(db, key, project, experiment, keys_of_scope=keys)
    if key is None:
        return {"project": project, "experiment": experiment, "metric": metric,
                "runs": [{**r, "best": None, "best_evaluated": None} for r in rs]}
    if d is None:        # unknown direction: no run is better than another (vocab.py)
        return {"project": project, "experiment": experiment, "metric": metric,
                "reason": unknown_direction(key),
                "runs": [{**r, "best": None, "best_evaluated": None} for r in rs]}
    sign = 1 if d == "min" else -1
    evaluated = _best_evaluated(db, key, d, project, experiment)
    rows = []
    for r in rs:
        kid = metrics.key_id(db, r["id"], key)
        best = planner.key_summary(db, kid, key, d)["best"] if kid else None
        rows.append({**r, "best": best, "best_evaluated": evaluated.get(r["id"])})

    def order(row):
        if row["best_evaluated"]:
            return (0, sign * row["best_evaluated"]["value"], row["id"])
        v = row["best"]["value"] if row["best"] else None
        if isinstance(v, (int, float)):
            return (1, sign * v, row["id"])
        return (2, 0, row["id"])
    rows.sort(key=order)
    return {"project": project, "experiment": experiment, "metric": metric, "runs": rows}
