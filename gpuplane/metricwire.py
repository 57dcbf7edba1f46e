"""The metric wire format (docs/api.md, "Metric ingest wire format"): parsing and checking
a batch (JSON or binary column form) into columns, and values back into JSON.

No database here: gpuplane/db/metrics.py stores what this module has checked.
"""
import array
import json
import struct
import sys

from . import vocab

MAX_KEYS = 10_000
MAX_STEP = 2**63 - 1

_SPECIAL = vocab.NONFINITE      # "NaN", "Infinity", "-Infinity": the wire's spelling


class BadBatch(ValueError):
    """A metric batch that does not follow the wire format; the message names the fix."""


class BadPoints(BadBatch):
    """Some points (or keys) of a well-formed batch are bad: a lenient reader
    (accept_batch, accept_binary) refuses those and keeps the others."""


MAX_KEY_CHARS = 512
MAX_REASONS = 20         # distinct refusal reasons an answer lists (the rest are summed)


class Refusals:
    """The points of one batch refused one by one, counted per reason (docs/api.md,
    "Metric ingest wire format"): nothing good is lost to one bad member."""

    def __init__(self):
        self.by_reason = {}
        self.total = 0

    def add(self, reason, n=1):
        self.total += n
        if reason in self.by_reason or len(self.by_reason) < MAX_REASONS:
            self.by_reason[reason] = self.by_reason.get(reason, 0) + n
        else:
            other = "other reasons (only the first %d are listed)" % MAX_REASONS
            self.by_reason[other] = self.by_reason.get(other, 0) + n

    def as_list(self):
        return [{"reason": r, "points": n} for r, n in self.by_reason.items()]

    def sentence(self):
        first = next(iter(self.by_reason), "")
        more = len(self.by_reason) - 1
        return (f"{self.total} point{'s' if self.total != 1 else ''} refused: {first}"
                + (f" (and {more} other reason{'s' if more > 1 else ''})" if more > 0 else ""))


class Accepted:
    """A checked batch: the good keys (bad ones left out, key indexes renumbered), the
    columns of its good points, and what was refused."""
    __slots__ = ("keys", "cols", "refused")

    def __init__(self, keys, cols, refused):
        self.keys, self.cols, self.refused = keys, cols, refused


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
        raise BadPoints("'keys' must be strings (metric names like \"train/loss\")")
    if any(not k or len(k) > MAX_KEY_CHARS for k in keys):
        raise BadPoints(f"each key must be a non-empty string of at most {MAX_KEY_CHARS} "
                        "characters")
    if len(set(keys)) != len(keys):
        raise BadPoints("'keys' has a name twice; list each metric name once")


def _key_reasons(keys):
    """Why each bad key of a batch is bad: {index: reason}. A name listed twice is bad at
    its second place (its points would land on the first one's series unannounced)."""
    bad, seen = {}, set()
    for i, k in enumerate(keys):
        if type(k) is not str:
            bad[i] = "a key must be a string (a metric name like \"train/loss\")"
        elif not k:
            bad[i] = "a key must not be empty"
        elif len(k) > MAX_KEY_CHARS:
            bad[i] = (f"key {k[:40]!r}... is {len(k)} characters; at most {MAX_KEY_CHARS} "
                      "are allowed")
        elif k in seen:
            bad[i] = (f"key {k[:60]!r} is listed twice in 'keys' (two names that are the same "
                      "text, e.g. 1 and \"1\"); list each name once")
        else:
            seen.add(k)
    return bad


def _point_reason(p, nkeys, bad_keys):
    """(reason, None) for a bad point, else (None, (kidx, step, value, ts))."""
    if type(p) is not list and type(p) is not tuple:
        return "each point must be a list [key_index, step, value, ts]", None
    if len(p) != 4:
        return "each point must have 4 items: [key_index, step, value, ts]", None
    k, s, v, t = p
    if type(k) is not int:
        return "a point's key_index must be an integer index into 'keys'", None
    if not 0 <= k < nkeys:
        return (f"a point's key_index is out of range; 'keys' has {nkeys} names, so use "
                f"0..{nkeys - 1}"), None
    if k in bad_keys:
        return bad_keys[k], None
    if type(s) is not int or not 0 <= s <= MAX_STEP:
        return "a point's step must be an integer from 0 to 2**63-1", None
    if type(t) is not int or not -MAX_STEP <= t <= MAX_STEP:
        return ("a point's ts must be an integer in range (milliseconds since the "
                "epoch)"), None
    if type(v) is not float:
        if type(v) is str:
            if v not in _SPECIAL:
                return ("a point's value must be a number or one of \"NaN\", \"Infinity\", "
                        "\"-Infinity\""), None
            v = _SPECIAL[v]
        elif type(v) is int:
            v = _value(v)
        else:
            return ("a point's value must be a number or one of \"NaN\", \"Infinity\", "
                    "\"-Infinity\""), None
    return None, (k, s, v, t)


def _filter(keys, points):
    """The lenient reading of a batch whose fast check failed: every point on its own."""
    refused = Refusals()
    bad_keys = _key_reasons(keys)
    good = [i for i in range(len(keys)) if i not in bad_keys]
    renumber = {old: new for new, old in enumerate(good)}
    kidx, steps, values, ts = [], [], [], []
    nkeys = len(keys)
    for p in points:
        reason, pt = _point_reason(p, nkeys, bad_keys)
        if reason is not None:
            refused.add(reason)
            continue
        kidx.append(renumber[pt[0]])
        steps.append(pt[1])
        values.append(pt[2])
        ts.append(pt[3])
    return Accepted([keys[i] for i in good], (kidx, steps, values, ts), refused)


def without_keys(acc, bad, reason):
    """`acc` less the points of the keys in `bad` (refused with `reason(key)`)."""
    keep = [i for i, k in enumerate(acc.keys) if k not in bad]
    renumber = {old: new for new, old in enumerate(keep)}
    kidx, steps, values, ts = acc.cols
    cols = ([], [], [], [])
    for k, s, v, t in zip(kidx, steps, values, ts):
        new = renumber.get(k)
        if new is None:
            acc.refused.add(reason(acc.keys[k]))
            continue
        cols[0].append(new)
        cols[1].append(s)
        cols[2].append(v)
        cols[3].append(t)
    return Accepted([acc.keys[i] for i in keep], cols, acc.refused)


def accept_batch(keys, points):
    """Check a JSON batch, keeping its good points: an Accepted. Raises BadBatch only for
    a batch that is not one (keys or points not lists, too many keys)."""
    try:
        return Accepted(keys, parse_batch(keys, points), Refusals())
    except BadPoints:
        return _filter(keys, points)


def accept_binary(raw):
    """accept_batch for the binary form."""
    try:
        keys, cols = parse_binary(raw)
        return Accepted(keys, cols, Refusals())
    except BadPoints:
        keys, cols = parse_binary(raw, check_points=False)
        return _filter(keys, list(zip(*cols)) if cols[0] else [])


def _column(raw, offset, code, n):
    col = array.array(code)
    col.frombytes(raw[offset:offset + n * col.itemsize])
    if sys.byteorder != "little":
        col.byteswap()
    return col, offset + n * col.itemsize


def parse_binary(raw, check_points=True):
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
    if check_points:
        _check_keys(keys)
    elif not isinstance(keys, list) or len(keys) > MAX_KEYS:
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
    if not check_points:
        return keys, (kidx, steps, values, ts)
    if max(kidx) >= len(keys):
        raise BadPoints(f"a point's key_index is out of range; 'keys' has {len(keys)} names, "
                        f"so use 0..{len(keys) - 1}")
    if min(steps) < 0:
        raise BadPoints("a point's step must be an integer from 0 to 2**63-1")
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
        raise BadPoints("each point must be a list [key_index, step, value, ts]") from None
    if lengths != {4}:
        raise BadPoints("each point must have 4 items: [key_index, step, value, ts]")
    kidx, steps, values, ts = zip(*points)
    if not set(map(type, kidx)) <= {int}:
        raise BadPoints("a point's key_index must be an integer index into 'keys'")
    if min(kidx) < 0 or max(kidx) >= len(keys):
        raise BadPoints(f"a point's key_index is out of range; 'keys' has {len(keys)} names, "
                       f"so use 0..{len(keys) - 1}")
    if not set(map(type, steps)) <= {int}:
        raise BadPoints("a point's step must be an integer")
    if min(steps) < 0 or max(steps) > MAX_STEP:
        raise BadPoints("a point's step must be an integer from 0 to 2**63-1")
    if not set(map(type, ts)) <= {int}:
        raise BadPoints("a point's ts must be an integer (milliseconds since the epoch)")
    if min(ts) < -MAX_STEP or max(ts) > MAX_STEP:
        raise BadPoints("a point's ts is out of range; send milliseconds since the epoch")
    vtypes = set(map(type, values))
    if not vtypes <= {float, int, str}:
        raise BadPoints("a point's value must be a number or one of \"NaN\", \"Infinity\", "
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
            raise BadPoints(f"a point's value must be a number or one of \"NaN\", "
                           f"\"Infinity\", \"-Infinity\"; got {v[:40]!r}") from None
    if abs(v) > 2**63:        # an int SQLite cannot bind; as a float it is still a value
        return float(v)
    return v


# A stored value for JSON: NULL (NaN) and infinities as the strings of the wire format.
encode = vocab.encode_stored


def encode_points(pts):
    return [[s, encode(mn), encode(mx), encode(mean), encode(last), n]
            for s, mn, mx, mean, last, n, *_ in pts]
