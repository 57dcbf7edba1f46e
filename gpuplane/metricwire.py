"""The metric wire format (docs/api.md, "Metric ingest wire format"): parsing and checking
a batch (JSON or binary column form) into columns, and values back into JSON.

No database here: gpuplane/db/metrics.py stores what this module has checked.
"""
import array
import json
import math
import struct
import sys

MAX_KEYS = 10_000
MAX_STEP = 2**63 - 1

_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


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
            for s, mn, mx, mean, last, n, *_ in pts]
