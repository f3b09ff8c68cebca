"""The compiled compare kernel (agent/kernels/compare.c) against the numpy path it replaces:
the same results on realistic and hostile blocks, refusal (never a crash) of buffers it cannot
read, and its log(p/q) against libm. test_compare_metrics.py runs every property test on both."""

from __future__ import annotations

import decimal
import math
import os
import sys
import threading

import numpy as np
import pytest

from precision_agent import kernels
from precision_agent.compare.metrics import METRIC_NAMES, RATIO_NAMES, compare_arrays

ALL = METRIC_NAMES + RATIO_NAMES


@pytest.fixture(scope="module")
def cmod_any():
    if not kernels.built("compare"):
        assert os.environ.get("CI") != "true", "the C compare kernel must be built in CI"
        pytest.skip("C compare kernel not built")
    return kernels._import("compare")


@pytest.fixture(params=["avx512", "avx2", "baseline", "neon"])
def cmod(request, cmod_any):
    """The kernel, once on each variant of its loops this CPU can run (AVX-512, AVX2 where it
    has them; the baseline build everywhere: SSE2 on x86-64, NEON on aarch64)."""
    if request.param not in cmod_any.variants():
        pytest.skip(f"this CPU or build has no {request.param} variant")
    with kernels.forced_variant(request.param):
        yield cmod_any


def both(*args, **kw):
    with kernels.forced("numpy"):
        a = compare_arrays(*args, **kw)
    with kernels.forced("c"):
        b = compare_arrays(*args, **kw)
    return a, b


def same_result(a, b, rel: float = 1e-9) -> None:
    for k in ALL:
        u, v = a.metrics[k], b.metrics[k]
        assert (math.isnan(u) and math.isnan(v)) or math.isclose(u, v, rel_tol=rel, abs_tol=1e-12), (k, u, v)
    for f in ("bitwise_equal", "count", "differ", "first_diff_index", "max_abs_index",
              "nonfinite_mismatch", "fail_reason"):
        assert getattr(a, f) == getattr(b, f), f
    for sa, sb in ((a.target_stats, b.target_stats), (a.bench_stats, b.bench_stats)):
        assert (sa is None) == (sb is None)
        if sa is not None:
            assert sa == pytest.approx(sb, rel=1e-9, abs=1e-12)


def _pair(n: int, seed: int, noise: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    return x, x + (rng.standard_normal(n) * noise).astype(np.float32)


@pytest.mark.parametrize("block", [1, 7, 8, 9, 4096, 1 << 17])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "mixed"])
def test_c_and_numpy_agree_on_realistic_pairs(cmod, dtype, block):
    x, y = _pair(20_003, 1)
    y[[5, 777, 19_999]] = x[[5, 777, 19_999]] * np.float32(3)   # a few large errors
    y[100:140] = 0.0                                               # bench zeros: msprobe's eps rule
    kw = {}
    if dtype == "float16":
        x, y = x.astype(np.float16), y.astype(np.float16)
    elif dtype == "bfloat16":
        x, y = ((v.view(np.uint32) >> 16).astype(np.uint16) for v in (x, y))
        kw = {"target_dtype": "bfloat16", "bench_dtype": "bfloat16"}
    elif dtype == "mixed":
        x = x.astype(np.float16)
    a, b = both(x, y, block_elems=block, **kw)
    same_result(a, b)
    assert b.differ > 0 and b.metrics["KullbackLeiblerDivergence"] > 0


def test_diverged_and_far_apart_pairs(cmod):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(10_000).astype(np.float32)
    for y in (rng.standard_normal(10_000).astype(np.float32),           # unrelated
              (x * np.float32(2.5)).astype(np.float32),                 # other scale
              (x + np.float32(1e-6)).astype(np.float32),                # one float32 step-ish
              np.abs(x) * np.float32(1e30),                             # huge values
              x * np.float32(1e-30)):                                   # tiny, some subnormal
        for block in (13, 4096):
            same_result(*both(x, y, block_elems=block), rel=1e-8)


def test_ratio_thresholds_exactly_at_the_boundary(cmod):
    """|x−y|/|y| exactly 1/1000 or 5/1000 (1001 vs 1000): 'below' is strict in both paths."""
    y = np.array([1000, 1000, 1000, 200, 200, 0, 0, 3], np.float32)
    x = np.array([1001, 999, 1005, 201, 199, 1e-19, 2e-19, 3], np.float32)
    a, b = both(x, y)
    same_result(a, b, rel=0)
    assert b.metrics["OneThousandthErrRatio"] == 3 / 8    # 1e-19 and 2e-19 over eps, 3 vs 3
    assert b.metrics["FiveThousandthsErrRatio"] == 5 / 8  # 1005, 201, 199: exactly 5/1000


@pytest.mark.parametrize("noise", [1e-2, 1e-3, 1e-4, 1e-5])
def test_kld_of_close_tensors_against_an_extended_precision_reference(cmod, noise):
    """KLD of close tensors is second order in their difference while its terms are first
    order: the kernel sums second-order terms b·g(w), so it stays accurate where KLD is tiny
    (the numpy path's T/Sa + log(Sb/Sa) loses ~1e-16/KLD of it)."""
    if np.finfo(np.longdouble).eps >= 1e-18:
        pytest.skip("long double is no wider than double here")
    rng = np.random.default_rng(9)
    x = rng.standard_normal(50_000).astype(np.float32)
    y = x + (rng.standard_normal(50_000) * noise).astype(np.float32)

    def dist(v):
        v = v.astype(np.longdouble)
        p = np.maximum((v - v.min()) / (v.max() - v.min()), np.longdouble(2.0 ** -23))
        return p / p.sum()
    p, q = dist(x), dist(y)
    want = float(np.sum(p * np.log(p / q)))
    with kernels.forced("c"):
        got = compare_arrays(x, y, block_elems=4096).metrics["KullbackLeiblerDivergence"]
    assert got == pytest.approx(want, rel=1e-6)


def test_nan_inf_blocks_mix_with_kernel_blocks(cmod):
    x, y = _pair(9_000, 3)
    x[[10, 5000]] = y[[10, 5000]] = np.nan
    x[7000] = y[7000] = np.inf
    for block in (64, 1000, 1 << 17):
        a, b = both(x, y, block_elems=block)
        same_result(a, b)
        assert b.nonfinite_mismatch == 0 and b.target_stats is not None
    y2 = y.copy()
    y2[8000] = -np.inf
    a, b = both(x, y2, block_elems=64)
    same_result(a, b)
    assert b.nonfinite_mismatch == 1


def test_identical_prefix_then_difference(cmod):
    x, _ = _pair(50_000, 4)
    y = x.copy()
    y[-3] = np.float32(7.5)           # a new maximum in the last block: KLD revisits the prefix
    for block in (100, 4096):
        a, b = both(x, y, block_elems=block)
        same_result(a, b)
        assert b.first_diff_index == 50_000 - 3


def test_buffers_the_kernel_cannot_read_as_they_are(cmod):
    """Misaligned blocks (a zip member's data starts anywhere) are copied into an aligned
    buffer; byte-swapped, strided-then-buffered and float64 ones stay on numpy: the same
    results either way. The kernel itself refuses anything unusual with ValueError."""
    x, y = _pair(4_001, 5)
    raw = np.zeros(4 * 4_001 + 1, np.uint8)
    odd = np.frombuffer(raw.data, np.float32, 4_001, offset=1)    # misaligned
    assert not odd.flags.aligned
    odd_w = odd.copy()
    for args in ((odd, y), (x.astype(">f4"), y), (x[::2], y[::2]), (x.astype(np.float64), y)):
        a, b = both(*args, block_elems=512)
        same_result(a, b)
    for bad in ((odd, y[:4_001], 0, 0), (x, y[:-1], 0, 0), (x.astype(">f4"), y, 0, 0),
                (x, y, 0, 7), (x.astype(np.float64), y, 0, 0), (x[:0], y[:0], 0, 0),
                (x.view(np.uint16), y.view(np.uint16), 0, 0)):
        with pytest.raises(ValueError):
            cmod.block(bad[0], bad[1], bad[2], bad[3], True, 0.0, None)
    # 16-bit words typed "H" (all a memoryview can carry: compare_raw.py) read as the kind says
    h, g = x.astype(np.float16), y.astype(np.float16)
    assert cmod.block(memoryview(h.view(np.uint16)), memoryview(g.view(np.uint16)), 1, 1, True, 0.0, None) \
        == cmod.block(h, g, 1, 1, True, 0.0, None)
    with pytest.raises(ValueError):
        cmod.range(odd, 0)
    with pytest.raises(ValueError):
        cmod.same(x, odd_w[:-1], 0)
    assert cmod.block(x, y, 0, 0, True, 0.0, (0.0, 1.0, 0.0, 1.0)) is not None
    with pytest.raises(ValueError):
        cmod.block(b"\0" * 8, b"\0" * 8, 0, 0, True, 0.0, None)   # bytes: format B, not f
    with pytest.raises(TypeError):
        cmod.block(3, x, 0, 0, True, 0.0, None)                      # not a buffer at all


@pytest.mark.parametrize("kind", [1, 2])
def test_range_over_every_16_bit_word(cmod, kind):
    words = np.random.default_rng(6).permutation(np.arange(65536, dtype=np.uint32)).astype(np.uint16)
    with np.errstate(invalid="ignore", over="ignore"):
        vals = (words.view(np.float16).astype(np.float64) if kind == 1
                else (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
    buf = words.view(np.float16) if kind == 1 else words
    for i in range(0, 65536, 997):
        v = vals[i:i + 997].copy()
        v[~np.isfinite(v)] = 0.0
        assert cmod.range(buf[i:i + 997], kind) == (v.min(), v.max())


def test_range_of_float32_special_values(cmod):
    f = np.array([1.0, -2.5, 3e38, -3e38, 1e-45, -0.0], np.float32)
    assert cmod.range(f, 0) == (float(np.float32(-3e38)), float(np.float32(3e38)))
    g = np.array([np.nan, 5.0, 2.0], np.float32)
    assert cmod.range(g, 0) == (0.0, 5.0)
    h = np.array([-np.inf, -1.0, -7.0], np.float32)
    assert cmod.range(h, 0) == (-7.0, 0.0)


def _log_ratio_exact(a: float, b: float) -> float:
    with decimal.localcontext() as ctx:
        ctx.prec = 50
        return float(decimal.Decimal(a).ln() - decimal.Decimal(b).ln())


def test_log_ratio_is_accurate_everywhere_and_near_one(cmod):
    """log(p/q) within a few ulps of the exact value (50 digits), relative to the result itself
    also where p/q is within 1e-15 of 1 (KLD of close tensors sums such terms)."""
    rng = np.random.default_rng(7)
    eps32 = float(np.finfo(np.float32).eps)
    p = np.exp(rng.uniform(math.log(eps32), math.log(1e30), 2_000))
    q = np.exp(rng.uniform(math.log(eps32), math.log(1e30), 2_000))
    near = q[:500] * (1 + rng.uniform(-1e-2, 1e-2, 500) * 10.0 ** -rng.integers(0, 14, 500))
    for a, b in zip(np.concatenate([p, near]), np.concatenate([q, q[:500]])):
        want = _log_ratio_exact(float(a), float(b))
        assert math.isclose(cmod.log_ratio(float(a), float(b)), want, rel_tol=2e-15), (a, b)
    assert cmod.log_ratio(5.0, 5.0) == 0.0
    with pytest.raises(ValueError):
        cmod.log_ratio(0.0, 1.0)


def test_threads_compare_at_once(cmod):
    """The kernel releases the GIL: several threads at once give what one thread gives."""
    x, y = _pair(300_000, 8)
    with kernels.forced("c"):
        want = compare_arrays(x, y)
        out: list = []
        ts = [threading.Thread(target=lambda: out.append(compare_arrays(x, y))) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
    assert len(out) == 3 and all(r == want for r in out)


def _whole_terms(t: tuple) -> tuple[float, float, float]:
    """(Σa, Σb, T = Σ a·log(a/b)) from a kernel's near (Σa, Σb, G) and far (T, Σa, Σb) partials:
    what does not depend on which terms a loop took as far."""
    return t[0] + t[4], t[1] + t[5], t[2] + t[3] + t[0] - t[1]


@pytest.mark.parametrize("n", [1, 7, 520, 4096 + 5, 40_003])
def test_kld_terms_pass_matches_the_one_pass_block(cmod, n):
    """Pass 2's kernel (terms) gives the one-pass block's KLD partials bit for bit, with far
    terms (|w| beyond the series) in one chunk, in the tail, and in more chunks than it records;
    pass 1's ranges are the blocks' min and max."""
    x, y = _pair(n, 11)
    lo = min(float(x.min()), float(y.min()))
    y[-1] = lo                       # far: p is not near q = 0 (clamped)
    y[n // 2] = lo
    for v in (y, (y * np.float32(-1.5)).astype(np.float32)):   # the second: far nearly everywhere
        hi, lo_v = max(float(x.max()), float(v.max())), min(lo, float(v.min()))
        for clamps in (True, False):
            sh, sc = (lo_v, 1 / (hi - lo_v + 1)) if clamps else (lo_v - 1, 1 / (hi - lo_v + 2))
            p = (sh, sc, sh, sc, clamps)   # not clamps: every p, q >= 1/(hi - lo + 2)
            one = cmod.block(x, v, 0, 0, True, 0.0, p)
            assert cmod.terms(x, v, 0, 0, p) == one[15:21]
            assert cmod.block(x, v, 0, 0, True, 0.0, None)[21:] == (
                float(x.min()), float(x.max()), float(v.min()), float(v.max()))


def test_float32_pairs_take_two_passes_and_halves_one(cmod, monkeypatch):
    """A float32 pair's KLD comes from pass 2 (terms), once per differing block; a float16 pair
    keeps the pre-pass flow on the baseline variant; a block holding NaN goes to numpy alone."""
    calls = []
    real, real_blocks = cmod.terms, cmod.terms_blocks

    def blocks(*a):
        rows = real_blocks(*a)
        calls.extend(1 for r in rows or () if r is not None)
        return rows
    monkeypatch.setattr(cmod, "terms", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(cmod, "terms_blocks", blocks)
    x, y = _pair(10_000, 12)
    y[:2048] = x[:2048]              # two identical blocks: terms once pass 2 knows both ranges
    with kernels.forced("c"):
        a = compare_arrays(x, y, block_elems=1024)
        assert len(calls) == 10      # 8 differing blocks in pass 2, 2 identical ones revisited
        calls.clear()
        # a misaligned tensor (a zip member's data) takes the kernel block by block, the same
        off = np.frombuffer(memoryview(np.empty(x.nbytes + 8, np.uint8))[2:2 + x.nbytes], np.float32)
        off[:] = x
        assert not off.flags.aligned
        assert compare_arrays(off, y, block_elems=1024) == a and len(calls) == 10
        calls.clear()
        compare_arrays(x.astype(np.float16), y.astype(np.float16), block_elems=1024)
        # AVX-512/AVX2: halves take two passes too (8 differing blocks; the identical ones need
        # no terms where both sides' ranges round to the same float16 values)
        assert len(calls) >= 8 if cmod.variant() in ("avx512", "avx2") else not calls
        calls.clear()
        assert x[5000] != y[5000]
        x[5000] = y[5000] = np.nan   # now an equal pair, in a block numpy takes; the rest stay
        b = compare_arrays(x, y, block_elems=1024)
        assert len(calls) == 9
        calls.clear()
        off[:] = x
        assert compare_arrays(off, y, block_elems=1024) == b and len(calls) == 9
        y[7000] = np.inf             # a mismatch: every metric NaN, as on numpy
        m = compare_arrays(x, y, block_elems=1024)
    assert b.differ == a.differ - 1 and m.nonfinite_mismatch == 1
    y[7000] = x[7000]
    same_result(*both(x, y, block_elems=1024))
    y[7000] = np.inf
    same_result(*both(x, y, block_elems=1024))


def _words(rng, n: int, kind: int, base=None) -> np.ndarray:
    """n values of a kernel kind (0 float32, 1 float16, 2 bfloat16 words): zeros, tiny values and
    wide magnitudes mixed in; near ``base`` (float64 values) when given."""
    if base is None:
        v = rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20)
    else:
        v = base * (1 + rng.standard_normal(n) * 10.0 ** rng.integers(-7, 0))
    sp = rng.random(n)
    v[sp < 0.05] = 0
    v[(sp > 0.05) & (sp < 0.07)] = 1e-30
    with np.errstate(over="ignore"):
        f = v.astype(np.float32)
        if kind == 1:
            return f.astype(np.float16)
    return (f.view(np.uint32) >> 16).astype(np.uint16) if kind == 2 else f


def test_every_variant_gives_the_same_bits(cmod_any):
    """The loops are one source compiled per variant (vector width a parameter): pass 1 (block,
    with and without KLD's terms) and pass 2 (terms) give the same bits on every variant this
    CPU runs. Every pair of kinds, tails of every length, zeros and subnormal-sized values."""
    names = cmod_any.variants()
    if len(names) < 2:
        pytest.skip("this CPU or build has one variant only")
    rng = np.random.default_rng(21)
    checked = 0
    for _ in range(400):
        n = int(rng.integers(1, 700))
        kx, ky = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        x = _words(rng, n, kx)
        xf = (x.astype(np.uint32) << 16).view(np.float32) if kx == 2 else x.astype(np.float32)
        if not np.isfinite(xf).all():
            continue
        y = _words(rng, n, ky, xf.astype(np.float64) if rng.random() < 0.8 else None)
        got = {}
        for v in names:
            with kernels.forced_variant(v):
                got[v] = [cmod_any.block(x, y, kx, ky, True, 0.0, None), cmod_any.range(x, kx)]
        p = got[names[0]][0]
        if p is not None and p[22] > p[21] and p[24] > p[23]:
            lx, hx, ly, hy = p[21:]
            for par in ((lx - (hx - lx), 1 / (2 * (hx - lx)), ly - (hy - ly), 1 / (2 * (hy - ly)), False),
                        (lx, 1 / (hx - lx), ly, 1 / (hy - ly), True)):   # the second: clamps
                for v in names:
                    with kernels.forced_variant(v):
                        got[v] += [cmod_any.terms(x, y, kx, ky, par), cmod_any.block(x, y, kx, ky, True, 0.0, par)]
            checked += 1
        for v in names[1:]:
            assert repr(got[v]) == repr(got[names[0]]), (v, n, kx, ky)
    assert checked > 200


def test_ranges_keep_the_sign_of_zero_on_every_variant(cmod):
    """-0.0 and 0.0 tie; the first one met is kept on every variant (the ranges feed KLD's
    shift, and the variants promise the same bits there)."""
    x = np.zeros(16, np.float32)
    x[8] = -0.0
    y = np.ones(16, np.float32)
    lo, hi = cmod.block(x, y, 0, 0, True, -1.0, None)[21:23]
    assert (math.copysign(1, lo), math.copysign(1, hi)) == (1, 1)
    x[0], x[8] = -0.0, 0.0
    lo, hi = cmod.block(x, y, 0, 0, True, -1.0, None)[21:23]
    assert (math.copysign(1, lo), math.copysign(1, hi)) == (-1, -1)


def test_one_flag_byte_for_a_block_of_any_size(cmod):
    x = np.ones(3, np.float32)
    assert cmod.terms_blocks(x, x, 0, 0, sys.maxsize, (0.0, 1.0, 0.0, 1.0), b"\0") is not None
    with pytest.raises(ValueError):
        cmod.terms_blocks(x, x, 0, 0, 2, (0.0, 1.0, 0.0, 1.0), b"\0")   # two blocks, one byte
