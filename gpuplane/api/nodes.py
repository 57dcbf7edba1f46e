"""Nodes, the queue, the combined status view, and the health check."""
from flask import Blueprint

from .. import __version__
from ..auth import requires
from ..db import jobs, nodes
from . import current_db

bp = Blueprint("nodes", __name__, url_prefix="/api/v1")


def node_views(db):
    """Nodes with each GPU's live readings and the job holding its slot."""
    active = jobs.active(db)
    out = []
    for n in nodes.list_nodes(db):
        stats = {g.get("index"): g for g in (n["stats"] or {}).get("gpus", [])}
        holder = {}
        cpu_jobs = []
        for j in active:
            if j["node"] != n["name"]:
                continue
            if j["cpu_only"]:
                cpu_jobs.append(j["id"])
            for i in j["gpu_indices"] or []:
                holder[i] = j["id"]
        gpus = []
        for g in n["gpus"]:
            live = stats.get(g.get("index"), {})
            gpus.append({**g, **{k: live.get(k) for k in
                                 ("util", "mem_used_mb", "temp_c", "power_w")},
                         "job_id": holder.get(g.get("index"))})
        out.append({"name": n["name"], "hostname": n["hostname"], "state": n["state"],
                    "synced": n["synced"], "last_seen": n["last_seen"], "fake": n["fake"],
                    "version": n["version"], "cpu_slots": n["cpu_slots"], "gpus": gpus,
                    "cpu_jobs": cpu_jobs, "host": (n["stats"] or {}).get("host")})
    return out


@bp.get("/health")
@requires("public")
def health():
    return {"ok": True, "version": __version__}


@bp.get("/nodes")
@requires("read")
def list_nodes():
    return {"nodes": node_views(current_db())}


@bp.get("/queue")
@requires("read")
def queue():
    return {"jobs": jobs.queued(current_db())}


@bp.get("/status")
@requires("read")
def status():
    db = current_db()
    return {"nodes": node_views(db), "queue": jobs.queued(db), "running": jobs.active(db)}
