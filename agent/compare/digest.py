"""Cross-rank consistency: one digest per (step, rank) over the tensors every data-parallel rank
must hold bit for bit (typically the weights a step starts from).

Each host exports its ranks' latest digest as a number (48 bits of BLAKE2b, exact in a float64
sample) next to the step it belongs to; a Prometheus rule then counts distinct digests across
hosts for the same step. The agent never talks to other hosts: Prometheus is the cluster layer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..kernels.lazy import np   # numpy on first use (kernels/lazy.py)

from ..config.regex import UserRegex
from ..dumps.types import DumpTensor

CHUNK_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class StepDigest:
    step: int | None
    rank: int | None
    digest: str        # hex, 16 digits
    value: int         # the first 48 bits, for a Prometheus sample
    tensors: int       # how many tensors went into it
    from_stats: bool   # True when the dump held statistics only (digest over Max/Min/Mean/Norm)


def tensor_key(t: DumpTensor) -> str:
    """What a ``digest`` regex (RE2 syntax, searched: not anchored) is matched against: ``"<op> <io>[<index>]"``."""
    return f"{t.name} {t.io}[{t.index}]"


def _feed_data(h: "hashlib._Hash", t: DumpTensor) -> None:
    a = np.asarray(t.load())  # type: ignore[misc]
    flat = a.reshape(-1)
    view = flat.view(np.uint8) if flat.flags.c_contiguous else np.ascontiguousarray(flat).view(np.uint8)
    for start in range(0, view.size, CHUNK_BYTES):
        h.update(memoryview(view[start:start + CHUNK_BYTES]))


def _feed_stats(h: "hashlib._Hash", t: DumpTensor) -> None:
    s = t.stats
    values = (s.max, s.min, s.mean, s.norm) if s is not None else ()
    h.update(repr(tuple(float("nan") if v is None else float(v) for v in values)).encode())


def step_digests(tensors: list[DumpTensor], pattern: str) -> list[StepDigest]:
    """Digests of the tensors whose key matches ``pattern``, per (step, rank), in execution order.

    The name, dtype and shape of every tensor go into the digest too, so two ranks that dumped
    different sets of tensors disagree even when the bytes happen to match."""
    rx = UserRegex(pattern, "digest")   # RE2: linear in the key, whatever the tensor names
    groups: dict[tuple[int | None, int | None], list[DumpTensor]] = {}
    for t in tensors:
        if rx.search(tensor_key(t)):
            groups.setdefault((t.step, t.rank), []).append(t)
    out = []
    for (step, rank), ts in groups.items():
        h = hashlib.blake2b(digest_size=8)
        from_stats = False
        for t in sorted(ts, key=lambda t: (t.order, t.io, t.index)):
            h.update(f"{tensor_key(t)}|{t.dtype}|{t.shape}\n".encode("utf-8", "surrogatepass"))  # names from JSON may hold lone surrogates
            if t.load is not None:
                _feed_data(h, t)
            else:
                from_stats = True
                _feed_stats(h, t)
        d = h.hexdigest()
        out.append(StepDigest(step, rank, d, int(d[:12], 16), len(ts), from_stats))
    return out
