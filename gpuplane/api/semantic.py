"""The semantic layer over REST: diagnosis, comparisons, failure explanations.

  GET /runs/<id>/diagnosis?key=           diagnose_run (key: the metric that decides)
  GET /runs:compare?ids=1,2&keys=a,b      compare_runs (&key=K adds K's aligned overlay series)
  GET /jobs/<id>/explanation              explain_failure
  GET /checkpoints:compare?runs=1,2&key=  compare_checkpoints, with the recommendation
The work is in gpuplane/semantic.py (pure functions) on data from gpuplane/db/semantic.py.
"""
import json
import math

from flask import Blueprint, Response, request

from .. import recommend, semantic
from ..auth import requires
from ..db import now_ms, semantic as load
from ..errors import BadRequest, NotFound
from .validate import query_int
from . import current_db

bp = Blueprint("semantic", __name__, url_prefix="/api/v1")

MAX_COMPARE = 20


def _json(obj):
    return Response(json.dumps(_clean(obj), separators=(",", ":"), allow_nan=False),
                    mimetype="application/json")


def _clean(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return semantic.wire(obj)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _ids(name, example, required=True):
    raw = request.args.get(name, "")
    try:
        ids = list(dict.fromkeys(int(x) for x in raw.split(",") if x.strip()))
    except ValueError:
        raise BadRequest(f"'{name}' must be ids separated by commas, e.g. {name}={example}; "
                         f"got {raw[:60]!r}") from None
    if required and not ids:
        raise BadRequest(f"'{name}' is required: ids separated by commas, e.g. {name}={example}")
    if len(ids) > MAX_COMPARE:
        raise BadRequest(f"'{name}' lists {len(ids)} ids; compare at most {MAX_COMPARE}")
    return ids


def _bundle(run_id):
    b = load.run_bundle(current_db(), run_id)
    if b is None:
        raise NotFound(f"run {run_id} does not exist; list runs with `gpuplane run list`")
    return b


@bp.get("/runs/<int:run_id>/diagnosis")
@requires("read")
def diagnosis(run_id):
    b = _bundle(run_id)
    key = request.args.get("key") or None
    if key and not any(k["key"] == key for k in b["keys"]):
        names = ", ".join(k["key"] for k in b["keys"]) or "none yet"
        raise BadRequest(f"run {run_id} has no metric {key!r}; its metrics: {names}")
    if key and not next(k for k in b["keys"] if k["key"] == key)["direction"]:
        raise BadRequest(recommend.unknown_direction(key))
    return _json(semantic.diagnose_run(b["run"], b["keys"],
                                       load.run_events(current_db(), run_id),
                                       now_ms=now_ms(), primary=key))


@bp.get("/runs:compare")
@requires("read")
def compare_runs():
    ids = _ids("ids", "3,4")
    if len(ids) < 2:
        raise BadRequest("'ids' needs at least two different runs to compare")
    keys = [k for k in request.args.get("keys", "").split(",") if k.strip()] or None
    bundles = [_bundle(i) for i in ids]
    try:
        result = semantic.compare_runs(bundles, keys=keys, primary=request.args.get("key"))
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if request.args.get("key"):
        # the key's curves cut into the same step buckets, for an overlay
        result["series"] = recommend.overlay(
            current_db(), ids, request.args["key"],
            query_int("max_points", 500, min=2, max=10_000))
    return _json(result)


@bp.get("/jobs/<int:job_id>/explanation")
@requires("read")
def explanation(job_id):
    job, lines, runs = load.job_with_logs(current_db(), job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist; list jobs with `gpuplane job list`")
    return _json(semantic.explain_failure(job, lines, runs))


@bp.get("/checkpoints:compare")
@requires("read")
def compare_checkpoints():
    run_ids = _ids("runs", "3,4")
    bundles = [_bundle(i) for i in run_ids]
    names = sorted({k["key"] for b in bundles for k in b["keys"]})
    first = bundles[0]["run"]
    # The key given, else the scope's primary metric definition, else a guess by name;
    # the direction from the metric definitions (docs/checkpoints.md).
    # With no primary metric, the guess is among the keys the evaluations logged (the
    # metric actually evaluated), else the runs' own.
    evaluated = sorted({k for c in load.checkpoints(current_db(), run_ids, [])
                        for k in (c["evaluation"] or {})})
    key, direction, metric = recommend.resolve_metric(
        current_db(), request.args.get("key") or None, first["project"], first["experiment"],
        keys_of_scope=[(n, 1) for n in evaluated or names])
    cks = load.checkpoints(current_db(), run_ids, [key] if key else [])
    if key and key not in names and not any(key in (c["evaluation"] or {}) for c in cks):
        raise BadRequest(f"no run among {run_ids} has the metric {key!r}, and no evaluation "
                         f"of their checkpoints does; the runs have: "
                         f"{', '.join(names) or 'no metrics yet'}")
    if key and direction is None:
        raise BadRequest(recommend.unknown_direction(key))
    result = semantic.compare_checkpoints(cks, key, direction)
    best = semantic.get_best_checkpoint(cks, key, direction)
    result["recommendation"] = {k: best.get(k) for k in
                                ("checkpoint", "runner_up", "margin", "noise", "significant",
                                 "source", "reason")}
    result["metric"] = metric
    return _json(result)
