"""Every fuzz target by name."""

from __future__ import annotations

from . import dumps, files, logs
from .core import Target

TARGETS: dict[str, Target] = {t.name: t for t in (*logs.TARGETS, *dumps.TARGETS, *files.TARGETS)}
