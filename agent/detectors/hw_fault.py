"""``hw_fault``: a GPU/NPU driver reported a device fault in the host's kernel log.

The ``kernel`` log format (agent/readers/parsers/kernel.py) sends one ``hw_fault`` sample per fault
with its ``device``, ``code``, ``class`` and ``meaning`` (agent/readers/fault_codes.yml). ``classes``
picks which faults a rule takes: by default ``hardware`` only, so application faults (Xid 13, 31,
43, 45: a program's bad address or killed context) never alert by themselves. The alert carries the
file's labels plus ``device`` and ``code``: one alert per faulty device and code, resolving after
``resolve_after`` without another such fault.
"""

from __future__ import annotations

from typing import Literal

from ..model import HW_FAULT, Sample, make_labels
from ..series.state import SeriesState
from .base import Detector, Hit, Params

FaultClass = Literal["hardware", "application", "unknown"]
DEVICE_KINDS = {"nvidia": "GPU", "ascend": "NPU"}


class HwFaultParams(Params):
    classes: list[FaultClass] = ["hardware"]


class HwFaultDetector(Detector[HwFaultParams]):
    kind = "hw_fault"
    params_model = HwFaultParams
    metrics = frozenset({HW_FAULT})
    default_resolve_after = 3600.0

    def observe(self, sample: Sample, series: SeriesState) -> Hit | None:
        cls = sample.attr("class", "unknown")
        if cls not in self.params.classes:
            return None
        device, code = str(sample.attr("device", "")), sample.attr("code")
        vendor = sample.attr("vendor")
        fault_name = f"{'Xid' if vendor == 'nvidia' else 'fault'} {code}"
        labels = make_labels(dict(sample.labels), device=device, code=str(code))
        message = f"device {device} {fault_name}: {sample.attr('meaning', '')} ({cls})"
        evidence = {k: v for k, v in sample.attrs}
        # vendor-neutral words for the rule's text: "GPU ... Xid 79", "NPU ... fault 0x80E01801"
        evidence["device_kind"] = DEVICE_KINDS.get(vendor, "device")
        evidence["fault_name"] = fault_name
        if sample.log_time is not None:
            evidence["log_time"] = sample.log_time
        return Hit(labels, message, float(code) if isinstance(code, int) else None, None, sample.source, evidence)
