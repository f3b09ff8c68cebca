"""The dump scanner's statistics equal a naive float64 reference, for every dtype, on random
arrays with NaN, +-Inf, subnormals, zeros, fp16 saturation, empty and 0-d arrays, non-contiguous
views and tiny blocks (block and row boundaries everywhere, fast and NaN/Inf paths mixed), with
one or several threads. Every test runs twice: on the numpy kernels and on the C kernel
(skipped where it is not built, except in CI, where it must be)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from precision_agent import kernels
from precision_agent.dumps.scanner import FP16_MAX, ROW, scan_array
from precision_agent.dumps.windows import scan_file_npy
from support.numerics import F32_TOL, F64_TOL, check, reference, tol_for

IN_CI = os.environ.get("CI") == "true"


@pytest.fixture(scope="module", autouse=True, params=["numpy", "c"])
def kernel_mode(request):
    """Module-scoped (hypothesis refuses function-scoped fixtures): the tests are grouped by mode."""
    if request.param == "c" and not kernels.built("scan"):
        assert not IN_CI, "CI builds the scan kernel: precision_agent.kernels._scan must import"
        pytest.skip("the C scan kernel is not built here (no compiler at install)")
    with kernels.forced(request.param):
        yield request.param


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# float32, float16 and bfloat16 tensors are summed in float32 within rows (BLAS dots keep >= 32
# partial sums, so <= 256 serial additions: worst case ~256 * 2^-24 = 1.5e-5 of sum(|x|)), rows
# in float64; float64/integer tensors entirely in float64.


SPECIAL32 = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-45, 3.4e38, -3.4e38, 1.0, -2.5]
SPECIAL16 = [0.0, -0.0, np.nan, np.inf, -np.inf, 6e-8, -6e-5, FP16_MAX, -FP16_MAX, 65000.0, 1.0]


def float_elems(dtype):
    if dtype == np.float16:
        base = st.floats(width=16, allow_nan=True, allow_infinity=True)
        return st.one_of(base, st.sampled_from(SPECIAL16))
    if dtype == np.float32:
        return st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from(SPECIAL32))
    # float64: |x| <= 1e150 so that squares cannot overflow (both sides would, in different
    # orders); Inf/NaN and float64 subnormals still included
    return st.one_of(st.floats(min_value=-1e150, max_value=1e150), st.sampled_from(
        [np.nan, np.inf, -np.inf, 5e-324, -2.2e-308, 0.0, -0.0]))


shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)
blocks = st.sampled_from([1, 3, 7, 64, 100, 1 << 16])  # rows are min(block, ROW) long
views = st.sampled_from(["plain", "step2", "transpose", "reversed"])


def make_view(a: np.ndarray, how: str) -> np.ndarray:
    if a.ndim == 0 or how == "plain":
        return a
    if how == "step2":
        return a[::2]
    if how == "transpose":
        return a.T
    return a[::-1]


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from([np.float16, np.float32, np.float64]), block=blocks, how=views)
def test_float_dtypes_match_reference(data, dtype, block, how):
    a = data.draw(hnp.arrays(dtype, shapes, elements=float_elems(dtype)))
    v = make_view(a, how)
    check(scan_array(v, block_elems=block), reference(v), tol_for(dtype))


@SETTINGS
@given(data=st.data(), block=blocks, how=views)
def test_bfloat16_matches_reference(data, block, how):
    f = data.draw(hnp.arrays(np.float32, shapes, elements=float_elems(np.float32)))
    words = (f.view(np.uint32) >> 16).astype(np.uint16)  # the high half: a bf16 word
    v = make_view(words, how)
    s = scan_array(v, dtype="bfloat16", block_elems=block)
    assert s.dtype == "bfloat16"
    check(s, reference(v, bf16=True), F32_TOL)


@SETTINGS
@given(data=st.data(), dtype=st.sampled_from([np.int8, np.int32, np.int64, np.uint8, np.bool_]),
       block=blocks, how=views)
def test_integer_dtypes_match_reference(data, dtype, block, how):
    a = data.draw(hnp.arrays(dtype, shapes))
    v = make_view(a, how)
    s = scan_array(v, block_elems=block)
    check(s, reference(v))
    if v.size:  # exact integer extremes
        assert s.min == float(int(v.min())) and s.max == float(int(v.max()))


def test_fp16_saturation_and_nonfinite_counts():
    a = np.array([FP16_MAX, -FP16_MAX, 65000, np.inf, -np.inf, np.nan, 0, 1], np.float16)
    s = scan_array(a, block_elems=3)
    assert (s.fp16_saturated, s.pos_inf, s.neg_inf, s.nan, s.count) == (2, 1, 1, 1, 8)
    assert (s.min, s.max) == (-FP16_MAX, FP16_MAX)
    assert scan_array(a.astype(np.float32)).fp16_saturated == 0  # only for float16 tensors


def test_fp16_subnormals_exact():
    words = np.arange(0, 1 << 16, dtype=np.uint16)  # every half value, subnormals included
    h = words.view(np.float16)
    for block in (7, 1 << 16):
        check(scan_array(h, block_elems=block), reference(h), F32_TOL)


def test_all_nonfinite_and_empty():
    s = scan_array(np.array([np.nan, np.inf], np.float32))
    assert s.min is s.max is s.mean is s.l2norm is None and s.zero_fraction == 0.0
    e = scan_array(np.zeros((3, 0), np.float64))
    assert e.count == 0 and e.zero_fraction is None and e.mean is None and e.shape == (3, 0)
    z = scan_array(np.array(-0.0))
    assert (z.count, z.zero_fraction, z.min, z.l2norm) == (1, 1.0, 0.0, 0.0)


def test_unsupported_dtype():
    with pytest.raises(TypeError):
        scan_array(np.zeros(3, np.complex64))


def test_memmap_larger_than_block(tmp_path):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((300, 1001)).astype(np.float32)
    a[5, 7] = np.nan
    a[100, :3] = np.inf
    a[200, 9] = 0
    path = tmp_path / "t.npy"
    np.save(path, a)
    s = scan_file_npy(str(path))
    check(s, reference(a), F32_TOL)
    assert s.shape == (300, 1001) and s.path == str(path)
    check(scan_file_npy(str(path), block_elems=4099), reference(a), F32_TOL)
    check(scan_file_npy(str(path), block_elems=4099, threads=3), reference(a), F32_TOL)
    mm = np.load(path, mmap_mode="r")
    check(scan_array(mm[:, ::3], block_elems=1000), reference(a[:, ::3]), F32_TOL)  # strided view


# -- fast paths: all-finite blocks, 16-bit words, float32 row sums, threads ----------------------
def big_with_specials(dtype, n: int, seed: int, specials: bool) -> np.ndarray:
    """n values (several rows and blocks long), NaN/Inf/zeros/-0 in a few blocks only."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 3 + 0.5).astype(dtype)
    a[rng.integers(0, n, 50)] = 0
    a[rng.integers(0, n, 20)] = -0.0
    if specials:
        a[[7, n // 2, n - 1]] = [np.nan, np.inf, -np.inf]
    return a


@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_large_arrays_rows_blocks_and_threads(dtype, specials):
    a = big_with_specials(dtype, 3 * ROW + 1234, seed=3, specials=specials)
    ref = reference(a)
    for block, threads in ((1 << 16, 1), (ROW + 17, 1), (5000, 2), (1000, 3), (4096, 8)):
        check(scan_array(a, block_elems=block, threads=threads), ref, tol_for(dtype))


@pytest.mark.parametrize("specials", [False, True])
def test_large_bfloat16_rows_blocks_and_threads(specials):
    f = big_with_specials(np.float32, 3 * ROW + 1234, seed=4, specials=specials)
    words = (f.view(np.uint32) >> 16).astype(np.uint16)
    ref = reference(words, bf16=True)
    for block, threads in ((1 << 16, 1), (ROW + 17, 1), (1000, 3)):
        check(scan_array(words, dtype="bfloat16", block_elems=block, threads=threads), ref, F32_TOL)
    check(scan_array(words.view(np.int16), dtype="bfloat16"), ref, F32_TOL)  # signed words too
    # word pairs read as uint32 need 4-byte alignment: an odd start takes the plain widening
    check(scan_array(words[1:], dtype="bfloat16", block_elems=1000), reference(words[1:], bf16=True), F32_TOL)


def test_float32_sums_much_better_than_tolerance_on_typical_data():
    # a serial float32 accumulation would be off by ~1e-4 here; the row scheme by ~1e-7
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(1 << 21) + 0.25).astype(np.float32)
    s, ref = scan_array(a), reference(a)
    assert abs(s.mean - ref["mean"]) <= 1e-6 * ref["abs_mean"]
    assert s.l2norm == pytest.approx(ref["l2norm"], rel=1e-6)


@pytest.mark.parametrize("scale", [1e30, 1e-30, 3e38])
def test_float32_out_of_fast_range_summed_in_float64(scale):
    # squares of 1e30 overflow float32 and squares of 1e-30 underflow: such blocks are summed
    # in float64, so the result is as exact as the float64 reference
    rng = np.random.default_rng(6)
    a = np.clip(rng.standard_normal(4 * 64 + 5) * scale, -3.4e38, 3.4e38).astype(np.float32)
    s = scan_array(a, block_elems=64)
    check(s, reference(a), F64_TOL)
    assert math.isfinite(s.l2norm) and s.l2norm > 0


@pytest.mark.parametrize("bf16", [False, True])
def test_half_words_single_signed_blocks_and_signed_zeros(bf16):
    def words(values):
        f = np.array(values, np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16) if bf16 else f.astype(np.float16).view(np.uint16)

    cases = [[-1.0, -2.5, -0.0, -0.125], [3.0, 0.0, 0.5, 2.0], [-0.0, -0.0], [0.0, -0.0, 0.0],
             [-65504.0, -1.0], [65504.0, 65504.0, 1.0], [-3.0, 2.0, -0.0, 0.0]]
    for values in cases:
        w = words(values)
        arr = w if bf16 else w.view(np.float16)
        for block in (1, 2, 1 << 16):
            s = scan_array(arr, dtype="bfloat16" if bf16 else None, block_elems=block)
            check(s, reference(arr, bf16=bf16), F32_TOL)


def test_fp16_saturation_in_negative_and_mixed_blocks():
    a = np.array([-FP16_MAX, -1, -2, -FP16_MAX, 3, FP16_MAX, -0.0, 60000], np.float16)
    for block in (1, 2, 4, 8):
        s = scan_array(a, block_elems=block)
        assert s.fp16_saturated == 3 and (s.min, s.max) == (-FP16_MAX, FP16_MAX)
        assert s.zero_fraction == 1 / 8


def test_threads_validated_and_small_arrays_single_span():
    with pytest.raises(ValueError):
        scan_array(np.zeros(3, np.float32), threads=0)
    a = np.arange(10, dtype=np.float32)
    check(scan_array(a, threads=4), reference(a), F32_TOL)  # fewer blocks than threads


@pytest.mark.parametrize("threads", [1, 3])
def test_release_ranges_cover_scanned_bytes_once(monkeypatch, threads):
    # scan_file_npy drops scanned pages of a memmap by these (start, end) byte ranges: with
    # several threads each reports its own span, never a range another thread still reads
    from precision_agent.dumps import scanner

    monkeypatch.setattr(scanner, "_RELEASE_BYTES", 4000)
    a = np.arange(10_000, dtype=np.float32)
    seen: list[tuple[int, int]] = []
    s = scan_array(a, block_elems=300, threads=threads, _release=lambda lo, hi: seen.append((lo, hi)))
    check(s, reference(a), F32_TOL)
    seen.sort()
    assert seen and all(0 <= lo < hi <= a.nbytes for lo, hi in seen)
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(seen, seen[1:]))  # disjoint
    assert sum(hi - lo for lo, hi in seen) > a.nbytes // 2


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32])
def test_one_signed_tensors_abs_mean_is_abs_of_mean(dtype, sign):
    # blocks of one sign take sum |x| from the plain sum (numpy kernels); rows and tails of
    # whole rows, several blocks, -0 among positives
    rng = np.random.default_rng(8)
    a = (sign * (np.abs(rng.standard_normal(3 * ROW + 5)) * 10)).astype(dtype)
    a[::97] = 0
    if dtype != np.int32:
        a[1::101] = -0.0
    for block in (1 << 16, ROW + 3, 100):
        s = scan_array(a, block_elems=block)
        check(s, reference(a), tol_for(dtype))
        assert s.abs_mean == pytest.approx(abs(s.mean), rel=tol_for(dtype))
