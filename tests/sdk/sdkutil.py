"""A real HTTP server that speaks the run routes of docs/api.md and records what it gets,
and can be told to misbehave (500, hang, reset, garbage, 401) to prove the SDK survives."""

import http.server
import json
import math
import os
import pathlib
import socket
import struct
import sys
import threading

from procs import wait_for  # noqa: F401  (the SDK tests import it from here)

SDK_DIR = pathlib.Path(__file__).resolve().parents[2] / "sdk"
if str(SDK_DIR) not in sys.path:
    sys.path.insert(0, str(SDK_DIR))

TOKEN = "test-token"



class IngestServer:
    """Modes: good, 500, hang, reset, garbage (not HTTP), garbage200 (200 with HTML), 401.
    ``fail_next`` makes the next N requests fail with 503 whatever the mode."""

    def __init__(self):
        self.mode = "good"
        self.fail_next = 0
        self.release = threading.Event()  # frees requests held by "hang"
        self.lock = threading.Lock()
        self.requests = []  # (method, path, headers, body) of every request
        self.applied = []  # (run_id, key, step, value) of every point applied in good mode
        self.runs = {}  # id -> body of POST /runs
        self.accepted = []  # (path, raw) of every request applied in good mode
        self.hung = 0
        self._next_run = 100
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                self._reply(200, {"ok": True})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                with server.lock:
                    server.requests.append((self.path, dict(self.headers), raw))
                    mode = server.mode
                    if server.fail_next > 0:
                        server.fail_next -= 1
                        mode = "503"
                if mode == "good":
                    return server.apply(self, raw)
                if mode in ("500", "503"):
                    return self._reply(int(mode), {"error": {"code": "Internal", "message": "x"}})
                if mode == "401":
                    return self._reply(401, {"error": {"code": "Unauthorized", "message": "x"}})
                if mode == "hang":
                    with server.lock:
                        server.hung += 1
                    server.release.wait(60)
                    return self._reply(503, {})
                if mode == "reset":
                    # RST instead of FIN: the client sees "connection reset by peer"
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                if mode == "garbage":
                    self.wfile.write(b"\x00\xffnot http at all\r\n\r\n")
                    self.close_connection = True
                    return
                if mode == "garbage200":
                    body = b"<html>captive portal</html>"
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return

            def _reply(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.handler = Handler
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def apply(self, h, raw):
        if h.headers.get("Authorization") != "Bearer %s" % TOKEN:
            return h._reply(401, {"error": {"code": "Unauthorized", "message": "bad token"}})
        try:
            body = decode_body(raw)
        except ValueError:
            return h._reply(400, {"error": {"code": "BadRequest", "message": "json"}})
        with self.lock:
            self.accepted.append((h.path, raw))
        parts = h.path.strip("/").split("/")  # api v1 runs [ID [what]]
        if parts == ["api", "v1", "runs"]:
            with self.lock:
                self._next_run += 1
                run_id = self._next_run
                self.runs[run_id] = body
            return h._reply(201, {"id": run_id, "source": body.get("source")})
        run_id, what = parts[3], parts[4]
        if what == "metrics":
            keys = body["keys"]
            with self.lock:
                for ki, step, value, ts in body["points"]:
                    self.applied.append((run_id, keys[ki], step, value))
            return h._reply(200, {"accepted": len(body["points"])})
        return h._reply(201 if what != "finish" else 200, {"ok": True})

    # -- what arrived ---------------------------------------------------------------------

    def identities(self, run_id):
        with self.lock:
            return {(k, s) for r, k, s, _ in self.applied if r == str(run_id)}

    def values(self, run_id):
        """{(key, step): set of values} of the good requests, NaN made comparable."""
        out = {}
        with self.lock:
            for r, k, s, v in self.applied:
                if r == str(run_id):
                    out.setdefault((k, s), set()).add("nan" if v != v else v)
        return out

    def posts(self, suffix):
        with self.lock:
            return [(p, decode_body(b)) for p, _, b in self.requests if p.endswith(suffix)]

    def accepted_posts(self, suffix):
        """Like posts(), but only the requests the server applied (not those it failed)."""
        with self.lock:
            return [(p, decode_body(b)) for p, b in self.accepted if p.endswith(suffix)]

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def decode_body(raw):
    """A request body as the server reads it: JSON, or a binary metrics batch."""
    if raw[:4] != b"GPP1":
        return json.loads(raw)
    import array
    (hlen,) = struct.unpack_from("<I", raw, 4)
    keys = json.loads(raw[8:8 + hlen])["keys"]
    (n,) = struct.unpack_from("<I", raw, 8 + hlen)
    offset, cols = 12 + hlen, []
    for code in "Iqdq":
        a = array.array(code)
        a.frombytes(raw[offset:offset + n * a.itemsize])
        offset += n * a.itemsize
        cols.append(a.tolist())
    if offset != len(raw):
        raise ValueError("binary batch of the wrong length")
    return {"keys": keys, "points": [list(p) for p in zip(*cols)]}


def spool_points(body):
    """[[key_index, step, value, ts], ...] of a spooled metrics record, in either form the
    SDK writes: column form ("cols", base64 of the binary columns) or JSON rows."""
    if "cols" not in body:
        return body["points"]
    import base64
    header = json.dumps({"keys": body["keys"]}).encode()
    raw = (b"GPP1" + struct.pack("<I", len(header)) + header + struct.pack("<I", body["n"])
           + base64.b64decode(body["cols"]))
    return decode_body(raw)["points"]


def sdk_env(home, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["GPUCTL_HOME"] = str(home)
    env["PYTHONPATH"] = str(SDK_DIR)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def isnan(v):
    return isinstance(v, float) and math.isnan(v)
