"""Bearer tokens and scopes.

Every route declares what it needs with one decorator, which also records it on the
view (`view.required_scope`) so a test can walk the route map and find an unclassified
route. Scopes: admin > write > read; `agent` only opens the agent WebSocket; `ingest`
writes to (and reads) its own run only.
"""
import functools

from flask import current_app, g, request

from .db import tokens
from .errors import Forbidden, Unauthorized, WriteScopeError

READ_SCOPES = {"admin", "write", "read"}
WRITE_SCOPES = {"admin", "write"}


def current_token():
    """The request's token row as a dict, or raise Unauthorized."""
    if "token" in g:
        return g.token
    header = request.headers.get("Authorization", "")
    secret = header[7:].strip() if header[:7].lower() == "bearer " else None
    if not secret:
        raise Unauthorized("no token: send 'Authorization: Bearer <token>' "
                           "(the admin token is in server.toml; `gpuplane token create` makes others)")
    row = tokens.lookup(current_app.config["DB"], secret)
    if row is None:
        raise Unauthorized("unknown or revoked token; create one with `gpuplane token create`")
    g.token = dict(row)
    return g.token


def _check(need, run_id=None):
    tok = current_token()
    scope = tok["scope"]
    if need == "any":
        return tok
    if need == "admin":
        if scope != "admin":
            raise Forbidden("this needs an admin token (the one in server.toml)")
    elif need == "read":
        if scope not in READ_SCOPES and not (scope == "ingest" and run_id is not None
                                             and tok["run_id"] == run_id):
            raise Forbidden(f"a {scope} token cannot read this; use a read token")
    elif need == "write":
        if scope not in WRITE_SCOPES:
            raise WriteScopeError(f"this token has {scope} scope; this route needs a write "
                                  "token (`gpuplane token create --scope write`)")
    elif need == "run":       # write, or the ingest token of this very run
        if scope == "ingest":
            if tok["run_id"] != run_id:
                raise Forbidden(f"this ingest token belongs to run {tok['run_id']}, "
                                f"not run {run_id}", code="ForbiddenRun")
        elif scope not in WRITE_SCOPES:
            raise WriteScopeError(f"this token has {scope} scope; writing to a run needs a "
                                  "write token or the run's own ingest token")
    elif need == "agent":
        if scope not in ("admin", "agent"):
            raise Forbidden("the agent connection needs an agent or admin token "
                            "(`gpuplane token create --name HOST --agent HOST`)")
    return tok


def requires(need):
    """Decorator: need is 'public', 'any', 'read', 'write', 'admin', 'agent' or 'run'.

    'read' and 'run' look for a `run_id` view argument so ingest tokens reach their run.
    """
    def deco(view):
        @functools.wraps(view)
        def wrapper(*args, **kwargs):
            if need != "public":
                _check(need, kwargs.get("run_id"))
            return view(*args, **kwargs)
        wrapper.required_scope = need
        return wrapper
    return deco
