"""The one-descriptor read of plain torch.save zips (dumps/storedzip.py) against zipfile's path:
where the fast read answers, it answers exactly what zipfile's path answers (the description,
the tensor's bytes); on anything else (mutated, truncated, padded files) it steps aside and the
error is zipfile's path's, word for word."""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import numpy as np
import pytest

from precision_agent.dumps.torchzip import _fast, _inspect_zipfile, inspect_pt, load_pt, open_pt
from support.torchpt import tensor_pickle, write_pt, write_pt_raw

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def _outcome(fn, *args) -> tuple:
    """What a read gives: the description and the tensor's bytes, or the error's type and words."""
    try:
        info, arr = fn(*args)
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return ("error", type(exc).__name__, str(exc))
    return ("ok", info.dtype, str(info.np_dtype), info.shape, info.ref, info.data_offset, info.member.filename,
            info.member.file_size, info.member.header_offset, arr.dtype.str, arr.shape, arr.tobytes(),
            arr.flags.writeable)


def _slow(path: str) -> tuple:
    info = _inspect_zipfile(path, 64, 8 << 30)
    return info, load_pt(info)


def _public(path: str) -> tuple:
    return inspect_pt(path), open_pt(path)


def _valid(tmp: Path) -> list[Path]:
    rng = np.random.default_rng(3)
    out = sorted((FIX / "msprobe_incidents" / "healthy" / "adamw_1e-4_tensor").rglob("*.pt"))[:6]   # torch's own
    out += [write_pt(tmp / "f32.pt", rng.standard_normal((7, 5), dtype=np.float32)),
            write_pt(tmp / "f16.pt", rng.standard_normal(300).astype(np.float16)),
            write_pt(tmp / "i64.pt", np.arange(12, dtype=np.int64).reshape(3, 4)),
            write_pt(tmp / "bool.pt", rng.standard_normal(9) > 0),
            write_pt(tmp / "bf16.pt", rng.integers(0, 1 << 16, 33, dtype=np.uint16), dtype="bfloat16"),
            write_pt(tmp / "view.pt", rng.standard_normal((4, 6), dtype=np.float32), transpose=True),
            write_pt(tmp / "scalar.pt", np.array(2.5, dtype=np.float32)),
            write_pt(tmp / "empty.pt", np.zeros((0, 3), dtype=np.float32))]
    big = tmp / "big.pt"   # a big-endian storage, as torch writes on such hosts
    with zipfile.ZipFile(big, "w") as z:
        z.writestr("big/data.pkl", tensor_pickle("FloatStorage", 4, (4,), (1,)))
        z.writestr("big/byteorder", "big")
        z.writestr("big/data/0", np.arange(4, dtype=">f4").tobytes())
    deflated = write_pt_raw(tmp / "deflated.pt", tensor_pickle("FloatStorage", 3, (3,), (1,)),
                            np.ones(3, np.float32).tobytes(), compress=zipfile.ZIP_DEFLATED)
    return out + [big, deflated]


def test_valid_files_read_the_same_both_ways(tmp_path):
    fast = 0
    for p in _valid(tmp_path):
        want = _outcome(_slow, str(p))
        assert want[0] == "ok", (p, want)
        assert _outcome(_public, str(p)) == want, p
        got = _fast(str(p), 64, 8 << 30, True)
        if got is not None:
            fast += 1
            assert _outcome(lambda: (got[0], got[1] if got[1] is not None else load_pt(got[0]))) == want, p
    assert fast >= 13   # all but the deflated one take the one-descriptor read


def _mutants(data: bytes, rng: random.Random, n: int):
    size = len(data)
    for _ in range(n):
        b = bytearray(data)
        kind = rng.randrange(6)
        if kind <= 2:   # flip bytes, mostly in the headers and the directory at both ends
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(min(size, 512)) if rng.random() < 0.5 else size - 1 - rng.randrange(min(size, 700))
                b[i] = rng.randrange(256)
        elif kind == 3:
            del b[rng.randrange(size):]
        elif kind == 4:
            b[rng.randrange(size):rng.randrange(size)] = b""
        else:
            at = rng.choice([0, size, size - 22, rng.randrange(size)])
            b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 70)))
        yield bytes(b)


@pytest.mark.parametrize("seed", range(3))
def test_mutated_files_give_zipfiles_answer(tmp_path, seed):
    rng = random.Random(seed)
    m = tmp_path / "m.pt"
    answered = 0
    for p in _valid(tmp_path)[:12]:
        for data in _mutants(Path(p).read_bytes(), rng, 60):
            m.write_bytes(data)
            want = _outcome(_slow, str(m))
            assert _outcome(_public, str(m)) == want
            got = _fast(str(m), 64, 8 << 30, True)
            if got is not None:
                answered += 1
                assert want[0] == "ok"
                assert _outcome(lambda: (got[0], got[1] if got[1] is not None else load_pt(got[0]))) == want
    assert answered > 0   # mutations of the tensor bytes still read fast


def test_special_files_are_refused_as_before(tmp_path):
    import os
    fifo = tmp_path / "x.pt"
    os.mkfifo(fifo)
    assert _fast(str(fifo), 64, 8 << 30, True) is None
    with pytest.raises(Exception) as a:
        open_pt(fifo)
    assert "not a regular file" in str(a.value)
