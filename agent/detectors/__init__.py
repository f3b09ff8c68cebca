"""Rule kinds: one module per kind, registered here by name."""

from __future__ import annotations

from .base import Clear, Detector, Hit, Params
from .loss_scale import LossScaleDetector
from .nonfinite import NonfiniteDetector

KINDS: dict[str, type[Detector]] = {cls.kind: cls for cls in (NonfiniteDetector, LossScaleDetector)}

__all__ = ["Clear", "Detector", "Hit", "KINDS", "Params"]
