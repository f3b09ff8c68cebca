"""The dump scanner's C kernel at its edges: lengths around the vector steps, misaligned,
strided and foreign buffers (declined, then scanned by numpy), NaN/Inf placement, signed
zeros, subnormals, the float32-safe range boundaries, fp16 saturation, bfloat16 NaN payloads,
tiny blocks and threads. Each case is checked against the float64 reference and against the
numpy kernels in the same process."""

from __future__ import annotations

import os

import numpy as np
import pytest

from precision_agent import kernels
from precision_agent.kernels import scan_c
from precision_agent.kernels.scan_numpy import Acc, Scratch
from precision_agent.dumps.scanner import FP16_MAX, scan_array
from support.numerics import F32_TOL, F64_TOL, check, reference

if not kernels.built("scan"):
    assert os.environ.get("CI") != "true", "CI builds the scan kernel: precision_agent.kernels._scan must import"
    pytest.skip("the C scan kernel is not built here (no compiler at install)", allow_module_level=True)

MOD = kernels._import("scan")
KINDS = ["f32", "f64", "f16", "bf16"]


def words_of(f32: np.ndarray) -> np.ndarray:
    return (np.asarray(f32, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def as_kind(values, kind: str) -> np.ndarray:
    v = np.asarray(values, np.float64)
    if kind == "f32":
        return v.astype(np.float32)
    if kind == "f64":
        return v
    if kind == "f16":
        return v.astype(np.float16)
    return words_of(v.astype(np.float32))


def both(a: np.ndarray, kind: str, **kw):
    """(C stats, numpy stats) of ``a``, checked against the reference (both must pass)."""
    bf16 = kind == "bf16"
    dtype = "bfloat16" if bf16 else None
    ref = reference(a, bf16=bf16)
    tol = F64_TOL if kind == "f64" else F32_TOL
    out = []
    for mode in ("c", "numpy"):
        with kernels.forced(mode):
            s = scan_array(a, dtype=dtype, **kw)
        check(s, ref, tol)
        out.append(s)
    return out


def test_c_mode_runs_the_c_kernel():
    with kernels.forced("c"):
        assert kernels.get("scan") is MOD
    with kernels.forced("numpy"):
        assert kernels.get("scan") is None


@pytest.mark.parametrize("kind", KINDS)
def test_lengths_around_the_vector_step(kind):
    rng = np.random.default_rng(11)
    for n in range(0, 41):
        vals = rng.standard_normal(n) * 3
        both(as_kind(vals, kind), kind)
        if n:
            vals[-1] = np.nan  # NaN in the scalar tail or the last vector
            c, _ = both(as_kind(vals, kind), kind)
            assert c.nan == 1


@pytest.mark.parametrize("kind", KINDS)
def test_specials_at_every_position_of_a_vector_step(kind):
    # a NaN/Inf hidden next to its min/max partner in the pairwise reduction, in every lane
    base = np.linspace(-5, 7, 64)
    for pos in range(0, 64, 3):
        for special in (np.nan, np.inf, -np.inf):
            vals = base.copy()
            vals[pos] = special
            both(as_kind(vals, kind), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_zeros_subnormals_and_all_nan(kind):
    both(as_kind([-0.0] * 37, kind), kind)
    both(as_kind([0.0, -0.0] * 20, kind), kind)
    c, _ = both(as_kind([np.nan] * 70, kind), kind, block_elems=32)
    assert c.nan == 70 and c.min is None and c.mean is None
    tiny = {"f32": 1e-45, "f64": 5e-324, "f16": 6e-8, "bf16": 1e-40}[kind]
    both(as_kind(np.arange(-20, 21) * tiny, kind), kind)


def test_all_float16_and_bfloat16_words_in_c():
    w = np.arange(1 << 16, dtype=np.uint16)  # every NaN payload, both Infs, subnormals, +-0
    for block in (5, 1000, 1 << 16):
        c, _ = both(w.view(np.float16), "f16", block_elems=block)
        assert c.nan == 2 * (0x3FF) and c.pos_inf == c.neg_inf == 1
        assert c.fp16_saturated == 2
        c, _ = both(w, "bf16", block_elems=block)
        assert c.nan == 2 * 0x7F and c.pos_inf == c.neg_inf == 1
    # every finite half word through the vector loop (a NaN/Inf would send blocks to the
    # careful loop): normals, subnormals and zeros of both signs
    finite = w[(w & 0x7C00) != 0x7C00].view(np.float16)
    for block in (64, 1000, 1 << 16):
        c, _ = both(finite, "f16", block_elems=block)
        assert c.fp16_saturated == 2 and c.zero_fraction == 2 / finite.size
    sub = finite[np.abs(finite) < 2.0 ** -14]  # subnormals alone: min/max/sums exact or close
    c, _ = both(sub, "f16")
    assert (c.min, c.max) == (-float(2.0 ** -14 - 2.0 ** -24), float(2.0 ** -14 - 2.0 ** -24))


def test_bfloat16_nan_payloads():
    w = np.array([0x7F81, 0xFFC0, 0x7FFF, 0xFF81, 0x7F80, 0xFF80, 0x3F80, 0xBF80] * 5, np.uint16)
    c, _ = both(w, "bf16")
    assert (c.nan, c.pos_inf, c.neg_inf, c.min, c.max) == (20, 5, 5, -1.0, 1.0)


def test_fp16_saturation_bounds():
    vals = [FP16_MAX, -FP16_MAX, 65000.0, -1.0, 0.5] * 7
    for block in (1, 2, 3, 35, 1000):
        c, _ = both(np.array(vals, np.float16), "f16", block_elems=block)
        assert c.fp16_saturated == 14 and (c.min, c.max) == (-FP16_MAX, FP16_MAX)


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_float32_safe_range_boundaries(kind):
    # amax exactly 2^50 / 2^-50 stays on float32 sums; just outside goes to float64
    for amax in (2.0 ** 50, 2.0 ** 51, 2.0 ** -50, 2.0 ** -51, 2.0 ** 100, 2.0 ** -100, 3e38):
        vals = np.resize([1.0, -0.5, 0.25, 0.75], 67) * amax
        vals[5] = -amax
        both(as_kind(vals, kind), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_blocks_and_threads(kind):
    rng = np.random.default_rng(3)
    vals = rng.standard_normal(203)
    vals[[0, 50, 202]] = [np.nan, np.inf, 0.0]
    a = as_kind(vals, kind)
    for block in range(1, 6):
        both(a, kind, block_elems=block)
    big = as_kind(rng.standard_normal(50_000), kind)
    for threads in (2, 3):
        both(big, kind, block_elems=4096, threads=threads)


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_misaligned_buffers_fall_back_to_numpy(offset):
    rng = np.random.default_rng(5)
    for dtype, kind in ((np.float32, "f32"), (np.float64, "f64"), (np.float16, "f16")):
        vals = rng.standard_normal(101).astype(dtype)
        vals[[3, 60]] = [np.nan, -np.inf]
        a = np.frombuffer(b"x" * offset + vals.tobytes(), dtype, count=vals.size, offset=offset)
        if a.ctypes.data % a.itemsize == 0:
            continue  # this offset happens to be aligned for the type
        assert MOD.__dict__[kind](a, MOD.state()) is False  # declined
        c, npy = both(a, kind)
        assert (c.nan, c.neg_inf, c.min, c.max) == (npy.nan, npy.neg_inf, npy.min, npy.max) == (
            1, 1, float(np.nanmin(vals[np.isfinite(vals)])), float(np.nanmax(vals[np.isfinite(vals)])))


def test_kernel_declines_foreign_buffers_and_checks_its_state():
    st = MOD.state()
    assert MOD.f32(np.arange(8, dtype=np.float32)[::2], st) is False      # strided
    assert MOD.f32(np.arange(8, dtype=">f4" if np.little_endian else "<f4"), st) is False
    assert MOD.f32(np.arange(8, dtype=np.int32), st) is False             # same size, not float
    assert MOD.f64(np.arange(8, dtype=np.float32), st) is False
    assert MOD.bf16(np.arange(8, dtype=np.float16), st) is False          # words, not halves
    assert MOD.f32(object(), st) is False
    assert MOD.take(st)[:6] == (0, 0, 0, 0, 0, 0)                         # nothing was folded
    with pytest.raises(ValueError):
        MOD.f32(np.zeros(4, np.float32), bytearray(8))
    with pytest.raises(TypeError):
        MOD.f32(np.zeros(4, np.float32))
    assert MOD.f32(np.array([1, -2, np.nan, 0], np.float32), st) is True
    nan, pinf, ninf, zeros, finite, sat, mn, mx, s, q, a = MOD.take(st)
    assert (nan, zeros, finite, mn, mx, s, q, a) == (1, 1, 3, -2.0, 1.0, -1.0, 5.0, 3.0)
    assert MOD.take(st)[4] == 0  # take() resets


def test_glue_hands_declined_blocks_to_the_fallback():
    seen = []
    fn = scan_c.block_fn(MOD, np.zeros(1, np.float32), False, lambda b, acc, sc: seen.append(b.size))
    acc, sc = Acc(), Scratch(64, 64)
    fn(np.arange(10, dtype=np.float32), acc, sc)
    fn(np.arange(20, dtype=np.float32)[::2], acc, sc)  # strided: numpy's turn
    sc.flush(acc)
    assert seen == [10] and acc.finite == 10 and acc.zeros == 1 and acc.sums == [45.0]
    assert acc.abss == [45.0]
    assert scan_c.block_fn(MOD, np.zeros(1, np.int32), False, lambda *a: None) is None


@pytest.mark.parametrize("kind", KINDS)
def test_abs_sum_clears_the_sign_in_every_lane_and_the_tail(kind):
    # one sign flipped at a time, in the vector lanes and in the scalar tail: sum |x| must not
    # move (a lane whose sign is not cleared would subtract 2|x|); NaN/Inf blocks take the
    # careful loop, which must agree
    n = 2 * 32 + 5
    base = np.resize([1.5, 0.25, 3.0, 0.5], n)  # exact in every kind
    exact = float(np.abs(base).mean())
    for pos in range(n):
        vals = base.copy()
        vals[pos] = -vals[pos]
        c, npy = both(as_kind(vals, kind), kind)
        assert c.abs_mean == pytest.approx(exact, rel=1e-12) and npy.abs_mean == pytest.approx(exact, rel=1e-12)
        vals[(pos + 7) % n] = np.inf
        c, _ = both(as_kind(vals, kind), kind)
        assert c.pos_inf == 1 and 0 < c.abs_mean


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16"])
def test_abs_mean_of_cancelling_data_is_relative_exact(kind):
    # mean ~ 0 while mean|x| does not cancel: both kernels get mean|x| to float32-lane accuracy
    rng = np.random.default_rng(12)
    vals = rng.standard_normal(300_001)
    vals -= vals.mean()
    a = as_kind(vals, kind)
    c, npy = both(a, kind, block_elems=1 << 14)
    ref = reference(a, bf16=kind == "bf16")["abs_mean"]
    assert c.abs_mean == pytest.approx(ref, rel=2e-6) and npy.abs_mean == pytest.approx(ref, rel=2e-6)
    assert abs(c.mean) < 1e-3 * c.abs_mean


def test_float64_abs_sum_overflows_like_a_reference():
    # +-1e308 cancel in the plain sum but not in sum |x|: Inf, as numpy's float64 sum gives
    a = np.array([1e308, -1e308, 1e308, -1e308, 1.0], np.float64)
    for mode in ("c", "numpy"):
        with kernels.forced(mode):
            s = scan_array(a)
        assert s.mean == pytest.approx(0.2) and s.abs_mean == np.inf and s.nan == 0


def test_every_variant_gives_the_same_bits():
    """The loops are one source compiled per variant (vector width a parameter): every variant
    this CPU runs folds a block into the same state, bit for bit, on both the fast and the
    careful loop (NaN/Inf, out-of-range magnitudes), for lengths around every step."""
    names = MOD.variants()
    if len(names) < 2:
        pytest.skip("this CPU or build has one variant only")
    rng = np.random.default_rng(5)
    for n in (1, 15, 31, 33, 64, 1023, 1025, 4099, 70_001):
        base = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)
        base[rng.random(n) < 0.05] = 0.0
        for special in (None, np.nan, np.inf, 1e30):
            v = base.copy()
            if special is not None:
                v[n // 2] = special
            for kind in KINDS:
                with np.errstate(over="ignore"):
                    a = as_kind(v, kind)
                fn = getattr(MOD, kind)
                got = {}
                for name in names:
                    with kernels.forced_variant(name):
                        st = MOD.state()
                        assert fn(a, st)
                        got[name] = repr(MOD.take(st))
                assert len(set(got.values())) == 1, (n, special, kind, got)
