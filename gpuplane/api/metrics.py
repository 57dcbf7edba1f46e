"""Metrics: ingest in the compact wire format, per-run summaries, downsampled series.

Routes (docs/metrics.md):
  POST /runs/<id>/metrics            {"keys": [...], "points": [[key_index, step, value, ts]]}
  GET  /runs/<id>/metrics            per key: count, latest, best, direction, trend
  GET  /runs/<id>/metrics/<key>      one key's series, at most max_points buckets, and
                                     each bucket's time (`ts`, ms) for a wall-clock axis
  GET  /metrics/series?runs=1,2&key= the same key across runs, for comparisons
Non-finite values are answered as the strings "NaN", "Infinity", "-Infinity".
"""
import json
import threading

from flask import Blueprint, Response, current_app, request

from ..auth import requires
from .. import metricwire, series as planner
from ..db import metrics
from ..errors import BadRequest, NotFound
from .validate import parse_json, query_int
from . import current_db
from .runs import writable_run

bp = Blueprint("metrics", __name__, url_prefix="/api/v1")

DEFAULT_POINTS = 1000
MAX_POINTS = 10_000
MAX_RUNS = 50

# One ingest at a time does its CPU work (parse, check, insert). SQLite releases the GIL
# on every row of an executemany; with other threads parsing JSON meanwhile, each row
# would wait for the GIL again (the convoy effect), slowing the insert many times over.
# Writes are serialised by SQLite anyway, so nothing is lost by queueing here.
_ingest_lock = threading.Lock()


def _json(obj, status=200):
    return Response(json.dumps(obj, separators=(",", ":"), allow_nan=False), status=status,
                    mimetype="application/json")


def _store():
    """The app's MetricStore (gpuplane.db.metrics): the ingest path and its caches."""
    return current_app.config["METRICS"]


def _run_or_404(run_id):
    if not _store().run_exists(run_id):
        raise NotFound(f"run {run_id} does not exist; list runs with `gpuplane run list`")


def _key_or_404(run_id, key):
    key_id = metrics.key_id(current_db(), run_id, key)
    if key_id is None:
        names = metrics.key_names(current_db(), run_id)
        shown = ", ".join(names[:50]) + (f" and {len(names) - 50} more" if len(names) > 50 else "")
        raise NotFound(f"run {run_id} has no metric {key!r}; "
                       + (f"its metrics are: {shown}" if names else "it has no metrics yet"))
    return key_id


@bp.post("/runs/<int:run_id>/metrics")
@requires("run")
def ingest(run_id):
    raw = request.get_data(cache=False)
    if not raw:
        raise BadRequest('the body is empty; send {"keys": [...], "points": [[key_index, '
                         'step, value, ts], ...]}')
    writable_run(run_id)
    if request.mimetype == metricwire.BINARY_TYPE:
        # Parsed and made ready (split per key, base buckets) outside the lock: reading
        # the columns takes no GIL-releasing calls, so it overlaps with another request's
        # rows going into SQLite (which releases the GIL) instead of queueing behind them.
        try:
            acc = metricwire.accept_binary(raw)
        except metricwire.BadBatch as e:
            raise BadRequest(str(e)) from None
        acc = _store().limit_keys(run_id, acc)
        batch = metrics.prepare(len(acc.keys), acc.cols)
        with _ingest_lock:
            n = _store().ingest(run_id, acc.keys, batch=batch, refused=acc.refused)
        _all_refused(acc)
        current_app.config["EVENTS"].offer_points(run_id, acc.keys, acc.cols)
        return _answer(n, acc)
    with _ingest_lock:
        data = parse_json(raw)
        if not isinstance(data, dict) or "keys" not in data or "points" not in data:
            raise BadRequest('the body must be an object {"keys": [...], "points": '
                             '[[key_index, step, value, ts], ...]}')
        try:
            acc = _store().limit_keys(run_id, metricwire.accept_batch(data["keys"],
                                                                      data["points"]))
            n = _store().ingest(run_id, acc.keys, cols=acc.cols, refused=acc.refused)
        except metricwire.BadBatch as e:
            raise BadRequest(str(e)) from None
        _all_refused(acc)
    # the event engine (gpuplane/events.py) checks them on its own thread
    current_app.config["EVENTS"].offer_points(run_id, acc.keys, acc.cols)
    return _answer(n, acc)


def _all_refused(acc):
    """A batch of which every point was refused is the client's mistake: a 400 naming the
    reasons (the run's METRIC_POINTS_REFUSED event counts them too). One with good points
    among bad ones stores the good ones (docs/api.md)."""
    if acc.refused.total and not acc.cols[1]:
        raise BadRequest(f"every point of the batch was refused: {acc.refused.sentence()}")


def _answer(n, acc):
    if not acc.refused.total:
        return _json({"accepted": n})
    return _json({"accepted": n, "refused": acc.refused.total,
                  "refusals": acc.refused.as_list()})


@bp.get("/runs/<int:run_id>/metrics")
@requires("read")
def summary(run_id):
    _run_or_404(run_id)
    return _json({"run_id": run_id, "keys": planner.summary(current_db(), run_id)})


def _range_args():
    max_points = query_int("max_points", DEFAULT_POINTS, min=1, max=MAX_POINTS)
    from_step = query_int("from_step", None, min=0)
    to_step = query_int("to_step", None, min=0)
    if from_step is not None and to_step is not None and from_step > to_step:
        raise BadRequest("'from_step' must not be greater than 'to_step'")
    return max_points, from_step, to_step


@bp.get("/runs/<int:run_id>/metrics/<path:key>")
@requires("read")
def series(run_id, key):
    max_points, from_step, to_step = _range_args()
    _run_or_404(run_id)
    key_id = _key_or_404(run_id, key)
    level, points = planner.series(current_db(), key_id, max_points, from_step, to_step)
    return _json({"key": key, "run_id": run_id, "level": level,
                  "points": metricwire.encode_points(points), "ts": [p[6] for p in points]})


@bp.get("/metrics/series")
@requires("read")
def multi_series():
    raw_runs = request.args.get("runs", "")
    key = request.args.get("key")
    if not key:
        raise BadRequest("'key' is required, e.g. ?runs=1,2&key=train/loss")
    try:
        run_ids = [int(r) for r in raw_runs.split(",") if r.strip()]
    except ValueError:
        raise BadRequest(f"'runs' must be run ids separated by commas, e.g. runs=1,2,3; "
                         f"got {raw_runs[:60]!r}") from None
    if not run_ids:
        raise BadRequest("'runs' is required: run ids separated by commas, e.g. runs=1,2,3")
    if len(run_ids) > MAX_RUNS:
        raise BadRequest(f"'runs' lists {len(run_ids)} runs; compare at most {MAX_RUNS}")
    max_points, from_step, to_step = _range_args()
    out, missing = [], []
    for run_id in dict.fromkeys(run_ids):
        _run_or_404(run_id)
        key_id = metrics.key_id(current_db(), run_id, key)
        if key_id is None:
            missing.append(run_id)
            out.append({"run_id": run_id, "level": None, "points": [], "ts": [], "missing": True})
            continue
        level, points = planner.series(current_db(), key_id, max_points, from_step, to_step)
        out.append({"run_id": run_id, "level": level, "points": metricwire.encode_points(points),
                    "ts": [p[6] for p in points]})
    if len(missing) == len(out):
        _key_or_404(out[0]["run_id"], key)
    return _json({"key": key, "series": out})
