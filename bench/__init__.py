"""Benchmarks of the real precision-agent process (speed lives here, never in tests/).

``python -m bench`` (or ``make bench``) runs them all; see bench/README.md.
"""

BENCHES = ("latency", "idle", "parse", "scan", "scantree", "compare", "fuzz", "fleet")
EXTRA = ("soak",)  # run only when named (``--only soak``): ten minutes of everything hostile at once
