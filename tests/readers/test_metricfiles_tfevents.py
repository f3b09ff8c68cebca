"""TensorBoard event files (readers/tfevents.py) written by the real writers (torch's and
tensorboardX's SummaryWriter): the scalars the map names, torn records, bad CRCs, damaged framing."""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import pytest

from precision_agent.readers import tfrecord
from precision_agent.readers.metricmap import current_map, metric_map
from precision_agent.readers.streams import file_kind, open_stream
from precision_agent.readers.tailer import TailEvent
from support import dumps as W
from support.metricfiles import HF_NAN_STEP, MEGATRON_INF_STEP, STEPS, event_file, records


def read(path: Path, **kw) -> list:
    s = open_stream(str(path), **kw)
    try:
        return s.finish(now=0.0)
    finally:
        s.close()


def series(samples, metric: str) -> dict[int, float]:
    out = {}
    for s in samples:
        if s.metric == metric:
            assert s.step not in out, f"{metric} at step {s.step} twice"
            out[s.step] = s.value
    return out


def test_hf_trainer_tags_are_read_with_steps_and_wall_time():
    samples = read(event_file("hf_ok"))
    loss = series(samples, "loss")
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in loss.values())
    assert sorted(series(samples, "grad_norm")) == list(range(1, STEPS + 1))
    assert series(samples, "lr")[1] == pytest.approx(0.05)
    assert sorted(series(samples, "eval_loss")) == [20, 40, 60]
    assert {s.metric for s in samples} == {"loss", "grad_norm", "lr", "eval_loss"}  # epoch, runtime: not ours
    assert all(s.producer == "tfevents" and s.log_time and s.log_time > 1e9 for s in samples)


def test_the_planted_nan_is_at_its_step():
    loss = series(read(event_file("hf_nan")), "loss")
    assert all(math.isfinite(v) for s, v in loss.items() if s < HF_NAN_STEP)
    assert math.isnan(loss[HF_NAN_STEP])


def test_megatron_new_style_tensor_scalars_and_vs_samples_ignored():
    samples = read(event_file("megatron_nan"))
    loss = series(samples, "loss")
    assert sorted(loss) == list(range(1, STEPS + 1)), "a ' vs samples' copy was read (steps are samples there)"
    assert loss[MEGATRON_INF_STEP] == math.inf
    assert set(series(samples, "loss_scale").values()) == {65536.0}
    assert len(series(samples, "grad_norm")) == STEPS and len(series(samples, "lr")) == STEPS


def test_tensorboardx_files_are_read():
    path = next(iter(sorted((event_file("tbx_ok").parent.parent).rglob("events.out.tfevents.*"))), None)
    if path is None:
        pytest.skip("tensorboardX fixture not written")
    samples = read(path)
    assert len(series(samples, "loss")) == STEPS and len(series(samples, "eval_loss")) == 3


def test_torn_final_record_waits_for_its_rest_and_survives_a_restart(tmp_path):
    recs = records(event_file("hf_nan"))
    k = max(i for i, r in enumerate(recs) if b"train/loss" in r)  # the last loss record is torn
    recs = recs[:k + 1]
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    last = recs[-1]
    path.write_bytes(b"".join(recs[:-1]) + last[:7])  # not even a whole header
    s = open_stream(str(path))
    first = s.poll(now=0.0)
    assert s.position.offset == sum(map(len, recs[:-1])) and s.stats.skipped == 0
    assert s.tailer.unread_bytes() == 0  # the torn start was looked at: a deleted file is not re-polled forever
    with open(path, "ab") as f:
        f.write(last[7:-3])  # header and most of the data
    assert s.poll(now=0.0) == [] and s.position.offset == sum(map(len, recs[:-1]))
    saved = s.position
    s.close()
    with open(path, "ab") as f:
        f.write(last[-3:])
    again = open_stream(str(path), position=saved)  # the agent restarted: the record is not lost
    rest = again.poll(now=0.0)
    assert [(x.metric, x.step) for x in rest] == [("loss", 60)]
    assert again.position.offset == os.path.getsize(path) and not parser_errors(again)
    full = read(event_file("hf_nan"))
    assert [(x.metric, x.step) for x in first + rest] == [(x.metric, x.step) for x in full][:len(first) + 1]


def parser_errors(stream) -> list[str]:
    return list(stream.parser.errors)


def test_a_bad_crc_is_counted_once_said_once_and_skipped(tmp_path):
    recs = records(event_file("hf_ok"))
    scalar = [i for i, r in enumerate(recs) if b"train/loss" in r]
    bad = [bytearray(r) for r in recs]
    for i in scalar[5:8]:  # three damaged loss records: three counted, one log line
        bad[i][-6] ^= 0x40
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    path.write_bytes(b"".join(bad))
    s = open_stream(str(path))
    samples = s.finish(now=0.0)
    assert s.stats.skipped == 3 and len(s.parser.errors) == 1 and "CRC" in s.parser.errors[0]
    assert len(series(samples, "loss")) == STEPS - 3 and len(series(samples, "grad_norm")) == STEPS


def test_a_damaged_header_loses_only_that_record(tmp_path):
    recs = records(event_file("hf_ok"))
    i = next(i for i, r in enumerate(recs) if b"train/loss" in r and i > 20)
    bad = bytearray(recs[i])
    bad[2] ^= 0x10  # the length: its CRC no longer holds
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    path.write_bytes(b"".join(recs[:i]) + bytes(bad) + b"".join(recs[i + 1:]))
    s = open_stream(str(path))
    samples = s.finish(now=0.0)
    assert s.stats.skipped == 1 and "header" in s.parser.errors[0]
    assert len(series(samples, "loss")) == STEPS - 1


@pytest.mark.parametrize("length", [1 << 40, (1 << 64) - 1, tfrecord.MAX_SANE + 1])
def test_hostile_lengths_with_a_valid_crc_are_damage_not_a_wait(tmp_path, length):
    recs = records(event_file("hf_ok"))
    head = struct.pack("<Q", length)
    hostile = head + struct.pack("<I", tfrecord.masked_crc(head)) + b"x" * 64
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    path.write_bytes(b"".join(recs[:10]) + hostile + b"".join(recs[10:]))
    s = open_stream(str(path))
    samples = s.poll(now=0.0)
    assert s.position.offset == path.stat().st_size, "stuck at the hostile length"
    assert s.stats.skipped == 1
    assert len(series(samples, "loss")) == STEPS


def test_records_over_the_limit_are_skipped_unread(tmp_path):
    path = event_file("megatron_ok")
    s = open_stream(str(path), max_line_bytes=200)  # the histograms are bigger than that
    samples = s.finish(now=0.0)
    assert s.stats.skipped == 6 and "over the limit" in s.parser.errors[0]
    assert len(series(samples, "loss")) == STEPS


def test_a_replaced_file_is_read_from_its_start(tmp_path):
    recs = records(event_file("hf_ok"))
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    path.write_bytes(b"".join(recs[:30]))
    s = open_stream(str(path))
    n = len(s.poll(now=0.0))
    tmp = tmp_path / "new"
    tmp.write_bytes(b"".join(recs[:5]))
    os.replace(tmp, path)
    again = s.poll(now=0.0)
    assert n and again and [e for e, _ in s.tailer.drain_events()] == [TailEvent.ROTATED]
    assert again[0].step == 1


@pytest.mark.parametrize("name", ["events.out.tfevents.1.host.1.0", "metrics.csv"])
def test_a_file_replaced_by_a_directory_is_an_error_not_an_exception(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"".join(records(event_file("hf_ok"))[:10]) if name != "metrics.csv"
                     else b"step,loss\n1,2.0\n")
    s = open_stream(str(path))
    assert s.poll(now=0.0)
    os.replace(path, tmp_path / "old")
    path.mkdir()  # (a directory is no regular file: safeio refuses it)
    assert s.poll(now=0.0) == [] and s.poll(now=0.0) == []
    events = s.tailer.drain_events()
    assert [e for e, _ in events if e == TailEvent.ERROR] and "directory" in " ".join(m for _, m in events)


def test_content_sniffing_and_names(tmp_path):
    renamed = tmp_path / "tb.bin"
    renamed.write_bytes(event_file("hf_ok").read_bytes())
    text = tmp_path / "train.log"
    text.write_text("step 1 loss 2.0\n")
    assert file_kind(str(renamed)) == "tfevents" and file_kind(str(text)) == "text"
    assert file_kind(str(tmp_path / "metrics.csv")) == "csv"
    assert file_kind(str(text), "tfevents") == "tfevents"


@pytest.mark.parametrize("fmt", ["hf_trainer", "megatron", "custom"])
def test_a_pinned_text_format_pins_text_logs_only(tmp_path, fmt):
    """The default include picks up event files and metrics.csv beside the logs: a watch with
    ``format: hf_trainer`` must not feed them to the HF text parser."""
    renamed = tmp_path / "tb.bin"
    renamed.write_bytes(event_file("hf_ok").read_bytes())
    named = tmp_path / "events.out.tfevents.1.host.1.0"
    named.write_bytes(event_file("hf_nan").read_bytes())
    text = tmp_path / "train.log"
    text.write_text("step 1 loss 2.0\n")
    csv = tmp_path / "metrics.csv"
    csv.write_bytes(b"step,loss\n1,nan\n")
    kinds = {p.name: file_kind(str(p), fmt) for p in (renamed, named, text, csv, tmp_path / "table.csv")}
    assert kinds == {"tb.bin": "tfevents", named.name: "tfevents", "train.log": "text", "metrics.csv": "csv",
                     "table.csv": "text"}
    pattern = r"step (?P<step>\d+) loss (?P<loss>\S+)" if fmt == "custom" else None
    s = open_stream(str(named), fmt=fmt, pattern=pattern)
    assert s.format == "tfevents" and math.isnan(series(s.finish(now=0.0), "loss")[HF_NAN_STEP])
    s = open_stream(str(csv), fmt=fmt, pattern=pattern)
    assert s.format == "csv" and math.isnan(s.finish(now=0.0)[0].value)


def test_a_user_map_extends_the_shipped_one_and_a_broken_one_is_said(tmp_path, monkeypatch):
    extra = tmp_path / "extra.yml"
    extra.write_text("metrics:\n  loss: [my/odd loss]\n  grad_norm: [train/loss]\nignore: [grad-norm]\n")
    monkeypatch.setenv("PRECISION_AGENT_METRIC_MAP", str(extra))
    m, why = current_map()
    assert why is None and m.metric("My/Odd Loss") == "loss" and m.metric("train/loss") == "grad_norm"
    assert m.metric("grad-norm") is None and m.metric("lm loss") == "loss"
    extra.write_text("metrics:\n  losss: [x]\n")
    metric_map.cache_clear()
    m, why = current_map()
    assert why and "losss" in why and m.metric("train/loss") == "loss"  # the shipped map stays in force
    monkeypatch.setenv("PRECISION_AGENT_METRIC_MAP", str(tmp_path / "missing.yml"))
    assert current_map()[1]


def test_a_closed_descriptor_reopens_where_it_was(tmp_path):
    """The follower closes idle descriptors (limits.max_open_files): the next read goes on."""
    recs = records(event_file("hf_ok"))
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    path.write_bytes(b"".join(recs[:50]))
    s = open_stream(str(path))
    first = s.poll(now=0.0)
    s.tailer.close()
    assert not s.tailer.is_open
    with open(path, "ab") as f:
        f.write(b"".join(recs[50:]))
    rest = s.poll(now=0.0)
    assert s.tailer.is_open and s.tailer.unread_bytes() == 0
    assert [(x.metric, x.step) for x in first + rest] == [(x.metric, x.step) for x in read(event_file("hf_ok"))]


@pytest.mark.parametrize("dtype,body,value", [
    (1, W.f_bytes(4, struct.pack("<f", 2.5)), 2.5),                      # DT_FLOAT tensor_content (TF2)
    (2, W.f_bytes(4, struct.pack("<d", float("nan"))), math.nan),        # DT_DOUBLE tensor_content
    (2, W.f_bytes(6, struct.pack("<d", 0.125)), 0.125),                  # DT_DOUBLE double_val, packed
    (1, W.key(5, 5) + struct.pack("<f", math.inf), math.inf),            # DT_FLOAT float_val, unpacked
    (19, W.f_bytes(13, W.varint(0x3C00)), 1.0),                          # DT_HALF half_val
    (14, W.f_bytes(13, W.varint(0x7FC0)), math.nan),                     # DT_BFLOAT16 half_val
    (3, W.f_bytes(4, struct.pack("<i", 7)), None),                       # DT_INT32: not a float scalar
])
def test_tensor_scalar_encodings(tmp_path, dtype, body, value):
    """The tensor encodings other writers use (hand-encoded: TF2 itself is not installed here)."""
    tensor = W.f_varint(1, dtype) + W.f_bytes(2, b"") + body
    summary = W.f_bytes(1, W.f_str(1, "loss") + W.f_bytes(8, tensor))
    event = W.key(1, 1) + struct.pack("<d", 1.7e9) + W.f_varint(2, 5) + W.f_bytes(5, summary)
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    path.write_bytes(tfrecord.frame(event))
    got = [(x.metric, x.step, x.value) for x in read(path)]
    if value is None:
        assert got == []
    elif math.isnan(value):
        assert got[0][:2] == ("loss", 5) and math.isnan(got[0][2])
    else:
        assert got == [("loss", 5, value)]


def test_a_zero_filled_stretch_costs_little_per_poll_and_the_records_after_it_are_read(tmp_path, monkeypatch):
    """A crash's zero-filled tail (ext4 delayed allocation) or a preallocated file: the search for
    the next header must not run a CRC at every byte (20 s for 4 MiB in one poll)."""
    recs = records(event_file("hf_nan"))
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    path.write_bytes(b"".join(recs[:10]) + b"\0" * (4 << 20) + b"".join(recs[10:]))
    crcs = []
    real = tfrecord.masked_crc

    def counted(data):
        crcs.append(1)
        assert len(crcs) < 50_000, "a CRC per byte of the zero-filled stretch"
        return real(data)
    monkeypatch.setattr(tfrecord, "masked_crc", counted)
    s = open_stream(str(path))
    samples, polls = [], 0
    while (polls == 0 or s.position.offset < os.path.getsize(path)) and polls < 50:
        samples += s.poll(budget_bytes=1 << 20, now=0.0)  # a budget below the stretch: several polls
        polls += 1
    assert polls > 1 and s.stats.skipped == 1
    assert math.isnan(series(samples, "loss")[HF_NAN_STEP]) and len(series(samples, "loss")) == len(
        series(read(event_file("hf_nan")), "loss"))


def test_start_at_end_skips_the_records_already_there(tmp_path):
    """A week-old NaN in an old run's event file must not page when the watch says start_at_end."""
    recs = records(event_file("hf_nan"))
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    cut = len(recs) - 5
    path.write_bytes(b"".join(recs[:cut]) + recs[cut][:20])  # the NaN step, then a torn record
    s = open_stream(str(path), start_at_end=True)
    assert s.poll(now=0.0) == [] and s.position.offset == len(b"".join(recs[:cut])) and s.position.line == cut
    with open(path, "ab") as f:
        f.write(recs[cut][20:] + b"".join(recs[cut + 1:]))
    rest = s.poll(now=0.0)
    whole = read(event_file("hf_nan"))
    assert rest and [(x.metric, x.step) for x in rest] == [(x.metric, x.step) for x in whole[-len(rest):]]
    assert all(x.step > HF_NAN_STEP for x in rest)
    saved = open_stream(str(path), position=s.position, start_at_end=True)  # a saved offset wins
    assert saved.poll(now=0.0) == [] and saved.position == s.position


def test_start_at_end_reads_an_event_file_that_appears_later_in_full(tmp_path):
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    s = open_stream(str(path), start_at_end=True)
    assert s.poll(now=0.0) == []
    path.write_bytes(event_file("hf_nan").read_bytes())
    assert math.isnan(series(s.poll(now=0.0), "loss")[HF_NAN_STEP])
