"""The tokens tests/test_api.py does not walk: an agent token and a run's ingest token
against every route of the app's own route map. (tests/test_api.py walks no token, a
bad token, a read token, and an ingest token on `run` routes; it also fails when a route
is added without a scope.)

An agent token opens the agent WebSocket and nothing else. An ingest token reads and
writes its own run only: every other route refuses it, and a write route refuses it with
WriteScopeError.
"""

from gpuplane.app import create_app
from procs import route_url, route_walk

from .helpers import report

SCOPES = {"public", "any", "read", "write", "admin", "agent", "run"}


def _routes(tmp_path):
    app = create_app(tmp_path / "routes", start_threads=False)
    return [(m, rule.rule, getattr(view, "required_scope", None))
            for m, rule, view in route_walk(app)]


def _url(rule, run_id, job_id):
    return route_url(rule, run_id, job_id, path="k0")


def test_agent_and_ingest_tokens_reach_only_what_they_may(live_server, tmp_path):
    api = live_server.api
    job = api.submit(["true"], "/tmp", cpu_only=True)
    mine = api.post("/api/v1/runs", {"name": "mine"}, expect=201)
    api.post("/api/v1/runs", {"name": "other"}, expect=201)
    agent = api.post("/api/v1/tokens", {"name": "a", "scope": "agent",
                                      "node": "n1"}, expect=201)["token"]
    from gpuplane.db import Database, tokens
    _, ingest = tokens.create(Database(live_server.home / "server" / "gpuctl.db"),
                              "run", "ingest", run_id=mine["id"])
    routes = _routes(tmp_path)
    unclassified = [(m, r) for m, r, s in routes if s not in SCOPES]
    assert not unclassified, f"classify these routes with @requires(...): {unclassified}"

    s, wrong, checked = api.session, [], 0
    for method, rule, scope in routes:
        if scope in ("public", "agent") or not rule.startswith("/api/"):
            continue
        url = live_server.url + _url(rule, mine["id"], job["id"])

        def send(token):
            r = s.request(method, url, json={}, timeout=30, stream=True,
                          headers={"Authorization": f"Bearer {token}"})
            r.close() if r.status_code < 400 else r.content
            return r
        checked += 1
        r = send(agent)
        if scope != "any" and r.status_code != 403:
            wrong.append(("agent", method, rule, r.status_code))
        own_run = "<int:run_id>" in rule and scope in ("read", "run")
        r = send(ingest)
        if scope == "any" or own_run:
            if r.status_code in (401, 403):
                wrong.append(("ingest, own run", method, rule, r.status_code))
        elif r.status_code != 403:
            wrong.append(("ingest", method, rule, r.status_code))
        elif scope == "write" and r.json()["error"]["code"] != "WriteScopeError":
            wrong.append(("ingest code", method, rule, r.json()["error"]["code"]))
    report("token-scopes", routes=len(routes), checked=checked, wrong=len(wrong))
    assert checked > 12
    assert not wrong, wrong
