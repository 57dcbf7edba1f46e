"""deploy/nginx-gpuplane.conf, run for real: nginx with a self-signed certificate in front of
a server, carrying REST, an SSE log stream and the agent WebSocket (docs/security.md).
Skipped where nginx or openssl is not installed (.ci/run installs nginx-light when apt-get
can)."""
import json
import os
import shutil
import ssl
import subprocess

import pytest
import requests
from simple_websocket import Client

from procs import ROOT, free_port, wait_for

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
OPENSSL = shutil.which("openssl")

pytestmark = pytest.mark.skipif(not (NGINX and OPENSSL),
                                reason="nginx or openssl not installed (apt-get install "
                                       "nginx-light openssl)")


@pytest.fixture
def proxy(live_server, tmp_path):
    d = tmp_path / "nginx"
    d.mkdir()
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    site = (ROOT / "deploy" / "nginx-gpuplane.conf").read_text()
    for old, new in (("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;"),
                     ("server_name gpuplane.example.org;", "server_name localhost;"),
                     ("/etc/ssl/gpuplane/fullchain.pem", str(cert)),
                     ("/etc/ssl/gpuplane/privkey.pem", str(key)),
                     ("http://127.0.0.1:8600", live_server.url)):
        assert old in site, old
        site = site.replace(old, new)
    (d / "site.conf").write_text(site)
    temps = "\n".join(f"  {k}_temp_path {d / k};" for k in
                      ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (d / "nginx.conf").write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"worker_processes 1;\npid {d / 'nginx.pid'};\nerror_log {d / 'error.log'};\n"
        f"events {{}}\nhttp {{\n  access_log off;\n{temps}\n  include {d / 'site.conf'};\n}}\n")
    proc = subprocess.Popen([NGINX, "-p", str(d), "-c", str(d / "nginx.conf"),
                             "-g", "daemon off;"], stdout=subprocess.DEVNULL,
                            stderr=open(d / "stderr.log", "wb"))
    url = f"https://localhost:{port}"

    def up():
        if proc.poll() is not None:
            raise AssertionError("nginx exited: " + (d / "stderr.log").read_text()
                                 + (d / "error.log").read_text())
        return requests.get(url + "/api/v1/health", verify=str(cert), timeout=2).ok
    try:
        wait_for(up, 20, what="nginx")
        yield url, str(cert)
    finally:
        proc.terminate()
        proc.wait(10)


def test_rest_sse_and_the_agent_websocket_through_the_tls_proxy(live_server, proxy):
    url, cert = proxy
    auth = {"Authorization": f"Bearer {live_server.token}"}
    r = requests.get(url + "/api/v1/auth/whoami", headers=auth, verify=cert, timeout=10)
    assert r.status_code == 200 and r.json()["scope"] == "admin"
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(url + "/api/v1/health", timeout=10)        # not trusted by default

    # An SSE stream answers its first line at once (proxy_buffering off).
    job = live_server.api.submit(["true"], "/tmp", gpus=1)   # queued: no agent
    with requests.get(f"{url}/api/v1/jobs/{job['id']}/logs/stream", headers=auth,
                      verify=cert, stream=True, timeout=10) as s:
        assert s.status_code == 200
        assert next(s.iter_lines(decode_unicode=True)) == ": following"

    # The agent WebSocket upgrades through the proxy: hello, welcome.
    token = live_server.api.post("/api/v1/tokens", {"name": "tls", "scope": "agent",
                                                    "node": "tls-node"}, expect=201)["token"]
    ctx = ssl.create_default_context(cafile=cert)
    ws = Client.connect(url.replace("https://", "wss://") + "/api/v1/agent/ws",
                        headers={"Authorization": f"Bearer {token}"}, ssl_context=ctx)
    try:
        ws.send(json.dumps({"type": "hello", "node": "tls-node", "epoch": "e1", "gpus": []}))
        welcome = json.loads(ws.receive(timeout=10))
        assert welcome["type"] == "welcome" and welcome["node"] == "tls-node"
    finally:
        ws.close()
