"""Fuzz targets of the structured metric-file readers: TensorBoard event files (torn records, bad
CRCs, huge and hostile lengths, hostile protobuf inside records whose CRCs hold) and CSV metric
logs (odd quoting, huge cells, NULs, header rewrites), each followed as the daemon follows it: part
written, polled, the rest appended (or the file rewritten), polled again, then read to its end."""

from __future__ import annotations

import random
import struct
from pathlib import Path

from conftest import REPO
from support import dumps as W
from precision_agent.readers import tfrecord
from precision_agent.readers.streams import open_stream

from .core import Target
from .mutate import JUNK, NUMBERS, mutate_bytes, pick

FIXTURES = REPO / "tests" / "fixtures" / "metricfiles"
_SEEDS: dict[str, list] = {}


def _event_records() -> list[bytes]:
    if "ev" not in _SEEDS:
        recs: list[bytes] = []
        for path in sorted(FIXTURES.rglob("events.out.tfevents.*")):
            data, at = path.read_bytes(), 0
            while at < len(data):
                (n,) = struct.unpack_from("<Q", data, at)
                recs.append(data[at:at + 16 + n])
                at += 16 + n
        _SEEDS["ev"] = recs
    return _SEEDS["ev"]


def _csv_lines() -> list[bytes]:
    if "csv" not in _SEEDS:
        _SEEDS["csv"] = [line for p in sorted(FIXTURES.rglob("metrics.csv")) for line in p.read_bytes().splitlines(True)]
    return _SEEDS["csv"]


def _hostile_event(rng: random.Random) -> bytes:
    """An Event whose bytes are hostile but well-framed: deep nesting, huge declared lengths,
    odd tensors under a tag the map names."""
    tag = W.f_str(1, pick(rng, ["train/loss", "lm loss", "loss-scale", "x" * 300, "grad-norm"]))
    kind = rng.randrange(6)
    if kind == 0:                       # a tensor of a float dtype with odd shapes and contents
        dims = b"".join(W.f_bytes(2, W.f_varint(1, pick(rng, [0, 1, 2, 1 << 62, (1 << 64) - 1])))
                        for _ in range(rng.randint(0, 40)))
        t = (W.f_varint(1, pick(rng, [1, 2, 14, 19, 7, 1 << 40])) + W.f_bytes(2, dims)
             + W.f_bytes(4, bytes(rng.randrange(256) for _ in range(pick(rng, [0, 2, 4, 8, 3, 1000]))))
             + W.f_bytes(5, bytes(rng.randrange(256) for _ in range(rng.randint(0, 12))))
             + W.f_bytes(13, bytes(rng.randrange(256) for _ in range(rng.randint(0, 12)))))
        value = tag + W.f_bytes(8, t)
    elif kind == 1:                     # nesting far deeper than any Event
        inner = b""
        for _ in range(rng.choice((10, 40, 200))):
            inner = W.f_bytes(1, inner)
        value = tag + W.f_bytes(8, inner)
    elif kind == 2:                     # a length-delimited field declaring more than is there
        value = tag + W.key(8, 2) + W.varint(pick(rng, [1 << 30, (1 << 64) - 1, 5]))
    elif kind == 3:                     # many values
        value = (tag + W.key(2, 5) + struct.pack("<f", float("nan"))) * rng.choice((1, 1000, 20000))
    elif kind == 4:                     # a varint of 11 bytes, a group wire type
        value = tag + pick(rng, [b"\x10" + b"\xff" * 11, W.key(2, 3), W.key(0, 0)])
    else:
        value = tag + W.key(2, 5) + struct.pack("<f", rng.choice((1.0, float("inf"), -0.0)))
    event = W.key(1, 1) + struct.pack("<d", pick(rng, [1.7e9, float("nan"), -1e308])) \
        + W.f_varint(2, pick(rng, [1, (1 << 64) - 1, 1 << 63])) + W.f_bytes(5, W.f_bytes(1, value))
    return event


def _hostile_header(rng: random.Random) -> bytes:
    length = pick(rng, [1 << 40, (1 << 64) - 1, tfrecord.MAX_SANE + 1, 1 << 29, 100, 0])
    head = struct.pack("<Q", length)
    crc = tfrecord.masked_crc(head) if rng.random() < 0.7 else rng.randrange(1 << 32)
    return head + struct.pack("<I", crc)


def _make_events(rng: random.Random) -> tuple[bytes, int, int]:
    recs = _event_records()
    start = rng.randrange(len(recs))
    parts = list(recs[start:start + rng.randint(1, 40)])
    for _ in range(rng.choice((0, 1, 2, 4))):
        i = rng.randint(0, len(parts))
        op = rng.randrange(5)
        if op == 0:
            parts.insert(i, tfrecord.frame(_hostile_event(rng)))
        elif op == 1:
            parts.insert(i, _hostile_header(rng) + bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
        elif op == 2 and parts and parts[i - 1]:
            parts[i - 1] = mutate_bytes(rng, parts[i - 1], hot=16)
        elif op == 3:
            parts.insert(i, bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))))
        elif parts and parts[i - 1]:      # a bad data CRC on a real record
            b = bytearray(parts[i - 1])
            b[-1 - rng.randrange(min(4, len(b)))] ^= 0xFF
            parts[i - 1] = bytes(b)
    body = b"".join(parts)
    return body, rng.randint(0, len(body)), rng.choice((64, 200, 1 << 20))


def _check(stream, got: list) -> None:
    for s in got:
        if s.source.line < 1 or not isinstance(s.value, float) or s.metric not in (
                "loss", "eval_loss", "grad_norm", "loss_scale", "lr"):
            raise AssertionError(f"bad sample {s!r}")
    pos = stream.position
    if pos is not None and pos.offset < 0:
        raise AssertionError(f"bad position {pos}")


def _run_events(payload: tuple[bytes, int, int], work: Path) -> None:
    body, cut, limit = payload
    path = work / "events.out.tfevents.1.host.1.0"
    path.write_bytes(body[:cut])
    stream = open_stream(str(path), max_line_bytes=limit)
    try:
        got = stream.poll(now=0.0)
        saved = stream.position
        with open(path, "ab") as f:  # the rest arrives later, cut anywhere (inside a header, a record)
            f.write(body[cut:])
        got += stream.poll(now=0.0)
        again = open_stream(str(path), position=saved, max_line_bytes=limit)  # a restart from the commit
        try:
            _check(again, again.finish(now=0.0))
        finally:
            again.close()
        got += stream.finish(now=0.0)
        if stream.position is not None and stream.position.offset != len(body):
            raise AssertionError(f"finish stopped at {stream.position.offset} of {len(body)}")
    finally:
        stream.close()
    _check(stream, got)


def _make_csv(rng: random.Random) -> tuple[bytes, bytes, int, int]:
    lines = _csv_lines()
    start = rng.randrange(len(lines))
    body = [lines[0]] + lines[start:start + rng.randint(0, 60)]
    for _ in range(rng.choice((0, 1, 2, 4))):
        i = rng.randint(1, len(body))
        op = rng.randrange(6)
        if op == 0:     # odd quoting
            body.insert(i, pick(rng, [b'"1', b'1,"2""', b'""",,,', b'0,1,"nan\n"\n', b"'a',b\n"]) + b"\n")
        elif op == 1:   # a huge cell
            body.insert(i, b"0,5," + b"9" * rng.choice((100, 5000, 300000)) + b"\n")
        elif op == 2:   # NULs, junk, hostile numbers
            body.insert(i, ",".join(pick(rng, NUMBERS + JUNK) for _ in range(rng.randint(1, 8))).encode(
                "utf-8", "surrogatepass") + b"\n")
        elif op == 3:
            body[i - 1] = mutate_bytes(rng, body[i - 1], hot=8)
        elif op == 4:   # a line without its end, NUL-filled
            body.insert(i, b"\0" * rng.choice((1, 100, 5000)))
        else:           # a new header in the middle (another writer)
            body.insert(i, b"epoch,step,train_loss_step,grad_norm,lr-SGD\r\n")
    first = b"".join(body)
    # later: appended rows, or the whole file rewritten with a new header (Lightning's rewrite)
    rewrite = rng.random() < 0.4
    later = (b"epoch,step,x,train_loss_step,val_loss\r\n" if rewrite else b"") + b"".join(
        lines[rng.randrange(len(lines))] for _ in range(rng.randint(0, 30)))
    return first, later, int(rewrite), rng.choice((64, 1024, 1 << 20))


def _run_csv(payload: tuple[bytes, bytes, int, int], work: Path) -> None:
    first, later, rewrite, limit = payload
    path = work / "metrics.csv"
    path.write_bytes(first)
    stream = open_stream(str(path), max_line_bytes=limit)
    try:
        got = stream.poll(now=0.0)
        if rewrite:
            path.write_bytes(later)
        else:
            with open(path, "ab") as f:
                f.write(later)
        got += stream.poll(now=0.0) + stream.finish(now=0.0)
    finally:
        stream.close()
    _check(stream, got)


TARGETS = [
    Target("tfevents", _make_events, _run_events),
    Target("metric_csv", _make_csv, _run_csv),
]
