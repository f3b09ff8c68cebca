"""SIGHUP and changed rule files: rules reload (a bad file keeps its last good version), the web
config file applies at once, and the config file is re-read and compared (changed settings are
named, and take effect at the next restart)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from ..config import Config, ConfigError
from ..engine.pipeline import Pipeline
from ..engine.rulefile import default_rules_dir, load_rules
from ..exporters.http import HttpExporter
from ..exporters.webconfig import load_web_config
from ..health import Health

log = logging.getLogger("precision_agent")


class Reloader:
    def __init__(self, config: Config, health: Health, pipeline: Pipeline, http: HttpExporter,
                 reread: Callable[[], Config] | None) -> None:
        """``reread``: loads and validates the config file again (SIGHUP), as at start."""
        self.config = config
        self.health = health
        self.pipeline = pipeline
        self.http = http
        self.reread = reread
        self.rule_dirs: list[Path] = ([default_rules_dir()] if config.default_rules else []) + list(config.rule_dirs)
        self._rule_mtimes: dict[str, float] = {}

    def check_config(self) -> None:
        """SIGHUP: the config file again, validated as at start. The running configuration stays
        in force either way; what differs is reported, not half-applied."""
        if self.reread is None:
            return
        try:
            new = self.reread()
        except ConfigError as exc:
            self.health.error("config", "%s (keeping the running configuration)", exc)
            self.health.inc("config_reloads_failure")
            return
        self.health.inc("config_reloads_success")
        self._reload_web_config()
        changed = [f for f in type(self.config).model_fields if getattr(new, f) != getattr(self.config, f)]
        self.health.set("config_restart_needed", 1.0 if changed else 0.0)
        if changed:
            log.warning("the config file changed %s; the agent keeps its running configuration until it "
                        "restarts (SIGHUP reloads rule files only)", ", ".join(changed))

    def _reload_web_config(self) -> None:
        """SIGHUP reads the web config file again, as exporter-toolkit does on every request:
        rotated certificates and changed users apply without a restart."""
        path = self.config.web_config_file
        if path is None:
            return
        try:
            self.http.apply(load_web_config(path))
        except (ConfigError, ValueError) as exc:
            self.health.error("config", "web config file: %s (keeping the one in force)", exc)
            return
        log.info("web config file %s reloaded", path)

    def reload_rules(self, initial: bool = False) -> None:
        try:
            rules = load_rules(self.rule_dirs, None if initial else self.pipeline.rules,
                               self.config.runbook_base_url or "")
        except ConfigError as exc:  # e.g. a rule directory vanished: keep the rules in force
            self.health.error("rule_file", "%s (keeping the rules in force)", exc)
            self.health.inc("rule_reloads_failure")
            self._rule_mtimes = self._rule_file_mtimes()  # report once, not at every resync
            return
        for err in rules.errors.values():
            self.health.error("rule_file", "%s (keeping the last good version, if any)", err)
        self.health.inc("rule_reloads_failure" if rules.errors else "rule_reloads_success")
        self.pipeline.set_rules(rules)
        self.health.set("rule_files_ok", len(rules.by_file) - len([e for e in rules.errors if e in rules.by_file]))
        self.health.set("rule_files_error", len(rules.errors))
        self.health.set("rules_loaded", len(rules.rules))
        self._rule_mtimes = self._rule_file_mtimes()
        log.info("loaded %d rule(s) from %d file(s)", len(rules.rules), len(rules.by_file))

    def check_rule_files(self) -> None:
        """Reload when a rule file changed on disk (every resync)."""
        if self._rule_file_mtimes() != self._rule_mtimes:
            log.info("rule files changed; reloading")
            self.reload_rules()

    def _rule_file_mtimes(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in self.rule_dirs:
            for p in ([d] if d.is_file() else sorted(d.glob("*.y*ml")) if d.is_dir() else []):
                try:
                    out[str(p)] = p.stat().st_mtime
                except OSError:
                    pass
        return out
