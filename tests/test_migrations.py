"""A database written by the v1 schema opens with today's code: migrated forward, every
row still there."""
import sqlite3

from gpuplane import series
from gpuplane.db import MIGRATIONS, SCHEMA_V1, Database, events, jobs, logs, metrics, runs

ROWS = {
    "tokens": ("INSERT INTO tokens (name, scope, secret_hash, run_id, created_at)"
               " VALUES ('ci', 'write', 'h1', NULL, 1), ('run 1', 'ingest', 'h2', 1, 2)"),
    "nodes": ("INSERT INTO nodes (name, hostname, gpus, state, epoch, cursor, last_seen)"
              " VALUES ('n1', 'box', '[{\"index\": 0}]', 'connected', 'E', 7, 3)"),
    "jobs": ("INSERT INTO jobs (name, command, working_dir, gpus, state, node, gpu_indices,"
             " run_id, attempt, created_at, queued_at) VALUES"
             " ('train', '[\"python\", \"t.py\"]', '/w', 1, 'RUNNING', 'n1', '[0]', 1, 1, 1, 1),"
             " ('old', '[\"true\"]', '/w', 0, 'SUCCEEDED', NULL, NULL, NULL, 0, 1, 1)"),
    "runs": ("INSERT INTO runs (job_id, attempt, source, state, name, created_at) VALUES"
             " (1, 1, 'job', 'RUNNING', 'train', 1), (NULL, NULL, 'sdk', 'SUCCEEDED', 's', 2)"),
    "logs": ("INSERT INTO logs (job_id, attempt, line_no, ts, text) VALUES"
             " (1, 1, 1, 1, 'epoch 1'), (1, 1, 2, 2, 'epoch 2')"),
    "metric_keys": "INSERT INTO metric_keys (run_id, key) VALUES (1, 'loss'), (1, 'acc')",
    "points": ("INSERT INTO points (key_id, step, value, ts) VALUES"
               " (1, 1, 0.9, 1), (1, 2, 0.8, 2), (1, 3, NULL, 3), (2, 1, 0.5, 1)"),
    "checkpoints": ("INSERT INTO checkpoints (run_id, path, step, size_bytes, fingerprint,"
                    " created_at) VALUES (1, '/w/c.pt', 2, 10, 'f', 4)"),
    "events": ("INSERT INTO events (run_id, job_id, node, type, message, ts) VALUES"
               " (1, 1, 'n1', 'JOB_STARTED', 'job 1 attempt 1 started on n1', 5)"),
}


ORDER = {"points": "key_id, step", "checkpoints": "id"}


def v1_database(path):
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript("BEGIN;\n" + SCHEMA_V1 + "\nPRAGMA user_version=1;\nCOMMIT;")
    for sql in ROWS.values():
        conn.execute(sql)
    dump = {}
    for t in ROWS:
        cols = [r[1] for r in conn.execute(f"PRAGMA table_info({t})")]
        dump[t] = (cols, conn.execute(f"SELECT {', '.join(cols)} FROM {t}"
                                      f" ORDER BY {ORDER.get(t, 'rowid')}").fetchall())
    conn.close()
    return dump


def test_a_v1_database_migrates_and_every_row_survives(tmp_path):
    path = tmp_path / "gpuctl.db"
    before = v1_database(path)
    db = Database(path)
    assert db.query_one("PRAGMA user_version")[0] == len(MIGRATIONS)
    # Every v1 column of every row, by name (a later migration may rebuild a table and
    # add columns; none may lose a row or a value).
    for table, (cols, rows) in before.items():
        after = db.query(f"SELECT {', '.join(cols)} FROM {table}"
                         f" ORDER BY {ORDER.get(table, 'rowid')}")
        assert [tuple(r) for r in after] == [tuple(r) for r in rows], table
    # ... and today's code reads them.
    assert jobs.get(db, 1)["command"] == ["python", "t.py"]
    assert runs.get(db, 1)["state"] == "RUNNING"
    assert [line["text"] for line in logs.tail(db, 1, 10)] == ["epoch 1", "epoch 2"]
    assert events.list_events(db, job_id=1)[0]["type"] == "JOB_STARTED"
    # Points written before rollups existed are still answered (from raw).
    key = metrics.key_id(db, 1, "loss")
    assert [p[0] for p in series.series(db, key)[1]] == [1, 2, 3]
    assert series.summary(db, 1)[1]["count"] == 3


def test_opening_twice_does_not_migrate_again(tmp_path):
    path = tmp_path / "gpuctl.db"
    v1_database(path)
    Database(path).close()
    db = Database(path)
    assert db.query_one("SELECT count(*) FROM jobs")[0] == 2
