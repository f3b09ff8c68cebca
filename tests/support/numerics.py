"""Reference statistics in float64 and the tolerances the scanner and the kernels are held to."""

from __future__ import annotations

import math

import numpy as np
import pytest

from precision_agent.dumps.scanner import FP16_MAX


def bf16_to_f64(words: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # signalling NaN payloads widen to quiet NaNs
        return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def reference(a: np.ndarray, bf16: bool = False) -> dict:
    """Naive float64 reference over the whole array."""
    x = bf16_to_f64(np.asarray(a).reshape(-1)) if bf16 else np.asarray(a).astype(np.float64).reshape(-1)
    fin = x[np.isfinite(x)]
    ref = {"count": x.size, "nan": int(np.isnan(x).sum()), "pos_inf": int((x == np.inf).sum()),
           "neg_inf": int((x == -np.inf).sum()),
           "zero_fraction": (int((x == 0).sum()) / x.size) if x.size else None,
           "fp16_saturated": int((np.abs(fin) >= FP16_MAX).sum()) if a.dtype == np.float16 else 0}
    if fin.size:
        ref.update(min=float(fin.min()), max=float(fin.max()), mean=float(np.sum(fin)) / fin.size,
                   l2norm=math.sqrt(float(np.sum(fin * fin))), abs_mean=float(np.mean(np.abs(fin))),
                   rms=math.sqrt(float(np.mean(fin * fin))))
    else:
        ref.update(min=None, max=None, mean=None, l2norm=None, abs_mean=None)
    return ref


F32_TOL = 3e-5


F64_TOL = 1e-9


def tol_for(dtype) -> float:
    return F32_TOL if np.dtype(dtype) in (np.float16, np.float32) else F64_TOL


def check(stats, ref, tol: float = F64_TOL) -> None:
    for k in ("count", "nan", "pos_inf", "neg_inf", "fp16_saturated", "min", "max", "zero_fraction"):
        assert getattr(stats, k) == ref[k], (k, getattr(stats, k), ref[k])
    if ref["mean"] is None:
        assert stats.mean is None and stats.l2norm is None and stats.abs_mean is None
        return
    # Sums accumulate in float64 in both, but in a different order (blocked BLAS dot + fsum vs
    # numpy pairwise); with cancellation the relative error of the *sum* is unbounded for both,
    # so the bound is relative to mean(|x|) (resp. the norm itself), the condition-independent one.
    assert abs(stats.mean - ref["mean"]) <= tol * ref["abs_mean"] + 1e-300, (stats.mean, ref["mean"])
    # a sum of |x| has no cancellation: the same bound is a relative one here
    assert abs(stats.abs_mean - ref["abs_mean"]) <= tol * ref["abs_mean"] + 1e-300, (
        stats.abs_mean, ref["abs_mean"])
    assert stats.abs_mean >= 0 and (stats.abs_mean > 0) == (ref["abs_mean"] > 0)
    if math.isinf(ref["l2norm"]):
        assert math.isinf(stats.l2norm)
    else:
        assert stats.l2norm == pytest.approx(ref["l2norm"], rel=tol, abs=1e-300)
