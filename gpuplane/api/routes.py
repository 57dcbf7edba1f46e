"""GET /api/v1/routes: the API's own map, so a client (the dashboard) can tell which
features this server has without probing for 404s."""
from flask import Blueprint, current_app

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
