"""whoami and token management."""
from flask import Blueprint

from ..auth import current_token, requires
from ..db import tokens
from ..errors import BadRequest, Conflict, NotFound
from .validate import body, field
from . import current_db

bp = Blueprint("auth", __name__, url_prefix="/api/v1")


@bp.get("/auth/whoami")
@requires("any")
def whoami():
    tok = current_token()
    bound = {"node": tok["node"]} if tok.get("node") else {}    # an agent token's node
    return {"name": tok["name"], "scope": tok["scope"], **bound,
            "can_write": tok["scope"] in ("admin", "write"), "run_id": tok["run_id"]}


@bp.get("/tokens")
@requires("admin")
def list_tokens():
    return {"tokens": [dict(t, revoked=bool(t["revoked"])) for t in tokens.list_all(current_db())]}


@bp.post("/tokens")
@requires("admin")
def create_token():
    data = body()
    name = field(data, "name", str, max_len=200).strip()
    if not name:
        raise BadRequest("'name' must not be empty; name the token after who uses it")
    scope = field(data, "scope", str, "read", choices=("read", "write", "admin", "agent"))
    node = field(data, "node", str, None, max_len=200, nullable=True)
    if scope == "agent" and not node:
        raise BadRequest("an agent token is bound to the one node it may connect as: give "
                         "'node' (`gpuplane token create --agent NODE`)")
    if node and scope != "agent":
        raise BadRequest("only an agent token is bound to a node; drop 'node' or use "
                         "scope agent")
    token_id, secret = tokens.create(current_db(), name, scope, node=node)
    return {"id": token_id, "name": name, "scope": scope, "node": node, "token": secret}, 201


@bp.delete("/tokens/<int:token_id>")
@requires("admin")
def revoke_token(token_id):
    row = tokens.get(current_db(), token_id)
    if row is None:
        raise NotFound(f"token {token_id} does not exist; see `gpuplane token list`")
    if row["name"] == tokens.SERVER_ADMIN:
        raise Conflict("this is the admin token from server.toml; to change it, edit "
                       "admin_token there and restart the server")
    tokens.revoke(current_db(), token_id)
    return {"id": token_id, "revoked": True}
