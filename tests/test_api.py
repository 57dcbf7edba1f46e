"""Every route, walked from the app's own route map: scopes and the error shape."""

import pytest

from gpuplane.app import create_app
from procs import route_url, route_walk

SCOPES = {"public", "any", "read", "write", "admin", "agent", "run"}


@pytest.fixture(scope="module")
def routes(tmp_path_factory):
    app = create_app(tmp_path_factory.mktemp("routes"), start_threads=False)
    return [(method, rule.rule, getattr(view, "required_scope", None))
            for method, rule, view in route_walk(app)]


def test_every_route_declares_its_scope(routes):
    """A new route without @requires(...) fails here until it is classified."""
    unclassified = [(m, r) for m, r, scope in routes if scope not in SCOPES]
    assert not unclassified, f"routes without a scope: {unclassified}"
    assert len(routes) > 15


def _url(rule, run_id, job_id):
    # project and experiment names get "p"
    return route_url(rule, run_id, job_id, path="train/loss", name="p")


def _assert_error(resp, status, code=None):
    assert resp.status_code == status, (resp.request.method, resp.url, resp.status_code,
                                        resp.text[:300])
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    assert body["error"]["message"], "an error must say what to do"
    if code:
        assert body["error"]["code"] == code, body


def test_auth_matrix_over_every_route(live_server, routes):
    api = live_server.api
    job = api.submit(["true"], "/tmp", cpu_only=True)
    run = api.post("/api/v1/runs", {"project": "p", "name": "mine"}, expect=201)
    other = api.post("/api/v1/runs", {"project": "p", "name": "other"}, expect=201)
    read = api.post("/api/v1/tokens", {"name": "r", "scope": "read"}, expect=201)["token"]
    # An ingest token for `other` (the SDK's job tokens are of this kind).
    from gpuplane.db import Database, tokens
    db = Database(live_server.home / "server" / "gpuctl.db")
    _, ingest = tokens.create(db, "ingest", "ingest", run_id=other["id"])

    s = api.session
    checked = 0
    for method, rule, scope in routes:
        if rule.startswith("/api/v1/agent/ws") or not rule.startswith("/api/"):
            continue
        url = live_server.url + _url(rule, run["id"], job["id"])
        def send(token):
            # stream=True: the SSE route would otherwise never finish; only status matters
            r = s.request(method, url, json={}, timeout=30, stream=True,
                          headers={"Authorization": f"Bearer {token}" if token else ""})
            r.close() if r.status_code < 400 else r.content
            return r
        if scope == "public":
            assert send(None).status_code < 400
            continue
        _assert_error(send(None), 401, "Unauthorized")
        _assert_error(send("gpr_not-a-token"), 401, "Unauthorized")
        if scope in ("write", "run"):
            _assert_error(send(read), 403, "WriteScopeError")
        if scope == "admin":
            _assert_error(send(read), 403)
        if scope == "run":
            _assert_error(send(ingest), 403, "ForbiddenRun")
        if scope in ("read", "any"):
            assert send(read).status_code not in (401, 403), (method, url)
        checked += 1
    assert checked > 12
    # The agent endpoint refuses the handshake before upgrading.
    r = s.get(live_server.url + "/api/v1/agent/ws", headers={"Authorization": f"Bearer {read}"})
    _assert_error(r, 403)


def test_whoami_says_what_a_token_can_do(live_server):
    api = live_server.api
    assert api.get("/api/v1/auth/whoami", expect=200) == {
        "name": "admin (server.toml)", "scope": "admin", "can_write": True, "run_id": None}
    for scope, can_write in (("read", False), ("write", True)):
        t = api.post("/api/v1/tokens", {"name": scope, "scope": scope}, expect=201)["token"]
        who = api.session.get(live_server.url + "/api/v1/auth/whoami",
                              headers={"Authorization": f"Bearer {t}"}).json()
        assert (who["scope"], who["can_write"]) == (scope, can_write)


def test_revoked_tokens_stop_working(live_server):
    api = live_server.api
    made = api.post("/api/v1/tokens", {"name": "laptop", "scope": "write"}, expect=201)
    assert made["token"].startswith("gpw_")
    listed = api.get("/api/v1/tokens", expect=200)["tokens"]
    assert any(t["id"] == made["id"] for t in listed)
    assert all("token" not in t and "secret_hash" not in t for t in listed)
    api.request("DELETE", f"/api/v1/tokens/{made['id']}", expect=200)
    r = api.session.get(live_server.url + "/api/v1/jobs",
                        headers={"Authorization": f"Bearer {made['token']}"})
    _assert_error(r, 401)
    _assert_error(api.session.delete(live_server.url + "/api/v1/tokens/999"), 404, "NotFound")


BAD_BODIES = [b"", b"{", b"[1, 2]", b"null", b'"text"', b"[" * 5000 + b"]" * 5000,
              b'{"command": 5, "working_dir": 7, "gpus": "two", "name": {"a": 1}}',
              b'{"gpus": NaN, "priority": Infinity, "command": ["x"], "working_dir": "/t"}',
              b'{"status": 1, "name": 2, "scope": "root", "path": 3, "keys": 4}']


def test_error_shape_on_every_route_with_bad_input(live_server, routes):
    api = live_server.api
    job = api.submit(["true"], "/tmp", cpu_only=True)
    run = api.post("/api/v1/runs", {"name": "r"}, expect=201)
    before = api.get("/api/v1/jobs")["jobs"]
    for method, rule, scope in routes:
        if rule.startswith("/api/v1/agent/ws") or not rule.startswith("/api/"):
            continue
        for job_id, run_id in ((job["id"], run["id"]), (987654, 987654)):
            url = live_server.url + _url(rule, run_id, job_id)
            bodies = BAD_BODIES if method in ("POST", "PUT", "PATCH") else [b""]
            for raw in bodies:
                r = api.session.request(method, url, data=raw, timeout=30, stream=True,
                                        headers={"Content-Type": "application/json"})
                if r.status_code < 400:
                    r.close()       # e.g. the SSE stream of a live job
                    continue
                assert r.status_code < 500, (method, url, raw[:40], r.status_code, r.text[:300])
                if r.status_code >= 400:
                    _assert_error(r, r.status_code)
    # Bad query strings, unknown routes and methods answer the same shape.
    _assert_error(api.session.get(live_server.url + "/api/v1/jobs?limit=lots"), 400)
    _assert_error(api.session.get(live_server.url + "/api/v1/jobs?state=happy"), 400)
    _assert_error(api.session.get(live_server.url + "/api/v1/nothing-here"), 404)
    _assert_error(api.session.put(live_server.url + "/api/v1/jobs"), 405)
    _assert_error(api.session.post(live_server.url + "/api/v1/jobs",
                                   data=b"x" * (17 * 1024 * 1024)), 413)
    # nothing stored was lost or changed by all of that
    after = api.get("/api/v1/jobs")["jobs"]
    assert [j["id"] for j in after if j["id"] in {b["id"] for b in before}] == \
        [b["id"] for b in before]


@pytest.mark.parametrize("body, fragment", [
    ({"command": [], "working_dir": "/tmp"}, "'command' is required"),
    ({"command": ["python"], "working_dir": "relative/dir"}, "absolute path"),
    ({"command": ["python"], "working_dir": "/tmp", "gpus": 65}, "at most 64"),
    ({"command": ["python"], "working_dir": "/tmp", "gpus": 2, "cpu_only": True},
     "cpu_only job asks for no GPUs"),
    ({"command": ["python"], "working_dir": "/tmp", "env": {"A": 1}}, "string values"),
    ({"command": ["python"], "working_dir": "/tmp", "max_attempts": 0}, "at least 1"),
])
def test_submit_rejects_bad_specs_with_a_sentence_naming_the_fix(live_server, body, fragment):
    r = live_server.api.post("/api/v1/jobs", body)
    assert live_server.api.last.status_code == 400
    assert fragment in r["error"]["message"]
