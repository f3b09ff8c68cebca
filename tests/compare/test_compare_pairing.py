"""compare pairing: which target tensor meets which benchmark tensor, on generated dump trees of
every layout (msprobe-like dirs, CANN files, MindSpore npy names, TF benchmark npy, plain npy),
and what is left unmatched."""

from __future__ import annotations

import os

import numpy as np

from support import dumps as W
from precision_agent.compare.pairing import match_groups, pair_key, pair_sides, read_side, tensor_label
from support.dumps import write_msprobe


def test_msprobe_pairs_by_entry_key_and_argument(tmp_path):
    a, b = np.ones((2, 3), np.float32), np.arange(3, dtype=np.float32)
    for side in ("bench", "target"):
        write_msprobe(tmp_path / side, [("Functional.linear.0.forward", {"input_args": [a, a.T.copy(), b],
                                                                        "output": [a @ a.T]}),
                                        ("Torch.relu.0.forward", {"input_args": [a], "output": [a]})])
    # the target has one extra op, the bench one of its own: both listed, never dropped
    write_msprobe(tmp_path / "target", [("Functional.linear.0.forward", {"input_args": [a, a.T.copy(), b],
                                                                         "output": [a @ a.T]}),
                                        ("Torch.gelu.0.forward", {"input_args": [a], "output": [a]})], step=1)
    write_msprobe(tmp_path / "bench", [("Functional.linear.0.forward", {"input_args": [a, a.T.copy(), b],
                                                                        "output": [a @ a.T]}),
                                       ("Torch.tanh.0.forward", {"input_args": [a], "output": [a]})], step=1)
    t, bn = read_side(tmp_path / "target"), read_side(tmp_path / "bench")
    assert (t.layout, bn.layout) == ("msprobe", "msprobe")
    p = pair_sides(t, bn)
    assert len(p.pairs) == 6 + 4
    for pair in p.pairs:
        assert (pair.target.name, tensor_label(pair.target), pair.target.step) == \
               (pair.bench.name, tensor_label(pair.bench), pair.bench.step)
    assert [tensor_label(x.target) for x in p.pairs[:4]] == ["input_args[0]", "input_args[1]",
                                                             "input_args[2]", "output[0]"]
    um = {(u["side"], u["op"], u["tensor"], u["step"]) for u in p.unmatched}
    assert um == {("target", "Torch.gelu.0.forward", "input_args[0]", 1),
                  ("target", "Torch.gelu.0.forward", "output[0]", 1),
                  ("bench", "Torch.tanh.0.forward", "input_args[0]", 1),
                  ("bench", "Torch.tanh.0.forward", "output[0]", 1)}
    assert len(p.unmatched_tensors) == len(p.unmatched)


def test_msprobe_proc_dir_pairs_with_rank_dir_by_step(tmp_path):
    a = np.ones(4, np.float32)
    for step in (0, 1):
        write_msprobe(tmp_path / "bench", [("Torch.relu.0.forward", {"input_args": [a], "output": [a]})],
                      step=step, rank="rank0")
        write_msprobe(tmp_path / "target", [("Torch.relu.0.forward", {"input_args": [a], "output": [a * step]})],
                      step=step, rank="proc4242")
    p = pair_sides(read_side(tmp_path / "target"), read_side(tmp_path / "bench"))
    assert not p.unmatched
    assert [(x.target.step, x.bench.step, x.target.rank, x.bench.rank) for x in p.pairs] == \
           [(0, 0, None, 0)] * 2 + [(1, 1, None, 0)] * 2


def test_match_groups_rules():
    # exact groups first; leftovers by step when each side has one rank there; then one to one
    assert match_groups({(0, 0): 1, (0, 1): 1}, {(0, 0): 1, (0, 1): 1}) == [((0, 0), (0, 0)), ((0, 1), (0, 1))]
    assert match_groups({(0, None): 1, (1, None): 1}, {(0, 3): 1, (1, 3): 1}) == \
        [((0, None), (0, 3)), ((1, None), (1, 3))]
    assert match_groups({(3, 0): 1}, {(7, 0): 1}) == [((3, 0), (7, 0))]
    # two ranks on one side, one on the other: the extra rank stays unmatched
    assert match_groups({(0, 0): 1, (0, 1): 1}, {(0, 0): 1}) == [((0, 0), (0, 0))]


def test_npy_trees_pair_by_relative_path(tmp_path):
    x = np.arange(6, dtype=np.float32)
    for side in ("bench", "target"):
        (tmp_path / side / "layer1").mkdir(parents=True)
        np.save(tmp_path / side / "layer1" / "w.npy", x)
        np.save(tmp_path / side / "top.npy", x)
    np.save(tmp_path / "target" / "layer1" / "only_here.npy", x)
    p = pair_sides(read_side(tmp_path / "target"), read_side(tmp_path / "bench"))
    assert sorted(pair_key(q.target, "npy") for q in p.pairs) == [("layer1/w.npy",), ("top.npy",)]
    assert [(u["side"], u["op"]) for u in p.unmatched] == [("target", os.path.join("layer1", "only_here.npy"))]


def test_cann_target_pairs_with_tf_benchmark_npy_by_op_name(tmp_path):
    """msaccucmp's NPU-vs-TF case: CANN files named by op, a TF dump named {op}.{idx}.{timestamp}.npy."""
    npu = tmp_path / "npu"
    npu.mkdir()
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    W.write_cann_dump(str(npu / W.dump_name("MatMul", "dense_MatMul", 3, 1, 1700000000000001)),
                      inputs=[W.tensor(x), W.tensor(x)], outputs=[W.tensor(x @ x)])
    W.write_cann_dump(str(npu / W.dump_name("Relu", "dense_Relu", 4, 1, 1700000000000002)),
                      inputs=[W.tensor(x)], outputs=[W.tensor(np.maximum(x, 0))])
    tf = tmp_path / "tf"
    tf.mkdir()
    np.save(tf / "dense_MatMul.0.1600000000000123.npy", x @ x)
    np.save(tf / "dense_Relu.0.1600000000000456.npy", np.maximum(x, 0))
    np.save(tf / "dense_BiasAdd.0.1600000000000789.npy", x)
    t, b = read_side(npu), read_side(tf)
    assert (t.layout, b.layout) == ("cann", "npy")
    p = pair_sides(t, b)
    assert [(q.target.name, q.target.io, q.bench.name) for q in p.pairs] == [
        ("dense_MatMul", "output", "dense_MatMul.0.1600000000000123.npy"),
        ("dense_Relu", "output", "dense_Relu.0.1600000000000456.npy")]
    um = sorted((u["side"], u["op"], u["tensor"]) for u in p.unmatched)
    assert um == [("bench", "dense_BiasAdd.0.1600000000000789.npy", "output[0]"),
                  ("target", "dense_MatMul", "input[0]"), ("target", "dense_MatMul", "input[1]"),
                  ("target", "dense_Relu", "input[0]")]


def test_repeated_op_pairs_by_occurrence(tmp_path):
    """An op run twice in a step: the n-th target occurrence meets the n-th benchmark one."""
    for side, ts0 in (("bench", 1600000000000000), ("target", 1700000000000000)):
        d = tmp_path / side
        d.mkdir()
        for i, v in enumerate((1.0, 2.0)):
            np.save(d / f"loop_Add.0.{ts0 + i}.npy", np.full(3, v, np.float32))
    p = pair_sides(read_side(tmp_path / "target"), read_side(tmp_path / "bench"))
    assert [(float(q.target.load()[0]), float(q.bench.load()[0])) for q in p.pairs] == [(1.0, 1.0), (2.0, 2.0)]


def test_cann_dumps_pair_across_runs_with_other_timestamps(tmp_path):
    x = np.ones((2, 2), np.float16)
    for side, ts in (("bench", 1600000000000000), ("target", 1700000000000000)):
        d = tmp_path / side / "20240101000000" / "0" / "ge_default" / "1" / "5"
        d.mkdir(parents=True)
        W.write_cann_dump(str(d / W.dump_name("Add", "add_1", 7 if side == "bench" else 9, 0, ts)),
                          inputs=[W.tensor(x), W.tensor(x)], outputs=[W.tensor(x + x)])
    p = pair_sides(read_side(tmp_path / "target"), read_side(tmp_path / "bench"))
    assert not p.unmatched
    assert [(q.step, q.rank, q.target.io, q.target.index) for q in p.pairs] == [
        (5, 0, "input", 0), (5, 0, "input", 1), (5, 0, "output", 0)]


def test_mindspore_npy_pairs_by_op_io_slot(tmp_path):
    x = np.arange(4, dtype=np.float32)
    for side, ts in (("bench", 111), ("target", 222)):
        d = tmp_path / side / "rank_0" / "net" / "0" / "3"
        d.mkdir(parents=True)
        np.save(d / f"MatMul.Default_MatMul-op1.{ts}.0.{ts}.input.0.DefaultFormat.float32.npy", x)
        np.save(d / f"MatMul.Default_MatMul-op1.{ts}.0.{ts}.output.0.DefaultFormat.float32.npy", x)
    p = pair_sides(read_side(tmp_path / "target"), read_side(tmp_path / "bench"))
    assert not p.unmatched
    assert [(q.step, q.rank, q.target.name, tensor_label(q.target)) for q in p.pairs] == [
        (3, 0, "Default_MatMul-op1", "input[0]"), (3, 0, "Default_MatMul-op1", "output[0]")]
