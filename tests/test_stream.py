"""The dashboard's multiplexed SSE stream (/api/v1/stream) and the route map."""
import json

import pytest
import requests

from gpuplane.api.stream import parse_topics
from gpuplane.errors import BadRequest
from procs import wait_for


def test_parse_topics():
    assert parse_topics("status, logs:17@420,events@3,events:run=5,job:2,run:9") == [
        ("status", None, None), ("logs", 17, 420), ("events", None, 3),
        ("events", ("run", 5), None), ("job", 2, None), ("run", 9, None)]
    for bad in ("", "nodes", "logs:x", "logs", "events:node=3", "status@x"):
        with pytest.raises(BadRequest):
            parse_topics(bad)


class Stream:
    def __init__(self, server, topics, headers=None):
        self.resp = requests.get(f"{server.url}/api/v1/stream", params={"topics": topics},
                                 headers={"Authorization": f"Bearer {server.token}", **(headers or {})},
                                 stream=True, timeout=30)
        self.lines = self.resp.iter_lines(decode_unicode=True)   # keep the iterator alive

    def next(self, topic):
        for line in self.lines:
            if line.startswith("data:"):
                msg = json.loads(line[5:])
                if msg["topic"] == topic:
                    return msg["data"]

    def close(self):
        self.resp.close()


def test_one_stream_carries_status_job_logs_and_events_and_resumes(live_server, agent, tmp_path):
    api = live_server.api
    (tmp_path / "say.py").write_text("print('one'); print('two')\n")
    job = api.submit(["python", "say.py"], tmp_path, cpu_only=True)
    api.wait_job(job["id"])
    s = Stream(live_server, f"status,job:{job['id']},logs:{job['id']},events:job={job['id']}")
    assert s.resp.status_code == 200
    status = s.next("status")
    assert [n["name"] for n in status["nodes"]] == ["node1"]
    assert s.next(f"job:{job['id']}")["state"] == "SUCCEEDED"
    lines = s.next(f"logs:{job['id']}")["lines"]
    assert [l["text"] for l in lines] == ["one", "two"]
    events = s.next(f"events:job={job['id']}")["events"]
    assert {e["type"] for e in events} >= {"QUEUED", "SUCCEEDED"}
    s.close()
    # A reconnect that names its cursors gets nothing twice.
    s = Stream(live_server, f"logs:{job['id']}@{lines[0]['id']},job:{job['id']}")
    assert [l["text"] for l in s.next(f"logs:{job['id']}")["lines"]] == ["two"]
    s.close()


def test_streams_over_the_cap_get_503_with_retry_after(server_factory):
    server = server_factory({"threads": 8, "agent_threads": 2, "rest_threads": 2})  # 4 SSE
    open_ = [Stream(server, "status") for _ in range(4)]
    assert all(s.resp.status_code == 200 for s in open_)
    third = Stream(server, "status")
    assert third.resp.status_code == 503
    assert third.resp.headers["Retry-After"] == "5"
    assert third.resp.json()["error"]["code"] == "TooManyStreams"
    open_[0].close()
    # The closed stream frees its slot once the server sees the hang-up (within a poll).
    def reopened():
        s = Stream(server, "status")
        if s.resp.status_code == 200:
            return s
        s.close()
    wait_for(reopened, 30, interval=0.5, what="a stream slot after a close").close()
    for s in open_[1:]:
        s.close()


def test_route_map_lists_the_api(live_server):
    routes = live_server.api.get("/api/v1/routes", expect=200)["routes"]
    rules = {}
    for r in routes:
        rules.setdefault(r["rule"], set()).update(r["methods"])
    assert rules["/api/v1/jobs"] == {"GET", "POST"}
    assert "/api/v1/stream" in rules


def test_static_files_are_served(live_server):
    r = requests.get(live_server.url + "/", timeout=10)
    assert r.status_code == 200 and "text/html" in r.headers["Content-Type"]
    assert requests.get(live_server.url + "/static/js/app.js", timeout=10).status_code == 200
    assert requests.get(live_server.url + "/static/vendor/uplot/LICENSE", timeout=10).ok
    assert requests.get(live_server.url + "/static/../gpuplane/app.py", timeout=10).status_code == 404
