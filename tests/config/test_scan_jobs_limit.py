"""`limits.scan_jobs` (issue 21): the daemon's dump scan reads one file at a time unless told
otherwise; a value that is no count of threads is a config error naming the key."""

import pytest

from precision_agent.config import ConfigError, load_config


def test_scan_jobs_defaults_to_one_and_is_validated(tmp_path):
    assert load_config(None, {"watches": [{"path": "/tmp"}]}).limits.scan_jobs == 1
    path = tmp_path / "agent.yml"
    path.write_text("limits:\n  scan_jobs: 4\n")
    assert load_config(path).limits.scan_jobs == 4
    for bad in ("0", "-1", "65", "two"):
        path.write_text(f"limits:\n  scan_jobs: {bad}\n")
        with pytest.raises(ConfigError, match="scan_jobs"):
            load_config(path)
