"""Aligned series of one metric over several runs, for overlays.

Every run is cut into the same step buckets (width w, bucket = step // w), so the i-th
point of each run covers the same steps. w is the smallest of 1, 4, 16, 64, ... that gives
at most max_points buckets over the union of the runs' step ranges; whole rollup buckets
are read where they exist (gpuplane/series.py does the same for one run).
"""
from . import metrics as m

WIDTHS = [1, 4, *m.LEVELS]


def _fold_to(rows, w):
    """Rollup-shaped rows of a finer width, folded into buckets of width w."""
    out = []
    for r in rows:
        r = (r[1] // w, *r[1:])
        if out and out[-1][0] == r[0]:
            out[-1] = m._fold(out[-1], r)
        else:
            out.append(r)
    return out


def aligned_series(db, key_ids, max_points=500):
    """key_ids: {name: key_id or None}. Returns (width, steps, {name: [(min, max, mean,
    last, count) or None per step]})."""
    conn = db.conn
    states, spans = {}, {}
    for name, kid in key_ids.items():
        if kid is None:
            continue
        states[name] = m._rollup_state(conn, kid)
        span = m._span(conn, kid, states[name][2])
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
        if w >= m.BASE and top >= m.BASE:
            base = min(w, top)
            rows = _fold_to(m._rows_at(conn, kid, base, lo, hi, rolled, top), w)
        else:
            rows = m._agg_raw(conn, kid, w, lo, hi)
        per[name] = {r[1] // w: (r[3], r[4], m._mean(r[5], r[7]), r[8], r[6]) for r in rows}
    buckets = sorted({b for d in per.values() for b in d})
    steps = [b * w for b in buckets]
    return w, steps, {name: [per[name].get(b) for b in buckets] for name in key_ids}
