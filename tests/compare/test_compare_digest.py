"""Cross-rank digests: equal tensors give equal digests, any changed bit or missing tensor does not."""

from __future__ import annotations

import numpy as np
import pytest

from precision_agent.compare.digest import step_digests
from precision_agent.dumps.scan import discover
from precision_agent.dumps.types import DumpTensor

from conftest import corpus_path


def _tensors(rank: int, weights: list[np.ndarray], step: int = 3) -> list[DumpTensor]:
    out = []
    for i, w in enumerate(weights):
        out.append(DumpTensor(name=f"Functional.linear.{i}.forward", io="input", index=1, dtype=str(w.dtype),
                              shape=w.shape, order=i, step=step, rank=rank, load=lambda w=w: w))
        act = np.full(4, rank, dtype=np.float32)  # activations differ per rank and must not count
        out.append(DumpTensor(name=f"Functional.linear.{i}.forward", io="output", index=0, dtype="float32",
                              shape=(4,), order=i, step=step, rank=rank, load=lambda a=act: a))
    return out


WEIGHTS = r"\.forward input\[1\]$"


def test_equal_weights_on_two_ranks_give_one_digest() -> None:
    rng = np.random.default_rng(0)
    w = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(3)]
    d0, = step_digests(_tensors(0, w), WEIGHTS)
    d1, = step_digests(_tensors(1, [x.copy() for x in w]), WEIGHTS)
    assert (d0.rank, d1.rank) == (0, 1) and d0.step == d1.step == 3
    assert d0.digest == d1.digest and d0.value == d1.value and d0.tensors == 3
    assert 0 <= d0.value < 2 ** 48 and not d0.from_stats


def test_digest_regex_is_linear_on_hostile_tensor_names() -> None:
    """The digest regex runs on RE2: ``(a+)+b`` over a tensor named with a long run of ``a`` answers
    at once (hours on a backtracking engine); a regex RE2 cannot take is a ValueError."""
    w = np.zeros(4, dtype=np.float32)
    t = [DumpTensor(name="a" * 3000, io="input", index=1, dtype="float32", shape=(4,), order=0, step=1, rank=0,
                    load=lambda: w),
         DumpTensor(name="a" * 30 + "b", io="input", index=1, dtype="float32", shape=(4,), order=1, step=1, rank=0,
                    load=lambda: w)]
    d, = step_digests(t, r"^(a+)+b ")
    assert d.tensors == 1
    with pytest.raises(ValueError, match="digest: invalid regex.*lookahead"):
        step_digests(t, r"(?=a)")


def test_one_flipped_bit_or_a_missing_tensor_changes_the_digest() -> None:
    rng = np.random.default_rng(1)
    w = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(3)]
    base, = step_digests(_tensors(0, w), WEIGHTS)
    flipped = [x.copy() for x in w]
    flipped[2].view(np.uint32)[5, 1] ^= 1
    assert step_digests(_tensors(1, flipped), WEIGHTS)[0].digest != base.digest
    assert step_digests(_tensors(1, w[:2]), WEIGHTS)[0].digest != base.digest


def test_non_contiguous_and_empty_tensors_are_digested() -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    t = [DumpTensor(name="w", io="input", index=1, dtype="float32", shape=a.shape, order=0, step=0, rank=0,
                    load=lambda: a),
         DumpTensor(name="e", io="input", index=1, dtype="float32", shape=(0,), order=1, step=0, rank=0,
                    load=lambda: np.zeros(0, np.float32))]
    d, = step_digests(t, r"input\[1\]")
    assert d.tensors == 2
    same = [DumpTensor(name="w", io="input", index=1, dtype="float32", shape=a.shape, order=0, step=0, rank=0,
                       load=lambda: np.ascontiguousarray(a)), t[1]]
    assert step_digests(same, r"input\[1\]")[0].digest == d.digest


@pytest.mark.corpus
@pytest.mark.parametrize("other, step, equal", [("same", 0, True), ("same", 1, True), ("nan", 0, True), ("drift", 0, True),
                                                 ("nan", 1, False), ("drift", 1, False)])
def test_corpus_weights_digest(other: str, step: int, equal: bool) -> None:
    """Weights entering each forward op: the sets agree exactly where GROUND_TRUTH.md says the
    parameters are equal (drift step 0 has equal weights; step 1 starts from moved ones)."""
    root = corpus_path("msprobe")
    pattern = r"^Functional\.(linear|layer_norm)\.\d+\.forward input\[[12]\]$"  # weights and biases
    ref = {d.step: d for d in step_digests(discover(root / "bench")[0], pattern)}
    got = {d.step: d for d in step_digests(discover(root / other)[0], pattern)}
    assert (ref[step].digest == got[step].digest) is equal
    assert ref[step].tensors > 5
