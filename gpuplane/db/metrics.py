"""Metric points: keys per run, raw points keyed by (key, step), rollups, series, summaries.

Storage (docs/metrics.md):
- `points` holds raw points, one per (key, step); a NULL value means NaN (SQLite turns a
  NaN into NULL, and every point has a value, so nothing else can be NULL).
- `rollups` holds fixed-width step buckets at widths 16, 64, 256, ... (bucket = step // width)
  with first/last step, min, max, sum, count, vcount (non-NaN count) and last value.
  Min/max/mean ignore NaN; a bucket of only NaN has NULL (NaN) min/max/mean.
- Ingest appends one `metric_dirty` row (key, lo, hi) per key per batch. `roll_up` (run by
  gpuplane.rollup.Rollup) recomputes the buckets those ranges touch and advances the key's
  `rolled_step`; a series query reads rollups up to there and raw points after.
"""
import array
import json
import math
import operator
import struct
import sys
from itertools import chain, repeat

from .. import semantic

MAX_KEYS = 10_000
MAX_STEP = 2**63 - 1
# Level widths: 16, 64, 256, ... 4**31 (the last below 2**63). The base level is 16, not
# 4: it is the one written from raw points, and a quarter as many rows to write matters
# more than the finer answers a level of 4 would give (raw covers those, see series()).
LEVELS = [4**j for j in range(2, 32)]
BASE = LEVELS[0]
# The rollup recomputes level 4 .. CHUNK from raw in step spans of CHUNK, one transaction
# each, so an ingest never waits long for the write lock.
CHUNK = 4**8

ROWS_PER_INSERT = 200
_MULTI_INSERT = ("INSERT OR REPLACE INTO points (key_id, step, value, ts) VALUES "
                 + ",".join(["(?,?,?,?)"] * ROWS_PER_INSERT))

_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

# Ids that are committed never change (keys and runs are never deleted), so they are cached
# per database file for the ingest fast path. Only committed ids go in (see ingest_batch).
_key_cache = {}
_run_cache = {}


class BadBatch(ValueError):
    """A metric batch that does not follow the wire format; the message names the fix."""


# -- ingest ---------------------------------------------------------------------------

# The binary form of a batch (docs/api.md, "Metric ingest wire format"): the same columns
# as the JSON form, packed little-endian, so the server reads them with array.frombytes
# instead of parsing decimal text (JSON parsing was a fifth of the ingest CPU).
BINARY_TYPE = "application/x-gpuplane-points"
BINARY_MAGIC = b"GPP1"
_U32 = struct.Struct("<I")


def _check_keys(keys):
    if not isinstance(keys, list):
        raise BadBatch("'keys' must be a list of metric names")
    if len(keys) > MAX_KEYS:
        raise BadBatch(f"'keys' has {len(keys)} names; send at most {MAX_KEYS} per batch")
    if not set(map(type, keys)) <= {str}:
        raise BadBatch("'keys' must be strings (metric names like \"train/loss\")")
    if any(not k or len(k) > 512 for k in keys):
        raise BadBatch("each key must be a non-empty string of at most 512 characters")
    if len(set(keys)) != len(keys):
        raise BadBatch("'keys' has a name twice; list each metric name once")


def _column(raw, offset, code, n):
    col = array.array(code)
    col.frombytes(raw[offset:offset + n * col.itemsize])
    if sys.byteorder != "little":
        col.byteswap()
    return col, offset + n * col.itemsize


def parse_binary(raw):
    """Read a binary batch: b"GPP1", u32 header length, JSON header {"keys": [...]},
    u32 n, then n x u32 key index, n x i64 step, n x f64 value, n x i64 ts.
    Returns (keys, columns) like parse_batch."""
    fix = ("send b'GPP1', a u32 header length, the JSON header {\"keys\": [...]}, a u32 "
           "point count, then the key_index (u32), step (i64), value (f64) and ts (i64) "
           "columns, little-endian")
    if raw[:4] != BINARY_MAGIC or len(raw) < 12:
        raise BadBatch(f"not a binary metric batch; {fix}")
    (hlen,) = _U32.unpack_from(raw, 4)
    try:
        header = json.loads(raw[8:8 + hlen])
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadBatch(f"the batch header is not JSON; {fix}") from None
    keys = header.get("keys") if isinstance(header, dict) else None
    _check_keys(keys)
    offset = 8 + hlen
    if len(raw) < offset + 4:
        raise BadBatch(f"the batch ends before its point count; {fix}")
    (n,) = _U32.unpack_from(raw, offset)
    offset += 4
    if len(raw) != offset + n * 28:
        raise BadBatch(f"the batch says {n} points but carries {len(raw) - offset} bytes of "
                       f"columns (28 per point); {fix}")
    if not n:
        return keys, ((), (), (), ())
    kidx, offset = _column(raw, offset, "I", n)
    steps, offset = _column(raw, offset, "q", n)
    values, offset = _column(raw, offset, "d", n)
    ts, offset = _column(raw, offset, "q", n)
    if max(kidx) >= len(keys):
        raise BadBatch(f"a point's key_index is out of range; 'keys' has {len(keys)} names, "
                       f"so use 0..{len(keys) - 1}")
    if min(steps) < 0:
        raise BadBatch("a point's step must be an integer from 0 to 2**63-1")
    return keys, (kidx, steps, values, ts)


def encode_binary(keys, points):
    """The binary form of [[key_index, step, value, ts], ...] (for clients and tests)."""
    header = json.dumps({"keys": keys}).encode()
    cols = list(zip(*points)) if points else [(), (), (), ()]
    out = [BINARY_MAGIC, _U32.pack(len(header)), header, _U32.pack(len(points))]
    for code, col in zip("Iqdq", cols):
        a = array.array(code, col)
        if sys.byteorder != "little":
            a.byteswap()
        out.append(a.tobytes())
    return b"".join(out)


def parse_batch(keys, points):
    """Check a batch in the wire format and return it as columns (kidx, steps, values, ts).

    Works column-wise with C-level builtins (map, zip, set, min, max) so that a batch of
    thousands of points costs no Python bytecode per point.
    """
    _check_keys(keys)
    if not isinstance(points, list):
        raise BadBatch("'points' must be a list of [key_index, step, value, ts] lists")
    if not points:
        return (), (), (), ()
    # No per-point type check of the points themselves: JSON has no other sequence, a
    # string or object of length 4 fails the column type checks below.
    try:
        lengths = set(map(len, points))
    except TypeError:
        raise BadBatch("each point must be a list [key_index, step, value, ts]") from None
    if lengths != {4}:
        raise BadBatch("each point must have 4 items: [key_index, step, value, ts]")
    kidx, steps, values, ts = zip(*points)
    if not set(map(type, kidx)) <= {int}:
        raise BadBatch("a point's key_index must be an integer index into 'keys'")
    if min(kidx) < 0 or max(kidx) >= len(keys):
        raise BadBatch(f"a point's key_index is out of range; 'keys' has {len(keys)} names, "
                       f"so use 0..{len(keys) - 1}")
    if not set(map(type, steps)) <= {int}:
        raise BadBatch("a point's step must be an integer")
    if min(steps) < 0 or max(steps) > MAX_STEP:
        raise BadBatch("a point's step must be an integer from 0 to 2**63-1")
    if not set(map(type, ts)) <= {int}:
        raise BadBatch("a point's ts must be an integer (milliseconds since the epoch)")
    if min(ts) < -MAX_STEP or max(ts) > MAX_STEP:
        raise BadBatch("a point's ts is out of range; send milliseconds since the epoch")
    vtypes = set(map(type, values))
    if not vtypes <= {float, int, str}:
        raise BadBatch("a point's value must be a number or one of \"NaN\", \"Infinity\", "
                       "\"-Infinity\"")
    if str in vtypes or int in vtypes:
        values = tuple(map(_value, values))
    return kidx, steps, values, ts


def _value(v):
    t = type(v)
    if t is float:
        return v
    if t is str:
        try:
            return _SPECIAL[v]
        except KeyError:
            raise BadBatch(f"a point's value must be a number or one of \"NaN\", "
                           f"\"Infinity\", \"-Infinity\"; got {v[:40]!r}") from None
    if abs(v) > 2**63:        # an int SQLite cannot bind; as a float it is still a value
        return float(v)
    return v


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


def insert_points(conn, ids, cols):
    """Upsert parsed columns; mark the touched step range of each key for the rollup."""
    kidx, steps, values, ts = cols
    if not steps:
        return 0
    if len(ids) == 1:
        key_col = repeat(ids[0])
        used = ids
    else:
        key_col = map(ids.__getitem__, kidx)
        used = [ids[i] for i in set(kidx)]
    rows = list(zip(key_col, steps, values, ts))
    # Whole groups of ROWS_PER_INSERT go in as one multi-row INSERT (a quarter less CPU
    # than executemany, which steps the statement once per row); the rest by executemany.
    whole = len(rows) - len(rows) % ROWS_PER_INSERT
    for i in range(0, whole, ROWS_PER_INSERT):
        conn.execute(_MULTI_INSERT, tuple(chain.from_iterable(rows[i:i + ROWS_PER_INSERT])))
    if whole < len(rows):
        conn.executemany("INSERT OR REPLACE INTO points (key_id, step, value, ts)"
                         " VALUES (?,?,?,?)", rows[whole:])
    # One range per key for the whole batch: a batch usually logs its keys at the same
    # steps, and a wider range only means a little more recomputation.
    lo, hi = min(steps), max(steps)
    conn.executemany("INSERT INTO metric_dirty (key_id, lo, hi) VALUES (?, ?, ?)",
                     [(k, lo, hi) for k in used])
    return len(steps)


def ingest(conn, run_id, keys, points):
    """Store points `[[key_index, step, value, ts], ...]` of a run inside the caller's
    transaction. The same (key, step) again replaces the point. Raises BadBatch."""
    cols = parse_batch(keys, points)
    if not cols[1]:
        return 0
    ids, _ = resolve_keys(conn, run_id, keys)
    return insert_points(conn, ids, cols)


def ingest_batch(db, run_id, keys, points=None, cols=None):
    """The REST path: parse (or take the columns of a binary batch), then one transaction
    with cached key ids. Returns the count."""
    if cols is None:
        cols = parse_batch(keys, points)
    if not cols[1]:
        return 0
    known = _key_cache.setdefault(db.path, {})
    with db.tx() as conn:
        ids, fresh = resolve_keys(conn, run_id, keys, known)
        n = insert_points(conn, ids, cols)
    if fresh:
        if len(known) > 1_000_000:
            known.clear()
        known.update(fresh)
    return n


def run_exists(db, run_id):
    known = _run_cache.setdefault(db.path, set())
    if run_id in known:
        return True
    if db.query_one("SELECT 1 FROM runs WHERE id = ?", (run_id,)) is None:
        return False
    known.add(run_id)
    return True


# -- keys -----------------------------------------------------------------------------

def key_names(db, run_id):
    return [r[0] for r in db.query("SELECT key FROM metric_keys WHERE run_id = ? ORDER BY key",
                                   (run_id,))]


def key_id(db, run_id, key):
    row = db.query_one("SELECT id FROM metric_keys WHERE run_id = ? AND key = ?", (run_id, key))
    return row[0] if row else None


# -- rollups (run by gpuplane.rollup.Rollup) ----------------------------------------------

def _rollup_state(conn, key_id):
    row = conn.execute("SELECT rolled_step, top_width, pruned_step FROM metric_rollup"
                       " WHERE key_id = ?", (key_id,)).fetchone()
    return tuple(row) if row else (-1, 0, -1)


def _merge_ranges(ranges, gap=CHUNK):
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


_FROM_LEVEL = """
INSERT OR REPLACE INTO rollups
    (key_id, width, bucket, first_step, last_step, min, max, sum, count, vcount, last)
SELECT g.key_id, :w * 4, g.b, g.fs, g.ls, g.mn, g.mx, g.sm, g.n, g.nv, c.last
FROM (SELECT key_id, bucket / 4 AS b, min(first_step) AS fs, max(last_step) AS ls,
             min(min) AS mn, max(max) AS mx, sum(sum) AS sm, sum(count) AS n,
             sum(vcount) AS nv
      FROM rollups WHERE key_id = :k AND width = :w AND bucket BETWEEN :lo AND :hi
      GROUP BY bucket / 4) AS g
JOIN rollups AS c ON c.key_id = g.key_id AND c.width = :w AND c.bucket = g.ls / :w
"""

_INSERT_BUCKETS = ("INSERT OR REPLACE INTO rollups (key_id, width, bucket, first_step, last_step,"
                   " min, max, sum, count, vcount, last) VALUES (?,?,?,?,?,?,?,?,?,?,?)")


def _roll_chunk(db, key_id, lo, hi, widths, skip_to=-1):
    """Recompute the buckets of levels `widths` (ascending, from BASE) covering [lo, hi].

    The base level is aggregated from raw points outside the write lock (the GROUP BY is
    the costly part; a stale read is redone by the next tick, whose dirty range covers
    it), then written with the levels above in one short transaction. Buckets holding a
    step <= skip_to (raw points pruned by retention) are kept as they are.
    """
    b_lo, b_hi = lo // BASE, hi // BASE
    if skip_to >= 0:
        b_lo = max(b_lo, skip_to // BASE + 1)
        if b_lo > b_hi:
            return
    rows = _agg_raw(db.conn, key_id, BASE, b_lo * BASE, b_hi * BASE + BASE - 1)
    with db.tx() as conn:
        conn.executemany(_INSERT_BUCKETS, [(key_id, BASE, *r) for r in rows])
        _roll_levels(conn, key_id, lo, hi, widths[1:], skip_to)


def _roll_levels(conn, key_id, lo, hi, widths, skip_to):
    """Levels above BASE, each from the one below it."""
    for w in widths:
        b_lo, b_hi = lo // w, hi // w
        if skip_to >= 0:
            b_lo = max(b_lo, skip_to // w + 1)
            if b_lo > b_hi:
                break
        conn.execute(_FROM_LEVEL, {"k": key_id, "w": w // 4, "lo": b_lo * 4,
                                   "hi": b_hi * 4 + 3})


def _top_width(max_step):
    for w in LEVELS:
        if w > max_step:
            return w
    return LEVELS[-1]


def roll_up(db, stop=None):
    """Bring the rollups up to date with what has been ingested. Returns keys processed."""
    dirty = db.query("SELECT id, key_id, lo, hi FROM metric_dirty ORDER BY id")
    if not dirty:
        return 0
    last_id = dirty[-1][0]
    by_key = {}
    for _, k, lo, hi in dirty:
        by_key.setdefault(k, []).append((lo, hi))
    for key_id, ranges in by_key.items():
        if stop is not None and stop.is_set():
            return 0           # the dirty rows stay; the next start does the rest
        roll_key(db, key_id, ranges)
    with db.tx() as conn:
        conn.execute("DELETE FROM metric_dirty WHERE id <= ?", (last_id,))
    return len(by_key)


def roll_key(db, key_id, ranges):
    rolled, top, pruned = _rollup_state(db.conn, key_id)
    spans = _merge_ranges(ranges)
    max_hi = max(hi for _, hi in spans)
    new_top = max(top, _top_width(max(max_hi, rolled)))
    fine = [w for w in LEVELS if w <= min(CHUNK, new_top)]
    coarse = [w for w in LEVELS if CHUNK < w <= new_top]
    for lo, hi in spans:
        # Levels up to CHUNK align inside a CHUNK-wide span: one short transaction each.
        for c0 in range(lo - lo % CHUNK, hi + 1, CHUNK):
            _roll_chunk(db, key_id, max(lo, c0), min(hi, c0 + CHUNK - 1), fine, pruned)
        if coarse:
            with db.tx() as conn:
                _roll_levels(conn, key_id, lo, hi, coarse, pruned)
    if new_top > top and top:
        # A new coarser level is built over the whole history from the one below it.
        with db.tx() as conn:
            for w in [w for w in LEVELS if top < w <= new_top]:
                conn.execute(_FROM_LEVEL, {"k": key_id, "w": w // 4, "lo": 0, "hi": MAX_STEP})
    with db.tx() as conn:
        conn.execute(
            "INSERT INTO metric_rollup (key_id, rolled_step, top_width) VALUES (?, ?, ?)"
            " ON CONFLICT (key_id) DO UPDATE SET rolled_step = max(rolled_step, excluded.rolled_step),"
            " top_width = max(top_width, excluded.top_width)", (key_id, max_hi, new_top))


def prune_raw(db, older_than_ms):
    """Delete raw points older than `older_than_ms` (their ts) that are already rolled up;
    rollups stay. Returns the number of points deleted."""
    deleted = 0
    for key_id, rolled in db.query("SELECT key_id, rolled_step FROM metric_rollup"
                                   " WHERE rolled_step >= 0"):
        # Only whole base buckets below the rolled step: a partial one is still read raw.
        upto = (rolled + 1) // BASE * BASE - 1
        if upto < 0:
            continue
        with db.tx() as conn:
            row = conn.execute("SELECT max(step) FROM points WHERE key_id = ? AND step <= ?"
                               " AND ts < ?", (key_id, upto, older_than_ms)).fetchone()
            if row[0] is None:
                continue
            # Everything at or below the newest pruned step counts as pruned: its bucket
            # must not be rebuilt from what raw is left.
            cur = conn.execute("DELETE FROM points WHERE key_id = ? AND step <= ? AND ts < ?",
                               (key_id, upto, older_than_ms))
            deleted += cur.rowcount
            conn.execute("UPDATE metric_rollup SET pruned_step = max(pruned_step, ?)"
                         " WHERE key_id = ?", (row[0], key_id))
    return deleted


# -- reading ----------------------------------------------------------------------------

def _agg_raw(conn, key_id, w, lo, hi):
    """Raw points in [lo, hi] grouped by step // w, in the rollup row shape."""
    if lo > hi:
        return []
    if w == 1:
        return [(s, s, s, v, v, v, 1, 0 if v is None else 1, v) for s, v in conn.execute(
            "SELECT step, value FROM points WHERE key_id = ? AND step BETWEEN ? AND ?"
            " ORDER BY step", (key_id, lo, hi))]
    return conn.execute(
        "SELECT g.b, g.fs, g.ls, g.mn, g.mx, g.sm, g.n, g.nv, p.value FROM"
        " (SELECT step / :w AS b, min(step) AS fs, max(step) AS ls, min(value) AS mn,"
        "  max(value) AS mx, sum(value) AS sm, count(*) AS n, count(value) AS nv"
        "  FROM points WHERE key_id = :k AND step BETWEEN :lo AND :hi GROUP BY step / :w) AS g"
        " JOIN points AS p ON p.key_id = :k AND p.step = g.ls ORDER BY g.b",
        {"w": w, "k": key_id, "lo": lo, "hi": hi}).fetchall()


def _level_rows(conn, key_id, w, b_lo, b_hi):
    if b_lo > b_hi:
        return []
    return conn.execute(
        "SELECT bucket, first_step, last_step, min, max, sum, count, vcount, last FROM rollups"
        " WHERE key_id = ? AND width = ? AND bucket BETWEEN ? AND ? ORDER BY bucket",
        (key_id, w, b_lo, b_hi)).fetchall()


def _count_level(conn, key_id, w, b_lo, b_hi):
    if b_lo > b_hi:
        return 0
    return conn.execute("SELECT count(*) FROM rollups WHERE key_id = ? AND width = ?"
                        " AND bucket BETWEEN ? AND ?", (key_id, w, b_lo, b_hi)).fetchone()[0]


def _span(conn, key_id, pruned):
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


def series(db, key_id, max_points=1000, from_step=None, to_step=None):
    """A downsampled series: (level, [(first_step, min, max, mean, last, count), ...]).

    At most `max_points` buckets. The level (bucket width in steps, 1 = raw) is the
    coarsest stored level that still gives >= max_points/2 buckets in the range; when it
    gives more than max_points, neighbouring buckets are merged. Rollups are read up to
    the key's rolled step and raw points after it, so a query never lags the ingest.
    """
    conn = db.conn
    rolled, top, pruned = _rollup_state(conn, key_id)
    rolled = _settled_step(conn, key_id, rolled)
    span = _span(conn, key_id, pruned)
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
        n = _count_level(conn, key_id, w, lo // w, min(hi // w, complete - 1))
        if tail_from <= hi:
            if tail_count is None:
                tail_count = conn.execute(
                    "SELECT count(*) FROM points WHERE key_id = ? AND step BETWEEN ? AND ?",
                    (key_id, tail_from, hi)).fetchone()[0]
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
            n = conn.execute("SELECT count(*) FROM points WHERE key_id = ? AND step"
                             " BETWEEN ? AND ?", (key_id, lo, hi)).fetchone()[0]
            chosen = 1 if n <= 2 * max_points else next(
                (w for w in [4, *LEVELS] if (hi // w - lo // w + 1) <= 2 * max_points),
                LEVELS[-1])
    w = chosen
    if w >= BASE and top:
        rows = _rows_at(conn, key_id, w, lo, hi, rolled, top)
    else:
        rows = _agg_raw(conn, key_id, w, lo, hi)
    return _merge(rows, w, max_points)


def _settled_step(conn, key_id, rolled):
    """The step up to which the rollups are current. Points that arrived out of order
    below the rolled step (another writer, a replay) wait in metric_dirty until the
    rollup thread gets to them; until then their steps are read raw."""
    row = conn.execute("SELECT min(lo) FROM metric_dirty WHERE key_id = ?", (key_id,)).fetchone()
    return rolled if row[0] is None else min(rolled, row[0] - 1)


def _rows_at(conn, key_id, w, lo, hi, rolled, top):
    """Buckets of width w over [lo, hi]: whole ones from level w; the one holding the
    rolled step from whole buckets of finer levels; then raw points past the finest."""
    complete = (rolled + 1) // w if top else 0
    rows = _level_rows(conn, key_id, w, lo // w, min(hi // w, complete - 1))
    covered = complete * w
    pieces = []
    for w2 in reversed([x for x in LEVELS if x < w and top]):
        c2 = (rolled + 1) // w2
        pieces += _level_rows(conn, key_id, w2, max(covered, lo) // w2, min(hi // w2, c2 - 1))
        covered = max(covered, c2 * w2)
    pieces += _agg_raw(conn, key_id, w, max(lo, covered), hi)
    for r in pieces:
        r = (r[1] // w, *r[1:])
        if rows and rows[-1][0] == r[0]:
            rows[-1] = _fold(rows[-1], r)
        else:
            rows.append(r)
    return rows


def _fold(a, b):
    """Two rollup-shaped rows (a before b) as one."""
    return (a[0], a[1], b[2], _pick(min, a[3], b[3]), _pick(max, a[4], b[4]),
            _pick(operator.add, a[5], b[5]), a[6] + b[6], a[7] + b[7], b[8])


def _pick(fn, x, y):
    if x is None:
        return y
    if y is None:
        return x
    return fn(x, y)


def _merge(rows, w, max_points):
    """Rows (bucket, first, last, min, max, sum, count, vcount, last_value) -> at most
    max_points output points, merging aligned groups of f neighbouring buckets."""
    f = max(1, -(-len(rows) // max_points))
    while f > 1 and len({r[0] // f for r in rows}) > max_points:
        f += 1
    if f == 1:
        return w, [(fs, mn, mx, _mean(sm, nv), last, n)
                   for b, fs, ls, mn, mx, sm, n, nv, last in rows]
    merged = []
    for r in rows:
        r = (r[0] // f, *r[1:])
        if merged and merged[-1][0] == r[0]:
            merged[-1] = _fold(merged[-1], r)
        else:
            merged.append(r)
    return w * f, [(fs, mn, mx, _mean(sm, nv), last, n)
                   for b, fs, ls, mn, mx, sm, n, nv, last in merged]


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
        for row in _level_rows(conn, key_id, w, covered // w, complete - 1):
            yield w, row
        covered = max(covered, complete * w)
    for row in _agg_raw(conn, key_id, 1, covered, MAX_STEP):
        yield 1, row


def summary(db, run_id):
    """Per key: count, latest, best (by direction), trend, first and last step."""
    conn = db.conn
    out = []
    for key_id, key in conn.execute("SELECT id, key FROM metric_keys WHERE run_id = ?"
                                    " ORDER BY key", (run_id,)).fetchall():
        out.append(key_summary(db, key_id, key))
    return out


def key_summary(db, key_id, key, d=None):
    """One key's summary; `d` ('min' | 'max') overrides the direction read from its name."""
    conn = db.conn
    rolled, top, pruned = _rollup_state(conn, key_id)
    d = d or semantic.direction(key)
    count, first, last_step = 0, None, None
    best = None          # (value, width, row)
    for w, row in _cover(conn, key_id, rolled, top):
        b, fs, ls, mn, mx, sm, n, nv, lv = row
        count += n
        first = fs if first is None else min(first, fs)
        last_step = ls if last_step is None else max(last_step, ls)
        v = mn if d == "min" else mx
        if v is not None and (best is None or (v < best[0] if d == "min" else v > best[0])):
            best = (v, w, row)
    latest = conn.execute("SELECT step, value, ts FROM points WHERE key_id = ?"
                          " ORDER BY step DESC LIMIT 1", (key_id,)).fetchone()
    if latest is not None and last_step is not None and latest[0] < last_step:
        latest = None
    if latest is None and last_step is not None:
        # The newest raw point was pruned: the last base bucket still knows it.
        r = conn.execute("SELECT last_step, last FROM rollups WHERE key_id = ? AND width = ?"
                         " ORDER BY bucket DESC LIMIT 1", (key_id, BASE)).fetchone()
        latest = (r[0], r[1], None) if r else None
    return {
        "key": key,
        "count": count,
        "latest": None if latest is None else
        {"step": latest[0], "value": encode(latest[1]), "ts": latest[2]},
        "best": None if best is None else
        {"step": _best_step(conn, key_id, d, best), "value": encode(best[0])},
        "direction": d,
        "trend": semantic.trend(series(db, key_id, max_points=200)[1], d),
        "first_step": first,
        "last_step": last_step,
    }


def _best_step(conn, key_id, d, best):
    """Walk down from the bucket holding the best value to the step that has it."""
    value, w, row = best
    bucket = row[0]
    order = "ASC" if d == "min" else "DESC"
    col = "min" if d == "min" else "max"
    while w > BASE:
        w //= 4
        child = conn.execute(
            f"SELECT bucket FROM rollups WHERE key_id = ? AND width = ? AND bucket BETWEEN ? AND ?"
            f" AND {col} IS NOT NULL ORDER BY {col} {order}, bucket LIMIT 1",
            (key_id, w, bucket * 4, bucket * 4 + 3)).fetchone()
        if child is None:
            return row[1]
        bucket = child[0]
    if w == 1:
        return row[1]
    r = conn.execute(
        f"SELECT step FROM points WHERE key_id = ? AND step BETWEEN ? AND ? AND value IS NOT NULL"
        f" ORDER BY value {order}, step LIMIT 1",
        (key_id, bucket * BASE, bucket * BASE + BASE - 1)).fetchone()
    if r is not None:
        return r[0]
    r = conn.execute("SELECT first_step FROM rollups WHERE key_id = ? AND width = ? AND bucket = ?",
                     (key_id, BASE, bucket)).fetchone()
    return r[0] if r else row[1]


def encode(v):
    """A stored value for JSON: NULL (NaN) and infinities as the strings of the wire format."""
    if v is None:
        return "NaN"
    if v == math.inf:
        return "Infinity"
    if v == -math.inf:
        return "-Infinity"
    return v


def encode_points(pts):
    return [[s, encode(mn), encode(mx), encode(mean), encode(last), n]
            for s, mn, mx, mean, last, n in pts]


def tips(db, run_id):
    """{key: last raw step} for a run's keys: a cheap fingerprint of "new points arrived"
    for live views (the points primary key makes each MAX one index probe)."""
    return {k: s for k, s in db.query(
        "SELECT k.key, (SELECT MAX(step) FROM points WHERE key_id = k.id)"
        " FROM metric_keys k WHERE k.run_id = ? ORDER BY k.key", (run_id,))}
