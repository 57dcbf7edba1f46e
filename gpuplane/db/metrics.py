"""Metric points: keys per run, raw points keyed by (key, step)."""
import math


def key_ids(conn, run_id, keys):
    """Map key names to ids for a run, creating the missing ones."""
    conn.executemany("INSERT OR IGNORE INTO metric_keys (run_id, key) VALUES (?, ?)",
                     [(run_id, k) for k in set(keys)])
    marks = ",".join("?" * len(set(keys)))
    rows = conn.execute(f"SELECT key, id FROM metric_keys WHERE run_id = ? AND key IN ({marks})",
                        (run_id, *set(keys))).fetchall()
    return {r[0]: r[1] for r in rows}


def _value(v):
    if isinstance(v, str):
        v = float(v)        # "NaN", "Infinity", "-Infinity"
    v = float(v)
    # SQLite stores NaN as NULL; keep NaN distinguishable from "no value" by the key's
    # presence and a NULL value.
    return None if math.isnan(v) else v


def ingest(conn, run_id, keys, points):
    """points: [[key_index, step, value, ts], ...]. Same (key, step) again replaces."""
    if not points:
        return 0
    ids = key_ids(conn, run_id, keys)
    idx = [ids[k] for k in keys]
    conn.executemany(
        "INSERT OR REPLACE INTO points (key_id, step, value, ts) VALUES (?,?,?,?)",
        [(idx[k], int(step), _value(v), int(ts)) for k, step, v, ts in points])
    return len(points)
