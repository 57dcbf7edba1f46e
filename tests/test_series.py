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
