"""Reading metrics: the series query planner and per-key summaries.

A series is answered from the rollup levels up to the key's rolled step and from raw
points after it, at the coarsest level that still gives enough buckets, so a query never
lags the ingest and costs about the same whatever the run's length. The SQL is in
gpuplane/db/metrics.py; what a key means (role, direction) is gpuplane/vocab.py's, the
trend gpuplane/semantic.py's.
"""

from . import semantic, vocab
from .db import metric_defs, metrics as store, runs as run_store
from .db.metrics import BASE, LEVELS
from .metricwire import MAX_STEP, encode

def series(db, key_id, max_points=1000, from_step=None, to_step=None):
    """A downsampled series: (level, [(first_step, min, max, mean, last, count, ts), ...]).

    `ts` is the earliest time (ms) of the bucket's points, its place on a wall-clock axis
    (None for a bucket whose raw points were pruned before rollups kept a time).

    At most `max_points` buckets. The level (bucket width in steps, 1 = raw) is the
    coarsest stored level that still gives >= max_points/2 buckets in the range; when it
    gives more than max_points, neighbouring buckets are merged. Rollups are read up to
    the key's rolled step and raw points after it, so a query never lags the ingest.
    """
    with db.read() as conn:
        rolled, top, pruned = store.read_state(conn, key_id)
        span = store.span(conn, key_id, pruned)
        if span is None:
            return 1, []
        lo = max(span[0], from_step or 0)
        hi = min(span[1], MAX_STEP if to_step is None else to_step)
        if lo > hi:
            return 1, []
        target = max(1, max_points // 2)
        tail_from = max(lo, rolled + 1)
        tail_count = None
        chosen = None
        for w in reversed([w for w in LEVELS if w <= top]):
            complete = (rolled + 1) // w          # buckets below this are whole in the rollup
            n = store.count_level(conn, key_id, w, lo // w, min(hi // w, complete - 1))
            if tail_from <= hi:
                if tail_count is None:
                    tail_count = store.count_raw(conn, key_id, tail_from, hi)
                n += min(tail_count + 1, hi // w - max(lo, complete * w) // w + 1)
            if n >= target:
                chosen = w
                break
        if chosen is None:
            if top and pruned >= lo:
                chosen = BASE              # raw is gone there: the finest stored level
            else:
                # Raw covers the range: widths below the base level, or no rollups yet, are
                # grouped from raw on the fly (with rollups present, at most 8 * max_points).
                n = store.count_raw(conn, key_id, lo, hi)
                chosen = 1 if n <= 2 * max_points else next(
                    (w for w in [4, *LEVELS] if (hi // w - lo // w + 1) <= 2 * max_points),
                    LEVELS[-1])
        w = chosen
        if w >= BASE and top:
            rows = _rows_at(conn, key_id, w, lo, hi, rolled, top)
        else:
            rows = store.agg_raw(conn, key_id, w, lo, hi)
        return _merge(rows, w, max_points)


def _rows_at(conn, key_id, w, lo, hi, rolled, top):
    """Buckets of width w over [lo, hi]: whole ones from level w; the one holding the
    rolled step from whole buckets of finer levels; then raw points past the finest."""
    complete = (rolled + 1) // w if top else 0
    rows = store.level_rows(conn, key_id, w, lo // w, min(hi // w, complete - 1))
    covered = complete * w
    pieces = []
    for w2 in reversed([x for x in LEVELS if x < w and top]):
        c2 = (rolled + 1) // w2
        pieces += store.level_rows(conn, key_id, w2, max(covered, lo) // w2, min(hi // w2, c2 - 1))
        covered = max(covered, c2 * w2)
    pieces += store.agg_raw(conn, key_id, w, max(lo, covered), hi)
    # the pieces start past the last whole bucket of level w
    return rows + _fold_to(pieces, w)


def _merge(rows, w, max_points):
    """Rows (bucket, first, last, min, max, sum, count, vcount, last_value, first_ts) -> at
    most max_points output points, merging aligned groups of f neighbouring buckets."""
    f = max(1, -(-len(rows) // max_points))
    while f > 1 and len({r[0] // f for r in rows}) > max_points:
        f += 1
    if f == 1:
        return w, [(fs, mn, mx, _mean(sm, nv), last, n, ts)
                   for b, fs, ls, mn, mx, sm, n, nv, last, ts in rows]
    merged = []
    for r in rows:
        r = (r[0] // f, *r[1:])
        if merged and merged[-1][0] == r[0]:
            merged[-1] = store.merge_rows(merged[-1], r)
        else:
            merged.append(r)
    return w * f, [(fs, mn, mx, _mean(sm, nv), last, n, ts)
                   for b, fs, ls, mn, mx, sm, n, nv, last, ts in merged]


def _mean(sm, nv):
    if sm is None or not nv:
        return None
    return sm / nv


# -- summaries --------------------------------------------------------------------------

def _cover(conn, key_id, rolled, top):
    """The whole key as few pieces as possible: whole buckets of the coarsest levels that
    fit below the rolled step, then raw points after. Yields (width, row)."""
    covered = 0
    for w in reversed([w for w in LEVELS if w <= top]):
        complete = (rolled + 1) // w
        for row in store.level_rows(conn, key_id, w, covered // w, complete - 1):
            yield w, row
        covered = max(covered, complete * w)
    for row in store.agg_raw(conn, key_id, 1, covered, MAX_STEP):
        yield 1, row


def summary(db, run_id):
    """Per key: count, latest, best (by direction), trend, first and last step, and what
    the vocabulary says of it (role, loss_like, direction and where it came from). The
    direction: the run's metric definitions first, then the key's name."""
    run = run_store.get(db, run_id)
    defined = metric_defs.defined_directions(db, run["project"] or "",
                                             run["experiment"] or "") if run else {}
    with db.read() as conn:
        out = []
        for key_id, key in store.keys_of_run(conn, run_id):
            out.append(key_summary(db, key_id, key, defined.get(key)))
        # The agent's TensorBoard tail names a curve tb/<tag>; when the SDK logs the same
        # curve as <tag>, both arrive. The SDK's is kept (the script's own values, at its
        # own steps); the TensorBoard copy says so and readers show it once.
        names = {k["key"] for k in out}
        for k in out:
            if k["key"].startswith("tb/") and k["key"][3:] in names:
                k["duplicate_of"] = k["key"][3:]
        return out


def key_summary(db, key_id, key, d=None):
    """One key's summary; `d` ('min' | 'max', a metric definition's) wins over the
    direction read from its name. A key of unknown direction (a counter, a schedule, a
    name that says nothing) is not judged: no best, no trend."""
    meaning = vocab.describe(key, d)
    d = meaning["direction"]
    judged = d is not None
    with db.read() as conn:
        rolled, top, pruned = store.read_state(conn, key_id)
        count, first, last_step = 0, None, None
        best = None          # (value, width, row)
        for w, row in _cover(conn, key_id, rolled, top):
            b, fs, ls, mn, mx, sm, n, nv, lv, _ = row
            count += n
            first = fs if first is None else min(first, fs)
            last_step = ls if last_step is None else max(last_step, ls)
            v = None if not judged else mn if d == "min" else mx
            if v is not None and (best is None or (v < best[0] if d == "min" else v > best[0])):
                best = (v, w, row)
        latest = store.latest_point(conn, key_id)
        if latest is not None and last_step is not None and latest[0] < last_step:
            latest = None
        if latest is None and last_step is not None:
            # The newest raw point was pruned: the last base bucket still knows it.
            r = store.last_base_bucket(conn, key_id)
            latest = (r[0], r[1], None) if r else None
        return {
            "key": key,
            "count": count,
            "latest": None if latest is None else
            {"step": latest[0], "value": encode(latest[1]), "ts": latest[2]},
            "best": None if best is None or not judged else
            {"step": _best_step(conn, key_id, d, best), "value": encode(best[0])},
            "direction": d,
            "trend": semantic.trend(series(db, key_id, max_points=200)[1], d) if judged else None,
            "judged": judged,
            **{k: meaning[k] for k in ("role", "loss_like", "counter", "direction_from")},
            "first_step": first,
            "last_step": last_step,
        }


def _best_step(conn, key_id, d, best):
    """Walk down from the bucket holding the best value to the step that has it."""
    value, w, row = best
    bucket = row[0]
    while w > BASE:
        w //= 4
        child = store.best_child_bucket(conn, key_id, w, bucket, d)
        if child is None:
            return row[1]
        bucket = child
    if w == 1:
        return row[1]
    step = store.best_raw_step(conn, key_id, bucket, d)
    if step is not None:
        return step
    first = store.base_first_step(conn, key_id, bucket)
    return first if first is not None else row[1]


# -- several runs aligned (overlays) ---------------------------------------------------
# Aligned series of one metric over several runs, for overlays.
# 
# Every run is cut into the same step buckets (width w, bucket = step // w), so the i-th
# point of each run covers the same steps. w is the smallest of 1, 4, 16, 64, ... that gives
# at most max_points buckets over the union of the runs' step ranges; whole rollup buckets
# are read where they exist, as series() does for one run.

WIDTHS = [1, 4, *LEVELS]


def _fold_to(rows, w):
    """Rollup-shaped rows of a finer width, folded into buckets of width w."""
    out = []
    for r in rows:
        r = (r[1] // w, *r[1:])
        if out and out[-1][0] == r[0]:
            out[-1] = store.merge_rows(out[-1], r)
        else:
            out.append(r)
    return out


def aligned_series(db, key_ids, max_points=500):
    """key_ids: {name: key_id or None}. Returns (width, steps, {name: [(min, max, mean,
    last, count) or None per step]})."""
    with db.read() as conn:
        states, spans = {}, {}
        for name, kid in key_ids.items():
            if kid is None:
                continue
            states[name] = store.rollup_state(conn, kid)
            span = store.span(conn, kid, states[name][2])
            if span is not None:
                spans[name] = span
        if not spans:
            return 1, [], {name: [] for name in key_ids}
        lo = min(s[0] for s in spans.values())
        hi = max(s[1] for s in spans.values())
        w = next((w for w in WIDTHS if hi // w - lo // w + 1 <= max_points), WIDTHS[-1])
        per = {}
        for name, kid in key_ids.items():
            if name not in spans:
                per[name] = {}
                continue
            rolled, top, _ = states[name]
            if w >= BASE and top >= BASE:
                base = min(w, top)
                rows = _fold_to(_rows_at(conn, kid, base, lo, hi, rolled, top), w)
            else:
                rows = store.agg_raw(conn, kid, w, lo, hi)
            per[name] = {r[1] // w: (r[3], r[4], _mean(r[5], r[7]), r[8], r[6]) for r in rows}
        buckets = sorted({b for d in per.values() for b in d})
        steps = [b * w for b in buckets]
        return w, steps, {name: [per[name].get(b) for b in buckets] for name in key_ids}
