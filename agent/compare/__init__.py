"""Dump comparison: a run's tensors against a benchmark run or a rerun, tensor by tensor.

pairing (which tensor matches which) → metrics (msaccucmp's definitions, one chunked pass) →
verdict (presets, and the strict first-op-that-lost-precision rule) → report (JSON, CSV, table).
"""
