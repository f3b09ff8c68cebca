"""The compare of flat word buffers without numpy (agent/kernels/compare_raw.py through
metrics.compare_raw) against compare_arrays on the same data with the C kernel: every field of
the TensorDiff bit for bit, over float32, float16 and bfloat16 sides, identical and differing
blocks, blocks that reach KLD's clamp; and None (numpy's path) wherever numpy must see a block."""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import pytest

from precision_agent import kernels
from precision_agent.compare.metrics import compare_arrays, compare_raw
from precision_agent.dumps.types import RawTensor

FIELDS = ("bitwise_equal", "count", "differ", "first_diff_index", "max_abs_index", "nonfinite_mismatch",
          "fail_reason")


@pytest.fixture(autouse=True)
def c_kernel():
    if not kernels.built("compare"):
        assert os.environ.get("CI") != "true", "the C compare kernel must be built in CI"
        pytest.skip("C compare kernel not built")
    with kernels.forced("c"):
        yield


def words(a: np.ndarray, code: str) -> tuple[RawTensor, np.ndarray, str | None]:
    """(the RawTensor, the array compare_arrays takes, its dtype argument) of float32 values ``a``
    stored as ``code``."""
    a = np.ascontiguousarray(a, np.float32).reshape(-1)
    if code == "f4":
        arr, dtype = a, None
    elif code == "f2":
        arr, dtype = a.astype(np.float16), None
    else:   # bfloat16: the high half of each float32 word
        arr, dtype = (a.view(np.uint32) >> 16).astype(np.uint16), "bfloat16"
    view = memoryview(arr if code == "f4" else arr.view(np.uint16))
    return RawTensor(view, code, arr.shape), arr, dtype


def bits(v: float | None) -> bytes | None:
    return None if v is None else struct.pack("<d", v)


def assert_same(raw, ref) -> None:
    assert raw is not None, "the raw path declined a pair it takes"
    assert {k: bits(v) for k, v in raw.metrics.items()} == {k: bits(v) for k, v in ref.metrics.items()}
    for f in FIELDS:
        assert getattr(raw, f) == getattr(ref, f), f
    for a, b in ((raw.target_stats, ref.target_stats), (raw.bench_stats, ref.bench_stats)):
        assert (a is None) == (b is None)
        if a is not None:
            assert [bits(v) for v in a] == [bits(v) for v in b]


def both(x: np.ndarray, y: np.ndarray, cx: str, cy: str, block: int):
    rx, ax, dx = words(x, cx)
    ry, ay, dy = words(y, cy)
    ref = compare_arrays(ax, ay, target_dtype=dx, bench_dtype=dy, block_elems=block)
    return compare_raw(rx, ry, block_elems=block), ref


def pair(seed: int, n: int, same_blocks: tuple[int, ...] = (), block: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """A bench side and a target side close to it, with the listed blocks equal on both."""
    rng = np.random.default_rng(seed)
    y = rng.standard_normal(n).astype(np.float32) * 3
    x = (y + rng.standard_normal(n).astype(np.float32) * 1e-3).astype(np.float32)
    for k in same_blocks:
        x[k * block:(k + 1) * block] = y[k * block:(k + 1) * block]
    return x, y


CODES = [("f4", "f4"), ("f2", "f2"), ("bf16", "bf16"), ("f2", "f4"), ("f4", "bf16")]


@pytest.mark.parametrize("cx,cy", CODES)
@pytest.mark.parametrize("n,same", [(1, ()), (7, ()), (5_000, ()), (5_000, (0, 1, 4)), (40_000, (0, 20, 39))])
def test_the_raw_path_gives_compare_arrays_bit_for_bit(cx, cy, n, same):
    x, y = pair(n + len(same), n, same)
    assert_same(*both(x, y, cx, cy, 1024))


@pytest.mark.parametrize("cx,cy", CODES)
def test_identical_sides_and_sides_equal_but_one_block(cx, cy):
    x, y = pair(3, 10_000)
    assert_same(*both(y, y, cx, cy, 1024))          # same values (bitwise where the codes agree)
    z = y.copy()
    z[7_000:7_010] += 0.5                            # one differing block among identical ones
    raw, ref = both(z, y, cx, cy, 1024)
    assert_same(raw, ref)
    if cx == cy:
        assert ref.first_diff_index == 7_000 and not ref.bitwise_equal


def test_blocks_that_reach_the_clamp_and_near_constant_data():
    """KLD's clamp (a block whose minimum is the side's minimum) and data like 16 ± 0.01, where
    the block sums cannot give Σ(v − min) (compare_numpy.Kld._shifted_sum)."""
    rng = np.random.default_rng(9)
    y = (16 + rng.standard_normal(9_000) * 0.01).astype(np.float32)
    x = (y + rng.standard_normal(9_000).astype(np.float32) * 1e-4).astype(np.float32)
    x[100], y[8_500] = 15.0, 15.5                   # the global minima, in differing blocks
    x[3_072:4_096] = y[3_072:4_096]                  # an identical block beside them
    for cx, cy in CODES:
        assert_same(*both(x, y, cx, cy, 1024))


def test_non_finite_misaligned_and_empty_buffers_go_to_numpy():
    x, y = pair(4, 4_096)
    x[5] = np.nan                                    # NaN in a differing block: numpy's policy
    assert both(x, y, "f4", "f4", 1024)[0] is None
    z = y.copy()
    z[:1024] = np.inf                                # Inf at the same places: an identical block, sum not finite
    assert both(z, z, "f4", "f4", 1024)[0] is None
    raw = bytearray(4 * 4_096 + 1)
    odd = memoryview(raw)[1:].cast("f")              # words that start at an odd address
    ry = words(y, "f4")[0]
    assert compare_raw(RawTensor(odd, "f4", (4_096,)), ry) is None
    assert compare_raw(RawTensor(memoryview(b"").cast("f"), "f4", (0,)), RawTensor(memoryview(b"").cast("f"), "f4", (0,))) is None
    short = words(y[:-1], "f4")[0]
    assert compare_raw(short, ry) is None            # lengths differ: the engine's shape check says why
    with kernels.forced("numpy"):
        assert compare_raw(ry, ry) is None           # no C kernel: arrays


def test_results_do_not_depend_on_the_block_size_path():
    """The same pair through raw and arrays at several block sizes: each size gives one answer."""
    x, y = pair(5, 30_000, (2, 3))
    for block in (512, 4096, 1 << 17):
        raw, ref = both(x, y, "f4", "f4", block)
        assert_same(raw, ref)
        assert math.isfinite(raw.metrics["KullbackLeiblerDivergence"])
