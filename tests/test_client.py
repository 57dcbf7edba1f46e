"""gpuplane/client.py: one method per route, each named after its route, each used."""
import re

from procs import ROOT

from gpuplane.app import create_app, stop_app
from gpuplane.client import Client


def test_one_method_per_route_and_each_route_exists(tmp_path):
    routes = Client.routes()
    methods = [name for name, fn in vars(Client).items()
               if callable(fn) and not name.startswith("_") and name not in
               ("close", "url", "request", "routes")]
    assert sorted(routes.values()) == sorted(methods), "every public method has one route"
    app = create_app(tmp_path, start_threads=False)
    try:
        served = {(m, re.sub(r"<(?:\w+:)?(\w+)>", "{}", r.rule[len("/api/v1/"):]))
                  for r in app.url_map.iter_rules() if r.rule.startswith("/api/v1/")
                  for m in r.methods - {"HEAD", "OPTIONS"}}
    finally:
        stop_app(app)
    for (method, path), name in routes.items():
        assert (method, re.sub(r"\{\w+\}", "{}", path)) in served, (name, method, path)


def test_every_method_is_called_and_named_after_its_route():
    callers = "\n".join(p.read_text() for p in [ROOT / "mcp_server.py",
                                                *(ROOT / "gpuplane" / "cli").glob("*.py")])
    verbs = {"GET": ("get", "list", "compare", "recommend", "stream"), "POST": None,
             "PUT": ("set",), "PATCH": ("update",), "DELETE": ("delete", "revoke")}
    for (method, path), name in Client.routes().items():
        assert re.search(rf"\.{name}\b", callers), f"Client.{name} is called by nothing"
        verb, noun = name.split("_", 1)
        if verbs[method]:
            assert verb in verbs[method], (name, method, path)
        # the noun is the route's: its last resource word (jobs/{id}/logs -> job_logs)
        words = [w.rstrip("s").replace("-", "_") for w in re.split(r"[/:]", path)
                 if w and not w.startswith("{")]
        assert noun.rstrip("s").split("_")[-1] in " ".join(words).replace("_", " ").split() \
            or noun.rstrip("s") in "_".join(words), (name, path)


def _server_that_resets_its_first_connection():
    """A loopback HTTP server whose first connection is reset as its request arrives (the
    server's keepalive closing a connection as a request goes out on it), and whose later
    connections get a 200. -> (url, the requests it saw, the thread)."""
    import socket
    import struct
    import threading

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    seen = []

    def serve():
        for n in range(2):
            conn, _ = lsock.accept()
            seen.append(conn.recv(65536).split(b"\r\n", 1)[0].decode())
            if n == 0:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 12\r\nConnection: close\r\n\r\n{\"ok\": true}")
            conn.close()
        lsock.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"http://127.0.0.1:{lsock.getsockname()[1]}", seen, t


def test_a_get_on_a_connection_reset_under_it_goes_again():
    url, seen, t = _server_that_resets_its_first_connection()
    client = Client(url, "gpa_test")
    assert client.get_health() == {"ok": True}
    assert seen == ["GET /api/v1/health HTTP/1.1"] * 2
    t.join(5)


def test_a_post_on_a_connection_reset_under_it_is_not_sent_again():
    import pytest
    from gpuplane.client import ServerUnreachable

    url, seen, t = _server_that_resets_its_first_connection()
    client = Client(url, "gpa_test")
    with pytest.raises(ServerUnreachable):
        client.request("POST", "jobs/1/cancel", body={})
    assert seen == ["POST /api/v1/jobs/1/cancel HTTP/1.1"]
