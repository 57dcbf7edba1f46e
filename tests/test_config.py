"""gpuplane/config.py: server.toml is checked once, at load, with a sentence that names
the key, the value and what is expected."""
import logging

import pytest

from gpuplane import config
from gpuplane.app import create_app


def write(tmp_path, text):
    (tmp_path / "server.toml").write_text(text)
    return tmp_path


def test_defaults_and_types(tmp_path):
    cfg = config.load_server_config(tmp_path)
    assert cfg.port == 8600 and cfg.node_grace_s == 60 and cfg.unknown == ()
    assert cfg["heartbeat_s"] == 5 and cfg.get("public_url") is None
    cfg = config.load_server_config(write(tmp_path, "node_grace_s = 2\nheartbeat_s = 0.5\n"
                                                    "[server]\nport = 9000\n"))
    assert cfg.node_grace_s == 2.0 and isinstance(cfg.node_grace_s, float)
    assert cfg.heartbeat_s == 0.5 and cfg.port == 9000


@pytest.mark.parametrize("line, key, expected", [
    ('node_grace_s = "soon"', "node_grace_s", "a number of seconds above 0"),
    ("node_grace_s = 0", "node_grace_s", "a number of seconds above 0"),
    ("node_grace_s = true", "node_grace_s", "a number of seconds above 0"),
    ("port = 70000", "port", "a port number from 1 to 65535"),
    ('port = "8600"', "port", "a port number from 1 to 65535"),
    ("threads = 2.5", "threads", "a whole number of threads"),
    ('public_url = "gpu-box:8600"', "public_url", "a URL starting with http://"),
    ("log_keep_lines = 0", "log_keep_lines", "a whole number of lines"),
    ("raw_retention_days = -1", "raw_retention_days", "a number of days"),
    ("[server]\nheartbeat_s = 0", "heartbeat_s", "a number of seconds from 0.1"),
])
def test_a_bad_value_is_one_sentence_naming_key_value_and_expectation(tmp_path, line, key,
                                                                       expected):
    write(tmp_path, line + "\n")
    with pytest.raises(config.ConfigError) as e:
        config.load_server_config(tmp_path)
    msg = str(e.value)
    value = line.split("=", 1)[1].strip()
    assert f"{key} = {value}" in msg and expected in msg and "server.toml" in msg
    assert "\n" not in msg


def test_a_bad_table_is_refused(tmp_path):
    write(tmp_path, 'webhooks = "http://x"\n')
    with pytest.raises(config.ConfigError, match="webhooks is not valid: expected a list"):
        config.load_server_config(tmp_path)


def test_unknown_keys_are_listed_and_reported_at_start(tmp_path, caplog):
    write(tmp_path, 'node_grace = 5\ncpu_slots_default = 4\n[server]\nprot = 1\n'
                    '[events]\nspike_z = 6\n[[webhooks]]\nurl = "http://x"\n[nonsense]\na = 1\n')
    cfg = config.load_server_config(tmp_path)
    assert set(cfg.unknown) == {"node_grace", "cpu_slots_default", "server.prot", "nonsense"}
    assert cfg.events == {"spike_z": 6} and cfg.webhooks == [{"url": "http://x"}]
    with caplog.at_level(logging.WARNING, logger="gpuplane.app"):
        create_app(tmp_path, start_threads=False)
    assert "node_grace" in caplog.text and "unknown setting" in caplog.text


def test_the_app_refuses_to_start_on_a_bad_value(tmp_path):
    write(tmp_path, "node_grace_s = -5\n")
    with pytest.raises(config.ConfigError, match="node_grace_s = -5"):
        create_app(tmp_path, start_threads=False)


def test_overrides_are_checked_too(tmp_path):
    cfg = config.load_server_config(tmp_path)
    assert cfg.replace(port=9001).port == 9001
    with pytest.raises(config.ConfigError, match="port"):
        cfg.replace(port=0)


def test_every_setting_is_read_somewhere():
    """No dead keys: each setting of SETTINGS appears in the code that uses it."""
    import pathlib
    pkg = pathlib.Path(config.__file__).parent
    text = "\n".join(p.read_text() for p in pkg.rglob("*.py") if p.name != "config.py")
    for key in config.SETTINGS:
        assert f'"{key}"' in text or f".{key}" in text, f"{key} is read nowhere"
