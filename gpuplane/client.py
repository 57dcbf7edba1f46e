"""REST client for the GPUPlane server, shared by the CLI and the MCP server.

Only `requests` and the standard library: the CLI and the MCP server reach the server
over REST and nothing else.
"""

import json
import os
import random
import time
import urllib.parse

import requests

DEFAULT_TIMEOUT = 30
# The server sends a keepalive comment every 15 s; silence for this long means the
# connection is dead even if the socket does not say so.
STREAM_READ_TIMEOUT = 60

__all__ = ["ApiError", "BadServerAddress", "Client", "ServerUnreachable", "resolve",
           "local_server"]


class ApiError(Exception):
    """The server answered with an error: `status` (HTTP), `code` and `message`."""

    def __init__(self, status, code, message):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def __str__(self):
        return self.message


class ServerUnreachable(ConnectionError):
    """No answer from the server at `url`."""

    def __init__(self, url, reason):
        self.url = url
        self.reason = reason
        super().__init__(f"cannot reach the GPUPlane server at {url} ({reason})")


def _connect_url(host, port):
    # A server bound to every interface is reached through loopback on its own host.
    if host in (None, "", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def local_server(home=None):
    """(url, admin_token, server.toml path) of the server of the local home.

    The url is where the server running on this home listens (it may have been started
    with --port), else host/port of server.toml (what this host can reach), else
    public_url. Either part is None when there is no such configuration.
    """
    from gpuplane import config

    home = config.home_dir(home)
    path = home / "server.toml"
    if not path.exists():
        return None, None, path
    cfg = config.load_server_config(home)
    running = config.running_address(home)
    if running:
        url = running
    elif cfg.get("port"):
        url = _connect_url(cfg.get("host"), cfg["port"])
    else:
        url = cfg.get("public_url")
    return url, cfg.get("admin_token"), path


class BadServerAddress(ValueError):
    """--server / $GPUCTL_SERVER is not an address a client can use."""


def normalize_server(text):
    """'http://host:port' from what a user types: a URL, or HOST:PORT, or HOST."""
    text = (text or "").strip().rstrip("/")
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError as e:
        raise BadServerAddress(f"server address {text!r} is not a URL ({e}); use "
                               "http://HOST:PORT or HOST:PORT, e.g. 127.0.0.1:8600") from None
    if parts.scheme not in ("http", "https"):
        raise BadServerAddress(f"server address {text!r} has scheme {parts.scheme!r}; use "
                               "http://HOST:PORT or https://HOST:PORT")
    if not parts.hostname:
        raise BadServerAddress(f"server address {text!r} names no host; use "
                               "http://HOST:PORT or HOST:PORT, e.g. 127.0.0.1:8600")
    if parts.query or parts.fragment:
        raise BadServerAddress(f"server address {text!r} has a query or fragment; give only "
                               "the scheme, host and port (and a path prefix, if any)")
    return text


def _is_loopback(host):
    if host is None:
        return False
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost.localdomain", "::1", "0:0:0:0:0:0:0:1"):
        return True
    return host.startswith("127.") and host.replace(".", "").isdigit()


def same_server(a, b):
    """Whether two addresses reach the same server: equal, or both on this host's loopback
    (localhost, 127.0.0.0/8, ::1) with the same port."""
    if not a or not b:
        return False
    pa, pb = urllib.parse.urlsplit(a.rstrip("/")), urllib.parse.urlsplit(b.rstrip("/"))
    if (pa.scheme, pa.hostname, pa.port, pa.path) == (pb.scheme, pb.hostname, pb.port, pb.path):
        return True
    default = {"http": 80, "https": 443}
    return (pa.scheme == pb.scheme and _is_loopback(pa.hostname) and _is_loopback(pb.hostname)
            and (pa.port or default.get(pa.scheme)) == (pb.port or default.get(pb.scheme))
            and pa.path == pb.path)


def resolve(server=None, token=None, home=None):
    """Pick (server_url, token): explicit arguments, then $GPUCTL_SERVER / $GPUCTL_TOKEN,
    then the local home's server.toml.

    The local admin token is only used when talking to that same local server, so a
    secret never goes to a server it does not belong to. Raises BadServerAddress for an
    address that is not one.
    """
    server = server or os.environ.get("GPUCTL_SERVER") or None
    token = token or os.environ.get("GPUCTL_TOKEN") or None
    if server:
        server = normalize_server(server)
    if server and token:
        return server, token
    local_url, admin_token, _ = local_server(home)
    if not server:
        server = (local_url or _connect_url("127.0.0.1", 8600)).rstrip("/")
    if not token and local_url and same_server(server, local_url):
        token = admin_token
    return server, token


def route(method, path):
    """Mark a Client method as the one that calls `method path` (a path under /api/v1
    with {placeholders}); tests/test_client.py checks that no route has two."""
    def mark(fn):
        fn.route = (method, path)
        return fn
    return mark


class Client:
    """One method per route of docs/api.md, named after the route's noun and verb
    (`list_jobs` is GET /jobs, `get_job` GET /jobs/ID, `cancel_job` POST /jobs/ID/cancel).
    Errors raise ApiError or ServerUnreachable."""

    def __init__(self, server=None, token=None, home=None, timeout=DEFAULT_TIMEOUT):
        self.server, self.token = resolve(server, token, home)
        self.timeout = timeout
        self._session = requests.Session()
        if self.token:
            self._session.headers["Authorization"] = f"Bearer {self.token}"
        self._session.headers["User-Agent"] = "gpuplane-client"

    def close(self):
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @classmethod
    def routes(cls):
        """{(method, path): method name} of every route this client calls."""
        return {fn.route: name for name, fn in vars(cls).items() if hasattr(fn, "route")}

    # -- plumbing -------------------------------------------------------------

    def url(self, path):
        return f"{self.server}/api/v1/{path.lstrip('/')}"

    def request(self, method, path, *, params=None, body=None, timeout=None):
        url = self.url(path)
        if params:
            params = {k: v for k, v in params.items() if v is not None}
        try:
            try:
                resp = self._session.request(
                    method, url, params=params or None, json=body,
                    timeout=timeout or self.timeout)
            except requests.exceptions.ConnectionError as e:
                # The server closes a connection idle for its keepalive (5 s); a GET sent on
                # it as it closes is reset. A GET is safe to send again, on a new connection.
                if method != "GET" or isinstance(e, requests.exceptions.Timeout):
                    raise
                resp = self._session.request(
                    method, url, params=params or None, json=body,
                    timeout=timeout or self.timeout)
        except requests.exceptions.Timeout:
            raise ServerUnreachable(self.server, "timed out") from None
        except requests.exceptions.ConnectionError as e:
            raise ServerUnreachable(self.server, _reason(e)) from None
        return self._answer(resp)

    def _get(self, path, **params):
        return self.request("GET", path, params=params)

    def _send(self, method, path, body=None, **params):
        """POST / PUT / PATCH / DELETE; None values of `body` are left to the server."""
        if body is not None:
            body = {k: v for k, v in body.items() if v is not None}
        elif method != "DELETE":
            body = {}
        return self.request(method, path, params=params, body=body)

    def _answer(self, resp):
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code >= 400:
            raise _error_from(resp, data)
        if data is None:
            raise ApiError(resp.status_code, "BadResponse",
                           f"{resp.url} answered something that is not JSON; "
                           "is --server pointing at a GPUPlane server?")
        return data

    # -- auth and tokens --------------------------------------------------------

    @route("GET", "health")
    def get_health(self):
        return self._get("health")

    @route("GET", "auth/whoami")
    def get_whoami(self):
        return self._get("auth/whoami")

    @route("GET", "tokens")
    def list_tokens(self):
        return self._get("tokens")["tokens"]

    @route("POST", "tokens")
    def create_token(self, name, scope, node=None):
        """An agent token is bound to the one node name it may connect as."""
        return self._send("POST", "tokens", {"name": name, "scope": scope, "node": node})

    @route("DELETE", "tokens/{id}")
    def revoke_token(self, token_id):
        return self._send("DELETE", f"tokens/{token_id}")

    # -- jobs -----------------------------------------------------------------

    @route("POST", "jobs")
    def submit_job(self, command, working_dir, **fields):
        """Submit a job. `fields`: name, gpus, cpu_only, priority, max_attempts, env,
        project, experiment, tb_dir, watch_dir, eval_command, after, ... (None values
        are left to the server)."""
        return self._send("POST", "jobs", {"command": command, "working_dir": working_dir,
                                           **fields})

    @route("GET", "jobs")
    def list_jobs(self, state=None, limit=None, ids=None):
        """Jobs, newest first; `ids`: only these (a list of ids)."""
        return self._get("jobs", state=state, limit=limit,
                         ids=",".join(map(str, ids)) if ids else None)["jobs"]

    @route("GET", "jobs/{id}")
    def get_job(self, job_id):
        return self._get(f"jobs/{job_id}")

    @route("POST", "jobs/{id}/cancel")
    def cancel_job(self, job_id):
        return self._send("POST", f"jobs/{job_id}/cancel")

    @route("POST", "jobs/{id}/retry")
    def retry_job(self, job_id, resume=None):
        return self._send("POST", f"jobs/{job_id}/retry", {"resume": resume})

    @route("POST", "jobs/{id}/hold")
    def hold_job(self, job_id):
        return self._send("POST", f"jobs/{job_id}/hold")

    @route("POST", "jobs/{id}/release")
    def release_job(self, job_id):
        return self._send("POST", f"jobs/{job_id}/release")

    @route("PATCH", "jobs/{id}")
    def update_job(self, job_id, **fields):
        """Change a queued job: priority, after or after_any (None values are left out)."""
        return self._send("PATCH", f"jobs/{job_id}", fields)

    @route("GET", "jobs/{id}/logs")
    def get_job_logs(self, job_id, tail=None):
        """{"lines": [...], "job_state"}: the lines the server keeps (the last 2000)."""
        return self._get(f"jobs/{job_id}/logs", tail=tail)

    @route("GET", "jobs/{id}/logs/stream")
    def stream_job_logs(self, job_id, tail=None, last_event_id=None, reconnect_for=60.0,
                        on_reconnect=None):
        """Yield log lines (dicts) as they arrive until the job has ended.

        A dropped connection is resumed with Last-Event-ID, so no line is lost or
        repeated; after `reconnect_for` seconds without getting back in, it raises
        ServerUnreachable. The first connection failing raises at once. `on_reconnect`
        (reason, seconds) is called once when a connection is lost, before waiting.
        """
        connected_once = False
        down_since = None
        delay = 0.25
        while True:
            params = {}
            headers = {"Accept": "text/event-stream"}
            if last_event_id is not None:
                headers["Last-Event-ID"] = str(last_event_id)
            elif tail is not None:
                params["tail"] = tail
            try:
                resp = self._session.get(
                    self.url(f"jobs/{job_id}/logs/stream"), params=params,
                    headers=headers, stream=True,
                    timeout=(self.timeout, STREAM_READ_TIMEOUT))
            except requests.exceptions.RequestException as e:
                if not connected_once:
                    raise ServerUnreachable(self.server, _reason(e)) from None
                resp = None
                reason = _reason(e)
            if resp is not None:
                if resp.status_code >= 400:
                    try:
                        data = resp.json()
                    except ValueError:
                        data = None
                    resp.close()
                    raise _error_from(resp, data)
                connected_once = True
                down_since = None
                delay = 0.25
                try:
                    with resp:
                        for event, event_id, data in _sse_events(resp):
                            if event_id is not None:
                                last_event_id = event_id
                            if event == "end":
                                return
                            if event in (None, "message", "line") and data:
                                yield json.loads(data)
                    reason = "the stream closed before the job ended"
                except requests.exceptions.RequestException as e:
                    reason = _reason(e)
            now = time.monotonic()
            if down_since is None and on_reconnect is not None:
                on_reconnect(reason, reconnect_for)    # once per outage: say what we wait for
            down_since = down_since or now
            if now - down_since > reconnect_for:
                raise ServerUnreachable(self.server, reason)
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)

    @route("GET", "jobs/{id}/explanation")
    def get_job_explanation(self, job_id):
        return self._get(f"jobs/{job_id}/explanation")

    # -- nodes and status -------------------------------------------------------

    @route("GET", "nodes")
    def list_nodes(self):
        return self._get("nodes")["nodes"]

    @route("GET", "status")
    def get_status(self):
        return self._get("status")

    # -- runs and their metrics -------------------------------------------------

    @route("POST", "runs")
    def create_run(self, project=None, experiment=None, name=None, config=None, source="sdk"):
        return self._send("POST", "runs", {"project": project, "experiment": experiment,
                                           "name": name, "config": config, "source": source})

    @route("GET", "runs")
    def list_runs(self, project=None, experiment=None, job_id=None, limit=None, kind=None,
                  best_evaluation=False, key=None):
        """kind: TRAIN or EVALUATE only; best_evaluation: each training run's best
        evaluated checkpoint by `key` (else its scope's primary metric)."""
        return self._get("runs", project=project, experiment=experiment, job_id=job_id,
                         limit=limit, kind=kind, best_evaluation=1 if best_evaluation else None,
                         key=key)["runs"]

    @route("GET", "runs/{id}")
    def get_run(self, run_id):
        return self._get(f"runs/{run_id}")

    @route("POST", "runs/{id}/finish")
    def finish_run(self, run_id, status="SUCCEEDED"):
        return self._send("POST", f"runs/{run_id}/finish", {"status": status})

    @route("POST", "runs/{id}/metrics")
    def log_run_metrics(self, run_id, keys, points):
        """points: [[key_index, step, value, ts], ...] (the compact wire format)."""
        return self._send("POST", f"runs/{run_id}/metrics", {"keys": keys, "points": points})

    @route("GET", "runs/{id}/metrics")
    def list_run_metrics(self, run_id):
        """Per metric key of the run: count, latest, best, direction, trend."""
        return self._get(f"runs/{run_id}/metrics")["keys"]

    @route("GET", "runs/{id}/metrics/{key}")
    def get_run_metric(self, run_id, key, max_points=None, from_step=None, to_step=None):
        """One key's downsampled series. The key is quoted whole: keys hold `/`, and may
        hold `?`, `#`, spaces or any other character."""
        return self._get(f"runs/{run_id}/metrics/{quote(key)}", max_points=max_points,
                         from_step=from_step, to_step=to_step)

    @route("GET", "metrics/series")
    def list_metric_series(self, run_ids, key, max_points=None):
        """One key's downsampled series of several runs: {"key", "series": [{"run_id",
        "points", "ts", "missing"?}]}."""
        return self._get("metrics/series", runs=",".join(map(str, run_ids)), key=key,
                         max_points=max_points)

    @route("GET", "runs/{id}/diagnosis")
    def get_run_diagnosis(self, run_id, key=None):
        return self._get(f"runs/{run_id}/diagnosis", key=key)

    @route("GET", "runs:compare")
    def compare_runs(self, run_ids, keys=None, key=None):
        return self._get("runs:compare", ids=",".join(map(str, run_ids)),
                         keys=",".join(keys) if keys else None, key=key)

    # -- checkpoints and evaluations -----------------------------------------------

    @route("POST", "runs/{id}/checkpoints")
    def create_checkpoint(self, run_id, path, step=None, epoch=None, size_bytes=None,
                          fingerprint=None, source=None):
        return self._send("POST", f"runs/{run_id}/checkpoints", {
            "path": path, "step": step, "epoch": epoch, "size_bytes": size_bytes,
            "fingerprint": fingerprint, "source": source})

    @route("GET", "checkpoints")
    def list_checkpoints(self, run=None, project=None, experiment=None, limit=None):
        return self._get("checkpoints", run=run, project=project, experiment=experiment,
                         limit=limit)

    @route("GET", "checkpoints/{id}")
    def get_checkpoint(self, checkpoint_id):
        return self._get(f"checkpoints/{checkpoint_id}")

    @route("POST", "checkpoints/{id}/evaluations")
    def create_evaluation(self, checkpoint_id, command=None, working_dir=None, gpus=None,
                          cpu_only=None):
        """Queue the EVALUATE job of a checkpoint (None values: the training job's)."""
        return self._send("POST", f"checkpoints/{checkpoint_id}/evaluations", {
            "command": command, "working_dir": working_dir, "gpus": gpus,
            "cpu_only": cpu_only})

    @route("GET", "checkpoints:compare")
    def compare_checkpoints(self, run_ids, key=None):
        return self._get("checkpoints:compare", runs=",".join(map(str, run_ids)), key=key)

    @route("POST", "checkpoints/{id}/pin")
    def pin_checkpoint(self, checkpoint_id, pinned=True):
        return self._send("POST", f"checkpoints/{checkpoint_id}/pin", {"pinned": pinned})

    @route("POST", "jobs/{id}/checkpoints:prune")
    def prune_job_checkpoints(self, job_id, keep_best=None, keep_last=None, dry_run=False):
        return self._send("POST", f"jobs/{job_id}/checkpoints:prune",
                          {"keep_best": keep_best, "keep_last": keep_last, "dry_run": dry_run})

    @route("GET", "checkpoints:recommend")
    def recommend_checkpoint(self, run=None, experiment=None, project=None, key=None,
                             sweep=None):
        return self._get("checkpoints:recommend", run=run, experiment=experiment,
                         project=project, key=key, sweep=sweep)

    # -- sweeps (docs/sweeps.md) ------------------------------------------------------

    @route("POST", "sweeps")
    def create_sweep(self, spec):
        return self._send("POST", "sweeps", spec)

    @route("GET", "sweeps")
    def list_sweeps(self, state=None, limit=None):
        return self._get("sweeps", state=state, limit=limit)

    @route("GET", "sweeps/{id}")
    def get_sweep(self, sweep_id):
        return self._get(f"sweeps/{sweep_id}")

    @route("POST", "sweeps/{id}/cancel")
    def cancel_sweep(self, sweep_id):
        return self._send("POST", f"sweeps/{sweep_id}/cancel")

    @route("POST", "sweeps/{id}/retry-failed")
    def retry_failed_sweep(self, sweep_id):
        return self._send("POST", f"sweeps/{sweep_id}/retry-failed")

    # -- projects, experiments, metric definitions ---------------------------------

    @route("GET", "projects")
    def list_projects(self, archived=False):
        return self._get("projects", archived=1 if archived else None)

    @route("POST", "projects")
    def create_project(self, name, description=None):
        return self._send("POST", "projects", {"name": name, "description": description or ""})

    @route("GET", "projects/{name}")
    def get_project(self, name):
        return self._get(f"projects/{quote(name)}")

    @route("PATCH", "projects/{name}")
    def update_project(self, project, fields):
        """fields: name (a new name), description, archived, time_limit, max_time_limit,
        preemptible (scheduling defaults; None clears one)."""
        return self._send("PATCH", f"projects/{quote(project)}", fields)

    @route("DELETE", "projects/{name}")
    def delete_project(self, name, archive=False):
        return self._send("DELETE", f"projects/{quote(name)}", archive=1 if archive else None)

    @route("GET", "experiments")
    def list_experiments(self, project=None, archived=False):
        return self._get("experiments", project=project, archived=1 if archived else None)

    @route("POST", "projects/{project}/experiments")
    def create_experiment(self, project, name, description=None):
        return self._send("POST", f"projects/{quote(project)}/experiments",
                          {"name": name, "description": description or ""})

    @route("PATCH", "projects/{project}/experiments/{name}")
    def update_experiment(self, project, experiment, fields):
        """fields: name (a new name), description, archived, retention (false: none)."""
        return self._send("PATCH", f"projects/{quote(project)}/experiments/{quote(experiment)}",
                          fields)

    @route("DELETE", "projects/{project}/experiments/{name}")
    def delete_experiment(self, project, name, archive=False):
        return self._send("DELETE", f"projects/{quote(project)}/experiments/{quote(name)}",
                          archive=1 if archive else None)

    @route("GET", "projects/{project}/experiments/{name}/runs")
    def list_experiment_runs(self, project, name, key=None):
        return self._get(f"projects/{quote(project)}/experiments/{quote(name)}/runs", key=key)

    @route("GET", "metric-definitions")
    def list_metric_definitions(self, project=None, experiment=None):
        return self._get("metric-definitions", project=project, experiment=experiment)

    @route("PUT", "metric-definitions")
    def set_metric_definition(self, key, project=None, experiment=None, direction=None,
                              primary=None, description=None):
        return self._send("PUT", "metric-definitions", {
            "key": key, "project": project, "experiment": experiment,
            "direction": direction, "primary": primary, "description": description})

    @route("DELETE", "metric-definitions")
    def delete_metric_definition(self, key, project=None, experiment=None):
        return self._send("DELETE", "metric-definitions", key=key, project=project,
                          experiment=experiment)

    # -- events -------------------------------------------------------------------

    @route("GET", "events")
    def list_events(self, run=None, job=None, type=None, severity=None, since=None,
                    after=None, limit=None):
        """{"events": [...], "last_id"}, oldest first."""
        return self._get("events", run=run, job=job, type=type, severity=severity,
                         since=since, after=after, limit=limit)


FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


class Waited(tuple):
    """What wait_for_jobs returns: (jobs, timed_out), and `event`, the critical event
    that ended an until_event wait (None otherwise)."""
    event = None


def wait_for_jobs(client, job_ids, any_=False, timeout_s=None, poll_s=1.0, on_end=None,
                  on_poll=None, until_event=False):
    """Wait until every job of `job_ids` has ended (any_: until one has), or timeout_s;
    until_event: or until a critical event is filed on one of them (one filed since the
    job was submitted counts, so an event before the wait began is not missed).

    Returns Waited((jobs, timed_out)), with .event: the jobs as GET /jobs lists them, in
    the order of `job_ids`. `on_end(job)` is called once for each job as it is seen ended
    (in the order they are seen); `on_poll()` after each look. One GET /jobs?ids= per
    poll_s (and with until_event one GET /events). An unknown id raises ApiError (404)
    before any waiting.
    """
    job_ids = list(dict.fromkeys(job_ids))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    cursor, found = None, None
    if until_event:
        cursor = client.list_events(limit=1)["last_id"] or 0
    for job_id in job_ids:      # unknown ids: the server's sentence, at once
        client.get_job(job_id)
        if until_event and found is None:
            evs = client.list_events(job=job_id, severity="critical", limit=1)["events"]
            found = evs[0] if evs else None
    seen = set()

    def done(jobs, timed_out, event=None):
        out = Waited((jobs, timed_out))
        out.event = event
        return out
    while True:
        if until_event and found is None:
            got = client.list_events(after=cursor, severity="critical", limit=1000)
            cursor = got["last_id"] or cursor
            found = next((e for e in got["events"] if e.get("job_id") in job_ids), None)
        by_id = {j["id"]: j for j in client.list_jobs(ids=job_ids, limit=len(job_ids))}
        jobs = [by_id[i] for i in job_ids if i in by_id]
        for j in jobs:
            if j["state"] in FINAL_STATES and j["id"] not in seen:
                seen.add(j["id"])
                if on_end is not None:
                    on_end(j)
        if on_poll is not None:
            on_poll()
        if found is not None:
            return done(jobs, False, found)
        ended = [j for j in jobs if j["state"] in FINAL_STATES]
        if (ended if any_ else len(ended) == len(jobs)):
            return done(jobs, False)
        if deadline is not None and time.monotonic() >= deadline:
            return done(jobs, True)
        time.sleep(poll_s if deadline is None
                   else max(0.0, min(poll_s, deadline - time.monotonic())))


def placement_warning(job, nodes):
    if job.get("cpu_only") or not job.get("gpus"):
        if not nodes:
            return (f"no node has connected yet; job {job['id']} waits for an agent "
                    "(see `gpuplane status`; docs/deploy.md starts one)")
        if not any((n.get("cpu_slots") or 0) > 0 for n in nodes):
            return (f"no node has CPU slots, so job {job['id']} (CPU only) cannot run until "
                    "an agent with cpu_slots > 0 connects")
        return None
    want = job["gpus"]
    if not nodes:
        return (f"no node has connected yet; job {job['id']} waits for an agent with "
                f"{want} GPU{'s' if want != 1 else ''} (see `gpuplane status`)")
    largest = max(nodes, key=_gpu_capacity)
    have = _gpu_capacity(largest)
    if have >= want:
        return None
    return (f"job {job['id']} needs {want} GPU{'s' if want != 1 else ''} on one node, and "
            f"the largest node ({largest.get('name')}) has {have}; it waits until such a "
            f"node connects. Cancel it (`gpuplane job cancel {job['id']}`) and submit with "
            f"-g {have}" + (" or --cpu-only" if have == 0 else "") + ", or add a bigger node")


def _gpu_capacity(node):
    """GPUs one job can have on a node: its cards, or a Slurm agent's largest node."""
    if node.get("runner") == "slurm":
        return int((node.get("slurm") or {}).get("max_gpus") or 0)
    return len(node.get("gpus") or [])


def quote(part):
    """One path segment, every reserved character escaped (`/` too)."""
    return urllib.parse.quote(str(part), safe="")


def _error_from(resp, data):
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return ApiError(resp.status_code, err.get("code") or "Error", err["message"])
    text = (resp.text or "").strip().splitlines()
    snippet = text[0][:200] if text else resp.reason
    return ApiError(resp.status_code, "HTTPError",
                    f"{resp.url} answered {resp.status_code}: {snippet}")


def _reason(exc):
    # requests nests urllib3's reason deep inside; the innermost line says it best.
    text = str(exc)
    for marker in ("Connection refused", "Name or service not known",
                   "No route to host", "timed out", "Network is unreachable",
                   "nodename nor servname", "Temporary failure in name resolution"):
        if marker in text:
            return marker.lower()
    return type(exc).__name__


def _sse_events(resp):
    """Parse a text/event-stream body into (event, id, data) tuples."""
    event, event_id, data = None, None, []
    for raw in resp.iter_lines(chunk_size=None):
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if line == "":
            if data or event:
                yield event, event_id, "\n".join(data)
            event, event_id, data = None, None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
        elif field == "id":
            event_id = value
    if data or event:
        yield event, event_id, "\n".join(data)
