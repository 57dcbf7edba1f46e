"""Issue 22's probes from outside (docs/security.md, "Limits"; docs/reliability.md): a body
that trickles in is cut off, and what a client, a job or an agent sends is bounded, each
refusal a 4xx with the error shape while the good records around it are kept."""
import socket
import threading
import time

from .helpers import report


def _trickler(port, token):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /api/v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + token.encode() + b"\r\nContent-Length: 100000\r\n\r\n{")
    return s


def test_a_trickling_body_is_cut_off(server_factory):
    # Before: io_timeout_s bounded each read only, so a client sending a byte a little
    # more often than that held its pool thread for ever; 4 of them froze the API.
    server = server_factory({"threads": 4, "rest_threads": 1, "agent_threads": 1,
                             "io_timeout_s": 1.5, "body_timeout_s": 2})
    clients = [_trickler(server.port, server.token) for _ in range(6)]
    stop = threading.Event()
    open_ = set(range(len(clients)))
    answers = {}

    def trickle():
        while not stop.is_set() and open_:
            for i in list(open_):
                try:
                    clients[i].sendall(b" ")
                except OSError:
                    open_.discard(i)
            stop.wait(0.4)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while open_ and time.monotonic() < deadline:
            for i in list(open_):
                c = clients[i]
                c.settimeout(0.05)
                try:
                    data = c.recv(4096)
                except socket.timeout:
                    continue
                except OSError:
                    data = b""
                answers[i] = data
                open_.discard(i)
        # (while the first 8 wait out their deadline they hold the 8 threads: a deadline
        # bounds the wait, it does not make it free)
        status_ok = server.api.get("/api/v1/status", expect=200, timeout=60) is not None
    finally:
        stop.set()
        t.join(5)
        for c in clients:
            c.close()
    timed_out = sum(1 for a in answers.values() if a.startswith(b"HTTP/1.1 408"))
    report("trickling-body", clients=len(clients), cut_off=len(answers), answered_408=timed_out)
    assert not open_, f"{len(open_)} trickling bodies still held a thread after 60 s"
    assert timed_out == len(clients), answers
    assert all(b'"RequestTimeout"' in a and b"body_timeout_s" in a for a in answers.values())
    assert status_ok
