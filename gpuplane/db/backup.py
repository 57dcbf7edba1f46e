"""Online backups and restore of the server's SQLite file.

A backup is SQLite's own backup API run in one step: it reads one consistent snapshot
(a WAL reader never blocks the writer), so the server goes on ingesting while it runs.
The copy is written beside its final name, checked with `PRAGMA integrity_check`,
fsynced and renamed, so `<home>/backups/` never holds a half-written file under a real
name. Restore is for a stopped server: it checks the file first and keeps the database
it replaces.
"""
import datetime
import os
import pathlib
import shutil
import sqlite3

from . import MIGRATIONS

PREFIX = "gpuctl-"
SUFFIX = ".db"


class BackupError(Exception):
    """A backup or restore that cannot be done; the message says why and what to do."""


def backup_dir(home):
    return pathlib.Path(home) / "backups"


def db_path(home):
    return pathlib.Path(home) / "server" / "gpuctl.db"


def check(path):
    """Integrity and schema version of a database file. Returns a dict; raises BackupError
    when the file is not a GPUPlane database this version can open."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise BackupError(f"{path} does not exist or is not a file")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            result = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            counts = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                      for t in ("jobs", "runs") if t in tables}
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise BackupError(f"{path} is not a readable SQLite database ({e})") from None
    if result != ["ok"]:
        raise BackupError(f"{path} fails the integrity check: {'; '.join(result[:5])}")
    if version == 0 or "jobs" not in tables:
        raise BackupError(f"{path} is not a GPUPlane database (no schema)")
    if version > len(MIGRATIONS):
        raise BackupError(f"{path} has schema version {version}, newer than this GPUPlane "
                          f"knows ({len(MIGRATIONS)}); upgrade GPUPlane first")
    return {"path": str(path), "schema_version": version, "size_bytes": path.stat().st_size,
            **counts}


def take(home, keep=7, now=None):
    """Back up the live database into <home>/backups/ and keep the newest `keep`.
    Returns the check() dict of the new file."""
    src_path = db_path(home)
    if not src_path.is_file():
        raise BackupError(f"no database at {src_path}; has a server run with this home?")
    out_dir = backup_dir(home)
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for side in [*out_dir.glob("*.partial-wal"), *out_dir.glob("*.partial-shm")]:
        if not side.with_name(side.name[:-4]).exists():   # left by an older version
            side.unlink(missing_ok=True)
    stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%d-%H%M%S-%f")
    final = out_dir / f"{PREFIX}{stamp}{SUFFIX}"
    tmp = final.with_name(final.name + ".partial")
    src = sqlite3.connect(str(src_path), timeout=30)
    try:
        src.execute("PRAGMA busy_timeout=30000")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        dst = sqlite3.connect(str(tmp))
        try:
            src.backup(dst)          # one step: one consistent snapshot
            # The copy comes in WAL mode (page 1 says so), and a WAL database opened
            # read-only by check() below leaves -wal and -shm beside it, which the rename
            # leaves behind as *.partial-wal / *.partial-shm. A backup is one file.
            dst.execute("PRAGMA journal_mode=DELETE")
        finally:
            dst.close()
    except sqlite3.Error as e:
        _remove_partial(tmp)
        raise BackupError(f"backup of {src_path} failed: {e}") from None
    finally:
        src.close()
    try:
        info = check(tmp)
    except BackupError:
        _remove_partial(tmp)
        raise
    _remove_partial(tmp, only_sidecars=True)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    info["path"] = str(final)
    prune(home, keep)
    return info


def _remove_partial(tmp, only_sidecars=False):
    for suffix in ("-wal", "-shm", "-journal") + (() if only_sidecars else ("",)):
        pathlib.Path(str(tmp) + suffix).unlink(missing_ok=True)


def list_backups(home):
    out_dir = backup_dir(home)
    if not out_dir.is_dir():
        return []
    files = sorted(p for p in out_dir.glob(f"{PREFIX}*{SUFFIX}") if p.is_file())
    return [{"path": str(p), "size_bytes": p.stat().st_size,
             "mtime": int(p.stat().st_mtime)} for p in files]


def prune(home, keep):
    """Remove all but the newest `keep` backups (names sort by time). Returns the removed."""
    if keep <= 0:
        return []
    files = [pathlib.Path(b["path"]) for b in list_backups(home)]
    doomed = files[:-keep]
    for p in doomed:
        p.unlink(missing_ok=True)
    return [str(p) for p in doomed]


def restore(home, source):
    """Put `source` in place of the server's database (the server must be stopped). The
    database it replaces is kept in <home>/backups/ as pre-restore-<time>.db. Returns
    (check() dict of the restored file, path of the kept old database or None)."""
    info = check(source)
    target = db_path(home)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    kept = None
    if target.exists():
        out_dir = backup_dir(home)
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        kept = out_dir / f"pre-restore-{stamp}{SUFFIX}"
        # Through the backup API, so a WAL that was never checkpointed comes along.
        src = sqlite3.connect(str(target))
        try:
            dst = sqlite3.connect(str(kept))
            try:
                src.backup(dst)
            finally:
                dst.close()
        finally:
            src.close()
        os.chmod(kept, 0o600)
    tmp = target.with_name(target.name + ".restoring")
    shutil.copyfile(source, tmp)
    os.chmod(tmp, 0o600)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    for suffix in ("-wal", "-shm"):
        pathlib.Path(str(target) + suffix).unlink(missing_ok=True)
    os.replace(tmp, target)
    info["path"] = str(target)
    return info, (str(kept) if kept else None)
