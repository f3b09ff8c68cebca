"""The map from the scalar names of structured metric files (TensorBoard tags, CSV columns) to the
agent's metrics: ``metric_map.yml`` beside this module, extended by the file that
``$PRECISION_AGENT_METRIC_MAP`` names (its names first). A broken user file is an error the
readers report (``map_error``) while the shipped map stays in force: a typo in the user's file
must not blind the agent to the names it already knew."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..model import TRAINING_METRICS
from ..safeio import FileTooBig, read_regular

SHIPPED = Path(__file__).with_name("metric_map.yml")
ENV_EXTRA = "PRECISION_AGENT_METRIC_MAP"
MAX_MAP_BYTES = 1 << 20
MAX_NAME = 256


class MapError(ValueError):
    """A metric map file that cannot be used; the message names the file and the reason."""


@dataclass(frozen=True)
class MetricMap:
    names: dict[str, str]          # lower-cased tag/column name -> agent metric
    step_columns: tuple[str, ...]  # lower-cased CSV step column names, in order of preference

    def metric(self, name: str) -> str | None:
        """The agent metric of a tag or column name, None when it is not one of ours."""
        return self.names.get(name.strip().lower()) if len(name) <= MAX_NAME else None


def _names(value: object, where: str) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(n, str) and n.strip() for n in value)):
        raise MapError(f"{where}: expected a list of names")
    return [n.strip().lower() for n in value]


def read_yaml(path: Path, error: type[ValueError] = MapError, max_bytes: int = MAX_MAP_BYTES) -> object:
    """The YAML document of a shipped or user data file (this map, the fault-code catalogue);
    ``error`` with the file and the reason when it cannot be read."""
    try:
        return yaml.safe_load(read_regular(path, max_bytes).decode("utf-8"))
    except (OSError, FileTooBig, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise error(f"{path}: {exc}") from None


def _load(path: Path) -> tuple[dict[str, list[str]], list[str], list[str]]:
    doc = read_yaml(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("metrics", {}), dict):
        raise MapError(f"{path}: expected a mapping with a mapping 'metrics' (metric: [names])")
    metrics: dict[str, list[str]] = {}
    for metric, names in (doc.get("metrics") or {}).items():
        if metric not in TRAINING_METRICS:
            raise MapError(f"{path}: metrics: unknown metric {metric!r}; known: {', '.join(TRAINING_METRICS)}")
        metrics[metric] = _names(names, f"{path}: metrics.{metric}")
    steps = _names(doc.get("step_columns") or [], f"{path}: step_columns")
    ignore = _names(doc.get("ignore") or [], f"{path}: ignore")
    return metrics, steps, ignore


@functools.lru_cache(maxsize=8)
def metric_map(extra: str | None = None) -> MetricMap:
    """The shipped map plus the file ``extra`` (its names win); raises MapError for a broken file."""
    layers = [_load(SHIPPED)]
    if extra:
        layers.insert(0, _load(Path(extra)))
    names: dict[str, str] = {}
    ignored: set[str] = set()
    steps: list[str] = []
    for metrics, step_cols, ignore in layers:  # the user's layer first: the first word on a name wins
        ignored.update(n for n in ignore if n not in names)
        for metric, keys in metrics.items():
            for key in keys:
                if key not in names and key not in ignored:
                    names[key] = metric
        steps.extend(c for c in step_cols if c not in steps)
    return MetricMap(names, tuple(steps))


def current_map() -> tuple[MetricMap, str | None]:
    """The map in force and, when ``$PRECISION_AGENT_METRIC_MAP`` cannot be used, why (the
    shipped map alone is then in force)."""
    extra = os.environ.get(ENV_EXTRA) or None
    try:
        return metric_map(extra), None
    except MapError as exc:
        return metric_map(None), str(exc)
