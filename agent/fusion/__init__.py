"""Operator fusion: the graph compiler's fusion reports, the executed graph's fused ops, the
``fusion_switch.cfg`` that turns passes off, and bisection to the pass that breaks a run."""
