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


def test_a_v7_database_gets_a_time_on_every_rollup_bucket(tmp_path):
    """Schema v8 gave rollup buckets a time (first_ts); v7 buckets are backfilled from their
    raw points, each level from the one below, and read as today's rollup writes them."""
    from gpuplane import rollup
    ref = Database(tmp_path / "ref.db")
    with ref.tx() as c:
        run_id = runs.create(c, source="sdk", state="RUNNING")
    t0 = 1_764_000_000_000
    store = metrics.MetricStore(ref)
    store.ingest(run_id, ["loss", "acc"], [[k, s, 1.0 / (s + 1), t0 + 1000 * s + 37 * k]
                                            for s in range(20_000) for k in (0, 1)])
    rollup.roll_up(ref)
    ref.close()
    # The same rows in a v7 database: what the v7 rollup wrote, less the new column.
    path = tmp_path / "v7.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript("BEGIN;\n" + "\n".join(MIGRATIONS[:7]) + "\nPRAGMA user_version=7;\nCOMMIT;")
    conn.execute("ATTACH ? AS ref", (str(tmp_path / "ref.db"),))
    v7_cols = "key_id, width, bucket, first_step, last_step, min, max, sum, count, vcount, last"
    run_cols = ", ".join(r[1] for r in conn.execute("PRAGMA main.table_info(runs)"))
    for table, cols in (("runs", run_cols), ("metric_keys", "*"), ("points", "*"),
                        ("metric_rollup", "*"), ("rollups", v7_cols)):
        if cols == "*":     # the v7 table's columns: later migrations add some
            cols = ", ".join(r[1] for r in conn.execute(f"PRAGMA main.table_info({table})"))
        conn.execute(f"INSERT INTO main.{table} {'' if cols == '*' else f'({cols})'}"
                     f" SELECT {cols} FROM ref.{table}")
    conn.execute("DETACH ref")
    # A base bucket whose raw points were pruned keeps no time; the one above it still has one.
    key = conn.execute("SELECT id FROM metric_keys WHERE key = 'acc'").fetchone()[0]
    conn.execute("DELETE FROM points WHERE key_id = ? AND step < 16", (key,))
    conn.execute("UPDATE metric_rollup SET pruned_step = 15 WHERE key_id = ?", (key,))
    conn.close()

    db = Database(path)
    assert db.query_one("PRAGMA user_version")[0] == len(MIGRATIONS)
    got = {tuple(r[:3]): r[3] for r in db.query(
        "SELECT key_id, width, bucket, first_ts FROM rollups")}
    want = {tuple(r[:3]): r[3] for r in Database(tmp_path / "ref.db").query(
        "SELECT key_id, width, bucket, first_ts FROM rollups")}
    assert got.keys() == want.keys() and len(got) > 1000
    assert {w for _, w, _ in got} >= {16, 64, 256, 1024, 4096, 16384}
    pruned = {b for b in got if b[0] == key and b[2] == 0}        # bucket 0 at every level
    assert got[(key, 16, 0)] is None
    assert {got[b] for b in pruned if b[1] > 16} == {t0 + 16_000 + 37}    # from bucket 1
    assert {b: v for b, v in got.items() if b not in pruned} == \
        {b: v for b, v in want.items() if b not in pruned}
    # ... and the series answers every bucket with its time, as on a new database.
    loss = metrics.key_id(db, run_id, "loss")
    for max_points in (40, 400):
        _, pts = series.series(db, loss, max_points)
        assert [p[6] for p in pts] == [t0 + 1000 * p[0] for p in pts]


def test_a_v9_database_opens_with_sweeps(tmp_path):
    """Schema v10 added sweeps, their trials and a job's config / sweep / stop reason: a
    v9 database's jobs read with no config and no sweep, and a sweep can be written."""
    from gpuplane.db import sweeps
    path = tmp_path / "v9.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript("BEGIN;\n" + "\n".join(MIGRATIONS[:9]) + "\nPRAGMA user_version=9;\nCOMMIT;")
    conn.execute(ROWS["jobs"])
    conn.close()
    db = Database(path)
    assert db.query_one("PRAGMA user_version")[0] == len(MIGRATIONS)
    job = jobs.get(db, 1)
    assert job["config"] == {} and job["sweep_id"] is None and job["stop_reason"] is None
    with db.tx() as c:
        sweep_id = sweeps.create(c, "s", "default", "", {"parallel": 1}, [{"lr": 0.1}])
    assert [t["params"] for t in sweeps.trials(db, sweep_id)] == [{"lr": 0.1}]


def test_a_v10_database_opens_with_the_slurm_columns(tmp_path):
    """v11 (docs/slurm.md): nodes are local ('process') runners with no partition, attempts
    have no Slurm job, jobs ask nothing of Slurm, and the rows are as they were."""
    path = tmp_path / "v10.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript("BEGIN;\n" + "\n".join(MIGRATIONS[:10]) + "\nPRAGMA user_version=10;\nCOMMIT;")
    for table in ("nodes", "jobs", "runs"):
        conn.execute(ROWS[table])
    conn.close()
    db = Database(path)
    assert db.query_one("PRAGMA user_version")[0] == len(MIGRATIONS)
    assert [tuple(r) for r in db.query("SELECT name, runner, slurm, cursor FROM nodes")] == \
        [("n1", "process", None, 7)]
    assert [tuple(r) for r in db.query(
        "SELECT name, state, cpus, mem_mb, time_limit_min FROM jobs ORDER BY id")] == \
        [("train", "RUNNING", None, None, None), ("old", "SUCCEEDED", None, None, None)]
    assert [r[0] for r in db.query("SELECT slurm_job_id FROM runs")] == [None, None]


def test_a_v11_database_opens_with_resume_and_retention_columns(tmp_path):
    """Schema v12: a job's `resume`, a run's `resumed_from`, a checkpoint's pinned /
    deleted / bytes freed / why kept; rows written before read with none of them."""
    from gpuplane.db import checkpoints
    path = tmp_path / "v11.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript("BEGIN;\n" + "\n".join(MIGRATIONS[:11]) + "\nPRAGMA user_version=11;\nCOMMIT;")
    for t in ("jobs", "runs"):
        conn.execute(ROWS[t])
    conn.execute("INSERT INTO checkpoints (run_id, path, step, created_at, updated_at)"
                 " VALUES (1, '/w/c.pt', 2, 1, 1)")
    conn.execute("INSERT INTO experiments (project, name, created_at) VALUES ('default', 'e', 1)")
    conn.close()
    db = Database(path)
    assert jobs.get(db, 1)["resume"] is False and runs.get(db, 1)["resumed_from"] is None
    assert jobs.get(db, 1)["retention"] is None          # v14: no retention policy
    from gpuplane.db import projects
    assert projects.get_experiment(db, "default", "e")["retention"] is None     # v15
    c = checkpoints.get(db, 1)
    assert c["pinned"] is False and c["deleted_at"] is None and c["keep_reason"] is None
    with db.read() as conn:
        assert checkpoints.resume_candidates(conn, 1, 2) == [
            {"checkpoint_id": 1, "path": "/w/c.pt", "step": 2}]


def test_a_v12_database_marks_the_runs_of_evaluations(tmp_path):
    """Schema v13 gave runs a kind: the run of an EVALUATE job written before is marked
    EVALUATE with the checkpoint it scored; every other run is a TRAIN run."""
    path = tmp_path / "gpuctl.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for i, sql in enumerate(MIGRATIONS[:12]):
        conn.executescript("BEGIN;\n" + sql + f"\nPRAGMA user_version={i + 1};\nCOMMIT;")
    conn.executescript("""
        INSERT INTO jobs (id, name, command, working_dir, gpus, state, run_id, attempt,
                          created_at, queued_at) VALUES
            (1, 'train', '["python", "t.py"]', '/w', 1, 'SUCCEEDED', 1, 1, 1, 1);
        INSERT INTO runs (id, job_id, attempt, source, state, name, created_at)
            VALUES (1, 1, 1, 'job', 'SUCCEEDED', 'train', 1);
        INSERT INTO checkpoints (id, run_id, path, step, created_at, updated_at)
            VALUES (5, 1, '/w/c', 2, 2, 2);
        INSERT INTO jobs (id, name, kind, command, working_dir, gpus, state, run_id, attempt,
                          parent_checkpoint_id, created_at, queued_at) VALUES
            (2, 'eval-ckpt5', 'EVALUATE', '["python", "e.py"]', '/w', 1, 'SUCCEEDED', 2, 1,
             5, 3, 3);
        INSERT INTO runs (id, job_id, attempt, source, state, name, created_at)
            VALUES (2, 2, 1, 'job', 'SUCCEEDED', 'eval-ckpt5', 3),
                   (3, NULL, NULL, 'sdk', 'SUCCEEDED', 'notebook', 4);
    """)
    conn.close()
    db = Database(path)
    assert db.query_one("PRAGMA user_version")[0] == len(MIGRATIONS)
    got = {r["id"]: (r["kind"], r["parent_checkpoint_id"]) for r in runs.list_runs(db)}
    assert got == {1: ("TRAIN", None), 2: ("EVALUATE", 5), 3: ("TRAIN", None)}
    assert [r["id"] for r in runs.list_runs(db, kind="TRAIN")] == [3, 1]


def test_a_v18_database_keeps_its_sweep_trials_and_takes_a_samplers_rows(tmp_path):
    """v19 made sweep_trials anew (params may be NULL until a sampler asks; `told`): a
    v18 database's trials keep their parameters, job, rung, stop and re-run mark, with
    nothing told, and a sampler's trial rows can be written without parameters."""
    from gpuplane.db import sweeps
    path = tmp_path / "v18.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript("BEGIN;\n" + "\n".join(MIGRATIONS[:18]) + "\nPRAGMA user_version=18;\nCOMMIT;")
    conn.execute("INSERT INTO sweeps (name, spec, created_at) VALUES ('s', '{}', 1)")
    conn.execute("INSERT INTO sweep_trials (sweep_id, number, params, job_id, rung, stopped, "
                 "retry) VALUES (1, 0, '{\"lr\":0.1}', 7, 2, '{\"rule\":\"asha\"}', 1)")
    conn.execute("INSERT INTO sweep_trials (sweep_id, number, params) VALUES (1, 1, '{}')")
    conn.close()
    db = Database(path)
    assert db.query_one("PRAGMA user_version")[0] == len(MIGRATIONS)
    old = sweeps.trials(db, 1)
    assert [(t["number"], t["params"], t["job_id"], t["rung"], t["stopped"], t["retry"],
             t["told"]) for t in old] == [(0, {"lr": 0.1}, 7, 2, {"rule": "asha"}, True, None),
                                          (1, {}, None, 0, None, False, None)]
    assert [tuple(r) for r in db.query("SELECT name FROM sqlite_master WHERE type = 'index'"
                                       " AND tbl_name = 'sweep_trials' AND sql IS NOT NULL")] \
        == [("sweep_trials_job",)]
    with db.tx() as c:
        sid = sweeps.create(c, "t", "default", "", {"sampler": "tpe"}, [None, None])
        sweeps.set_trial_told(c, sweeps.trials(db, sid)[0]["id"], {"state": "FAIL"})
    assert [(t["params"], t["told"]) for t in sweeps.trials(db, sid)] == \
        [(None, {"state": "FAIL"}), (None, None)]
