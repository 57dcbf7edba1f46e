"""Metric rollups: the algorithm and the thread that runs it; the SQL is in
gpuplane/db/metrics.py.

Every tick brings up to date the buckets that newly ingested points touched (the step
ranges ingest recorded in `metric_dirty`): the base level from raw points where the ingest
did not write it itself (out-of-order and replaced points), and the levels above from it.
Once every `retention_check_s` it deletes raw points older than `raw_retention_days` (server.toml;
0 or absent keeps them forever); rollups are kept, so series and summaries still work.
"""
import logging

from .db import metrics as store, now_ms
from .db.metrics import BASE, CHUNK, LEVELS
from .metricwire import MAX_STEP
from .worker import Worker

log = logging.getLogger(__name__)

DAY_MS = 86_400_000


class Rollup(Worker):
    name = "rollup"
    interval = 1.0
    retention_check_s = 600

    def __init__(self, db, cfg=None):
        super().__init__()
        self.db = db
        self.retention_days = float((cfg or {}).get("raw_retention_days") or 0)
        self._next_prune = 0.0

    def tick(self):
        roll_up(self.db, stop=self._stop)
        if self.retention_days > 0 and now_ms() >= self._next_prune:
            self.prune()
            self._next_prune = now_ms() + self.retention_check_s * 1000

    def prune(self, now=None):
        """Delete raw points older than the retention period. Returns how many."""
        if self.retention_days <= 0:
            return 0
        cutoff = (now if now is not None else now_ms()) - int(self.retention_days * DAY_MS)
        deleted = prune_raw(self.db, cutoff)
        if deleted:
            log.info("pruned %d raw metric points older than %s days", deleted,
                     self.retention_days)
        return deleted


# -- the algorithm ----------------------------------------------------------------------

def _merge_ranges(ranges, gap=CHUNK):
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _roll_chunk(db, key_id, lo, hi, widths, skip_to, raw_spans):
    """Bring the buckets of levels `widths` (ascending, from BASE) covering [lo, hi] up to
    date, in one short transaction: the base level from raw points over `raw_spans` (the
    ranges whose base buckets the ingest did not write), the levels above from the base.
    Buckets holding a step <= skip_to (raw points pruned by retention) are kept as they are.

    The raw aggregation runs inside the write transaction: an ingest that extends a base
    bucket meanwhile would otherwise be overwritten by the older aggregate, and nothing
    would redo it (its range is marked as having its base written).
    """
    with db.tx() as conn:
        for r_lo, r_hi in raw_spans:
            b_lo, b_hi = max(lo, r_lo) // BASE, min(hi, r_hi) // BASE
            if skip_to >= 0:
                b_lo = max(b_lo, skip_to // BASE + 1)
            if b_lo > b_hi:
                continue
            rows = store.agg_raw(conn, key_id, BASE, b_lo * BASE, b_hi * BASE + BASE - 1)
            store.write_buckets(conn, key_id, BASE, rows)
        _roll_levels(conn, key_id, lo, hi, widths[1:], skip_to)


def _roll_levels(conn, key_id, lo, hi, widths, skip_to):
    """Levels above BASE, each from the one below it."""
    for w in widths:
        b_lo, b_hi = lo // w, hi // w
        if skip_to >= 0:
            b_lo = max(b_lo, skip_to // w + 1)
            if b_lo > b_hi:
                break
        store.build_level(conn, key_id, w, b_lo, b_hi)


def _top_width(max_step):
    for w in LEVELS:
        if w > max_step:
            return w
    return LEVELS[-1]


def roll_up(db, stop=None):
    """Bring the rollups up to date with what has been ingested. Returns keys processed."""
    dirty = store.dirty_ranges(db)
    if not dirty:
        return 0
    last_id = dirty[-1][0]
    by_key = {}
    for _, k, lo, hi, base in dirty:
        by_key.setdefault(k, []).append((lo, hi, base))
    for key_id, ranges in by_key.items():
        if stop is not None and stop.is_set():
            return 0           # the dirty rows stay; the next start does the rest
        roll_key(db, key_id, ranges)
    store.clear_dirty(db, last_id)
    return len(by_key)


def roll_key(db, key_id, ranges):
    """ranges: [(lo, hi, base)], base true where the ingest wrote the base buckets."""
    with db.read() as conn:
        rolled, top, pruned = store.rollup_state(conn, key_id)
    spans = _merge_ranges((lo, hi) for lo, hi, _ in ranges)
    raw = _merge_ranges(((lo, hi) for lo, hi, base in ranges if not base), gap=BASE)
    max_hi = max(hi for _, hi in spans)
    new_top = max(top, _top_width(max(max_hi, rolled)))
    fine = [w for w in LEVELS if w <= min(CHUNK, new_top)]
    coarse = [w for w in LEVELS if CHUNK < w <= new_top]
    for lo, hi in spans:
        # Levels up to CHUNK align inside a CHUNK-wide span: one short transaction each.
        for c0 in range(lo - lo % CHUNK, hi + 1, CHUNK):
            c_lo, c_hi = max(lo, c0), min(hi, c0 + CHUNK - 1)
            _roll_chunk(db, key_id, c_lo, c_hi, fine, pruned,
                        [r for r in raw if r[0] <= c_hi and r[1] >= c_lo])
        if coarse:
            with db.tx() as conn:
                _roll_levels(conn, key_id, lo, hi, coarse, pruned)
    if new_top > top and top:
        # A new coarser level is built over the whole history from the one below it.
        with db.tx() as conn:
            for w in [w for w in LEVELS if top < w <= new_top]:
                store.build_level(conn, key_id, w, 0, MAX_STEP // w)
    with db.tx() as conn:
        store.set_rolled(conn, key_id, max_hi, new_top)


def prune_raw(db, older_than_ms):
    """Delete raw points older than `older_than_ms` (their ts) that are already rolled up;
    rollups stay. Returns the number of points deleted."""
    deleted = 0
    for key_id, rolled in store.rolled_keys(db):
        # Only whole base buckets below the rolled step: a partial one is still read raw.
        upto = (rolled + 1) // BASE * BASE - 1
        if upto < 0:
            continue
        with db.tx() as conn:
            deleted += store.prune_key(conn, key_id, upto, older_than_ms)
    return deleted
