"""GET /api/v1/routes: the API's own map, so a client (the dashboard) can tell which
features this server has without probing for 404s. GET /api/v1/ says where to start."""
from flask import Blueprint, current_app

from .. import __version__
from ..auth import requires

bp = Blueprint("routes", __name__, url_prefix="/api/v1")


@bp.get("/routes")
@requires("any")
def list_routes():
    out = []
    for rule in current_app.url_map.iter_rules():
        if not rule.rule.startswith("/api/v1/"):
            continue
        methods = sorted(m for m in rule.methods if m not in ("HEAD", "OPTIONS"))
        out.append({"rule": rule.rule, "methods": methods})
    out.sort(key=lambda r: r["rule"])
    return {"routes": out}


@bp.get("/")
@requires("public")
def index():
    # A person who opens the API's root in a browser or with curl learns where to go.
    return {"name": "GPUPlane", "version": __version__,
            "auth": "send 'Authorization: Bearer <token>' (gpuplane token show-admin on the "
                    "server's host prints the admin token)",
            "routes": "/api/v1/routes (the API's map, with a token)", "health": "/api/v1/health",
            "docs": "docs/api.md in the GPUPlane repository"}
