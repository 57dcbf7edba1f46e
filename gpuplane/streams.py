"""The thread budget of the one gthread worker, shared by long-lived connections.

Each agent WebSocket and each SSE follower holds a pool thread for as long as it is open.
They are capped so that `rest_threads` always stay free for REST requests; SSE followers
have a cap of their own below that, so the `agent_threads` between the two are reserved for
agents (which may also use whatever the followers leave). Beyond its cap a stream is
answered 503 with Retry-After.
"""
import socket
import threading

from .errors import ApiError


class Busy(ApiError):
    status, code = 503, "TooManyStreams"


class StreamSlots:
    def __init__(self, threads, agent_threads, rest_threads):
        self.streams_cap = threads - rest_threads              # agents + followers
        self.sse_cap = threads - rest_threads - agent_threads  # followers alone
        self.agent_threads = agent_threads
        self._lock = threading.Lock()
        self.counts = {"sse": 0, "agent": 0}

    def acquire(self, kind):
        """Take a slot for an 'sse' or 'agent' stream, or raise Busy (503)."""
        with self._lock:
            total = self.counts["sse"] + self.counts["agent"]
            if kind == "sse" and self.counts["sse"] >= self.sse_cap:
                raise _busy(f"{self.sse_cap} log followers are open, the most this server "
                            "allows (raise `threads` in server.toml); retry later")
            if total >= self.streams_cap:
                raise _busy(f"{self.streams_cap} long-lived connections are open, the most "
                            "this server allows (raise `threads` in server.toml); retry later")
            self.counts[kind] += 1

    def release(self, kind):
        with self._lock:
            self.counts[kind] = max(0, self.counts[kind] - 1)

    def snapshot(self):
        with self._lock:
            return {**self.counts, "sse_cap": self.sse_cap, "streams_cap": self.streams_cap}


def _busy(message):
    e = Busy(message)
    e.retry_after = 5
    return e


def clear_timeout(environ):
    """For a route that holds its connection open on purpose (the agent WebSocket): the
    gunicorn worker (gpuplane/gunicorn_worker.py) put a per-operation timeout on it."""
    sock = environ.get("gunicorn.socket")
    if isinstance(sock, socket.socket):
        try:
            sock.settimeout(None)
        except OSError:
            pass
