"""Hardware or numerics: the ``suspect`` label of every incident alert (issue 22).

When a job goes NaN, who must act: the infrastructure team (a faulty device: drain, cordon) or the
model's owner (fp16 range, a learning rate)? Every alert of an incident rule (``JUDGED``: non-finite
values, a collapsed loss scale, divergence, the dump incidents) carries ``suspect`` = ``hardware`` |
``numerics`` | ``unknown`` and, in its evidence, ``suspect_evidence``: what decided it. The rows, in
order (docs/hardware.md gives the reasons):

1. Megatron's rerun state machine re-ran the iteration on another GPU and got the same result
   (``reproducible``): **numerics**, whatever else happened (a Xid too).
2. It says the result was not reproducible: on the same GPU (``transient``) or on another GPU
   (``persistent``: the first GPU computed wrong): **hardware**.
3. A hardware-class fault of this host's devices (agent/readers/fault_codes.yml, class
   ``hardware``: Xid 48, 63/64, 74, 79, 92, 94/95, ...) read within ``window`` before the incident
   or up to its firing: **hardware**. Application faults (Xid 13, 31, 43, 45) are listed, never
   decide.
4. The all-reduced gradient norm is NaN/Inf on this rank while other ranks of the run reached that
   step with only finite ones (data-parallel replicas must agree bit for bit): **hardware**. A
   single rank's loss (its own batch) is listed, never decides.
5. Otherwise **unknown**: numerics is never guessed without the rerun's evidence.

Times are the agent's read times (see agent/series/hardware.py for faults read long after their
stamp). The label is fixed when the alert opens: the alert's identity (fingerprint) leaves
``suspect`` out, so a later hit of the same alert keeps the label it fired with (a changed label
would be a new alert, a second page) and carries the verdict as it stands then in
``suspect_evidence`` (``now``) and the ``suspect`` annotation. A hardware fault read after the
firing pages on its own (GpuHardwareFault).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ..model import GRAD_NORM, Alert, AlertState, Finding, Labels, fingerprint
from ..series.hardware import HostLedger, Note, run_labels
from ..series.state import SeriesState
from .rulefile import Rule

SUSPECT = "suspect"
EVIDENCE = "suspect_evidence"
HARDWARE, NUMERICS, UNKNOWN = "hardware", "numerics", "unknown"
# incident kinds judged; loss_scale only for its incident conditions
JUDGED = frozenset({"nonfinite", "divergence", "dump_nonfinite", "dump_overflow", "dump_divergence",
                    "nondeterminism", "loss_scale"})
LOSS_SCALE_JUDGED = frozenset({"floor", "collapse"})
DEFAULT_WINDOW_S = 600.0
RERUN_STEPS = 100  # a rerun verdict up to this many iterations before the incident's step is its own
RERUN_MAX_AGE_S = 86400.0  # ... and read at most this long before it
LISTED = 8         # faults and verdicts listed in the evidence, at most each


def identity(labels: Labels) -> Labels:
    """An alert's identity labels: without ``suspect``, so the verdict never splits an alert."""
    return tuple(kv for kv in labels if kv[0] != SUSPECT) if any(k == SUSPECT for k, _ in labels) else labels


class SuspectJudge:
    """Judges the findings of incident rules against the host ledger the pipeline feeds."""

    def __init__(self, window: float = DEFAULT_WINDOW_S) -> None:
        self.window = window
        self.ledger = HostLedger()

    def judges(self, rule: Rule) -> bool:
        if rule.spec.kind not in JUDGED or SUSPECT in rule.spec.labels:
            return False
        return rule.spec.kind != "loss_scale" or getattr(rule.detector.params, "condition", "") in LOSS_SCALE_JUDGED

    def judged(self, rule: Rule, f: Finding, alerts: Mapping[str, Alert],
               series: Mapping[Labels, SeriesState]) -> Finding:
        """``f`` with its ``suspect`` label, evidence and annotation."""
        verdict, why, ev = self.verdict(f, series)
        label = verdict
        old = alerts.get(fingerprint(rule.name, identity(f.labels)))
        if old is not None and old.state != AlertState.RESOLVED:
            label = dict(old.labels).get(SUSPECT, verdict)  # fixed when the alert opened
        line = f"{label}: {why}"
        if label != verdict:
            ev["fixed_at_firing"] = label
            line = why = f"{label} at firing; now {verdict}: {why}"
        ev["verdict"] = verdict
        labels = tuple(sorted(identity(f.labels) + ((SUSPECT, label),)))
        evidence = {**f.evidence, EVIDENCE: ev, "suspect_why": why}
        annotations = rule.annotate(labels, f.value, f.step, f.source, evidence)
        annotations[SUSPECT] = line
        return dataclasses.replace(f, labels=labels, evidence=evidence, annotations=annotations)

    def verdict(self, f: Finding, series: Mapping[Labels, SeriesState]) -> tuple[str, str, dict[str, Any]]:
        """(suspect, one line why, evidence) for a finding read at ``f.time``."""
        start, end = f.time - self.window, f.time
        ev: dict[str, Any] = {"window_s": self.window, "first_bad_step": f.step, "judged_at": f.time}
        reruns = [r for r in self.ledger.reruns_of(f.labels) if _rerun_matches(r, f.step, start, end)]
        if reruns:
            ev["reruns"] = [r.to_json() for r in reruns[-LISTED:]]
        faults = list(self.ledger.faults_between(start, end))
        hw = [x for x in faults if x.attr("class") == "hardware"]
        other = [x for x in faults if x.attr("class") != "hardware"]
        if hw:
            ev["faults"] = [_fault_json(x, f.time) for x in hw[-LISTED:]]
        if other:
            ev["not_hardware_faults"] = [_fault_json(x, f.time) for x in other[-LISTED:]]
        single = _single_rank(f, series)
        if single:
            ev["single_rank"] = single
        verdicts = {r.attr("verdict") for r in reruns}
        if "reproducible" in verdicts:
            r = next(r for r in reversed(reruns) if r.attr("verdict") == "reproducible")
            return NUMERICS, (f"Megatron's rerun reproduced the result on another GPU at iteration "
                              f"{r.step} (rank {r.attr('rank')}): a numerical problem"), ev
        for v, what in (("persistent", "not reproducible on another GPU: the first GPU computed wrong"),
                        ("transient", "not reproducible on a rerun on the same GPU: a transient fault")):
            if v in verdicts:
                r = next(r for r in reversed(reruns) if r.attr("verdict") == v)
                return HARDWARE, (f"Megatron's rerun at iteration {r.step} (rank {r.attr('rank')}, "
                                  f"node {r.attr('node')}, device {r.attr('device')}): {what}"), ev
        if hw:
            x = hw[-1]
            return HARDWARE, (f"{_name(x)} ({x.attr('meaning')}) on device {x.attr('device')} "
                              f"{_ago(x, f.time)} ({x.where})"), ev
        if single and single.get("decides"):
            return HARDWARE, (f"{GRAD_NORM} non-finite on rank {single['rank']} only at step {f.step}: "
                              f"ranks {', '.join(single['finite_ranks'])} reached it with finite values"), ev
        why = "no hardware fault, rerun verdict or rank disagreement"
        if other:
            why += f" ({len(other)} application/unknown-class fault(s) listed: not hardware)"
        if "reproducible_same_gpu" in verdicts:
            why += "; Megatron's rerun reproduced it on the same GPU, the rerun on another GPU is pending"
        return UNKNOWN, why, ev


def later(alert: Alert, finding: Finding) -> None:
    """A later hit of an open alert: its suspect evidence and annotation as they stand now (the
    label stays; the alert book calls this where it keeps the onset's evidence)."""
    ev = finding.evidence.get(EVIDENCE)
    if ev is None:
        return
    evidence = alert.finding.get("evidence")
    if isinstance(evidence, dict):
        evidence[EVIDENCE] = ev
        evidence["suspect_why"] = finding.evidence.get("suspect_why", "")
    if SUSPECT in finding.annotations:
        alert.annotations[SUSPECT] = finding.annotations[SUSPECT]


def _rerun_matches(r: Note, step: int | None, start: float, end: float) -> bool:
    if r.step is not None and step is not None:
        # its iteration, and read within a day of the incident: a run label used again weeks
        # later (or a watch without labels) does not inherit an old run's verdict
        return step - RERUN_STEPS <= r.step <= step + 1 and end - RERUN_MAX_AGE_S <= r.read <= end + 1.0
    return not r.stale and start <= r.read <= end


def _single_rank(f: Finding, series: Mapping[Labels, SeriesState]) -> dict[str, Any] | None:
    """Ranks of the same run at the incident's step: finite ones beside this rank's non-finite value."""
    labels = dict(f.labels)
    metric, rank, step = labels.get("metric"), labels.get("rank"), f.step
    if f.kind != "nonfinite" or rank is None or step is None or metric is None:
        return None
    run = run_labels(f.labels)
    finite, bad, ranks, attempt = [], [], [], 1
    for key, st in list(series.items())[-4096:]:
        other = dict(key).get("rank")
        if other is None or run_labels(key) != run:
            continue
        if other == rank:
            attempt = max(attempt, st.attempt)
        elif metric in st.last:
            ranks.append((other, st))
    for other, st in ranks:
        if st.attempt < attempt:
            # a rank that never went back as this one did: a previous attempt's, not read since
            # the restart (read times cannot tell: a catch-up reads both attempts at once). A rank
            # that joined after the restart is left out too: a witness fewer, never a false one
            continue
        if st.nonfinite.get(metric, 0) and (st.first_nonfinite_step is None or st.first_nonfinite_step <= step):
            bad.append(other)
        elif (reached := st.attempt_step) is not None and reached >= step and not st.nonfinite.get(metric, 0) \
                and math.isfinite(st.last[metric]):
            finite.append(other)
    if not finite:
        return None
    return {"rank": rank, "metric": metric, "step": step, "finite_ranks": sorted(finite)[:LISTED],
            "nonfinite_ranks": sorted(bad)[:LISTED],
            # the all-reduced gradient norm is the same on every data-parallel rank; a loss is the rank's own batch's
            "decides": metric == GRAD_NORM and not bad}


def _name(x: Note) -> str:
    return f"Xid {x.attr('code')}" if x.attr("vendor") == "nvidia" else f"fault {x.attr('code')}"


def _ago(x: Note, now: float) -> str:
    d = now - x.read
    return f"read {d:.0f} s before the incident" if d >= 1 else "read with the incident"


def _fault_json(x: Note, now: float) -> dict[str, Any]:
    out = x.to_json()
    out["before_incident_s"] = round(now - x.read, 3)
    return out
