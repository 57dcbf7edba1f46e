"""Where GPUPlane keeps its files and how it reads `server.toml`.

The home is `$GPUCTL_HOME` (default `~/.gpuctl/`). `server.toml` is TOML read with
tomllib; the first server start writes it with a fresh admin token.
"""
import os
import pathlib
import secrets
import tomllib

DEFAULT_PORT = 8600

SERVER_DEFAULTS = {
    "host": "127.0.0.1",
    "port": DEFAULT_PORT,
    "admin_token": None,
    "public_url": None,        # what jobs and agents use to reach the server
    # The gthread pool (docs/security.md, "Thread budget"): agents + SSE followers + REST.
    # Sized for 32 agents, 64 followers and 16 REST requests at once.
    "threads": 112,
    "agent_threads": None,     # reserved for agent WebSockets; default threads * 2 // 7
    "rest_threads": None,      # never taken by long streams; default max(2, threads // 7)
    "header_timeout_s": 5,     # a client must finish its request headers within this
    "io_timeout_s": 30,        # per socket read/write once the headers are in
    "node_grace_s": 60,        # a disconnected node's jobs become NODE_LOST after this
    "heartbeat_s": 5,
    "cpu_slots_default": 4,
    "log_keep_lines": 2000,
    "max_body_mb": 16,
    "backup_interval_h": 0,    # scheduled `gpuplane backup` every N hours; 0: off
    "backup_keep": 7,          # backups kept in <home>/backups/
}


def home_dir(arg=None):
    if arg:
        return pathlib.Path(arg).expanduser().absolute()
    env = os.environ.get("GPUCTL_HOME")
    if env:
        return pathlib.Path(env).expanduser().absolute()
    return pathlib.Path.home() / ".gpuctl"


class ConfigError(Exception):
    pass


def _read_toml(path):
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML ({e}); fix or remove it") from None


def load_server_config(home):
    home = pathlib.Path(home)
    raw = _read_toml(home / "server.toml")
    config = dict(SERVER_DEFAULTS)
    # Settings may stand at the top of the file or under [server].
    for section in (raw, raw.get("server", {})):
        config.update({k: v for k, v in section.items() if not isinstance(v, (dict, list))})
    config["webhooks"] = raw.get("webhooks", [])
    config["events"] = raw.get("events", {})
    config["home"] = str(home)
    return config


MIN_ADMIN_TOKEN = 16


def check_server_config(config):
    """Validate the thread budget and the admin token once, at start, with a sentence."""
    threads = config.get("threads")
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0:
        if config.get("rest_threads") is None:
            config["rest_threads"] = max(2, threads // 7)
        if config.get("agent_threads") is None:
            config["agent_threads"] = max(1, threads * 2 // 7)
    for key in ("threads", "agent_threads", "rest_threads"):
        v = config.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{key} in server.toml must be a positive integer, got {v!r}")
    for key in ("header_timeout_s", "io_timeout_s"):
        v = config.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.1 <= v <= 3600:
            raise ConfigError(f"{key} in server.toml must be a number of seconds from 0.1 "
                              f"to 3600, got {v!r}")
    if config["threads"] - config["agent_threads"] - config["rest_threads"] < 1:
        raise ConfigError(
            f"threads ({config['threads']}) must exceed agent_threads "
            f"({config['agent_threads']}) + rest_threads ({config['rest_threads']}) by at "
            "least 1, the share left for log followers; raise threads in server.toml")
    token = config.get("admin_token")
    if not isinstance(token, str) or len(token) < MIN_ADMIN_TOKEN:
        raise ConfigError(f"admin_token in server.toml must be a string of at least "
                          f"{MIN_ADMIN_TOKEN} characters; delete the line and restart to get "
                          "a fresh random one")


def server_url(config):
    if config.get("public_url"):
        return config["public_url"].rstrip("/")
    host = config["host"]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{config['port']}"


def _toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def ensure_server_config(home, **overrides):
    """Create `server.toml` with an admin token if it has none. Returns (config, created)."""
    home = pathlib.Path(home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "server.toml"
    config = load_server_config(home)
    created = False
    if not config.get("admin_token"):
        token = "gpa_" + secrets.token_urlsafe(24)
        lines = [
            "# GPUPlane server settings. The admin token can do everything:",
            "# keep this file private (it is created with mode 0600).",
            f"admin_token = {_toml_value(token)}",
        ]
        old = path.read_text() if path.exists() else ""
        if not old:
            for key in ("host", "port"):
                value = overrides.get(key) or config[key]
                lines.append(f"{key} = {_toml_value(value)}")
        # Top-level keys must come before any [table], so the token goes first.
        atomic_write(path, "\n".join(lines) + "\n" + old, mode=0o600)
        config = load_server_config(home)
        created = True
    return config, created


def atomic_write(path, text, mode=0o644):
    tmp = pathlib.Path(str(path) + ".partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
