"""A tiny stand-in for the server side of docs/protocol.md, for the agent's unit tests.

A stdlib listening socket on a free port, simple_websocket's Server per connection, and the
protocol's cursor rule (apply seq > cursor, ack, `resend` on a gap). Everything it saw is
kept for assertions; `wait_for` polls a condition with a deadline.
"""
import json
import socket
import threading
import time

import simple_websocket


class FakeServer:
    def __init__(self, token="agent-secret", ack=True, heartbeat_s=0.2, keep_points=True):
        self.token = token
        self.heartbeat_s = heartbeat_s
        self.ack = ack                 # False: swallow batches (ack timeout path)
        self.lock = threading.RLock()     # wait_for predicates may call records()
        self.epoch = None
        self.cursor = 0
        self.applied = []              # records applied, in order (the server's truth)
        self.swallowed = []            # records of the batches swallowed while ack is False
        self.batches = 0
        self.hellos, self.syncs, self.closes = [], [], []
        self.heartbeats = 0
        self.heartbeat_times = []      # time.monotonic() of each heartbeat's arrival
        self.heartbeat_sent = []       # the agent's `ts` of each heartbeat
        # False: a metrics record keeps only `n_points` (millions of small lists would make
        # this process's garbage collector, not the agent, the slow side of a test)
        self.keep_points = keep_points
        self.rejected = 0
        self.ws = None                 # the live session
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._threads = []
        t = threading.Thread(target=self._accept_loop, daemon=True, name="fake-server")
        t.start()
        self._threads.append(t)

    # -- test helpers ----------------------------------------------------------------------

    def wait_for(self, predicate, timeout=20.0, what="condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                value = predicate()
            if value:
                return value
            self._stop.wait(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def send(self, msg):
        ws = self.wait_for(lambda: self.ws, what="a connected agent")
        ws.send(json.dumps(msg))

    def drop(self):
        """Close the live session as a crashing server would."""
        ws, self.ws = self.ws, None
        if ws is not None:
            try:
                ws.close()
            except Exception:
                pass

    def records(self, kind=None):
        with self.lock:
            return [r for r in self.applied if kind is None or r["kind"] == kind]

    def stop(self):
        self._stop.set()
        self.drop()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)     # wakes the blocked accept()
        except OSError:
            pass
        self._sock.close()
        for t in self._threads:
            t.join(5)

    # -- server ----------------------------------------------------------------------------

    def _accept_loop(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn):
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                conn.close()
                return
            head += chunk
        lines = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
        environ = {"werkzeug.socket": conn}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            environ["HTTP_" + k.strip().upper().replace("-", "_")] = v.strip()
        ws = simple_websocket.Server(environ)
        if environ.get("HTTP_AUTHORIZATION") != f"Bearer {self.token}":
            with self.lock:
                self.rejected += 1
            ws.close(4401, "unknown token")
            return
        self.ws = ws
        try:
            while not self._stop.is_set():
                raw = ws.receive(timeout=0.5)
                if raw is None:
                    continue
                reply = self._handle(json.loads(raw))
                if reply is not None:
                    ws.send(json.dumps(reply))
        except simple_websocket.ConnectionClosed as e:
            with self.lock:
                self.closes.append(e.reason)
        finally:
            if self.ws is ws:
                self.ws = None

    def _handle(self, msg):
        with self.lock:
            kind = msg["type"]
            if kind == "hello":
                self.hellos.append(msg)
                if msg["epoch"] != self.epoch:
                    self.epoch, self.cursor = msg["epoch"], 0
                return {"type": "welcome", "node": msg["node"], "epoch": self.epoch,
                        "cursor": self.cursor, "heartbeat_s": self.heartbeat_s}
            if kind == "heartbeat":
                self.heartbeats += 1
                self.heartbeat_times.append(time.monotonic())
                self.heartbeat_sent.append(msg.get("ts"))
                return None
            if kind == "sync":
                self.syncs.append(msg)
                return None
            if kind == "batch":
                self.batches += 1
                if not self.ack:
                    self.swallowed.extend(msg["records"])
                    return None
                new = [r for r in msg["records"] if r["seq"] > self.cursor]
                if new and new[0]["seq"] != self.cursor + 1:
                    return {"type": "resend", "from": self.cursor + 1}
                for r in new:
                    assert not any(k.startswith("_") for k in r), r
                    if not self.keep_points and r["kind"] == "metrics":
                        r["n_points"] = len(r.pop("points"))
                    self.applied.append(r)
                if new:
                    self.cursor = new[-1]["seq"]
                return {"type": "ack", "seq": self.cursor}
            raise AssertionError(f"unexpected message {msg!r}")
