"""TensorBoard event-file tailing for the agent (moves into agent.py).

Reads the TFRecord framing itself so that CRCs are checked in C (google-crc32c)
instead of tensorboard's pure-Python loop; decodes with tensorboard's own protos.
See docs/tensorboard.md.
"""
import logging
import math
import os
import re
import struct
import time

from tensorboard.compat.proto import event_pb2

try:
    # The C extension directly: the package's own pure-Python fallback is no faster
    # than tensorboard's and warns on import.
    from google_crc32c.cext import value as _crc32c
    TB_CRC32C = "google-crc32c"
except ImportError:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as _crc32c
    TB_CRC32C = "python"

tb_log = logging.getLogger("gpuplane.agent.tb")

_TB_CHUNK = 4 << 20          # bytes read per system call
_TB_HUGE_RECORD = 16 << 20   # larger records (graphs, big images) are skipped unread: never scalars
_TB_HEADER = struct.Struct("<QI")
_TB_U32 = struct.Struct("<I")
_TB_F32 = struct.Struct("<f")
_TB_F64 = struct.Struct("<d")
_TB_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}
# Directories that exist once per launch of the training script: torch's, tensorboardX's
# and HF Trainer's default `runs/Nov29_08-46-00_host`, Lightning's `version_3`. Keeping them
# in the metric key would give every launch new keys and break comparing runs.
_TB_LAUNCH_DIR = re.compile(r"^(?:[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}_.+|version_\d+)$")
_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_INT64 = 1, 2, 3, 9


def tb_run_prefix(rel_dir):
    """Key prefix for event files in `rel_dir` (posix, relative to the watched root)."""
    parts = [p for p in rel_dir.split("/") if p not in ("", ".") and not _TB_LAUNCH_DIR.match(p)]
    return "/".join(parts) + "/" if parts else ""


def _tb_scalar(t):
    """The value of a numeric rank-0 (or one-element) TensorProto, else None."""
    for d in t.tensor_shape.dim:
        if d.size != 1:
            return None
    dtype = t.dtype
    if dtype == _DT_FLOAT:
        if t.float_val:
            return t.float_val[0]
        if len(t.tensor_content) == 4:
            return _TB_F32.unpack(t.tensor_content)[0]
    elif dtype == _DT_DOUBLE:
        if t.double_val:
            return t.double_val[0]
        if len(t.tensor_content) == 8:
            return _TB_F64.unpack(t.tensor_content)[0]
    elif dtype == _DT_INT32 and t.int_val:
        return float(t.int_val[0])
    elif dtype == _DT_INT64 and t.int64_val:
        return float(t.int64_val[0])
    # Everything else (half, bfloat16, unsigned, other encodings): let tensorboard decode it.
    from tensorboard.util import tensor_util
    try:
        arr = tensor_util.make_ndarray(t)
    except Exception:
        return None
    if arr.size != 1 or arr.dtype.kind not in "fiu":
        return None
    return float(arr.item())


class _TBFile:
    __slots__ = ("path", "rel", "prefix", "offset", "bad_header")

    def __init__(self, path, rel, offset):
        self.path = path
        self.rel = rel
        self.prefix = tb_run_prefix(rel.rpartition("/")[0])
        self.offset = offset
        self.bad_header = False   # stopped at a record whose length CRC failed


class TBTailer:
    """Follows every `*tfevents*` file under root_dir and returns new scalar points.

    poll() -> [(key, step, value, wall_time_ms)], each point once, in file order; about
    max_points at most (the rest comes with the next polls).
    offsets: {path relative to root_dir: end of the last record consumed}; pass it back
    after a restart to carry on exactly where the last poll stopped.
    """

    def __init__(self, root_dir, started_after_ts=None, offsets=None, *, rescan_s=3.0,
                 max_points=200_000):
        self.root = os.path.abspath(root_dir)
        self.started_after_ts = started_after_ts
        self.rescan_s = rescan_s
        # A long backlog (restart, or a big file from an earlier attempt of the same run) is
        # handed out over several polls rather than all in memory at once.
        self.max_points = max_points
        self._files = {}           # rel -> _TBFile
        self._resume = {str(k): int(v) for k, v in (offsets or {}).items()}
        self._plugins = {}         # (run prefix, tag) -> plugin name, from the first metadata seen
        self._warned = set()
        self._next_scan = 0.0
        self.corrupt_records = 0

    @property
    def offsets(self):
        out = dict(self._resume)   # files from before a restart that are not (yet) back
        out.update((rel, f.offset) for rel, f in self._files.items())
        return out

    def poll(self):
        now = time.monotonic()
        if now >= self._next_scan:
            self._scan()
            # A huge tree must not turn the agent into a full-time directory walker.
            # (rescan_s=0 means every poll, for tests.)
            took = time.monotonic() - now
            self._next_scan = now + took + max(self.rescan_s, 10 * took) if self.rescan_s else 0.0
        points = []
        for rel in sorted(self._files):
            if len(points) >= self.max_points:
                break
            f = self._files[rel]
            try:
                self._read(f, points)
            except FileNotFoundError:
                del self._files[rel]
            except OSError as e:
                self._warn_once(f.rel, "oserror", "cannot read %s: %s", f.path, e)
        return points

    def _warn_once(self, rel, kind, msg, *args):
        if (rel, kind) not in self._warned:
            self._warned.add((rel, kind))
            tb_log.warning(msg, *args)

    def _scan(self):
        stack = [self.root]
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(d)
            except OSError:
                continue
            with it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            if not e.name.startswith(".") and e.name not in _TB_SKIP_DIRS:
                                stack.append(e.path)
                        elif "tfevents" in e.name and e.is_file():
                            self._consider(e)
                    except OSError:
                        continue

    def _consider(self, entry):
        rel = os.path.relpath(entry.path, self.root).replace(os.sep, "/")
        if rel in self._files:
            return
        if rel in self._resume:
            offset = self._resume.pop(rel)
        elif self.started_after_ts is not None and entry.stat().st_mtime < self.started_after_ts:
            return   # from an earlier launch; looked at again if it is ever written to
        else:
            offset = 0
        self._files[rel] = _TBFile(entry.path, rel, offset)

    def _read(self, f, points):
        size = os.stat(f.path).st_size
        if size < f.offset:
            tb_log.warning("%s shrank below %d bytes; reading it again from the start", f.path, f.offset)
            f.offset = 0
            f.bad_header = False
        if size == f.offset:
            return
        want = 12 if f.bad_header else _TB_CHUNK
        with open(f.path, "rb") as fh:
            while True:
                fh.seek(f.offset)
                buf = fh.read(want)
                consumed, need = self._parse(f, buf, points)
                f.offset += consumed
                if need > _TB_HUGE_RECORD:
                    if f.offset + need > size:
                        return   # wait until the writer has finished it
                    f.offset += need
                    continue
                if len(buf) < want or need == 0:
                    return   # end of file, or stopped at a bad length CRC
                if len(points) >= self.max_points:
                    return   # (checked per chunk: the per-record loop stays lean)
                want = max(_TB_CHUNK, need)

    def _parse(self, f, buf, points):
        """Consume the complete records in buf.

        Returns (bytes consumed, bytes needed from there for the next record; 0 to stop).
        """
        n = len(buf)
        pos = 0
        crc = _crc32c
        header = _TB_HEADER.unpack_from
        u32 = _TB_U32.unpack_from
        parse = event_pb2.Event.FromString
        prefix = f.prefix
        plugins = self._plugins
        append = points.append
        isfinite = math.isfinite
        while True:
            if pos + 12 > n:
                return pos, 12
            length, length_crc = header(buf, pos)
            c = crc(buf[pos:pos + 8])
            if (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF != length_crc:
                # The length can't be trusted, so the record boundaries are lost: stop here
                # (TensorBoard abandons the file too). Retried each poll in case we saw a
                # half-written header.
                if not f.bad_header:
                    f.bad_header = True
                    self._warn_once(f.rel, "length", "%s: bad length CRC at byte %d; not reading further",
                                    f.path, f.offset + pos)
                return pos, 0
            f.bad_header = False
            end = pos + 16 + length
            if end > n:
                return pos, 16 + length
            data = buf[pos + 12:end - 4]
            c = crc(data)
            if (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF != u32(buf, end - 4)[0]:
                if end == n:
                    # Nothing after it yet: may be a write still landing. Decide once the
                    # writer has moved on.
                    return pos, 17 + length
                self.corrupt_records += 1
                self._warn_once(f.rel, "data", "%s: bad data CRC at byte %d; skipping the record",
                                f.path, f.offset + pos)
                pos = end
                continue
            pos = end
            try:
                ev = parse(data)
            except Exception:
                self.corrupt_records += 1
                self._warn_once(f.rel, "proto", "%s: undecodable event at byte %d; skipping it",
                                f.path, f.offset + pos)
                continue
            values = ev.summary.value
            if not values:
                continue   # file_version, graph, session_log, ...
            wall_time = ev.wall_time
            if not isfinite(wall_time):
                # TensorBoard drops these too; int() of it would raise.
                self._warn_once(f.rel, "time", "%s: event with wall_time %s at byte %d; skipping it",
                                f.path, wall_time, f.offset + pos)
                continue
            step = ev.step
            ms = int(wall_time * 1000)
            for v in values:
                if v.HasField("simple_value"):
                    append((prefix + v.tag, step, v.simple_value, ms))
                elif v.HasField("tensor"):
                    # TF2 writes the plugin metadata only with a tag's first value.
                    key = (prefix, v.tag)
                    if v.HasField("metadata"):
                        plugins[key] = v.metadata.plugin_data.plugin_name
                    plugin = plugins.get(key)
                    if plugin is not None and plugin != "scalars":
                        continue
                    value = _tb_scalar(v.tensor)
                    if value is not None:
                        append((prefix + v.tag, step, value, ms))
