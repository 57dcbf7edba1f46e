"""The gunicorn worker class: gthread, except that no pool thread waits for a slow client.

gunicorn's `ThreadWorker` hands a connection to a pool thread as soon as its first byte
arrives, and that thread then reads the request headers with blocking reads and no
timeout: a client that sends `GET / HTTP/1.1\\r\\n` and stops holds a thread for ever, and
some dozens of them freeze the API (docs/security.md). This worker reads the header block
in the worker's own poller instead, without blocking: a connection reaches the pool only
once its headers are complete, and one that has not finished them `header_timeout_s`
after its first byte (or after connecting) is closed. Body reads and response writes get
a per-operation socket timeout (`io_timeout_s`); the long-lived routes (the agent
WebSocket) clear it through `environ["gunicorn.socket"]`.

Given to gunicorn as `worker_class = "gpuplane.gunicorn_worker.Worker"`; the two timeouts
come from the environment the server sets before it starts gunicorn.
"""
import os
import queue
import selectors
import threading
import time
from concurrent import futures
from functools import partial

from gunicorn.workers.gthread import ThreadWorker

HEADER_TIMEOUT_ENV = "GPUPLANE_HEADER_TIMEOUT_S"
IO_TIMEOUT_ENV = "GPUPLANE_IO_TIMEOUT_S"
BODY_TIMEOUT_ENV = "GPUPLANE_BODY_TIMEOUT_S"
MAX_HEADER_BYTES = 64 * 1024
_TOO_LARGE_BODY = (b'{"error": {"code": "HeadersTooLarge", "message": "request headers over '
                   b'64 KiB; send fewer"}}\n')
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nContent-Length: "
              + str(len(_TOO_LARGE_BODY)).encode() + b"\r\n\r\n" + _TOO_LARGE_BODY)


class ElasticPool(futures.Executor):
    """gthread's pool, except that a thread idle for `idle_s` exits: after a burst (a
    fleet reconnecting, a hundred followers gone) threads go back to the baseline instead
    of staying for the life of the process. (SQLite connections are not per thread: the
    Database's fixed pool lends one per read or transaction, gpuplane/db/__init__.py.)"""

    def __init__(self, max_workers, idle_s=5.0):
        self._max, self._idle_s = max_workers, idle_s
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = self._pending = 0
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs):
        future = futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._pending += 1
            if self._pending > self._idle and self._threads < self._max:
                self._threads += 1
                self._idle += 1
                threading.Thread(target=self._work, name="gpuplane-http", daemon=True).start()
            self._queue.put((future, fn, args, kwargs))
        return future

    def _work(self):
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    retire = self._pending == 0 or self._shutdown
                    if retire:
                        self._threads -= 1
                        self._idle -= 1
                if retire:
                    _thread_exit()
                    return
                continue
            if item is None:
                with self._lock:
                    self._threads -= 1
                    self._idle -= 1
                return
            future, fn, args, kwargs = item
            with self._lock:
                self._pending -= 1
                self._idle -= 1
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:      # noqa: B902 (handed to the future)
                    future.set_exception(e)
            del future, fn, args, kwargs, item
            with self._lock:
                self._idle += 1

    def shutdown(self, wait=True, *, cancel_futures=False):
        with self._lock:
            self._shutdown = True
            n = self._threads
        for _ in range(n):
            self._queue.put(None)


class Worker(ThreadWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = float(os.environ.get(HEADER_TIMEOUT_ENV) or 5)
        self.io_timeout = float(os.environ.get(IO_TIMEOUT_ENV) or 30)
        self.body_timeout = float(os.environ.get(BODY_TIMEOUT_ENV) or 60)
        self._reading = {}          # conn -> deadline, while its headers come in

    def get_thread_pool(self):
        return ElasticPool(self.cfg.threads)

    # -- headers are read here, on the worker's own loop ---------------------------------

    def enqueue_req(self, conn):
        if self.cfg.is_ssl or conn.__dict__.pop("_headers_ready", False):
            return super().enqueue_req(conn)
        pre = b""
        if conn.initialized and conn.parser is not None:
            pre = conn.parser.unreader.take_buffered()    # a pipelined next request
        conn._pre = bytearray(pre)
        if b"\r\n\r\n" in conn._pre:
            return self._dispatch(conn)
        conn.sock.setblocking(False)
        self._reading[conn] = time.monotonic() + self.header_timeout
        self.poller.register(conn.sock, selectors.EVENT_READ,
                             partial(self._on_header_bytes, conn))

    def _on_header_bytes(self, conn, sock):
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            return self._drop(conn)
        conn._pre += data
        if b"\r\n\r\n" in conn._pre:
            self._unwatch(conn)
            self._dispatch(conn)
        elif len(conn._pre) > MAX_HEADER_BYTES:
            try:
                sock.send(_TOO_LARGE)
            except OSError:
                pass
            self._drop(conn)

    def _dispatch(self, conn):
        conn.data_ready = True      # gthread's handle() must not wait for data again
        conn._headers_ready = True
        super().enqueue_req(conn)

    def _unwatch(self, conn):
        self._reading.pop(conn, None)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, conn):
        self._unwatch(conn)
        self.nr_conns -= 1
        conn.close()

    def murder_pending(self):
        super().murder_pending()
        now = time.monotonic()
        for conn in [c for c, deadline in self._reading.items() if deadline <= now]:
            self._drop(conn)

    # -- in the pool thread ----------------------------------------------------------------

    def handle(self, conn):
        pre = bytes(conn.__dict__.pop("_pre", b""))
        try:
            conn.sock.setblocking(True)
            conn.init()
            if pre:
                conn.parser.unreader.unread(pre)
            unreader = conn.parser.unreader
            if not isinstance(getattr(unreader, "sock", None), (_DeadlineSocket, type(None))):
                unreader.sock = _DeadlineSocket(unreader.sock, self.io_timeout)
        except OSError:
            return False
        return super().handle(conn)

    def handle_request(self, req, conn):
        # Headers are in; a body that stops coming or a reader that stops reading gives
        # up after io_timeout_s per operation instead of holding this thread, and the
        # whole body must be in within body_timeout_s.
        conn.sock.settimeout(self.io_timeout)
        dsock = getattr(conn.parser.unreader, "sock", None) if conn.parser else None
        if isinstance(dsock, _DeadlineSocket):
            dsock.deadline = time.monotonic() + self.body_timeout
        try:
            return super().handle_request(req, conn)
        finally:
            if isinstance(dsock, _DeadlineSocket):
                dsock.deadline = None

    def load_wsgi(self):
        super().load_wsgi()
        self.wsgi = _body_deadline(_close_after_unread_body(self.wsgi), self.body_timeout)


def _thread_exit():
    from .db import close_thread_connections
    try:
        close_thread_connections()
    except Exception:       # closing is best effort; the thread ends either way
        pass


class _DeadlineSocket:
    """The socket as the request parser reads it: io_timeout_s bounds each recv, but a
    client sending a byte just inside it each time would hold the pool thread for as long
    as it likes (gunicorn's body reader loops over recv until it has what it asked for).
    While `deadline` is set, each recv waits at most until then."""

    def __init__(self, sock, io_timeout):
        self._sock, self._io = sock, io_timeout
        self.deadline = None

    def recv(self, n, *flags):
        if self.deadline is None:
            return self._sock.recv(n, *flags)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request body deadline passed")
        self._sock.settimeout(min(self._io, left))
        try:
            return self._sock.recv(n, *flags)
        finally:
            self._sock.settimeout(self._io)        # the response's writes

    def __getattr__(self, name):
        return getattr(self._sock, name)


class _DeadlineInput:
    """wsgi.input whose reads past the body deadline (a TimeoutError from the socket) end
    the request with a 408 in the error shape; the connection is then closed."""

    def __init__(self, raw, body_timeout):
        self._raw, self._budget = raw, body_timeout

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except TimeoutError:
            from werkzeug.exceptions import RequestTimeout
            raise RequestTimeout(f"the request body did not arrive within {self._budget:g} s "
                                 "(body_timeout_s); send it at once, or in smaller "
                                 "requests") from None

    def read(self, *args):
        return self._guard(self._raw.read, *args)

    def readline(self, *args):
        return self._guard(self._raw.readline, *args)

    def readlines(self, *args):
        return self._guard(self._raw.readlines, *args)

    def __iter__(self):
        while True:
            line = self.readline()
            if not line:
                return
            yield line


def _body_deadline(app, body_timeout):
    def wrapped(environ, start_response):
        raw = environ.get("wsgi.input")
        if raw is not None:
            environ["wsgi.input"] = _DeadlineInput(raw, body_timeout)
        return app(environ, start_response)
    return wrapped


def _close_after_unread_body(app):
    """An error answered before the body was read (401, 404, 413 to a big batch): gunicorn
    drains at most 64 KiB of it and otherwise drops the connection after saying
    keep-alive, so the client's next request on it would get no answer. Say close."""
    def wrapped(environ, start_response):
        def start(status, headers, exc_info=None):
            if int(status[:3]) >= 400 and _content_length(environ) > 0:
                response = getattr(start_response, "__self__", None)
                if response is not None and hasattr(response, "force_close"):
                    response.force_close()
            return start_response(status, headers, exc_info)
        return app(environ, start)
    return wrapped


def _content_length(environ):
    try:
        return int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0
