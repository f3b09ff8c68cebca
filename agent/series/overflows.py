"""Overflow accounting of a series: the overflow events that scale values, skip counters, scaler
messages and non-finite grad norms prove, each counted once (the rules are listed in state.py's
docstring). :class:`OverflowAccounting` is a part of :class:`~.state.SeriesState`: its methods work on
that dataclass's fields (the counters, the scale trajectory and the copy filters)."""

from __future__ import annotations

import math

from ..model import LOSS, LOSS_SCALE, OVERFLOW, Sample, far_apart

# producers whose printed grad norm covers only the steps that were applied: Megatron leaves the
# field out when every step of the interval was skipped, so a printed NaN went into the weights
APPLIED_GRAD_NORM_PRODUCERS = frozenset({"megatron"})


class OverflowAccounting:
    """The overflow and loss-scale bookkeeping methods of :class:`~.state.SeriesState`."""

    __slots__ = ()  # SeriesState is slotted: one per followed series

    def _count(self, n: int) -> None:
        self.overflow_steps += n
        self._events_since_counter += n
        self._overflows_since_scale += n
        self._window_overflows += n

    @staticmethod
    def _event(s: Sample, n: int, variant: str) -> Sample:
        return Sample(s.labels, OVERFLOW, float(n), s.step, s.source, s.time, s.log_time,
                      (("variant", variant),), s.producer)

    def _gradnorm_overflow(self, s: Sample, out: list[Sample]) -> None:
        """A non-finite grad norm beside a finite loss, where the run may scale its loss, is a
        skipped step; counted once per step, unless a message already counted it."""
        self.gradnorm_explained = False
        loss = self.last.get(LOSS)
        if (self.loss_scaling == "no" or s.producer in APPLIED_GRAD_NORM_PRODUCERS
                or (loss is not None and not math.isfinite(loss))):
            return
        if self._progress_line == (s.source.path, s.source.line):
            # the record's own progress opened a new window: the step it reports is the one
            # the window before it covers (where a scaler message would stand)
            if self._window_before > 0:
                self.gradnorm_explained = True
                return
            self._count(1)
            self._window_overflows -= 1
            self._window_before += 1
        elif self._window_overflows > 0:
            self.gradnorm_explained = True
            return
        else:
            self._count(1)
        out.append(self._event(s, 1, "grad_norm"))

    def _reconcile(self, s: Sample, skipped: int) -> list[Sample]:
        extra = max(0, skipped - self._events_since_counter)
        if extra:
            self.scaler_events += extra
            self._count(extra)
        self._events_since_counter = 0
        return [self._event(s, extra, "counter")] if extra else []

    def _scale(self, s: Sample, out: list[Sample]) -> bool:
        attrs = s.attrs  # mostly none: a value from a periodic report
        frm = s.attr("frm") if attrs else None
        decrease = s.attr("decrease") if attrs else None
        backoffs = 0
        if frm is not None:
            lt = self._last_transition
            if (lt is not None and not self._progress_since_transition and lt[0] == frm and lt[1] == s.value
                    and self.scale_last == s.value and not far_apart(lt[2], s.log_time)):
                return False  # another rank's copy of the transition just seen
            self._last_transition = (frm, s.value, s.log_time)
            self._progress_since_transition = False
            backoffs += self._observe_scale(frm)
        elif decrease and self.scale_last is None:
            # "reducing loss scale to X" with no earlier value seen: the message itself
            # proves a decrease happened (apex, fairseq, torch_npu print only the new value)
            self.scale_decreases += 1
            backoffs += 1
        regrown = False
        if decrease and self._pending_skip:
            self._pending_skip = False  # the skip messages before this back-off were its copies
            # a copy of the last back-off message comes without training in between
            regrown = self._progress_since_scale and self.scale_last is not None and s.value >= self.scale_last
        backoffs += self._observe_scale(s.value)
        if regrown and not backoffs:
            # "reducing to X" after a skip, X no lower than the last value: the scale grew back
            # unseen and backed off again; the skip was one overflow event all the same
            backoffs = 1
        if backoffs:
            # a dynamic scaler backs off only after an overflow: each back-off the values prove is
            # an overflow event, unless a message or counter already counted it
            extra = backoffs - self._overflows_since_scale
            if extra > 0:
                self._count(extra)
                out.append(self._event(s, extra, "backoff"))
        self._overflows_since_scale = 0
        self._progress_since_scale = False
        self.last[LOSS_SCALE] = s.value
        return True

    def _observe_scale(self, v: float) -> int:
        """Take one scale value; returns the back-offs (halvings) a decrease implies, else 0."""
        if self.scale_first is None:
            self.scale_first = v
        backoffs = 0
        last = self.scale_last
        if last is not None:
            if v < last:
                self.scale_decreases += 1
                backoffs = halvings(last, v)
            elif v > last:
                self.scale_increases += 1
        low, high = self.scale_min, self.scale_max  # min() and max() of the two, without the calls
        if low is None or v < low:
            self.scale_min = v
        if high is None or v > high:
            self.scale_max = v
        self.scale_last = v
        return backoffs

    def _duplicate_overflow(self, s: Sample) -> bool:
        cur = {"step": s.step, "frm": s.attr("frm"), "to": s.attr("to"), "variant": s.attr("variant"),
               "log_time": s.log_time}
        prev, self._last_overflow = self._last_overflow, cur
        fresh, self._progress_since_overflow = self._progress_since_overflow, False
        if prev is None or fresh or far_apart(prev["log_time"], s.log_time):
            return False
        for key in ("step", "frm", "to", "variant"):
            if prev[key] is not None and cur[key] is not None and prev[key] != cur[key]:
                return False
        # merge what the copies know (e.g. the step from "Grad overflow on iteration N")
        self._last_overflow = {k: cur[k] if cur[k] is not None else prev[k] for k in cur}
        return True


def halvings(frm: float, to: float) -> int:
    """How many halvings take ``frm`` down to ``to`` (at least 1): interval reports hide several."""
    if not (0 < to < frm) or not math.isfinite(frm):
        return 1
    ratio = frm / to  # past the float range for ~1e308 down to a denormal: the logs' difference then
    return max(1, round(math.log2(ratio) if math.isfinite(ratio) else math.log2(frm) - math.log2(to)))
