"""The exporters: what leaves the agent, read from snapshots of the stages, never owning state.

This folder sits at the project's top level (the layout the project chose: ``agent/``,
``exporters/``, ``rules/``), and is installed *inside* the agent's package as
``precision_agent.exporters`` (pyproject.toml's ``package-dir``), so ``from ..model import`` here
means ``precision_agent.model``. In the pipeline's order it comes after the state store and before
the daemon that wires it:

* ``metrics.py``: the custom collector for /metrics (training series, alerts, health counters);
  ``dumps.py``: digests and compare outcomes from ``precision_agent.dumps.results``;
* ``httpserver.py`` + ``http.py``: the bounded HTTP server, TLS and basic auth (``webconfig.py``,
  exporter-toolkit's file format); ``api.py``: the JSON API documents;
* ``alertmanager.py``: the Alertmanager v2 pusher (its config model is
  ``precision_agent.config.alertmanager``);
* data folders, installed as package data: ``grafana/`` (dashboard), ``prometheus/`` (alert and
  recording rules with promtool tests), ``alertmanager/`` (routing, grouping, inhibition).
"""
