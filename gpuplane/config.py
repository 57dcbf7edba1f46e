"""Where GPUPlane keeps its files and how it reads `server.toml`.

The home is `$GPUCTL_HOME` (default `~/.gpuctl/`). `server.toml` is TOML read with
tomllib; the first server start writes it with a fresh admin token.
"""
import dataclasses
import os
import pathlib
import secrets
import tomllib

DEFAULT_PORT = 8600


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _url(v):
    return isinstance(v, str) and v.startswith(("http://", "https://")) and len(v) > 8


SCHEDULING = ("backfill", "strict", "first-fit")

# Every server.toml setting: (default, check, what is expected). Settings may stand at the
# top of the file or under [server]. Nothing here is read anywhere but through
# ServerConfig, and every setting here is read somewhere (no dead keys).
SETTINGS = {
    "host": ("127.0.0.1", lambda v: isinstance(v, str) and v != "",
             'an address to listen on, e.g. "127.0.0.1" or "0.0.0.0"'),
    "port": (DEFAULT_PORT, lambda v: _integer(v) and 1 <= v <= 65535,
             "a port number from 1 to 65535"),
    "admin_token": (None, lambda v: v is None or (isinstance(v, str) and v.strip() != ""),
                    "a token string (remove the line and a new one is written at the next "
                    "start)"),
    # What jobs and agents use to reach the server; default http://host:port.
    "public_url": (None, lambda v: v is None or _url(v),
                   'a URL starting with http:// or https://, e.g. "http://gpu-box:8600"'),
    # The gthread pool (docs/security.md, "Thread budget"): agents + SSE followers + REST.
    # Sized for 32 agents, 64 followers and 16 REST requests at once.
    "threads": (112, lambda v: _integer(v) and 4 <= v <= 4096,
                "a whole number of threads from 4 to 4096"),
    # Reserved for agent WebSockets; default threads * 2 // 7.
    "agent_threads": (None, lambda v: v is None or (_integer(v) and v >= 1),
                      "a whole number of threads, at least 1 (default threads * 2 // 7)"),
    # Never taken by long streams; default max(2, threads // 7).
    "rest_threads": (None, lambda v: v is None or (_integer(v) and v >= 1),
                     "a whole number of threads, at least 1 (default max(2, threads // 7))"),
    # A client must finish its request headers within this.
    "header_timeout_s": (5, lambda v: _number(v) and 0.1 <= v <= 3600,
                         "a number of seconds from 0.1 to 3600"),
    # Per socket read/write once the headers are in.
    "io_timeout_s": (30, lambda v: _number(v) and 0.1 <= v <= 3600,
                     "a number of seconds from 0.1 to 3600"),
    # A request body must be in within this (a body trickling in below io_timeout_s per
    # read would otherwise hold a pool thread for ever).
    "body_timeout_s": (60, lambda v: _number(v) and 0.1 <= v <= 3600,
                       "a number of seconds from 0.1 to 3600"),
    # A disconnected node's jobs become NODE_LOST after this.
    "node_grace_s": (60, lambda v: _number(v) and 0 < v <= 86400 * 7,
                     "a number of seconds above 0 (e.g. 60)"),
    "heartbeat_s": (5, lambda v: _number(v) and 0.1 <= v <= 3600,
                    "a number of seconds from 0.1 to 3600 (e.g. 5)"),
    "log_keep_lines": (2000, lambda v: _integer(v) and v >= 1,
                       "a whole number of lines, at least 1"),
    "max_body_mb": (16, lambda v: _integer(v) and 1 <= v <= 4096,
                    "a whole number of MiB from 1 to 4096"),
    # Scheduled `gpuplane backup` every N hours (gpuplane/backups.py); 0: off.
    "backup_interval_h": (0, lambda v: _number(v) and 0 <= v <= 24 * 365,
                          "a number of hours, 0 or more (0 turns scheduled backups off)"),
    # Backups kept in <home>/backups/.
    "backup_keep": (7, lambda v: _integer(v) and v >= 1, "a whole number of backups, at least 1"),
    # Raw metric points older than this are pruned (rollups stay); 0 keeps them forever.
    "raw_retention_days": (0, lambda v: _number(v) and v >= 0,
                           "a number of days, 0 or more (0 keeps raw points forever)"),
    # How the queue is placed (docs/scheduling.md): "backfill" (later jobs run now when
    # they end, by their time limits, before the reservations of those ahead), "strict"
    # (no job passes a waiting one) or "first-fit" (any job that fits runs now).
    "scheduling": ("backfill", lambda v: v in SCHEDULING,
                   'one of "backfill", "strict", "first-fit"'),
    # Priority preemption (docs/scheduling.md): a preemptible job that has run less than
    # this is never stopped for a more urgent one.
    "preempt_min_run_s": (60, lambda v: _number(v) and v >= 0,
                          "a number of seconds, 0 or more"),
    # The warning before a job's time limit (and before a preemption's stop): a signal
    # and the seconds before, as sbatch --signal=USR1@60. A job's --signal overrides it.
    "time_signal": ("USR1@60", lambda v: _signal_ok(v),
                    'a signal and its lead in seconds, e.g. "USR1@60"'),
}
def _signal_ok(v):
    from . import timelimit
    try:
        timelimit.parse_signal(v, 60)
    except timelimit.LimitError:
        return False
    return True


# Tables that belong to other parts: [events] (the rule settings, gpuplane/rules.py) and
# [[webhooks]]. They are checked for shape here and for content by their owner.
TABLES = {
    "events": (dict, "a table of rule settings ([events])"),
    "webhooks": (list, "a list of tables ([[webhooks]])"),
}

SERVER_DEFAULTS: dict = {k: default for k, (default, _, _) in SETTINGS.items()}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The server's settings, checked once when loaded (load_server_config)."""
    home: str
    host: str = SERVER_DEFAULTS["host"]
    port: int = SERVER_DEFAULTS["port"]
    admin_token: str | None = None
    public_url: str | None = None
    threads: int = SERVER_DEFAULTS["threads"]
    agent_threads: int | None = None
    rest_threads: int | None = None
    header_timeout_s: float = SERVER_DEFAULTS["header_timeout_s"]
    io_timeout_s: float = SERVER_DEFAULTS["io_timeout_s"]
    body_timeout_s: float = SERVER_DEFAULTS["body_timeout_s"]
    node_grace_s: float = SERVER_DEFAULTS["node_grace_s"]
    heartbeat_s: float = SERVER_DEFAULTS["heartbeat_s"]
    log_keep_lines: int = SERVER_DEFAULTS["log_keep_lines"]
    max_body_mb: int = SERVER_DEFAULTS["max_body_mb"]
    raw_retention_days: float = SERVER_DEFAULTS["raw_retention_days"]
    backup_interval_h: float = SERVER_DEFAULTS["backup_interval_h"]
    backup_keep: int = SERVER_DEFAULTS["backup_keep"]
    scheduling: str = SERVER_DEFAULTS["scheduling"]
    preempt_min_run_s: float = SERVER_DEFAULTS["preempt_min_run_s"]
    time_signal: str = SERVER_DEFAULTS["time_signal"]
    events: dict = dataclasses.field(default_factory=dict)
    webhooks: list = dataclasses.field(default_factory=list)
    unknown: tuple = ()          # keys in server.toml nobody reads (reported at start)
    path: str = ""

    # Read like the dict it used to be: cfg["node_grace_s"], cfg.get("port").
    def __getitem__(self, key):
        if key not in SETTINGS and key not in TABLES and key != "home":
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def replace(self, **changes):
        """A copy with some settings changed, checked like the file's."""
        for key, value in changes.items():
            check(key, value, "override")
        return dataclasses.replace(self, **changes)


def check(key, value, where):
    default, ok, expected = SETTINGS[key]
    if not ok(value):
        fallback = ("the default, " + _toml_value(default) if default is not None
                    else "no value")
        raise ConfigError(f"{where}: {key} = {_toml_value(value)} is not valid: expected "
                          f"{expected}; fix it, or remove the line for {fallback}")
    if isinstance(default, float) or key.endswith(("_s", "_days")):
        return float(value)
    return value


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
    """Read and check server.toml. Raises ConfigError with one sentence naming the key,
    the value and what is expected; unknown keys are listed in `.unknown`."""
    home = pathlib.Path(home)
    path = home / "server.toml"
    raw = _read_toml(path)
    values, unknown, tables = {}, [], {}
    server = raw.get("server", {})
    if not isinstance(server, dict):
        raise ConfigError(f"{path}: server must be a table ([server]); fix or remove it")
    # Settings may stand at the top of the file or under [server] (which wins).
    for prefix, section in (("", raw), ("server.", server)):
        for key, value in section.items():
            if prefix == "" and key == "server":
                continue
            if key in SETTINGS:
                values[key] = check(key, value, str(path))
            elif prefix == "" and key in TABLES:
                kind, expected = TABLES[key]
                if not isinstance(value, kind) or (
                        kind is list and not all(isinstance(x, dict) for x in value)):
                    raise ConfigError(f"{path}: {key} is not valid: expected {expected}; "
                                      "fix or remove it")
                tables[key] = value
            else:
                unknown.append(prefix + key)
    return ServerConfig(home=str(home), path=str(path), unknown=tuple(unknown),
                        **values, **tables)


MIN_ADMIN_TOKEN = 16


def check_server_config(cfg):
    """What a starting server needs beyond each value's own check: the thread budget
    adds up, and the admin token is long enough. Returns the config with the thread
    shares filled in; raises ConfigError with a sentence."""
    rest = cfg.rest_threads if cfg.rest_threads is not None else max(2, cfg.threads // 7)
    agent = (cfg.agent_threads if cfg.agent_threads is not None
             else max(1, cfg.threads * 2 // 7))
    if cfg.threads - agent - rest < 1:
        raise ConfigError(
            f"threads ({cfg.threads}) must exceed agent_threads ({agent}) + rest_threads "
            f"({rest}) by at least 1, the share left for log followers; raise threads in "
            "server.toml")
    token = cfg.admin_token
    if not isinstance(token, str) or len(token) < MIN_ADMIN_TOKEN:
        raise ConfigError(f"admin_token in server.toml must be a string of at least "
                          f"{MIN_ADMIN_TOKEN} characters; delete the line and restart to get "
                          "a fresh random one")
    return dataclasses.replace(cfg, agent_threads=agent, rest_threads=rest)


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


# The address a running server really listens on (`gpuplane up --port N` and `gpuplane
# server --port N` override server.toml): "PID URL", written once it is bound, removed at
# exit. The CLI, the MCP server and `up`'s hints reach the server through it.
ADDRESS_FILE = "server.address"


def write_running_address(home, url):
    atomic_write(pathlib.Path(home) / ADDRESS_FILE, f"{os.getpid()} {url}\n", mode=0o600)


def clear_running_address(home):
    path = pathlib.Path(home) / ADDRESS_FILE
    try:
        if path.read_text().split()[:1] == [str(os.getpid())]:
            path.unlink()
    except (OSError, IndexError):
        pass


def running_address(home):
    """The URL of the server running on this home, or None (none runs, or it left no
    address: a crash leaves a file whose process is gone)."""
    try:
        pid, url = (pathlib.Path(home) / ADDRESS_FILE).read_text().split()[:2]
        os.kill(int(pid), 0)
    except PermissionError:
        return url               # alive, under another user
    except (OSError, ValueError):
        return None
    return url


def atomic_write(path, text, mode=0o644):
    tmp = pathlib.Path(str(path) + ".partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
