"""compare_arrays / compare_stats against plain float64 implementations of the definitions
(msaccucmp's metric columns, msprobe's error ratios and statistics diffs), written here without
blocks or shortcuts; property-based over dtypes, shapes, NaN/Inf, zeros, subnormals, block sizes."""

from __future__ import annotations

import contextlib
import math
import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from precision_agent.compare.metrics import (
    DEFAULT_BLOCK, METRIC_NAMES, RATIO_NAMES, REASON_EMPTY, REASON_NONFINITE, REASON_SCALAR,
    REASON_ZERO_X, REASON_ZERO_Y, compare_arrays, compare_stats)
from precision_agent import kernels
from precision_agent.model import TensorStats

EPS = np.finfo(float).eps


@pytest.fixture(autouse=True, params=["numpy", "c", "c-avx2", "c-baseline"])
def kernel_mode(request):
    """Every test here runs on every block kernel: numpy's and the compiled one (which must be
    built in CI), the latter with the variant this CPU picks and, where it has them, once more on
    the AVX2 and baseline variants that other CPUs run."""
    mode, _, variant = request.param.partition("-")
    if mode == "c" and not kernels.built("compare"):
        assert os.environ.get("CI") != "true", "the C compare kernel must be built in CI"
        pytest.skip("C compare kernel not built")
    if variant and (kernels.variant("compare") == variant or variant not in kernels.variants()):
        pytest.skip(f"the {variant} loops are what this CPU runs anyway (the 'c' case), or it has none")
    with kernels.forced(mode), (kernels.forced_variant(variant) if variant else contextlib.nullcontext()):
        yield request.param


EPS32 = float(np.finfo(np.float32).eps)
ALL = METRIC_NAMES + RATIO_NAMES


# -- the reference ------------------------------------------------------------------------------
def f32_values(a: np.ndarray, dtype: str | None = None) -> np.ndarray:
    a = np.asarray(a)
    if dtype == "bfloat16":
        with np.errstate(invalid="ignore"):  # NaN words
            return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64).ravel()
    with np.errstate(over="ignore"):
        return a.astype(np.float32).astype(np.float64).ravel()


def reference(x0, y0, xdt=None, ydt=None) -> dict:
    x, y = f32_values(x0, xdt), f32_values(y0, ydt)
    n = x.size
    nonfin = ~np.isfinite(x) | ~np.isfinite(y)
    same = (np.isnan(x) & np.isnan(y)) | (x == y)
    mismatch = int(np.count_nonzero(nonfin & ~same))
    out = {k: math.nan for k in ALL}
    res = {"metrics": out, "mismatch": mismatch, "max_abs_index": None}
    if mismatch:
        return res
    x = np.where(np.isfinite(x), x, 0.0)
    y = np.where(np.isfinite(y), y, 0.0)
    nx, ny = np.sqrt(np.sum(x * x)), np.sqrt(np.sum(y * y))
    if n == 1:
        out["CosineSimilarity"] = 1.0
    elif nx <= EPS and ny < EPS:
        out["CosineSimilarity"] = 1.0
    elif nx > EPS and ny > EPS:
        out["CosineSimilarity"] = min(1.0, float(np.sum((x / nx) * (y / ny))))
    d = x - y
    out["RelativeEuclideanDistance"] = 0.0 if ny <= EPS else float(np.sqrt(np.sum(d * d)) / ny)
    xc, yc = x.copy(), y.copy()        # msprobe: eps added to both sides where the bench is 0
    z = yc == 0
    xc[z] += EPS
    yc[z] += EPS
    with np.errstate(all="ignore"):
        rel = np.abs((xc - yc) / yc)
    out["OneThousandthErrRatio"] = float(np.mean(rel < 0.001))
    out["FiveThousandthsErrRatio"] = float(np.mean(rel < 0.005))
    if np.asarray(x0).dtype == np.bool_ and np.asarray(y0).dtype == np.bool_:
        return res
    out["MaxAbsoluteError"] = float(np.max(np.abs(d)))
    out["MeanAbsoluteError"] = float(np.mean(np.abs(d)))
    out["RootMeanSquareError"] = float(np.sqrt(np.mean(d * d)))
    big = np.abs(y) > EPS
    with np.errstate(all="ignore"):
        terms = np.where(big, np.abs(x / y - 1), 0.0)
    out["AccumulatedRelativeError"] = float(np.sum(terms))
    out["MaxRelativeError"] = float(np.max(terms))
    out["MeanRelativeError"] = float(np.mean(terms))
    if not (np.all(x == 0) or np.all(y == 0)):
        def dist(v):
            lo, hi = v.min(), v.max()
            p = (v - lo) / (hi - lo) if hi > lo else v
            p = np.maximum(p, EPS32)
            return p / p.sum()
        p, q = dist(x), dist(y)
        k = float(np.sum(p * np.log(p / q)))
        out["KullbackLeiblerDivergence"] = 0.0 if abs(k) < EPS else k
    if out["MaxAbsoluteError"] > 0:
        res["max_abs_index"] = int(np.argmax(np.abs(d)))
    return res


def values_differ(x0, y0, xdt=None, ydt=None) -> np.ndarray:
    vx = f32_values(x0, xdt) if xdt == "bfloat16" else np.asarray(x0).ravel()
    vy = f32_values(y0, ydt) if ydt == "bfloat16" else np.asarray(y0).ravel()
    ne = vx != vy
    if vx.dtype.kind == "f" and vy.dtype.kind == "f":
        ne &= ~(np.isnan(vx) & np.isnan(vy))
    return ne


def stats_ref(x0, dt=None):
    v = f32_values(x0, dt)
    v = v[np.isfinite(v)]
    return None if v.size == 0 else (float(np.mean(v)), float(np.std(v)))


def close(a: float, b: float, rel: float = 1e-6, abs_: float = 1e-9) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def check(x, y, xdt=None, ydt=None, block=DEFAULT_BLOCK):
    got = compare_arrays(x, y, target_dtype=xdt, bench_dtype=ydt, block_elems=block)
    ref = reference(x, y, xdt, ydt)
    x, y = np.asarray(x), np.asarray(y)
    assert set(got.metrics) == set(ALL)
    for k in ALL:
        a, b = got.metrics[k], ref["metrics"][k]
        scale = 1e-9
        if k == "CosineSimilarity":
            scale = 1e-7  # the reference normalises first: both round at ~1e-16 of Σ|x·y|/‖x‖‖y‖
        assert close(a, b, abs_=scale), (k, a, b)
    assert got.count == x.size
    assert got.nonfinite_mismatch == ref["mismatch"]
    ne = values_differ(x, y, xdt, ydt)
    assert got.differ == int(np.count_nonzero(ne))
    assert got.first_diff_index == (int(np.argmax(ne)) if ne.any() else None)
    assert got.bitwise_equal == (x.dtype == y.dtype and xdt == ydt and x.tobytes() == y.tobytes())
    if not ref["mismatch"]:
        assert got.max_abs_index == ref["max_abs_index"]
        assert (got.fail_reason == REASON_SCALAR) == (x.size == 1)
    else:
        assert got.fail_reason == REASON_NONFINITE
    for mine, theirs, src, dt in ((got.target_stats, stats_ref(x, xdt), x, xdt),
                                  (got.bench_stats, stats_ref(y, ydt), y, ydt)):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            top = float(np.max(np.abs(f32_values(src, dt)[np.isfinite(f32_values(src, dt))])))
            assert close(mine[0], theirs[0], abs_=1e-12 * max(1.0, top))
            assert close(mine[1], theirs[1], rel=1e-5, abs_=1e-7 * max(1.0, top))
    return got


# -- strategies ---------------------------------------------------------------------------------
DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_]
SPECIAL = [0.0, -0.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 1e-40, -1e-45, 65504.0, 1e-3,
           1e-13, 2.0 ** -52, -(2.0 ** -53), 1.0008, 1.00505, 0.996]   # eps, ratio thresholds


def _elements(dtype):
    if np.dtype(dtype).kind == "f":
        w = np.dtype(dtype).itemsize * 8
        return st.one_of(st.floats(width=w, allow_nan=True, allow_infinity=True, allow_subnormal=True),
                         st.sampled_from(SPECIAL).map(lambda v: np.dtype(dtype).type(v)))
    return None


@st.composite
def pairs(draw, dtypes=DTYPES, same_dtype=None):
    dx = draw(st.sampled_from(dtypes))
    dy = dx if (same_dtype if same_dtype is not None else draw(st.booleans())) else draw(st.sampled_from(dtypes))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=7))
    x = draw(hnp.arrays(dx, shape, elements=_elements(dx)))
    how = draw(st.sampled_from(["independent", "copy", "perturb", "zeros"]))
    if how == "independent":
        y = draw(hnp.arrays(dy, shape, elements=_elements(dy)))
    elif how == "zeros":
        y = np.zeros(shape, dy)
    else:
        with np.errstate(all="ignore"):
            y = x.astype(dy)
        if how == "perturb" and y.size:
            k = draw(st.integers(0, y.size - 1))
            flat = y.reshape(-1)
            flat[k] = draw(hnp.from_dtype(np.dtype(dy), allow_nan=True, allow_infinity=True)
                           if np.dtype(dy).kind == "f" else hnp.from_dtype(np.dtype(dy)))
            if y.dtype.kind == "f" and draw(st.booleans()):
                with np.errstate(all="ignore"):
                    y = (y * (1 + 1e-4 * np.arange(y.size).reshape(shape) % 3)).astype(dy)
    if draw(st.booleans()):
        x, y = y, x
    return x, y


PROPS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(pairs(), st.sampled_from([1, 3, 7, DEFAULT_BLOCK]))
def test_every_metric_equals_the_float64_reference(pair, block):
    check(*pair, block=block)


@PROPS
@given(pairs(dtypes=[np.float16, np.float32], same_dtype=True), st.sampled_from([2, 5, DEFAULT_BLOCK]))
def test_half_and_single_same_dtype(pair, block):
    check(*pair, block=block)


@st.composite
def bf16_pairs(draw):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=9))
    words = st.one_of(st.integers(0, 0xFFFF), st.sampled_from([0x7F80, 0xFF80, 0x7FC0, 0x0000, 0x8000, 0x0001]))
    x = draw(hnp.arrays(np.uint16, shape, elements=words))
    y = x.copy() if draw(st.booleans()) else draw(hnp.arrays(np.uint16, shape, elements=words))
    if y.size and draw(st.booleans()):
        y.reshape(-1)[draw(st.integers(0, y.size - 1))] ^= np.uint16(draw(st.integers(1, 0x7F)))
    return x, y


@PROPS
@given(bf16_pairs(), st.sampled_from([1, 4, DEFAULT_BLOCK]))
def test_bfloat16_raw_words(pair, block):
    check(pair[0], pair[1], "bfloat16", "bfloat16", block=block)


def test_bfloat16_against_float32_bench():
    rng = np.random.default_rng(3)
    y = rng.standard_normal(1000).astype(np.float32)
    words = (y.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
    got = check(words, y, "bfloat16", None, block=64)
    assert 0.99 < got.metrics["CosineSimilarity"] < 1.0 and not got.bitwise_equal


# -- exact edge cases ---------------------------------------------------------------------------
def test_scalar_shapes_force_cosine_one_and_say_why():
    for x, y in ((np.float32(2.0), np.float32(3.0)), (np.full((1, 1), 2.0, np.float32), np.full((1, 1), -3.0, np.float32))):
        d = check(x, y)
        assert d.metrics["CosineSimilarity"] == 1.0 and d.fail_reason == REASON_SCALAR
        assert d.metrics["MaxAbsoluteError"] == pytest.approx(abs(float(x.ravel()[0]) - float(y.ravel()[0])))


def test_empty_and_shape_mismatch_compare_nothing():
    e = compare_arrays(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32))
    assert e.count == 0 and e.fail_reason == REASON_EMPTY and all(math.isnan(v) for v in e.metrics.values())
    s = compare_arrays(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))
    assert s.count == 0 and "(2, 3)" in s.fail_reason and "(3, 2)" in s.fail_reason
    assert not s.bitwise_equal and all(math.isnan(v) for v in s.metrics.values())


def test_all_zero_sides():
    z, o = np.zeros(5, np.float32), np.arange(5, dtype=np.float32)
    both = check(z, z.copy())
    assert both.metrics["CosineSimilarity"] == 1.0 and math.isnan(both.metrics["KullbackLeiblerDivergence"])
    assert both.metrics["RelativeEuclideanDistance"] == 0.0 and both.bitwise_equal
    left = check(z, o)
    assert math.isnan(left.metrics["CosineSimilarity"]) and left.fail_reason == REASON_ZERO_X
    right = check(o, z)
    assert math.isnan(right.metrics["CosineSimilarity"]) and right.fail_reason == REASON_ZERO_Y
    assert right.metrics["RelativeEuclideanDistance"] == 0.0  # ‖y‖ <= eps
    assert right.metrics["MaxRelativeError"] == 0.0 and right.metrics["AccumulatedRelativeError"] == 0.0


def test_bool_keeps_only_cosine_and_red():
    x = np.array([1, 0, 1, 1], bool)
    y = np.array([1, 1, 1, 0], bool)
    d = check(x, y)
    assert d.metrics["CosineSimilarity"] == pytest.approx(2 / 3)
    assert d.metrics["RelativeEuclideanDistance"] == pytest.approx(math.sqrt(2) / math.sqrt(3))
    for k in METRIC_NAMES:
        if k not in ("CosineSimilarity", "RelativeEuclideanDistance"):
            assert math.isnan(d.metrics[k]), k
    assert d.differ == 2 and d.first_diff_index == 1


def test_nonfinite_policy():
    nan, inf = np.nan, np.inf
    matched = check(np.array([1, nan, inf, -inf, 2], np.float32), np.array([1, nan, inf, -inf, 2.5], np.float32))
    assert matched.nonfinite_mismatch == 0 and matched.differ == 1 and matched.first_diff_index == 4
    assert matched.metrics["MaxAbsoluteError"] == 0.5 and matched.max_abs_index == 4
    assert matched.metrics["OneThousandthErrRatio"] == pytest.approx(4 / 5)
    assert matched.target_stats == pytest.approx((1.5, 0.5))  # finite values only
    signs = check(np.array([1, inf], np.float32), np.array([1, -inf], np.float32))
    assert signs.nonfinite_mismatch == 1 and signs.fail_reason == REASON_NONFINITE
    assert all(math.isnan(v) for v in signs.metrics.values())
    one_side = check(np.array([nan, 1, 2], np.float32), np.array([0, 1, 2], np.float32), block=1)
    assert one_side.nonfinite_mismatch == 1 and one_side.differ == 1 and one_side.first_diff_index == 0


def test_bitwise_versus_value_equality():
    z = check(np.array([0.0, 1.0], np.float32), np.array([-0.0, 1.0], np.float32))
    assert z.differ == 0 and not z.bitwise_equal and z.metrics["CosineSimilarity"] == 1.0
    a = np.array([np.nan, 1.0], np.float32)
    b = a.copy()
    b.view(np.uint32)[0] ^= 1  # another NaN payload
    p = check(a, b)
    assert p.differ == 0 and not p.bitwise_equal and p.nonfinite_mismatch == 0
    same = check(np.arange(10, dtype=np.float64), np.arange(10, dtype=np.float64))
    assert same.bitwise_equal and same.differ == 0 and same.first_diff_index is None
    other_dtype = check(np.arange(10, dtype=np.float32), np.arange(10, dtype=np.float64))
    assert not other_dtype.bitwise_equal and other_dtype.differ == 0


def test_float64_differences_below_float32_are_counted_but_not_measured():
    x = np.array([1.0, 2.0, 3.0])
    y = x + np.array([0.0, 1e-12, 0.0])
    d = check(x, y)
    assert d.differ == 1 and d.first_diff_index == 1
    assert d.metrics["MaxAbsoluteError"] == 0.0  # both round to the same float32, as in msaccucmp


def test_unsupported_input_is_a_reason_not_an_exception():
    c = compare_arrays(np.ones(3, np.complex64), np.ones(3, np.complex64))
    assert "complex64" in c.fail_reason and c.count == 0
    b = compare_arrays(np.ones(3, np.float32), np.ones(3, np.float32), target_dtype="bfloat16")
    assert "bfloat16" in b.fail_reason


# -- blocks, large arrays, layouts, memmaps -----------------------------------------------------
def test_chunk_boundaries_and_mixed_identical_blocks():
    rng = np.random.default_rng(7)
    x = rng.standard_normal(10_007).astype(np.float32)
    y = x.copy()
    y[5000:5003] += np.float32(0.25)   # one block differs, the others are bitwise identical
    y[9999] = 0.0
    x[[100, 200]] = np.nan
    y[[100, 200]] = np.nan
    for block in (64, 1000, 4096, DEFAULT_BLOCK):
        d = check(x, y, block=block)
        assert d.differ == 4 and d.first_diff_index == 5000 and d.nonfinite_mismatch == 0
        assert d.max_abs_index in (5000, 5001, 5002, 9999)
    # KLD's min-max spans identical blocks: a distant extreme in an identical block matters
    x2 = x.copy()
    y2 = y.copy()
    x2[10] = y2[10] = 50.0
    k_small = check(x2, y2, block=64).metrics["KullbackLeiblerDivergence"]
    k_big = compare_arrays(x2, y2).metrics["KullbackLeiblerDivergence"]
    assert k_small == pytest.approx(k_big, rel=1e-9)


def test_non_contiguous_views_compare_in_c_order():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 40)).astype(np.float32)
    y = x + rng.standard_normal((30, 40)).astype(np.float32) * 1e-3
    y[3, 5] = 9.0
    for xv, yv in ((x.T, y.T), (x[:, ::3], y[:, ::3]), (np.asfortranarray(x), y)):
        d = compare_arrays(xv, yv, block_elems=17)
        c = compare_arrays(np.ascontiguousarray(xv), np.ascontiguousarray(yv), block_elems=17)
        assert d.first_diff_index == c.first_diff_index and d.max_abs_index == c.max_abs_index
        assert d.differ == c.differ
        for k in ALL:
            assert close(d.metrics[k], c.metrics[k], rel=1e-12), k
        check(xv, yv, block=17)


def test_memmap_of_a_file_in_bounded_memory(tmp_path):
    n = 4 << 20   # 16 MiB per side
    rng = np.random.default_rng(5)
    x = rng.standard_normal(n, dtype=np.float32)
    y = x + rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    want = compare_arrays(x, y)
    del x, y
    mx = np.load(tmp_path / "x.npy", mmap_mode="r")
    my = np.load(tmp_path / "y.npy", mmap_mode="r")
    tracemalloc.start()
    try:
        got = compare_arrays(mx, my)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak   # block-sized scratch only, never a copy of a 16 MiB side
    assert got.count == n and got.differ == want.differ
    for k in ALL:
        assert got.metrics[k] == want.metrics[k], k
    assert 0.999 < got.metrics["CosineSimilarity"] < 1.0
    assert got.metrics["KullbackLeiblerDivergence"] > 0


# -- fast paths: KLD per block, range pre-pass, BLAS rows, raw compares ------------------------
def _noisy(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    return x, x + (rng.standard_normal(n) * 1e-3).astype(np.float32)


@pytest.mark.parametrize("block", [64, 1000, 8192, DEFAULT_BLOCK])
def test_kld_when_identical_blocks_come_before_the_first_difference(block):
    """A rerun that diverges late: the identical prefix's KLD terms are added after the range
    pre-pass, with the same normalisation on both sides (a == b there) or a different one."""
    x, _ = _noisy(20_000, 11)
    same_range = x.copy()
    same_range[-5:] += np.float32(1e-3)          # min and max unchanged: one normalisation
    new_max = x.copy()
    new_max[-1] = np.float32(9.0)                # y's range grows: log(a/b) != 0 everywhere
    new_min_early = x.copy()
    new_min_early[-3] = np.float32(-9.0)
    for y in (same_range, new_max, new_min_early):
        d = check(x, y, block=block)
        assert d.metrics["KullbackLeiblerDivergence"] > 0 and d.first_diff_index >= 20_000 - 5


@pytest.mark.parametrize("block", [7, 4096, DEFAULT_BLOCK])
def test_kld_clamp_and_constant_sides(block):
    x, y = _noisy(9_000, 12)
    check(x, y, block=block)                     # each side's minimum sits in one clamped block
    five = np.full(9_000, 5.0, np.float32)       # constant side, left as is (above the clamp)
    neg = np.full(9_000, -3.0, np.float32)       # constant side, every element clamped
    for a, b in ((five, y), (y, five), (neg, y), (five, neg), (five, five + np.float32(1.0))):
        check(a, b, block=block)
    tiny = y.copy()
    tiny[::97] = tiny.min()                      # many elements at the clamp, in every block
    check(x, tiny, block=block)


@pytest.mark.parametrize("block", [2, 4096])
def test_kld_of_sides_far_apart_in_magnitude(block):
    """Constant sides are left as is, so 1.5 against 1.17e13 gives a/b ~ 1e-13 and Σb/Σa ~ 1e13:
    each far term's b·g(w) is ~b, and the close-sides form G/Σa + log1p(e) − e cancelled two
    1e13-sized numbers to -0.00098 (a hypothesis find). Uniform against uniform is 0."""
    for n in (1, 9, 5000):
        x = np.full(n, 1.5, np.float32)
        y = np.full(n, 1.170996e13, np.float32)
        for a, b in ((x, y), (y, x)):
            check(a if n > 1 else a.reshape(()), b if n > 1 else b.reshape(()), block=block)
            assert abs(compare_arrays(a, b, block_elems=block).metrics["KullbackLeiblerDivergence"]) < 1e-12
    rng = np.random.default_rng(3)
    z = (rng.random(5000) + 1).astype(np.float32)
    check(z, np.full(5000, 1e12, np.float32), block=block)    # one side spread, one far above
    check(np.full(5000, 1e-3, np.float32), z * np.float32(1e9), block=block)


@pytest.mark.parametrize("block", [5, 2048, DEFAULT_BLOCK])
def test_kld_on_a_narrow_range_far_from_zero(block):
    """16 ± 0.01: Σ(x − min) would come from Σx − m·min with heavy cancellation, so the block
    sums x − min itself; zero-centred data takes Σx (both against the reference)."""
    rng = np.random.default_rng(15)
    x = (16 + rng.uniform(-0.01, 0.01, 6_000)).astype(np.float32)
    y = x.copy()
    y[3_000:] += np.float32(2 ** -19)            # one float32 step, in the second half only
    d = check(x, y, block=block)
    assert d.metrics["KullbackLeiblerDivergence"] > 0
    check(x - np.float32(16), y - np.float32(16), block=block)

def test_range_pre_pass_rounds_like_the_values():
    """Range from raw float64 / int / half / big-endian data equals the range of the float32
    values (NaN/Inf zeroed, float64 beyond float32's range counted as Inf)."""
    rng = np.random.default_rng(13)
    big = rng.standard_normal(5_000) * 1e3
    big[[10, 4000]] = 1e39                       # Inf in float32 on both sides: zeroed, matched
    other = big + rng.standard_normal(5_000)
    other[[10, 4000]] = 1e39
    for block in (3, 500, DEFAULT_BLOCK):
        d = check(big, other, block=block)
        assert d.nonfinite_mismatch == 0 and d.metrics["KullbackLeiblerDivergence"] > 0
        check(rng.integers(-2**40, 2**40, 3_000), rng.integers(-2**40, 2**40, 3_000), block=block)
        with np.errstate(over="ignore"):          # 1e39 and beyond 65504 become Inf in half
            halves = big.astype(np.float16), other.astype(np.float16)
        check(*halves, block=block)
        xs, ys = _noisy(3_000, 14)
        check(xs.astype(">f4"), ys, block=block)
        check(xs.astype(">f4"), ys.astype(">f4"), block=block)


def test_kept_buffers_carry_nothing_between_compares():
    """Block buffers are kept per thread between compares: a compare after others of other
    sizes and dtypes (bfloat16, float64, half) gives exactly what it gives on fresh buffers,
    and threads comparing at once each get their own."""
    import threading
    from precision_agent.kernels.compare_numpy import drop_scratch
    x, y = _noisy(50_000, 18)
    words = (y.view(np.uint32) >> 16).astype(np.uint16)
    jobs = [((x, y), {}), ((x[:7], y[:7]), {}), ((x.astype(np.float64), y), {}),
            ((words, y), {"target_dtype": "bfloat16"}), ((x.astype(np.float16), y[:50_000].astype(np.float16)), {}),
            ((x[:3000], y[:3000]), {"block_elems": 64})]
    fresh = []
    for args, kw in jobs:
        drop_scratch()
        fresh.append(compare_arrays(*args, **kw))
    drop_scratch()
    for _ in range(2):
        for (args, kw), want in zip(jobs, fresh):
            assert compare_arrays(*args, **kw) == want
    errors: list[str] = []

    def worker(k: int) -> None:
        for i in range(8):
            args, kw = jobs[(k + i) % len(jobs)]
            if compare_arrays(*args, **kw) != fresh[(k + i) % len(jobs)]:
                errors.append(f"thread {k} job {(k + i) % len(jobs)}")
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and errors == []

@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_16_bit_float_range_from_words_covers_every_word(kind):
    """The pre-pass ranks half/bfloat16 words as int16 keys: over all 65536 words, in blocks,
    its extremes equal the float ones (NaN/Inf blocks: zeroed, like pass 1)."""
    from precision_agent.kernels.compare_numpy import Scratch, Side, _block_range
    words = np.random.default_rng(17).permutation(np.arange(65536, dtype=np.uint32)).astype(np.uint16)
    side = Side(words, "bfloat16") if kind == "bfloat16" else Side(words.view(np.float16), None)
    values = f32_values(words, "bfloat16") if kind == "bfloat16" else words.view(np.float16).astype(np.float64)
    sc = Scratch(1000)
    with np.errstate(invalid="ignore"):           # NaN words widen quietly inside compare_arrays
        ranges = [(i, _block_range(side, side.a[i:i + 1000], sc)) for i in range(0, 65536, 1000)]
    for i, got in ranges:
        v = values[i:i + 1000].copy()
        v[~np.isfinite(v)] = 0.0
        assert got == (v.min(), v.max())
        finite = np.isfinite(values[i:i + 1000])   # the key path alone, on finite words
        assert _block_range(side, side.a[i:i + 1000][finite], sc) == (v[finite].min(), v[finite].max())


@pytest.mark.parametrize("n", [0, 1, 8191, 8192, 8193, 3 * 8192 + 7])
@pytest.mark.parametrize("rows", ["vecdot", "loop"])
def test_float64_dot_in_rows_is_the_exact_sum(n, rows, monkeypatch):
    from precision_agent.kernels import compare_numpy as blocks   # rows of 8192 through BLAS, then the rest
    if rows == "loop":                            # what numpy < 2.0 (no vecdot) runs
        monkeypatch.setattr(blocks, "_rowdot", blocks._rowdot_loop)
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(np.float32).astype(np.float64)
    b = rng.standard_normal(n).astype(np.float32).astype(np.float64)
    assert blocks.dot(a, b) == pytest.approx(math.fsum((a * b).tolist()), rel=1e-13, abs=1e-12)
    if rows == "loop" and n > 8192:
        x, y = _noisy(n, 16)
        check(x, y)


# -- statistics mode ----------------------------------------------------------------------------
def ts(mx, mn, mean, norm, shape=(4,), nan=0, pinf=0, ninf=0) -> TensorStats:
    return TensorStats(name="op", io="output", index=0, dtype="float32", shape=shape, count=4,
                       nan=nan, pos_inf=pinf, neg_inf=ninf, min=mn, max=mx, mean=mean, l2norm=norm)


def test_stats_diffs_follow_msprobe():
    d = compare_stats(ts(2.0, -1.0, 0.5, 4.0), ts(1.0, -1.0, 0.25, 0.0))
    assert not d.equal and d.fail_reason == ""
    assert d.diffs["MaxDiff"] == 1.0 and d.diffs["MaxRelativeErr"] == 1.0   # fraction, not %
    assert d.diffs["MinDiff"] == 0.0 and d.diffs["MinRelativeErr"] == 0.0
    assert d.diffs["MeanDiff"] == 0.25 and d.diffs["MeanRelativeErr"] == 1.0
    assert d.diffs["NormDiff"] == 4.0 and d.diffs["NormRelativeErr"] == math.inf  # bench 0
    same = compare_stats(ts(math.nan, -math.inf, math.nan, math.inf, nan=1, ninf=1),
                         ts(math.nan, -math.inf, math.nan, math.inf, nan=1, ninf=1))
    assert same.equal and all(v == 0.0 for v in same.diffs.values())


def test_stats_nonfinite_and_missing():
    n = compare_stats(ts(math.nan, 0.0, 1.0, 2.0, nan=1), ts(3.0, 0.0, 1.0, 2.0))
    assert math.isnan(n.diffs["MaxDiff"]) and math.isnan(n.diffs["MaxRelativeErr"])
    assert not n.equal and REASON_NONFINITE in n.fail_reason
    i = compare_stats(ts(3.0, -math.inf, 1.0, 2.0, ninf=1), ts(3.0, -2.0, 1.0, 2.0))
    assert i.diffs["MinDiff"] == -math.inf and i.diffs["MinRelativeErr"] == math.inf
    j = compare_stats(ts(3.0, 0.0, 1.0, 2.0), ts(math.inf, 0.0, 1.0, 2.0, pinf=1))
    assert j.diffs["MaxDiff"] == -math.inf and j.diffs["MaxRelativeErr"] == math.inf
    # the four numbers agree but one side saw a NaN: msprobe would call this equal
    hidden = compare_stats(ts(3.0, 0.0, 1.0, 2.0, nan=1), ts(3.0, 0.0, 1.0, 2.0))
    assert not hidden.equal
    m = compare_stats(ts(None, None, None, None), ts(None, None, None, None))
    assert all(math.isnan(v) for v in m.diffs.values()) and "No statistics" in m.fail_reason
    s = compare_stats(ts(1.0, 0.0, 0.5, 1.0, shape=(2, 2)), ts(1.0, 0.0, 0.5, 1.0, shape=(4,)))
    assert not s.equal and "shapes" in s.fail_reason


def test_error_ratio_thresholds_and_zero_bench():
    x = np.array([1.0009, 1.0011, 1.0049, 1.0051, 0.0, 1e-20, 1e-18, 1.0], np.float32)
    y = np.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    d = check(x, y)
    # below 0.001: 1.0009, 0/0, 1e-20/eps; below 0.005 also 1.0011, 1.0049 and 1e-18/eps (4.5e-3)
    assert d.metrics["OneThousandthErrRatio"] == 3 / 8
    assert d.metrics["FiveThousandthsErrRatio"] == 6 / 8
    # msaccucmp skips |y| <= eps in the relative errors, but still divides by all N
    assert d.metrics["MaxRelativeError"] == pytest.approx(0.0051, rel=1e-4)
    assert d.metrics["MeanRelativeError"] == pytest.approx((0.0009 + 0.0011 + 0.0049 + 0.0051) / 8, rel=1e-4)
