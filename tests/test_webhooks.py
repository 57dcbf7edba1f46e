"""Webhooks against a real local HTTP receiver: what ntfy and Bark expect, and receivers
that refuse, hang or fail. The sender runs its real threads; nothing here sleeps to wait."""
import http.server
import json
import socket
import threading
import urllib.parse

import pytest

from gpuplane import webhooks
from gpuplane.db import Database, events
from procs import wait_for


class Receiver:
    """A real HTTP server that records requests; `mode` makes it answer 500 or hang."""

    def __init__(self):
        self.got = []
        self.mode = "ok"
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                if outer.mode == "hang":
                    outer.release.wait(10)
                outer.got.append({"method": self.command, "path": self.path,
                                  "headers": dict(self.headers), "body": body})
                code = 500 if outer.mode == "500" else 200
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            do_GET = do_POST = _any

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def db(tmp_path):
    return Database(tmp_path / "gpuctl.db")


def add(db, type="LOSS_NAN", severity="critical", message="train/loss became nan at step 3",
        run_id=7):
    with db.tx() as c:
        return events.record(c, {"type": type, "severity": severity, "message": message,
                                 "run_id": run_id, "job_id": 3, "step": 3,
                                 "data": {"key": "train/loss"}}, 0)[0]


def started(db, hooks):
    w = webhooks.Webhooks(db, {"webhooks": hooks})
    w.start()
    return w


def test_ntfy_gets_title_priority_and_tags_headers(db, receiver):
    w = started(db, [{"url": receiver.url + "/gpu-topic", "kind": "ntfy",
                      "min_severity": "warning"}])
    try:
        add(db, severity="info", type="USER", message="not for the phone")
        add(db)
        w.notify()
        wait_for(lambda: receiver.got, what="the ntfy post")
        req = receiver.got[0]
        assert req["method"] == "POST" and req["path"] == "/gpu-topic"
        assert req["headers"]["Title"] == "LOSS_NAN (critical) - run 7"
        assert req["headers"]["Priority"] == "5"
        assert req["headers"]["Tags"] == "rotating_light,loss_nan"
        assert req["body"] == b"train/loss became nan at step 3"
        assert len(receiver.got) == 1            # the info event stayed below min_severity
    finally:
        w.stop()


def test_bark_gets_title_and_body_in_the_url(db, receiver):
    w = started(db, [{"url": receiver.url + "/DEVICEKEY", "kind": "bark",
                      "types": ["OOM"]}])
    try:
        add(db)                                          # not an OOM: filtered out
        add(db, type="OOM", message="job 3 ran out of memory / lower the batch")
        w.notify()
        wait_for(lambda: receiver.got, what="the bark request")
        req = receiver.got[0]
        path, _, query = req["path"].partition("?")
        parts = path.split("/")
        assert req["method"] == "GET" and parts[1] == "DEVICEKEY"
        assert urllib.parse.unquote(parts[2]) == "OOM (critical) - run 7"
        assert urllib.parse.unquote(parts[3]) == "job 3 ran out of memory / lower the batch"
        assert urllib.parse.parse_qs(query) == {"group": ["gpuplane"],
                                                "level": ["timeSensitive"]}
        assert len(receiver.got) == 1
    finally:
        w.stop()


def test_json_posts_the_event_and_retries_a_500(db, receiver):
    receiver.mode = "500"
    w = started(db, [{"url": receiver.url + "/hook", "retries": 1}])
    try:
        add(db)
        w.notify()
        wait_for(lambda: w.senders[0].failed == 1, timeout=20, what="two tries, then give up")
        assert len(receiver.got) == 2
        body = json.loads(receiver.got[0]["body"])
        assert body["type"] == "LOSS_NAN" and body["run_id"] == 7 and body["count"] == 1
        receiver.mode = "ok"
        add(db, run_id=8)
        w.notify()
        wait_for(lambda: w.senders[0].sent == 1, what="the next event delivered")
    finally:
        w.stop()


def test_refused_and_hanging_receivers_do_not_block_the_others(db, receiver, caplog):
    receiver.mode = "hang"
    holder = socket.socket()          # bound, never listening: refused, and ours alone
    holder.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{holder.getsockname()[1]}/nobody"
    w = started(db, [{"url": dead, "retries": 0, "name": "dead"},
                     {"url": receiver.url + "/slow", "retries": 0, "timeout_s": 0.5,
                      "name": "slow"}])
    good = Receiver()
    w2 = started(db, [{"url": good.url + "/fine", "name": "fine"}])
    try:
        add(db)
        w.notify()
        w2.notify()
        wait_for(lambda: good.got, what="the healthy receiver served")
        wait_for(lambda: w.senders[0].failed == 1 and w.senders[1].failed == 1,
                 timeout=20, what="refused and timed out")
        text = caplog.text
        assert "webhook dead: gave up on event" in text and "ConnectionError" in text
        assert "webhook slow: gave up on event" in text and "Timeout" in text
    finally:
        receiver.release.set()
        holder.close()
        w.stop()
        w2.stop()
        good.close()


def test_bad_webhook_config_names_the_entry_and_key():
    for bad, words in (
            ([{"url": "ftp://x"}], "webhooks[0] in server.toml: url must be an http(s) URL"),
            ([{"url": "http://x", "kind": "slack"}], "kind must be one of ntfy, bark, json"),
            ([{"url": "http://x", "min_severity": "loud"}], "min_severity must be info"),
            ([{"url": "http://x", "types": "OOM"}], "types must be a list"),
            ([{"url": "http://x", "oops": 1}], "unknown keys ['oops']"),
            ({"url": "http://x"}, "must be a list of tables")):
        with pytest.raises(webhooks.WebhookConfigError) as e:
            webhooks.parse_webhooks(bad)
        assert words in str(e.value)


def test_a_bad_webhook_in_server_toml_stops_the_server_with_a_sentence(tmp_path):
    from gpuplane.app import create_app
    from gpuplane.config import ConfigError
    (tmp_path / "server.toml").write_text('[[webhooks]]\nurl = "https://ntfy.sh/t"\n'
                                          'kind = "ntfy"\nmin_severity = "urgent"\n')
    with pytest.raises(ConfigError, match=r"webhooks\[0\] in server.toml: min_severity"):
        create_app(tmp_path, start_threads=False)
