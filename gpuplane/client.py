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
    """(url, admin_token, server.toml path) of the server configured in the local home.

    The url comes from host/port (what this host can reach), else public_url. Either
    part is None when there is no such configuration.
    """
    from gpuplane import config

    home = config.home_dir(home)
    path = home / "server.toml"
    if not path.exists():
        return None, None, path
    cfg = config.load_server_config(home)
    if cfg.get("port"):
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


class Client:
    """One method per route of docs/api.md. Errors raise ApiError or ServerUnreachable."""

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

    # -- plumbing -------------------------------------------------------------

    def url(self, path):
        return f"{self.server}/api/v1/{path.lstrip('/')}"

    def request(self, method, path, *, params=None, body=None, timeout=None):
        url = self.url(path)
        if params:
            params = {k: v for k, v in params.items() if v is not None}
        try:
            resp = self._session.request(
                method, url, params=params or None, json=body,
                timeout=timeout or self.timeout)
        except requests.exceptions.Timeout:
            raise ServerUnreachable(self.server, "timed out") from None
        except requests.exceptions.ConnectionError as e:
            raise ServerUnreachable(self.server, _reason(e)) from None
        return self._answer(resp)

    def get(self, path, **params):
        return self.request("GET", path, params=params)

    def post(self, path, body=None):
        return self.request("POST", path, body=body if body is not None else {})

    def delete(self, path, **params):
        return self.request("DELETE", path, params=params)

    def put(self, path, body=None):
        return self.request("PUT", path, body=body if body is not None else {})

    def patch(self, path, body=None):
        return self.request("PATCH", path, body=body if body is not None else {})

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

    def health(self):
        return self.get("health")

    def whoami(self):
        return self.get("auth/whoami")

    def tokens(self):
        return self.get("tokens")["tokens"]

    def create_token(self, name, scope, node=None):
        """An agent token is bound to the one node name it may connect as."""
        body = {"name": name, "scope": scope}
        if node is not None:
            body["node"] = node
        return self.post("tokens", body)

    def revoke_token(self, token_id):
        return self.delete(f"tokens/{token_id}")

    # -- jobs -----------------------------------------------------------------

    def submit_job(self, command, working_dir, **fields):
        """Submit a job. `fields`: name, gpus, cpu_only, priority, max_attempts, env,
        project, experiment, tb_dir, watch_dir (None values are left to the server)."""
        body = {"command": command, "working_dir": working_dir}
        body.update({k: v for k, v in fields.items() if v is not None})
        return self.post("jobs", body)

    def list_jobs(self, state=None, limit=None):
        return self.get("jobs", state=state, limit=limit)["jobs"]

    def get_job(self, job_id):
        return self.get(f"jobs/{job_id}")

    def cancel_job(self, job_id):
        return self.post(f"jobs/{job_id}/cancel")

    def retry_job(self, job_id):
        return self.post(f"jobs/{job_id}/retry")

    def hold_job(self, job_id, held=True):
        return self.post(f"jobs/{job_id}/{'hold' if held else 'release'}")

    def edit_job(self, job_id, **fields):
        """Change a queued job: priority, after or after_any (None values are left out)."""
        return self.request("PATCH", f"jobs/{job_id}",
                            body={k: v for k, v in fields.items() if v is not None})

    def logs(self, job_id, tail=None):
        """{"lines": [...], "job_state"}: the lines the server keeps (the last 2000)."""
        return self.get(f"jobs/{job_id}/logs", tail=tail)

    def stream_logs(self, job_id, tail=None, last_event_id=None, reconnect_for=60.0,
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

    # -- nodes, queue, status ---------------------------------------------------------

    def nodes(self):
        return self.get("nodes")["nodes"]

    def queue(self):
        return self.get("queue")["jobs"]

    def status(self):
        return self.get("status")

    def placement_warning(self, job):
        """A sentence when no node known to the server could ever hold `job` (a job as
        answered by submit), else None. The job is queued either way: a node may come."""
        return placement_warning(job, self.nodes())

    # -- runs -------------------------------------------------------------------

    def list_runs(self, project=None, experiment=None, job_id=None, limit=None):
        return self.get("runs", project=project, experiment=experiment,
                        job_id=job_id, limit=limit)["runs"]

    def get_run(self, run_id):
        return self.get(f"runs/{run_id}")

    def run_metrics(self, run_id):
        """Per metric key of the run: count, latest, best, direction, trend."""
        return self.get(f"runs/{run_id}/metrics")["keys"]

    def metric_series(self, run_id, key, max_points=None, from_step=None, to_step=None):
        """One key's downsampled series. The key is quoted whole: keys hold `/`, and may
        hold `?`, `#`, spaces or any other character."""
        return self.get(f"runs/{run_id}/metrics/{quote(key)}", max_points=max_points,
                        from_step=from_step, to_step=to_step)

    def create_run(self, project=None, experiment=None, name=None, config=None, source="sdk"):
        body = {"project": project, "experiment": experiment, "name": name,
                "config": config, "source": source}
        return self.post("runs", {k: v for k, v in body.items() if v is not None})

    def finish_run(self, run_id, status="SUCCEEDED"):
        return self.post(f"runs/{run_id}/finish", {"status": status})

    def log_metrics(self, run_id, keys, points):
        """points: [[key_index, step, value, ts], ...] (the compact wire format)."""
        return self.post(f"runs/{run_id}/metrics", {"keys": keys, "points": points})

    def add_checkpoint(self, run_id, path, step=None, epoch=None, size_bytes=None):
        return self.post(f"runs/{run_id}/checkpoints", {
            "path": path, "step": step, "epoch": epoch, "size_bytes": size_bytes})

    def add_event(self, run_id, name, data=None, step=None, ts=None):
        return self.post(f"runs/{run_id}/events", {
            "name": name, "data": data, "step": step, "ts": ts})

    # -- observe, checkpoints, events, semantic (used by the MCP server; owner: mcp) ----------

    def list_checkpoints(self, run_id):
        return self.get(f"runs/{run_id}/checkpoints")

    def evaluate_checkpoint(self, checkpoint_id, command=None):
        body = {"command": command} if command else {}
        return self.post(f"checkpoints/{checkpoint_id}/evaluations", body)

    def recommend_checkpoint(self, run=None, experiment=None, project=None, key=None):
        return self.get("checkpoints:recommend", run=run, experiment=experiment,
                        project=project, key=key)

    def set_metric_definition(self, key, direction=None, primary=None, project=None,
                              experiment=None):
        body = {"key": key, "direction": direction, "primary": primary,
                "project": project, "experiment": experiment}
        return self.request("PUT", "metric-definitions",
                            body={k: v for k, v in body.items() if v is not None})

    def list_events(self, run=None, job=None, type=None, severity=None, since=None,
                    after=None, limit=None):
        return self.get("events", run=run, job=job, type=type, severity=severity,
                        since=since, after=after, limit=limit)

    def run_events(self, run_id, after=None, limit=None):
        return self.get(f"runs/{run_id}/events", after=after, limit=limit)

    def diagnose_run(self, run_id, key=None):
        return self.get(f"runs/{run_id}/diagnosis", key=key)

    def compare_runs(self, run_ids, keys=None, key=None):
        return self.get("runs:compare", ids=",".join(map(str, run_ids)),
                        keys=",".join(keys) if keys else None, key=key)

    def compare_checkpoints(self, run_ids, key=None):
        return self.get("checkpoints:compare", runs=",".join(map(str, run_ids)), key=key)

    def explain_failure(self, job_id):
        return self.get(f"jobs/{job_id}/explanation")

    # -- checkpoints, evaluations, projects, experiments, metric definitions (owner: ckpt) --

    def checkpoints(self, run=None, project=None, experiment=None, limit=None):
        return self.get("checkpoints", run=run, project=project, experiment=experiment,
                        limit=limit)

    def get_checkpoint(self, checkpoint_id):
        return self.get(f"checkpoints/{checkpoint_id}")

    def queue_evaluation(self, checkpoint_id, command=None, working_dir=None, gpus=None,
                         cpu_only=None):
        body = {"command": command, "working_dir": working_dir, "gpus": gpus,
                "cpu_only": cpu_only}
        return self.post(f"checkpoints/{checkpoint_id}/evaluations",
                         {k: v for k, v in body.items() if v is not None})

    def get_evaluation(self, evaluation_id):
        return self.get(f"evaluations/{evaluation_id}")

    def register_checkpoint(self, run_id, path, step=None, epoch=None, size_bytes=None,
                            fingerprint=None, source=None):
        body = {"path": path, "step": step, "epoch": epoch, "size_bytes": size_bytes,
                "fingerprint": fingerprint, "source": source}
        return self.post(f"runs/{run_id}/checkpoints",
                         {k: v for k, v in body.items() if v is not None})

    def update_run(self, run_id, config=None, tags=None, name=None):
        body = {"config": config, "tags": tags, "name": name}
        return self.patch(f"runs/{run_id}", {k: v for k, v in body.items() if v is not None})

    def projects(self, archived=False):
        return self.get("projects", archived=1 if archived else None)

    def create_project(self, name, description=None):
        return self.post("projects", {"name": name, "description": description or ""})

    def update_project(self, project, fields):
        """fields: name (a new name), description, archived."""
        return self.patch(f"projects/{quote(project)}", fields)

    def delete_project(self, name, archive=False):
        return self.delete(f"projects/{quote(name)}", archive=1 if archive else None)

    def experiments(self, project=None, archived=False):
        return self.get("experiments", project=project, archived=1 if archived else None)

    def create_experiment(self, project, name, description=None):
        return self.post(f"projects/{quote(project)}/experiments",
                         {"name": name, "description": description or ""})

    def update_experiment(self, project, experiment, fields):
        """fields: name (a new name), description, archived."""
        return self.patch(f"projects/{quote(project)}/experiments/{quote(experiment)}", fields)

    def delete_experiment(self, project, name, archive=False):
        return self.delete(f"projects/{quote(project)}/experiments/{quote(name)}",
                           archive=1 if archive else None)

    def experiment_runs(self, project, name, key=None):
        return self.get(f"projects/{quote(project)}/experiments/{quote(name)}/runs", key=key)

    def metric_definitions(self, project=None, experiment=None):
        return self.get("metric-definitions", project=project, experiment=experiment)

    def put_metric_definition(self, key, project=None, experiment=None, direction=None,
                              primary=None, description=None):
        body = {"key": key, "project": project, "experiment": experiment,
                "direction": direction, "primary": primary, "description": description}
        return self.put("metric-definitions", {k: v for k, v in body.items() if v is not None})

    def delete_metric_definition(self, key, project=None, experiment=None):
        return self.delete("metric-definitions", key=key, project=project,
                           experiment=experiment)


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
    largest = max(nodes, key=lambda n: len(n.get("gpus") or []))
    have = len(largest.get("gpus") or [])
    if have >= want:
        return None
    return (f"job {job['id']} needs {want} GPU{'s' if want != 1 else ''} on one node, and "
            f"the largest node ({largest.get('name')}) has {have}; it waits until such a "
            f"node connects. Cancel it (`gpuplane job cancel {job['id']}`) and submit with "
            f"-g {have}" + (" or --cpu-only" if have == 0 else "") + ", or add a bigger node")


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
