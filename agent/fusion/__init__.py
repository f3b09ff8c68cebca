"""Operator fusion: the graph compiler's fusion reports, the executed graph's fused ops, the
``fusion_switch.cfg`` that turns passes off, and bisection to the pass that breaks a run."""


class FusionFileError(ValueError):
    """A compiler file (fusion report, executed graph) that cannot be read: names the file and why."""

    def __init__(self, file: str, reason: str) -> None:
        self.file, self.reason = file, reason
        super().__init__(f"{file}: {reason}")
