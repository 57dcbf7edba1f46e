"""Nodes, the queue, the combined status view, and the health check."""
from flask import Blueprint, current_app

from .. import __version__
from ..auth import requires
from ..db import jobs, nodes
from . import current_db

bp = Blueprint("nodes", __name__, url_prefix="/api/v1")


def node_views(db, active=None):
    """Nodes with each GPU's live readings and the job holding its slot."""
    if active is None:
        active = jobs.active(db)
    by_node = {}
    for j in active:
        by_node.setdefault(j["node"], []).append(j)
    out = []
    for n in nodes.list_nodes(db):
        # The gateway refuses readings of another shape; a row stored before it did (or
        # written by hand) must still not make /status, /nodes or the stream a 500.
        raw = n["stats"] if isinstance(n["stats"], dict) else {}
        stats = {_hashable(g.get("index")): g for g in _objects(raw.get("gpus"))}
        holder = {}
        cpu_jobs = []
        for j in by_node.get(n["name"], ()):
            if j["cpu_only"] or n.get("runner") == "slurm":    # a Slurm node: every job
                cpu_jobs.append(j["id"])
            for i in j["gpu_indices"] or []:
                holder[i] = j["id"]
        gpus = []
        for g in _objects(n["gpus"]):
            live = stats.get(_hashable(g.get("index")), {})
            gpus.append({**g, **{k: live.get(k) for k in
                                 ("util", "mem_used_mb", "temp_c", "power_w")},
                         "job_id": holder.get(g.get("index"))})
        out.append({"name": n["name"], "hostname": n["hostname"], "state": n["state"],
                    "synced": n["synced"], "last_seen": n["last_seen"], "fake": n["fake"],
                    "version": n["version"], "cpu_slots": n["cpu_slots"], "gpus": gpus,
                    "cpu_jobs": cpu_jobs,
                    "host": raw.get("host") if isinstance(raw.get("host"), dict) else None,
                    # a Slurm agent: what its partition offers, its job slots (docs/slurm.md)
                    "runner": n.get("runner") or "process", "slurm": n.get("slurm")})
    return out


def _objects(v):
    return [g for g in v if isinstance(g, dict)] if isinstance(v, list) else []


def _hashable(v):
    return v if isinstance(v, (int, str, float, type(None))) else None


@bp.get("/health")
@requires("public")
def health():
    db = current_db()
    failing = db.write_error and db.probe_write()
    if failing:
        message = (f"the server cannot write to its database ({failing}); free disk space "
                   "or make the server's home writable")
        return {"ok": False, "version": __version__, "writes": f"failing: {failing}",
                "error": {"code": "Unavailable", "message": message}}, 503
    return {"ok": True, "version": __version__, "writes": "ok"}


@bp.get("/nodes")
@requires("read")
def list_nodes():
    return {"nodes": node_views(current_db())}


def _brief(job_list):
    # List views leave `env` out: it may be 64 KiB a job, and it holds secrets.
    return [{k: v for k, v in j.items() if k != "env"} for j in job_list]


@bp.get("/queue")
@requires("read")
def queue():
    return {"jobs": _brief(jobs.queued(current_db()))}


def status_view(db, scheduler=None):
    """Nodes, the queue and running jobs (without env) in one read, and the GPUs the
    scheduler holds for the queue's head: REST and the stream."""
    active = jobs.active(db)
    held = getattr(scheduler, "reservation", None)
    return {"nodes": node_views(db, active), "queue": _brief(jobs.queued(db)),
            "running": _brief(active),
            # the GPUs backfill holds for the queue's head (docs/scheduling.md)
            "reservations": [held] if held else []}


@bp.get("/status")
@requires("read")
def status():
    return status_view(current_db(), current_app.config.get("SCHEDULER"))
