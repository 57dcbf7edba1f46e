"""gpuplane/series.py: a query never lags the ingest, even for points that arrive out of
order below the rolled step before the next roll-up."""
from gpuplane import rollup, series
from gpuplane.db import Database, metrics, runs


def test_points_below_the_rolled_step_count_before_the_next_rollup(tmp_path):
    db = Database(tmp_path / "gpuctl.db")
    with db.tx() as c:
        run_id = runs.create(c, source="sdk", state="RUNNING")
    store = metrics.MetricStore(db)

    def put(lo, hi):
        store.ingest(run_id, ["loss"], [[0, s, 1.0 / (s + 1), 1] for s in range(lo, hi)])

    put(5000, 10_000)
    rollup.roll_up(db)
    put(0, 5000)                        # out of order, below the rolled step
    key = metrics.key_id(db, run_id, "loss")
    for max_points in (10, 100, 1000):
        _, pts = series.series(db, key, max_points=max_points)
        assert sum(p[5] for p in pts) == 10_000
    assert series.summary(db, run_id)[0]["count"] == 10_000
    rollup.roll_up(db)
    _, pts = series.series(db, key, max_points=100)
    assert sum(p[5] for p in pts) == 10_000 and pts[0][0] == 0


def test_every_bucket_carries_the_earliest_time_of_its_points(tmp_path):
    """The wall-clock axis: a bucket's ts is the min ts of its points, at every level,
    whether it is read from rollups, from raw points past the rolled step or merged."""
    db = Database(tmp_path / "gpuctl.db")
    with db.tx() as c:
        run_id = runs.create(c, source="sdk", state="RUNNING")
    store = metrics.MetricStore(db)
    t0 = 1_764_000_000_000

    def ts(s):                  # not monotonic inside a bucket: min() must be taken
        return t0 + 10 * s + (7 if s % 16 == 0 else 0)

    store.ingest(run_id, ["loss"], [[0, s, float(s % 13), ts(s)] for s in range(70_000)])
    rollup.roll_up(db)
    store.ingest(run_id, ["loss"], [[0, s, 1.0, ts(s)] for s in range(70_000, 75_000)])
    key = metrics.key_id(db, run_id, "loss")
    by_step = {s: ts(s) for s in range(75_000)}
    for max_points, lo, hi in ((50, None, None), (700, None, None), (5000, None, None),
                               (100, 1000, 1100), (100, 60_000, 74_000)):
        level, pts = series.series(db, key, max_points, lo, hi)
        assert pts and all(len(p) == 7 for p in pts)
        bounds = [p[0] for p in pts] + [hi + 1 if hi is not None else 75_000]
        for p, end in zip(pts, bounds[1:]):
            assert p[6] == min(by_step[s] for s in range(p[0], end)), (max_points, level, p[0])
    # The rollups themselves hold it (they answer after the raw points are pruned).
    rows = db.query("SELECT width, first_step, last_step, first_ts FROM rollups"
                    " WHERE key_id = ? AND width IN (16, 256, 65536)", (key,))
    assert rows and all(r[3] == min(by_step[s] for s in range(r[1], r[2] + 1)) for r in rows)
