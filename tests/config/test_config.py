"""Config validation: defaults, units, and failing fast with file, field and reason."""

import subprocess
import sys

import pytest

from precision_agent.config import DEFAULT_LISTEN, ConfigError, load_config, parse_duration, parse_size


def test_defaults_are_safe():
    c = load_config(None, {"watches": [{"path": "/tmp"}]})
    assert c.listen == DEFAULT_LISTEN and c.listen.startswith("127.0.0.1:")
    port = int(c.listen.rsplit(":", 1)[1])
    assert not 9100 <= port <= 9999
    assert c.watches[0].kind == "log" and c.default_rules


@pytest.mark.parametrize("text, seconds", [("30s", 30), ("1m30s", 90), ("500ms", 0.5), (2, 2.0), ("1h", 3600)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_sizes():
    assert parse_size("64MiB") == 64 << 20 and parse_size(10) == 10
    with pytest.raises(ValueError):
        parse_size("lots")


@pytest.mark.parametrize("yaml_text, field, reason", [
    ("listen: nonsense\n", "listen", "HOST:PORT"),
    ("watches: [{path: /x, kind: bogus}]\n", "watches.0.kind", "'log' or 'dump'"),
    ("watches: [{path: /x, labels: {'bad-name': 1}}]\n", "watches.0.labels", "not a valid Prometheus label"),
    ("watches: [{path: /x, labels: {alertname: x}}]\n", "watches.0.labels", "reserved"),
    ("resync_interval: often\n", "resync_interval", "invalid duration"),
    ("limits: {max_series: 0}\n", "limits.max_series", "greater than or equal to 1"),
    ("listne: 127.0.0.1:1\n", "listne", "Extra inputs are not permitted"),
    ("- a list\n", "(top level)", "expected a mapping"),
    ("listen: [\n", "line", "invalid YAML"),
])
def test_bad_config_names_file_field_reason(tmp_path, yaml_text, field, reason):
    path = tmp_path / "agent.yml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.file == str(path) and field in err.value.field and reason in err.value.reason, str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "absent.yml")


def test_run_with_bad_config_exits_2_naming_file_and_field(tmp_path):
    path = tmp_path / "agent.yml"
    path.write_text("watches:\n  - path: /tmp\n    recursive: maybe\n")
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "run", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert str(path) in proc.stderr and "watches.0.recursive" in proc.stderr, proc.stderr


def test_flags_override_file(tmp_path):
    path = tmp_path / "agent.yml"
    path.write_text("listen: 127.0.0.1:1234\nwatches: [{path: /a}]\n")
    c = load_config(path, {"listen": "127.0.0.1:4321", "watches": [{"path": "/b"}]})
    assert c.listen == "127.0.0.1:4321" and [str(w.path) for w in c.watches] == ["/a", "/b"]


def test_unknown_format_and_missing_rule_dir_fail_at_load(tmp_path):
    path = tmp_path / "agent.yml"
    path.write_text("watches: [{path: /x, format: bogus}]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.field == "watches.0.format" and "unknown log format" in err.value.reason
    path.write_text(f"rule_dirs: [{tmp_path / 'nope'}]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.field == "rule_dirs" and "does not exist" in err.value.reason


def test_custom_format_needs_a_valid_pattern(tmp_path):
    path = tmp_path / "agent.yml"
    path.write_text("watches: [{path: /x, format: custom}]\n")
    with pytest.raises(ConfigError, match="needs a 'pattern'"):
        load_config(path)
    path.write_text("watches: [{path: /x, format: custom, pattern: 'loss=(?P<loss>[0-9.]+'}]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.field == "watches.0.pattern" and "invalid regex" in err.value.reason
    path.write_text("watches: [{path: /x, format: custom, pattern: 'it (?P<step>\\d+) l=(?P<loss>\\S+)'}]\n")
    assert load_config(path).watches[0].pattern


def test_replay_with_a_user_defined_format(tmp_path):
    log = tmp_path / "mine.log"
    log.write_text("it 1 l=2.5\nit 2 l=nan\nnoise\n")
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "replay", "--json", "--pattern",
                           r"it (?P<step>\d+) l=(?P<loss>\S+)", str(log)], capture_output=True, text=True, timeout=60)
    import json
    r = json.loads(proc.stdout)
    assert r["format"] == "custom" and r["steps"] == {"first": 1, "last": 2}
    assert r["nonfinite"] == [{"metric": "loss", "step": 2, "line": 2}]
