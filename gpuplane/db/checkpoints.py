"""Checkpoints: one insert path for the agent's watcher and the SDK.

The fingerprint rule: the same (run_id, path, fingerprint) is one checkpoint, reported
once or many times. A reporter that has no fingerprint of its own gets one made from the
step and the size, so a re-report of the same file is still one checkpoint.
"""


def default_fingerprint(step, size_bytes):
    return f"{step}:{size_bytes}"


def add(conn, run_id, path, step, epoch, size_bytes, fingerprint, ts):
    """Insert inside the caller's transaction; returns the checkpoint's id (the existing
    one when the same run, path and fingerprint were reported before)."""
    fp = fingerprint if fingerprint is not None else default_fingerprint(step, size_bytes)
    conn.execute(
        "INSERT INTO checkpoints (run_id, path, step, epoch, size_bytes, fingerprint,"
        " created_at) VALUES (?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
        (run_id, path, step, epoch, size_bytes, fp, ts))
    return conn.execute("SELECT id FROM checkpoints WHERE run_id = ? AND path = ?"
                        " AND fingerprint = ?", (run_id, path, fp)).fetchone()[0]
