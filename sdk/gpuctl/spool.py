"""The local spool: one jsonl file per run under ``$GPUCTL_HOME/spool/``.

Every record the SDK owes the server is appended here *before* it is sent, and the file is
cut back only once the server has acknowledged everything in it. The first line is a
header naming the run, so a later process can replay a spool it did not write.

A spool file is locked (``flock``) by the process that writes it for as long as that
process lives; a replayer only touches files whose lock it can take, so it never races a
live writer. ``<file>.offset`` remembers how far an interrupted replay got, so records the
server already acknowledged are not sent twice.
"""

import collections
import json
import os

try:
    import fcntl
except ImportError:  # Windows: no locks, so no replay of other processes' spools
    fcntl = None  # type: ignore[assignment]

MEMORY_RECORDS = 64  # records held in memory besides the file (at most 9 MB of points)
MEMORY_MAX_RECORDS = 200  # when there is no file: about a million points, 28 MB


def spool_dir():
    home = os.environ.get("GPUCTL_HOME") or os.path.join(os.path.expanduser("~"), ".gpuctl")
    return os.path.join(home, "spool")


def spool_path(run_id):
    return os.path.join(spool_dir(), "sdk-%s.jsonl" % run_id)


def record_line(kind, payload):
    # payload is already JSON text, so a batch is serialised once for disk and wire alike
    return ('{"t":"%s","body":%s}\n' % (kind, payload)).encode()


def _lock(fd):
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _write_state(path, state):
    tmp = "%s.offset.tmp" % path
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, "%s.offset" % path)


def _read_state(path):
    try:
        with open("%s.offset" % path) as f:
            state = json.load(f)
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def _remove_state(path):
    try:
        os.unlink("%s.offset" % path)
    except FileNotFoundError:
        pass


class OwnSpool:
    """The spool of this process's run. Records are appended by the sender thread; the
    first few are also kept in memory so sending rarely rereads the file, the rest are read
    back from disk when their turn comes (a long offline run must not grow the heap).
    When the file cannot be written (read-only home, disk full) it degrades to a bounded
    in-memory list: data still flows while the server answers, and ``failed`` says so."""

    def __init__(self, path, header):
        self.path = path
        self.header = header
        # (end_offset, kind, payload, n_points); payload is the record's JSON text, or for
        # a metrics batch written by this process the bytes that go on the wire
        self.pending = collections.deque()
        self.unacked_points = 0
        self.failed = False
        self.errors = 0  # writes that failed: each one is a record living only in memory
        self.memory_drops = 0
        self._fd = None
        self._size = 0
        self._read_pos = 0  # end offset of the last record held in memory

    def _open(self):
        if self._fd is not None:
            return True
        if self.failed:
            return False
        base = self.path[: -len(".jsonl")]
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            # the plain name can be taken: another process attached to the same run, or
            # records an earlier process left (those stay for the replayer)
            for path in (self.path, "%s.%d.jsonl" % (base, os.getpid())):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
                if (_lock(fd) and os.fstat(fd).st_size == 0
                        and not os.path.exists(path + ".offset")):
                    self.path, self._fd, self._size = path, fd, 0
                    return True
                os.close(fd)
        except OSError:
            pass
        self.failed = True
        return False

    def append(self, kind, payload, n_points, wire=None):
        """Keep a record until the server acknowledges it: ``payload`` (JSON text) goes to
        the file; the copy kept in memory for sending is ``wire`` when given."""
        held = payload if wire is None else wire
        self.unacked_points += n_points
        if self._open():
            try:
                data = b""
                if self._size == 0:
                    data = (json.dumps(self.header, default=str) + "\n").encode()
                    self._read_pos = len(data)
                data += record_line(kind, payload)
                before = self._size
                os.write(self._fd, data)
                self._size += len(data)
                if self._read_pos >= before and len(self.pending) < MEMORY_RECORDS:
                    self.pending.append((self._size, kind, held, n_points))
                    self._read_pos = self._size
                return
            except OSError:
                self.failed = True
                self.close()
        self.errors += 1
        if len(self.pending) >= MEMORY_MAX_RECORDS:
            _, _, _, n = self.pending.popleft()
            self.unacked_points -= n
            self.memory_drops += 1
        self.pending.append((0, kind, held, n_points))

    def set_run(self, run_id, mode):
        # a local run that got registered later: what is on disk now belongs to run_id
        self.header = dict(self.header, run_id=run_id, mode=mode)
        if self._fd is not None and self._size:
            _write_state(self.path, {"offset": 0, "run_id": run_id})

    def peek(self):
        if not self.pending and self._fd is not None and self._read_pos < self._size:
            self._refill()
        return self.pending[0] if self.pending else None

    def _refill(self):
        data = os.pread(self._fd, max(0, self._size - self._read_pos), self._read_pos)
        pos = self._read_pos
        for line in data.splitlines(keepends=True):
            if len(self.pending) >= MEMORY_RECORDS or not line.endswith(b"\n"):
                break
            pos += len(line)
            try:
                rec = json.loads(line)
                if rec.get("t") in ("run", None):
                    continue
                body = rec["body"]
                n = body.get("n", len(body.get("points", ()))) if rec["t"] == "metrics" else 0
                self.pending.append((pos, rec["t"], json.dumps(body), n))
            except (ValueError, KeyError, AttributeError, TypeError):
                continue
        self._read_pos = pos

    def ack(self):
        _, _, _, n = self.pending.popleft()
        self.unacked_points -= n
        if not self.pending and self._fd is not None and self._read_pos >= self._size:
            # everything acknowledged: cut the file back so nothing is replayed twice
            os.ftruncate(self._fd, 0)
            self._size = self._read_pos = 0
            _remove_state(self.path)

    def has_data(self):
        return bool(self.pending) or self._size > 0

    def close(self):
        if self._fd is None:
            return
        try:
            if not self.pending and self._size == 0:
                os.unlink(self.path)
        except OSError:
            pass
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = None


class ForeignSpool:
    """A spool file left by another (finished) process, opened for replay."""

    def __init__(self, path, fd):
        self.path = path
        self._fd = fd
        self.state = _read_state(path)
        self.header = None

    @classmethod
    def open(cls, path):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        if not _lock(fd) or os.fstat(fd).st_nlink == 0:
            # its writer still lives, or another replayer finished and removed it
            os.close(fd)
            return None
        return cls(path, fd)

    def records(self):
        """Yield ``(end_offset, record)`` from where the last replay stopped. Sets
        ``header`` from the first line. A torn last line (the writer died mid-write) and
        lines that do not parse are skipped."""
        with os.fdopen(os.dup(self._fd), "rb") as f:
            f.seek(0)
            first = f.readline()
            try:
                self.header = json.loads(first)
            except ValueError:
                self.header = None
                return
            start = max(int(self.state.get("offset", 0)), f.tell())
            f.seek(start)
            offset = start
            for line in f:
                offset += len(line)
                if not line.endswith(b"\n"):
                    break
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "t" in rec:
                    yield offset, rec

    def read_header(self):
        for _ in self.records():
            break
        return self.header

    def advance(self, offset, **extra):
        self.state.update(extra)
        self.state["offset"] = offset
        _write_state(self.path, self.state)

    def remove(self):
        try:
            os.unlink(self.path)
        except OSError:
            pass
        _remove_state(self.path)

    def close(self):
        try:
            os.close(self._fd)
        except OSError:
            pass


def foreign_files(own_path):
    d = spool_dir()
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    return [os.path.join(d, n) for n in names
            if n.startswith("sdk-") and n.endswith(".jsonl") and os.path.join(d, n) != own_path]
