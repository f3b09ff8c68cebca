"""Shared by the dump kinds that alert on "the first op(s) of a step": a bounded per-series
memory of how many hits each (dump directory, step) has had. No rule kind lives here."""

from __future__ import annotations

from collections import OrderedDict

from ..model import Sample
from .base import PerSeries

KEYS_PER_SERIES = 256  # (directory, step) pairs remembered per series; older ones are forgotten


class StepQuota:
    """``take(sample, n)`` is True for the first ``n`` samples of each (source, step) of a series.

    The source (the scanned directory) is part of the key because a dump without step numbers
    (a plain ``.npy`` tree) reports step None for every directory."""

    def __init__(self) -> None:
        self._seen: PerSeries[OrderedDict[tuple, int]] = PerSeries(OrderedDict)

    def take(self, sample: Sample, n: int) -> bool:
        seen = self._seen.get(sample.labels)
        key = (sample.source.path, sample.step)
        used = seen.get(key, 0)
        if used >= n:
            return False
        seen[key] = used + 1
        seen.move_to_end(key)
        while len(seen) > KEYS_PER_SERIES:
            seen.popitem(last=False)
        return True
