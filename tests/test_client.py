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
