"""The metric rollup thread: keeps the bucket levels up to date and prunes old raw points.

Every tick recomputes the buckets that newly ingested points touched (the step ranges
ingest recorded in `metric_dirty`; out-of-order and replaced points included). Once every
`retention_check_s` it deletes raw points older than `raw_retention_days` (server.toml;
0 or absent keeps them forever); rollups are kept, so series and summaries still work.
"""
import logging

from .db import metrics, now_ms
from .worker import Worker

log = logging.getLogger(__name__)

DAY_MS = 86_400_000


class Rollup(Worker):
    name = "rollup"
    interval = 1.0
    retention_check_s = 600

    def __init__(self, db, cfg=None):
        super().__init__()
        self.db = db
        self.retention_days = float((cfg or {}).get("raw_retention_days") or 0)
        self._next_prune = 0.0

    def tick(self):
        metrics.roll_up(self.db, stop=self._stop)
        if self.retention_days > 0 and now_ms() >= self._next_prune:
            self.prune()
            self._next_prune = now_ms() + self.retention_check_s * 1000

    def prune(self, now=None):
        """Delete raw points older than the retention period. Returns how many."""
        if self.retention_days <= 0:
            return 0
        cutoff = (now if now is not None else now_ms()) - int(self.retention_days * DAY_MS)
        deleted = metrics.prune_raw(self.db, cutoff)
        if deleted:
            log.info("pruned %d raw metric points older than %s days", deleted,
                     self.retention_days)
        return deleted
