"""Fusion test inputs: fusion reports with N passes, msprobe dumps of a fused-attention step, the `fusion` command."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "precision_agent", "fusion", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def report_text(n: int, ub_every: int = 3) -> str:
    """A fusion report with n effective passes (every ub_every-th a UB pass) and two matched-only ones."""
    graph = {f"G{i:03d}FusionPass": {"effect_times": "2", "match_times": "3"} for i in range(n) if i % ub_every}
    ub = {f"U{i:03d}FusionPass": {"effect_times": "1", "match_times": "1"} for i in range(n) if not i % ub_every}
    graph["NeverFusionPass"] = {"effect_times": "0", "match_times": "5"}
    ub["NeverUbFusionPass"] = {"effect_times": "0", "match_times": "1"}
    return json.dumps({"graph_fusion": graph, "session_and_graph_id": "0_0", "ub_fusion": ub})


def write_msprobe_calls(root, calls: list[tuple[str, list[np.ndarray], list[np.ndarray]]], step: int = 0) -> None:
    """``step<N>/rank0/dump.json`` + ``dump_tensor_data/*.npy`` for calls (name, inputs, outputs)."""
    d = root / f"step{step}" / "rank0"
    (d / "dump_tensor_data").mkdir(parents=True)
    data = {}
    for name, ins, outs in calls:
        entry = {}
        for slot, arrays, io in (("input_args", ins, "input"), ("output", outs, "output")):
            items = []
            for i, a in enumerate(arrays):
                fname = f"{name}.{io}.{i}.npy"
                np.save(d / "dump_tensor_data" / fname, a)
                with np.errstate(invalid="ignore"):
                    items.append({"type": "torch.Tensor", "dtype": "torch.float32", "shape": list(a.shape),
                                  "Max": float(np.max(a)), "Min": float(np.min(a)), "Mean": float(np.mean(a)),
                                  "Norm": float(np.linalg.norm(a)), "requires_grad": False, "data_name": fname})
            entry[slot] = items
        data[name] = entry
    (d / "dump.json").write_text(json.dumps({"task": "tensor", "level": "L1", "framework": "pytorch",
                                             "dump_data_dir": str(d / "dump_tensor_data"), "data": data}))


def attention_calls(fault: str | None) -> list:
    rnd = np.random.default_rng(5)
    x = rnd.standard_normal((2, 8, 16)).astype(np.float32)
    q = x @ rnd.standard_normal((16, 16)).astype(np.float32)
    att = q.copy()
    if fault == "nan":
        att[0, 3, 5] = np.nan
    elif fault == "drift":
        att = att * np.float32(1.01)
    out = att @ rnd.standard_normal((16, 16)).astype(np.float32)
    return [("Functional.linear.0.forward", [x], [q]),
            ("NPU.npu_fusion_attention.0.forward", [q, q, q], [att]),
            ("Functional.linear.1.forward", [att], [out])]


WRITER = r"""
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])   # tests/
from support.fusion import attention_calls as run_of, write_msprobe_calls as write_msprobe
write_msprobe(Path(sys.argv[1]), run_of("nan"), step=3)
"""
