"""Job log lines: the server keeps the last N per job (the agent keeps them all)."""


def append(conn, job_id, attempt, lines, keep=2000):
    """Insert [[line_no, ts, text], ...]; a line seen before is ignored. Returns rows added."""
    before = conn.total_changes
    conn.executemany(
        "INSERT OR IGNORE INTO logs (job_id, attempt, line_no, ts, text) VALUES (?,?,?,?,?)",
        [(job_id, attempt, int(no), int(ts), str(text)) for no, ts, text in lines])
    added = conn.total_changes - before
    if added:
        conn.execute(
            "DELETE FROM logs WHERE job_id = ? AND id <= (SELECT id FROM logs WHERE job_id = ?"
            " ORDER BY id DESC LIMIT 1 OFFSET ?)", (job_id, job_id, keep))
    return added


def tail(db, job_id, n=100):
    rows = db.query("SELECT id, attempt, line_no, ts, text FROM logs WHERE job_id = ?"
                    " ORDER BY id DESC LIMIT ?", (job_id, n))
    return [dict(r) for r in reversed(rows)]


def after(db, job_id, after_id, limit=1000):
    return [dict(r) for r in db.query(
        "SELECT id, attempt, line_no, ts, text FROM logs WHERE job_id = ? AND id > ?"
        " ORDER BY id LIMIT ?", (job_id, after_id, limit))]
