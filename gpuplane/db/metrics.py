"""Metric storage: keys per run, raw points keyed by (key, step), rollup levels. SQL only.

Storage (docs/metrics.md):
- `points` holds raw points, one per (key, step); a NULL value means NaN (SQLite turns a
  NaN into NULL, and every point has a value, so nothing else can be NULL).
- `rollups` holds fixed-width step buckets at widths 16, 64, 256, ... (bucket = step // width)
  with first/last step, min, max, sum, count, vcount (non-NaN count), last value and
  first_ts (the earliest ts of its points: the bucket's place on a wall-clock axis).
  Min/max/mean ignore NaN; a bucket of only NaN has NULL (NaN) min/max/mean.
- A row in the rollup shape, as the functions here read and write it: (bucket, first_step,
  last_step, min, max, sum, count, vcount, last, first_ts).
- Ingest appends one `metric_dirty` row (key, lo, hi, base) per key per batch. A key whose
  points in the batch all come after every step it has (the usual case: training
  appends) gets its base buckets written by the ingest itself, from the batch in memory
  (agg_batch, `base` = 1); the rollup algorithm (gpuplane/rollup.py) recomputes the base
  buckets of the other ranges from raw, builds the levels above, and advances the key's
  `rolled_step`; the series planner (gpuplane/series.py) reads rollups up to
  there and raw points after. The wire format is checked in gpuplane/metricwire.py.
"""
import math
import sqlite3
from bisect import bisect_left
from itertools import islice, repeat
from operator import add, floordiv, itemgetter, lt, sub

from ..metricwire import parse_batch
from . import events

# Level widths: 16, 64, 256, ... 4**31 (the last below 2**63). The base level is 16, not
# 4: it is the one written from raw points, and a quarter as many rows to write matters
# more than the finer answers a level of 4 would give (raw covers those, see series()).
LEVELS = [4**j for j in range(2, 32)]
BASE = LEVELS[0]
# The rollup recomputes level 4 .. CHUNK from raw in step spans of CHUNK, one transaction
# each, so an ingest never waits long for the write lock.
CHUNK = 4**8

# Points go in as multi-row INSERTs of up to ROWS_PER_INSERT rows with one flat parameter
# list (no tuple per row): a third less CPU per point than executemany, which steps the
# statement once per row. 2500 rows = 10 000 parameters, under the 32 766 a SQLite since
# 3.32 allows (an older one's 999 gives 249 rows).
ROWS_PER_INSERT = min(2500, sqlite3.connect(":memory:").getlimit(
    sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // 4)
_MULTI_INSERT = ("INSERT OR REPLACE INTO points (key_id, step, value, ts) VALUES "
                 + ",".join(["(?,?,?,?)"] * ROWS_PER_INSERT))


class MetricStore:
    """The ingest fast path of one database, with the caches it owns. Ids that are
    committed never change (keys and runs are never deleted), so they are cached; only
    committed ids go in."""

    def __init__(self, db, max_cached_keys=1_000_000):
        self.db = db
        self.max_cached_keys = max_cached_keys
        self._keys = {}          # (run_id, key) -> key id
        self._runs = set()

    def ingest(self, run_id, keys, points=None, cols=None, batch=None, refused=None):
        """Parse (or take the columns of a binary batch, or a batch made ready by
        prepare()), then one transaction. Returns the count. Raises metricwire.BadBatch.
        `refused` (a metricwire.Refusals) is recorded as the run's METRIC_POINTS_REFUSED
        event in the same transaction."""
        if batch is None:
            if cols is None:
                cols = parse_batch(keys, points)
            batch = prepare(len(keys), cols)
        if not batch.n:
            if refused is not None and refused.total:
                with self.db.tx() as conn:
                    events.points_refused(conn, run_id, refused)
            return 0
        with self.db.tx() as conn:
            ids, fresh = resolve_keys(conn, run_id, keys, self._keys)
            n = insert_points(conn, ids, batch)
            if refused is not None and refused.total:
                events.points_refused(conn, run_id, refused)
        if fresh:
            if len(self._keys) > self.max_cached_keys:
                self._keys.clear()
            self._keys.update(fresh)
        return n

    def limit_keys(self, run_id, acc):
        """`acc` (a metricwire.Accepted) less the points of keys that would take the run
        past MAX_KEYS_PER_RUN (refused, counted). Keys it has already are always fine."""
        if all((run_id, k) in self._keys for k in acc.keys):
            return acc
        with self.db.read() as conn:
            return limit_keys(conn, run_id, acc)

    def run_exists(self, run_id):
        if run_id in self._runs:
            return True
        if not run_exists(self.db, run_id):
            return False
        self._runs.add(run_id)
        return True


# -- ingest ---------------------------------------------------------------------------

MAX_KEYS_PER_RUN = 10_000


def limit_keys(conn, run_id, acc):
    """See MetricStore.limit_keys (inside a transaction, exact; outside one, two batches
    at once may pass the limit by what they bring together)."""
    if not acc.keys:
        return acc
    have = set()
    for i in range(0, len(acc.keys), 500):
        part = acc.keys[i:i + 500]
        have.update(r[0] for r in conn.execute(
            f"SELECT key FROM metric_keys WHERE run_id = ? AND key IN ({','.join('?' * len(part))})",
            (run_id, *part)))
    new = [k for k in acc.keys if k not in have]
    if not new:
        return acc
    n = conn.execute("SELECT count(*) FROM metric_keys WHERE run_id = ?", (run_id,)).fetchone()[0]
    room = max(0, MAX_KEYS_PER_RUN - n)
    if len(new) <= room:
        return acc
    from ..metricwire import without_keys
    return without_keys(acc, set(new[room:]), lambda k: (
        f"run {run_id} has {n} metric keys; a run holds at most {MAX_KEYS_PER_RUN}, so new "
        "keys are refused (log fewer distinct names)"))


def resolve_keys(conn, run_id, keys, known=None):
    """Key ids for `keys` of a run, creating missing ones: (ids, fresh).

    `known` maps (run_id, key) to committed ids; `fresh` holds the ids looked up or made
    here, to add to `known` once the caller's transaction has committed.
    """
    if known is not None:
        ids = [known.get((run_id, k)) for k in keys]
        if None not in ids:
            return ids, {}
    conn.executemany("INSERT OR IGNORE INTO metric_keys (run_id, key) VALUES (?, ?)",
                     zip(repeat(run_id), keys))
    found = {}
    for i in range(0, len(keys), 500):
        part = keys[i:i + 500]
        marks = ",".join("?" * len(part))
        found.update(conn.execute(
            f"SELECT key, id FROM metric_keys WHERE run_id = ? AND key IN ({marks})",
            (run_id, *part)).fetchall())
    return [found[k] for k in keys], {(run_id, k): found[k] for k in keys}


class Batch:
    """A parsed batch made ready to store (prepare()): per key index its columns and base
    buckets, and the flat parameter list of the points, whose key ids insert_points fills
    in. Made before the write transaction, so a request prepares its batch while another
    one's rows go in."""
    __slots__ = ("n", "kidx", "per_key", "aggs", "flat")


def prepare(nkeys, cols):
    """A Batch of parsed columns (kidx, steps, values, ts) of a batch naming nkeys keys."""
    kidx, steps, values, ts = cols
    b = Batch()
    b.n, b.kidx = len(steps), kidx
    if not b.n:
        b.per_key, b.aggs, b.flat = {}, {}, []
        return b
    b.per_key = _split_by_key(nkeys, kidx, steps, values, ts)
    b.aggs = {i: agg_batch(*cols_i, BASE) for i, cols_i in b.per_key.items()}
    b.flat = flat = [None] * (4 * b.n)       # key, step, value, ts, key, step, ...
    flat[1::4], flat[2::4], flat[3::4] = steps, values, ts
    return b


def insert_points(conn, ids, batch):
    """Upsert a batch (a Batch, or parsed columns); write the base buckets of the keys the
    batch appends to, and mark the touched step range of each key for the rollup."""
    if not isinstance(batch, Batch):
        batch = prepare(len(ids), batch)
    n, flat = batch.n, batch.flat
    if not n:
        return 0
    # Base buckets of the keys this batch appends to (what each key holds is read for all
    # keys at once: each SQLite call lets other threads take the GIL). The subqueries say
    # ORDER BY ... DESC LIMIT 1, not max(): a correlated max() scans the whole key.
    base, ranges = {}, {}
    held = _append_state(conn, [ids[i] for i, rows in batch.aggs.items() if rows])
    for i, rows in batch.aggs.items():
        key_id = ids[i]
        if rows is None or rows[0][1] <= held[key_id][0]:
            # not ascending, or replaces or fills in: the rollup recomputes from raw
            k_steps = batch.per_key[i][0]
            ranges[key_id] = (min(k_steps), max(k_steps), 0)
            continue
        last = held[key_id][1]
        if last is not None and last[0] == rows[0][0]:
            rows[0] = merge_rows(last, rows[0])
        base[key_id] = rows
        ranges[key_id] = (rows[0][1], rows[-1][2], 1)
    flat[0::4] = [ids[0]] * n if len(ids) == 1 else map(ids.__getitem__, batch.kidx)
    width = 4 * ROWS_PER_INSERT
    whole = 4 * (n - n % ROWS_PER_INSERT)
    for i in range(0, whole, width):
        conn.execute(_MULTI_INSERT, flat[i:i + width])
    if whole < len(flat):
        rest = flat[whole:]
        conn.executemany("INSERT OR REPLACE INTO points (key_id, step, value, ts)"
                         " VALUES (?,?,?,?)", zip(*(iter(rest),) * 4))
    for key_id, bucket_rows in base.items():
        write_buckets(conn, key_id, BASE, bucket_rows)
    conn.executemany("INSERT INTO metric_dirty (key_id, lo, hi, base) VALUES (?, ?, ?, ?)",
                     [(key_id, *r) for key_id, r in ranges.items()])
    return n


def _split_by_key(k, kidx, steps, values, ts):
    """{key index: (steps, values, ts)} of a batch naming k keys, each in the batch's
    order. Slices (C speed) when every point of a step lists the keys in order, as the SDK
    sends them."""
    if k == 1:
        return {0: (steps, values, ts)}
    n = len(steps)
    if n % k == 0 and list(kidx[:k]) == list(range(k)) and kidx[k:] == kidx[:-k]:
        return {i: (steps[i::k], values[i::k], ts[i::k]) for i in range(k)}
    where = {}
    for i, key in enumerate(kidx):
        where.setdefault(key, []).append(i)
    out = {}
    for key, idx in where.items():
        if len(idx) == 1:
            i = idx[0]
            out[key] = ((steps[i],), (values[i],), (ts[i],))
        else:
            pick = itemgetter(*idx)
            out[key] = (pick(steps), pick(values), pick(ts))
    return out


def agg_batch(steps, values, ts, w):
    """agg_raw of one key's points of a batch, computed from the batch in memory, or None
    when its steps do not strictly ascend. NaN is left out of min, max and sum as SQLite
    leaves out the NULL it stores for NaN (and a NaN bound to a statement is stored as
    NULL, so a sum of inf and -inf becomes NULL there too). Column-wise, with C-level
    map/zip/sorted over the buckets' slices: no Python bytecode per point (sorting a
    bucket of floats is cheaper than min() and max() over it)."""
    steps, values, ts = map(_as_list, (steps, values, ts))
    n = len(steps)
    if steps[n - 1] - steps[0] == n - 1 and steps == sorted(steps):
        # every step once: a bucket every w points
        cuts = [0, *range(min(n, w - steps[0] % w), n, w), n]
    elif all(map(lt, steps, islice(steps, 1, None))):
        cuts, i = [0], 0
        while i < n:
            i = bisect_left(steps, (steps[i] // w + 1) * w, i)
            cuts.append(i)
    else:
        return None
    starts, ends = cuts[:-1], cuts[1:]
    lasts = [e - 1 for e in ends]
    vals = [values[a:b] for a, b in zip(starts, ends)]
    total = sum(values)
    if total == total:              # no NaN (inf - inf also takes the careful path)
        ordered = list(map(sorted, vals))
        mins, maxs = map(itemgetter(0), ordered), map(itemgetter(-1), ordered)
        sums, vcounts = map(sum, vals), map(sub, ends, starts)
    else:
        vals = [[v for v in vs if v == v] for vs in vals]
        mins = [min(vs) if vs else None for vs in vals]
        maxs = [max(vs) if vs else None for vs in vals]
        sums = [sum(vs) if vs else None for vs in vals]
        vcounts = map(len, vals)
    if ts == sorted(ts):            # time moves forward: a bucket's earliest is its first
        first_ts = map(ts.__getitem__, starts)
    else:
        first_ts = map(min, [ts[a:b] for a, b in zip(starts, ends)])
    first = [steps[i] for i in starts]
    return list(zip(map(floordiv, first, repeat(w)), first, map(steps.__getitem__, lasts),
                    mins, maxs, sums, map(sub, ends, starts), vcounts,
                    map(values.__getitem__, lasts), first_ts))


def _as_list(column):
    """A list of the column (a binary batch's columns are arrays: box each number once)."""
    return column.tolist() if hasattr(column, "tolist") else list(column)


def _append_state(conn, key_ids):
    """{key_id: (the highest step the key has held, its last base bucket row or None)};
    pruned steps count as held."""
    if not key_ids:
        return {}
    marks = ",".join("?" * len(key_ids))
    held = dict(conn.execute(
        f"SELECT k.id, max(coalesce((SELECT step FROM points WHERE key_id = k.id"
        f" ORDER BY step DESC LIMIT 1), -1),"
        f" coalesce((SELECT pruned_step FROM metric_rollup WHERE key_id = k.id), -1))"
        f" FROM metric_keys AS k WHERE k.id IN ({marks})", key_ids).fetchall())
    last = {r[0]: tuple(r[1:]) for r in conn.execute(
        "SELECT r.key_id, r.bucket, r.first_step, r.last_step, r.min, r.max, r.sum, r.count,"
        " r.vcount, r.last, r.first_ts FROM metric_keys AS k JOIN rollups AS r"
        " ON r.key_id = k.id AND r.width = ? AND r.bucket = (SELECT bucket FROM rollups"
        " WHERE key_id = k.id AND width = ? ORDER BY bucket DESC LIMIT 1)"
        f" WHERE k.id IN ({marks})", (BASE, BASE, *key_ids)).fetchall()}
    return {k: (held.get(k, -1), last.get(k)) for k in key_ids}


def merge_rows(a, b):
    """Two rows in the rollup shape, a's steps before b's, as one (a's bucket). A NULL sum
    over values that are not all NaN is a NaN sum (inf - inf, which SQLite stores as NULL):
    it stays NaN."""
    sa = a[5] if a[5] is not None or not a[7] else math.nan
    sb = b[5] if b[5] is not None or not b[7] else math.nan
    return (a[0], a[1], b[2], _pick(min, a[3], b[3]), _pick(max, a[4], b[4]),
            _pick(add, sa, sb), a[6] + b[6], a[7] + b[7], b[8], _pick(min, a[9], b[9]))


def _pick(fn, x, y):
    return y if x is None else x if y is None else fn(x, y)


def ingest(conn, run_id, keys, points):
    """Store points `[[key_index, step, value, ts], ...]` of a run inside the caller's
    transaction. The same (key, step) again replaces the point. Raises BadBatch."""
    cols = parse_batch(keys, points)
    if not cols[1]:
        return 0
    ids, _ = resolve_keys(conn, run_id, keys)
    return insert_points(conn, ids, cols)


def ingest_batch(db, run_id, keys, points=None, cols=None):
    """One batch in its own transaction, without a cache (MetricStore.ingest has one)."""
    return MetricStore(db).ingest(run_id, keys, points, cols)


def run_exists(db, run_id):
    return db.query_one("SELECT 1 FROM runs WHERE id = ?", (run_id,)) is not None


# -- keys -----------------------------------------------------------------------------

def key_names(db, run_id):
    return [r[0] for r in db.query("SELECT key FROM metric_keys WHERE run_id = ? ORDER BY key",
                                   (run_id,))]


def key_id(db, run_id, key):
    row = db.query_one("SELECT id FROM metric_keys WHERE run_id = ? AND key = ?", (run_id, key))
    return row[0] if row else None


def points_after(db, run_id, key, after_step=-1, limit=100000):
    """[(step, value)] of a run's key at steps > after_step, in step order (value None:
    NaN). What a sweep's early stopping reads, a little at a time."""
    return [tuple(r) for r in db.query(
        "SELECT p.step, p.value FROM points p JOIN metric_keys k ON k.id = p.key_id"
        " WHERE k.run_id = ? AND k.key = ? AND p.step > ? ORDER BY p.step LIMIT ?",
        (run_id, key, after_step, limit))]


def keys_of_run(conn, run_id):
    return conn.execute("SELECT id, key FROM metric_keys WHERE run_id = ? ORDER BY key",
                        (run_id,)).fetchall()


# -- rollup levels (the algorithm is in gpuplane/rollup.py) ------------------------------

def rollup_state(conn, key_id):
    """(rolled_step, top_width, pruned_step) of a key."""
    row = conn.execute("SELECT rolled_step, top_width, pruned_step FROM metric_rollup"
                       " WHERE key_id = ?", (key_id,)).fetchone()
    return tuple(row) if row else (-1, 0, -1)


_FROM_LEVEL = """
INSERT OR REPLACE INTO rollups
    (key_id, width, bucket, first_step, last_step, min, max, sum, count, vcount, last, first_ts)
SELECT g.key_id, :w * 4, g.b, g.fs, g.ls, g.mn, g.mx, g.sm, g.n, g.nv, c.last, g.ft
FROM (SELECT key_id, bucket / 4 AS b, min(first_step) AS fs, max(last_step) AS ls,
             min(min) AS mn, max(max) AS mx, sum(sum) AS sm, sum(count) AS n,
             sum(vcount) AS nv, min(first_ts) AS ft
      FROM rollups WHERE key_id = :k AND width = :w AND bucket BETWEEN :lo AND :hi
      GROUP BY bucket / 4) AS g
JOIN rollups AS c ON c.key_id = g.key_id AND c.width = :w AND c.bucket = g.ls / :w
"""

_INSERT_BUCKETS = ("INSERT OR REPLACE INTO rollups (key_id, width, bucket, first_step, last_step,"
                   " min, max, sum, count, vcount, last, first_ts)"
                   " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)")


def write_buckets(conn, key_id, width, rows):
    """Rows in the agg_raw shape as buckets of `width`."""
    conn.executemany(_INSERT_BUCKETS, ((key_id, width) + tuple(r) for r in rows))


def build_level(conn, key_id, w, b_lo, b_hi):
    """Buckets b_lo..b_hi of width w, each from the four of width w // 4 below it."""
    conn.execute(_FROM_LEVEL, {"k": key_id, "w": w // 4, "lo": b_lo * 4, "hi": b_hi * 4 + 3})


def set_rolled(conn, key_id, rolled_step, top_width):
    conn.execute(
        "INSERT INTO metric_rollup (key_id, rolled_step, top_width) VALUES (?, ?, ?)"
        " ON CONFLICT (key_id) DO UPDATE SET rolled_step = max(rolled_step, excluded.rolled_step),"
        " top_width = max(top_width, excluded.top_width)", (key_id, rolled_step, top_width))


def dirty_ranges(db):
    """[(id, key_id, lo, hi, base)] the ingest marked for the rollup, oldest first; `base`
    is 1 where the ingest wrote the base buckets itself."""
    return db.query("SELECT id, key_id, lo, hi, base FROM metric_dirty ORDER BY id")


def clear_dirty(db, upto_id):
    with db.tx() as conn:
        conn.execute("DELETE FROM metric_dirty WHERE id <= ?", (upto_id,))


def rolled_keys(db):
    return db.query("SELECT key_id, rolled_step FROM metric_rollup WHERE rolled_step >= 0")


def prune_key(conn, key_id, upto, older_than_ms):
    """Delete a key's raw points at steps <= upto older than the cutoff. Returns how many."""
    row = conn.execute("SELECT max(step) FROM points WHERE key_id = ? AND step <= ?"
                       " AND ts < ?", (key_id, upto, older_than_ms)).fetchone()
    if row[0] is None:
        return 0
    # Everything at or below the newest pruned step counts as pruned: its bucket
    # must not be rebuilt from what raw is left.
    # A registered checkpoint's own step is kept: its training value must never come
    # from another step once the raw points around it are gone (docs/checkpoints.md).
    cur = conn.execute(
        "DELETE FROM points WHERE key_id = ? AND step <= ? AND ts < ? AND step NOT IN"
        " (SELECT c.step FROM checkpoints c JOIN metric_keys k ON k.run_id = c.run_id"
        "  WHERE k.id = ? AND c.step IS NOT NULL)",
        (key_id, upto, older_than_ms, key_id))
    conn.execute("UPDATE metric_rollup SET pruned_step = max(pruned_step, ?)"
                 " WHERE key_id = ?", (row[0], key_id))
    return cur.rowcount


# -- reading (the planner is in gpuplane/series.py) ---------------------------------------

def read_state(conn, key_id):
    """rollup_state for a query: the rolled step is lowered below any range ingested but
    not rolled up yet (points that came out of order, below the rolled step), so the
    query reads raw points there instead of buckets that do not hold them yet."""
    rolled, top, pruned = rollup_state(conn, key_id)
    lo = conn.execute("SELECT min(lo) FROM metric_dirty WHERE key_id = ?",
                      (key_id,)).fetchone()[0]
    if lo is not None and lo <= rolled:
        rolled = lo - 1
    return rolled, top, pruned


def agg_raw(conn, key_id, w, lo, hi):
    """Raw points in [lo, hi] grouped by step // w, in the rollup row shape."""
    if lo > hi:
        return []
    if w == 1:
        return [(s, s, s, v, v, v, 1, 0 if v is None else 1, v, t) for s, v, t in conn.execute(
            "SELECT step, value, ts FROM points WHERE key_id = ? AND step BETWEEN ? AND ?"
            " ORDER BY step", (key_id, lo, hi))]
    return conn.execute(
        "SELECT g.b, g.fs, g.ls, g.mn, g.mx, g.sm, g.n, g.nv, p.value, g.ft FROM"
        " (SELECT step / :w AS b, min(step) AS fs, max(step) AS ls, min(value) AS mn,"
        "  max(value) AS mx, sum(value) AS sm, count(*) AS n, count(value) AS nv,"
        "  min(ts) AS ft"
        "  FROM points WHERE key_id = :k AND step BETWEEN :lo AND :hi GROUP BY step / :w) AS g"
        " JOIN points AS p ON p.key_id = :k AND p.step = g.ls ORDER BY g.b",
        {"w": w, "k": key_id, "lo": lo, "hi": hi}).fetchall()


def level_rows(conn, key_id, w, b_lo, b_hi):
    if b_lo > b_hi:
        return []
    return conn.execute(
        "SELECT bucket, first_step, last_step, min, max, sum, count, vcount, last, first_ts"
        " FROM rollups WHERE key_id = ? AND width = ? AND bucket BETWEEN ? AND ? ORDER BY bucket",
        (key_id, w, b_lo, b_hi)).fetchall()


def count_level(conn, key_id, w, b_lo, b_hi):
    if b_lo > b_hi:
        return 0
    return conn.execute("SELECT count(*) FROM rollups WHERE key_id = ? AND width = ?"
                        " AND bucket BETWEEN ? AND ?", (key_id, w, b_lo, b_hi)).fetchone()[0]


def span(conn, key_id, pruned):
    """(first_step, last_step) of a key, or None when it has no points."""
    # Two queries: SQLite answers a lone min() or max() from the index, both at once by a scan.
    lo = conn.execute("SELECT min(step) FROM points WHERE key_id = ?", (key_id,)).fetchone()[0]
    hi = conn.execute("SELECT max(step) FROM points WHERE key_id = ?", (key_id,)).fetchone()[0]
    if pruned >= 0:
        r = conn.execute("SELECT min(first_step), max(last_step) FROM rollups"
                         " WHERE key_id = ? AND width = ?", (key_id, BASE)).fetchone()
        if r[0] is not None:
            lo = r[0] if lo is None else min(lo, r[0])
            hi = r[1] if hi is None else max(hi, r[1])
    return None if lo is None else (lo, hi)


def count_raw(conn, key_id, lo, hi):
    return conn.execute("SELECT count(*) FROM points WHERE key_id = ? AND step BETWEEN ? AND ?",
                        (key_id, lo, hi)).fetchone()[0]


def latest_point(conn, key_id):
    """(step, value, ts) of the key's newest raw point, or None."""
    return conn.execute("SELECT step, value, ts FROM points WHERE key_id = ?"
                        " ORDER BY step DESC LIMIT 1", (key_id,)).fetchone()


def last_base_bucket(conn, key_id):
    """(last_step, last value) of the key's newest base bucket, or None."""
    return conn.execute("SELECT last_step, last FROM rollups WHERE key_id = ? AND width = ?"
                        " ORDER BY bucket DESC LIMIT 1", (key_id, BASE)).fetchone()


def best_child_bucket(conn, key_id, w, parent, d):
    """Of the four buckets of width w under `parent`, the one with the best value
    (d: 'min' or 'max'), or None."""
    col, order = ("min", "ASC") if d == "min" else ("max", "DESC")
    row = conn.execute(
        f"SELECT bucket FROM rollups WHERE key_id = ? AND width = ? AND bucket BETWEEN ? AND ?"
        f" AND {col} IS NOT NULL ORDER BY {col} {order}, bucket LIMIT 1",
        (key_id, w, parent * 4, parent * 4 + 3)).fetchone()
    return row[0] if row else None


def best_raw_step(conn, key_id, bucket, d):
    """The step with the best raw value in a base bucket, or None."""
    order = "ASC" if d == "min" else "DESC"
    row = conn.execute(
        f"SELECT step FROM points WHERE key_id = ? AND step BETWEEN ? AND ? AND value IS NOT NULL"
        f" ORDER BY value {order}, step LIMIT 1",
        (key_id, bucket * BASE, bucket * BASE + BASE - 1)).fetchone()
    return row[0] if row else None


def base_first_step(conn, key_id, bucket):
    row = conn.execute("SELECT first_step FROM rollups WHERE key_id = ? AND width = ?"
                       " AND bucket = ?", (key_id, BASE, bucket)).fetchone()
    return row[0] if row else None


def tips(db, run_id):
    """{key: last raw step} for a run's keys: a cheap fingerprint of "new points arrived"
    for live views (the points primary key makes each MAX one index probe)."""
    return {k: s for k, s in db.query(
        "SELECT k.key, (SELECT MAX(step) FROM points WHERE key_id = k.id)"
        " FROM metric_keys k WHERE k.run_id = ? ORDER BY k.key", (run_id,))}
