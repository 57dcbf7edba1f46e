"""Scheduled backups: a thread that takes `gpuplane backup` every `backup_interval_h`
hours (server.toml; 0, the default, turns it off) and keeps the newest `backup_keep`.

The first one is due one interval after the newest backup already in <home>/backups/
(or at start when there is none), so restarts neither skip nor pile up backups.
"""
import logging
import time

from .db import backup
from .worker import Worker

log = logging.getLogger(__name__)


class BackupSchedule(Worker):
    name = "backups"
    interval = 60.0

    def __init__(self, home, interval_h, keep):
        super().__init__()
        self.home = home
        self.period_s = float(interval_h) * 3600
        self.keep = int(keep)
        newest = backup.list_backups(home)
        self.due = (newest[-1]["mtime"] + self.period_s) if newest else 0.0

    def tick(self, now=None):
        now = time.time() if now is None else now
        if self.period_s <= 0 or now < self.due:
            return None
        self.due = now + self.period_s
        try:
            info = backup.take(self.home, keep=self.keep)
        except backup.BackupError as e:
            log.error("scheduled backup failed: %s; next try in %.1f h", e, self.period_s / 3600)
            return None
        log.info("scheduled backup: %s (%.1f MB)", info["path"], info["size_bytes"] / 1e6)
        return info
