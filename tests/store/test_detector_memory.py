"""Detector memory survives a restart: the codec, and Pipeline + StateStore split at every point
of a stream giving exactly the findings of an uninterrupted run."""

from __future__ import annotations

import math
import random
import sqlite3
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np
import pytest

from precision_agent.detectors.base import PerSeries
from precision_agent.store.book import MemoryBook
from precision_agent.store.memory import (CodecError, decode, decode_record, dump_key, encode, encode_record,
                                    load_key)
from precision_agent.detectors.base import slots_of
from precision_agent.model import LOSS, LOSS_SCALE, OVERFLOW, Sample, SourcePos
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import load_rules
from precision_agent.store.state import DB_NAME, StateStore

LABELS = (("job", "gpt"), ("rank", "0"))

RULES = """
groups:
  - name: g
    rules:
      - alert: Decreasing
        kind: loss_scale
        params: {condition: decreases, min_decreases: 3, window: 100, warmup_steps: 10}
        labels: {severity: ticket}
      - alert: Ratio
        kind: loss_scale
        params: {condition: overflow_ratio, window: 60, min_steps: 30, max_overflow_ratio: 0.08, warmup_steps: 0}
        labels: {severity: ticket}
      - alert: Spike
        kind: spike
        params: {window: 10, min_history: 3, min_delta: 0.5}
        labels: {severity: warning}
      - alert: Stuck
        kind: stuck
        params: {window: 20, min_before: 10, min_improvement: 0.05}
        labels: {severity: ticket}
      - alert: Diverging
        kind: divergence
        params: {rises: 3, window: 12, min_delta: 0.5}
        labels: {severity: warning}
      - alert: Zero
        kind: zero_loss
        params: {consecutive: 2}
        labels: {severity: page}
      - alert: Overflows
        kind: overflow
        params: {window: 50, max_overflows: 4, warmup_steps: 0}
        labels: {severity: ticket}
"""


def sample(metric: str, value: float, step: int, **attrs: object) -> Sample:
    return Sample(LABELS, metric, value, step, SourcePos("/l/train.log", step, step * 100), 1000.0 + step,
                  None, tuple(attrs.items()), "megatron")


def stream() -> list[Sample]:
    """A run that exercises every rule above, several times, at scattered steps."""
    rng = random.Random(7)
    out: list[Sample] = []
    scale = 65536.0
    for step in range(1, 241):
        loss = 4.0 - step * 0.01 + rng.uniform(-0.05, 0.05)
        if step in (60, 61):
            loss = 9.0                      # spike
        if 120 <= step <= 160:
            loss = 2.8 + rng.uniform(-0.02, 0.02)  # stuck plateau
        if 170 <= step <= 176:
            loss = 3.0 + (step - 170) * 0.4  # divergence
        if step in (190, 191, 192):
            loss = 0.0                      # zero loss
        out.append(sample(LOSS, loss, step))
        if step in (30, 45, 52, 200, 204, 209, 213, 230):
            scale /= 2                      # back-offs: collapses at 52 and 209, recovery at 100 and 230
            out.append(sample(OVERFLOW, 1.0, step))
        if step in (100, 220):
            scale *= 4
        if 70 <= step <= 110 and step % 6 == 0 or 195 <= step <= 215 and step % 3 == 0:
            out.append(sample(OVERFLOW, 1.0, step))
        if step % 5 == 0 or step in (30, 45, 52, 100, 200, 204, 209, 213, 220, 230):
            out.append(sample(LOSS_SCALE, scale, step))
    return out


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    d = tmp_path / "rules"
    d.mkdir()
    (d / "r.yml").write_text(RULES)
    return d


def outcome(p: Pipeline, findings: list) -> tuple[list, dict]:
    return ([(f.rule, f.step, f.summary) for f in findings],
            {a.rule: a.state.value for a in p.alerts.alerts.values()})


def restarted(rules_dir: Path, state: Path, samples: list[Sample], split: int) -> tuple[list, dict]:
    """Process ``samples[:split]``, commit as the daemon does, restart from the store, process the rest."""
    p1 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    findings = p1.process(samples[:split])
    store = StateStore(state)
    store.commit(alerts=list(p1.alerts.alerts.values()), deleted_alerts=p1.alerts.deleted,
                 series=list(p1.series.values()), memory=p1.memory_delta())
    store.close()
    store = StateStore(state)
    p2 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    p2.alerts.load(store.load_alerts())
    for st in store.load_series():
        p2.series[st.labels] = st
    p2.restore_memory(store.load_memory(), 0.0)
    store.close()
    assert p2.memory.errors == []
    findings += p2.process(samples[split:])
    return outcome(p2, findings)


def test_a_restart_anywhere_gives_the_findings_of_an_uninterrupted_run(rules_dir, tmp_path):
    samples = stream()
    p = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    expected = outcome(p, p.process(samples))
    fired = {r for r, _, _ in expected[0]}
    assert fired == {"Decreasing", "Ratio", "Spike", "Stuck", "Diverging", "Zero", "Overflows"}, expected
    for split in range(1, len(samples), 7):
        got = restarted(rules_dir, tmp_path / f"s{split}", samples, split)
        assert got == expected, f"restart after sample {split} ({samples[split - 1].step})"


def test_without_memory_a_restart_changes_what_is_found(rules_dir, tmp_path):
    """The property above is not vacuous: dropping the memory rows changes the outcome."""
    samples = stream()
    p = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    expected = outcome(p, p.process(samples))
    differs = 0
    for split in range(1, len(samples), 7):
        p1 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
        findings = p1.process(samples[:split])
        p2 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
        p2.alerts.load(list(p1.alerts.alerts.values()))
        p2.series.update(p1.series)
        findings += p2.process(samples[split:])
        differs += outcome(p2, findings) != expected
    assert differs > 10


def test_overflow_ratio_and_spike_windows_span_the_restart(rules_dir, tmp_path):
    """Overflows before and after the restart add up to one ratio alert; a spike right after the
    restart is judged against the history before it."""
    before = [sample(LOSS, 2.0 + 0.01 * (s % 3), s) for s in range(1, 41)]
    before += [sample(OVERFLOW, 1.0, s) for s in (33, 36, 39)]
    before.sort(key=lambda x: x.step)
    after = [sample(LOSS, 9.0, 41)] + [sample(OVERFLOW, 1.0, 41)] + [sample(LOSS, 2.0, 42)]
    _, alerts = restarted(rules_dir, tmp_path / "st", before + after, len(before))
    assert alerts.get("Spike") == "firing" and alerts.get("Ratio") == "firing"
    p = Pipeline(load_rules([rules_dir]), memory=MemoryBook())  # no restart: the same
    assert outcome(p, p.process(before + after))[1] == alerts


def test_edited_rule_starts_empty_and_removed_rule_rows_are_deleted(rules_dir, tmp_path):
    samples = [s for s in stream() if s.step <= 50]  # two of the three back-offs of the first collapse
    p1 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    p1.process(samples)
    store = StateStore(tmp_path / "st")
    store.commit(memory=p1.memory_delta())
    rules_of = {r[0].rsplit("|", 1)[1] for r in store.load_memory()}
    assert {"Decreasing", "Spike", "Ratio"} <= rules_of
    (rules_dir / "r.yml").write_text(RULES.replace("window: 100,", "window: 90,")
                                     .replace("      - alert: Zero\n", "      - alert: Gone\n"))
    p2 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    p2.restore_memory(store.load_memory(), 0.0)
    dec = next(r for r in p2.rules.rules if r.name == "Decreasing").detector
    spike = next(r for r in p2.rules.rules if r.name == "Spike").detector
    assert len(dec._tracks) == 0 and len(spike._tracks) == 1  # edited: empty; untouched: restored
    store.commit(memory=p2.memory_delta())
    rules_now = {r[0].rsplit("|", 1)[1] for r in store.load_memory()}
    assert "Decreasing" not in rules_now and "Zero" not in rules_now and "Spike" in rules_now
    store.close()


def test_corrupt_row_empties_that_rule_only_and_is_reported(rules_dir, tmp_path):
    samples = [s for s in stream() if s.step <= 50]
    p1 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    p1.process(samples)
    store = StateStore(tmp_path / "st")
    store.commit(memory=p1.memory_delta())
    store.db.execute("UPDATE memory SET data='{\"values\": {\"$zz\": 1}}' WHERE rule LIKE '%|Spike'")
    store.db.execute("UPDATE memory SET data='{\"last\": \"a string\"}' WHERE rule LIKE '%|Decreasing'")
    p2 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    p2.restore_memory(store.load_memory(), 0.0)
    assert p2.memory.errors == [] and len(p2.memory.bad_rows) == 2  # handed to the store to quarantine
    assert sorted(row[0].rsplit("|", 1)[1] for row, _ in p2.memory.bad_rows) == ["Decreasing", "Spike"]
    for row, why in p2.memory.bad_rows:
        store.quarantine("memory", row, why)
    by = {r.name: r.detector for r in p2.rules.rules}
    assert len(by["Spike"]._tracks) == 0 and len(by["Decreasing"]._tracks) == 0
    assert len(by["Ratio"]._tracks) == 1 and len(by["Stuck"]._tracks) == 1
    p2.process([sample(LOSS, 2.0, 51)])  # the emptied rules work
    store.commit(memory=p2.memory_delta())  # and their bad rows are gone
    p3 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    p3.restore_memory(store.load_memory(), 0.0)
    assert p3.memory.errors == [] and p3.memory.bad_rows == []
    assert store.db.execute("SELECT count(*) FROM quarantine WHERE tbl='memory'").fetchone()[0] == 2
    store.close()


def test_store_from_before_the_memory_table_is_migrated(tmp_path):
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE offsets (path TEXT PRIMARY KEY, dev INTEGER NOT NULL, ino INTEGER NOT NULL,
            offset INTEGER NOT NULL, line INTEGER NOT NULL, updated REAL NOT NULL);
        INSERT INTO offsets VALUES ('/x.log', 1, 2, 30, 4, 0);""")
    db.commit()
    db.close()
    errors: list[str] = []
    store = StateStore(tmp_path, errors.append)
    try:
        assert errors == [] and store.moved_aside is None
        assert store.load_offsets()["/x.log"].offset == 30 and store.load_memory() == []
    finally:
        store.close()


def test_memory_rows_follow_evictions_and_stay_bounded(tmp_path):
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    (rules_dir / "r.yml").write_text(RULES)
    p = Pipeline(load_rules([rules_dir]), max_series=5000, memory=MemoryBook())
    spike = next(r for r in p.rules.rules if r.name == "Spike").detector
    spike._tracks._cap = 50
    store = StateStore(tmp_path / "st")
    for run in range(120):  # more series than the cap, in several commits
        p.process([Sample((("run", str(run)),), LOSS, 2.0, 1, SourcePos("/a", 1), 1.0)])
        if run % 7 == 0:
            store.commit(memory=p.memory_delta())
    store.commit(memory=p.memory_delta())
    rows = [r for r in store.load_memory() if r[0].endswith("|Spike")]
    assert len(rows) == 50 and {r[2] for r in rows} == {f'[["run","{i}"]]' for i in range(70, 120)}
    store.close()


def test_codec_round_trips_memory_shapes():
    sp = SourcePos("/a/b.log", 7, 99)
    s = Sample(LABELS, LOSS, math.nan, 3, sp, 1.5, None, (("frm", 8.0), ("sketch", np.arange(4.0))), "hf")
    value = {"q": deque([(1, 2.5), (None, 1)], maxlen=5), "o": OrderedDict([((("a", "b"),), 1)]),
             "f": [math.inf, -math.inf, 0.1], "p": sp, "t": (1, "x", None, True), "$k": {1: "int key"}}
    back = decode(encode(value))
    assert back["q"] == value["q"] and back["q"].maxlen == 5 and back["o"] == value["o"]
    assert back["f"] == value["f"] and back["p"] == sp and back["t"] == value["t"] and back["$k"] == {1: "int key"}
    s2 = decode(encode(s))
    assert (s2.labels, s2.metric, s2.step, s2.source, s2.producer) == (s.labels, LOSS, 3, sp, "hf")
    assert math.isnan(s2.value) and np.array_equal(s2.attr("sketch"), np.arange(4.0))


@pytest.mark.parametrize("data", [
    {"$zz": 1}, {"$f": "1e400"}, {"$q": [], "n": -1}, {"$o": [[[1, 2], 3]]}, {"$p": ["/a", "1", 0]},
    {"$a": "|O", "shape": [1], "b": ""}, {"$a": "<f8", "shape": [3], "b": "AAAA"}, {"$s": {"labels": 1}},
])
def test_codec_rejects_what_it_did_not_write(data):
    with pytest.raises(CodecError):
        decode(data)


def test_codec_refuses_unknown_objects_and_records_check_types():
    with pytest.raises(CodecError):
        encode(object())
    from precision_agent.detectors.loss_scale import _Track
    with pytest.raises(CodecError):
        decode_record(_Track, {"decreases": "1, 2"})  # a string where a list belongs
    # a window written by an earlier version as a deque comes back as the list the track keeps now
    old = decode_record(_Track, {"decreases": {"$qt": [[3, 1], [None, 2]], "n": None}})
    assert old.decreases == [(3, 1), (None, 2)] and type(old.decreases) is list
    assert decode(encode([(3, 1.5), (4, 2)])) == [(3, 1.5), (4, 2)]
    t = decode_record(_Track, {"last": 4, "warm": False, "unknown_field": 1})
    assert t.last == 4 and t.warm is False and not hasattr(t, "unknown_field")


def test_per_series_notes_changes_and_drops_within_its_cap():
    ps: PerSeries[list] = PerSeries(list, cap=3)
    for i in range(5):
        ps.get(((str(i), "x"),))
    assert ps.changed == {(("2", "x"),), (("3", "x"),), (("4", "x"),)}
    assert ps.removed == {(("0", "x"),), (("1", "x"),)}
    ps.persisted()
    for i in range(5, 12):
        ps.get(((str(i), "x"),))
    assert ps.reset and not ps.removed  # more drops than the cap: one full rewrite instead


def test_tensor_kinds_restore_their_explicit_state():
    """weight_not_changed remembers each weight (stats + sketch) as one keyed row and the step's
    open group through state()/restore(), as data: a restart between two dumped steps still
    compares them."""
    from precision_agent.detectors.tensor_change import NotChangedParams, WeightNotChangedDetector
    from precision_agent.dumps.watchpoints import DUMP_TENSOR, STEP_END
    from precision_agent.store.memory import dumps, loads
    from precision_agent.series.state import SeriesState

    def weight(step: int, name: str) -> Sample:
        attrs = (("tensor", name), ("role", "weight"), ("fn", ""), ("bias", False), ("count", 8), ("min", -1.0),
                 ("max", 1.0), ("mean", 0.0), ("l2norm", 2.0), ("sketch", np.linspace(-1, 1, 8)), ("step", step))
        return Sample(LABELS, DUMP_TENSOR, 0.0, None, SourcePos(f"/d/step{step}", 0), float(step), None, attrs)

    end = [Sample(LABELS, DUMP_TENSOR, 0.0, None, SourcePos(f"/d/step{s}", 0), float(s), None,
                  (("event", STEP_END), ("step", s))) for s in (1, 2)]
    series = SeriesState(LABELS)
    feed = [weight(1, "fc.weight"), weight(1, "fc2.weight"), end[0], weight(2, "fc.weight"), weight(2, "fc2.weight"),
            end[1]]
    whole = WeightNotChangedDetector(NotChangedParams())
    expected = [h for h in (whole.observe(s, series) for s in feed) if h is not None]
    assert len(expected) == 1 and expected[0].evidence["offenders"] == 2
    for split in range(1, len(feed)):
        first = WeightNotChangedDetector(NotChangedParams())
        got = [h for h in (first.observe(s, series) for s in feed[:split]) if h is not None]
        assert first.memory_dirty
        again = WeightNotChangedDetector(NotChangedParams())
        again.restore(decode(loads(dumps(encode(first.state())))))  # the step's open group
        for slot, ps in slots_of(first).items():  # the weights: one row each, as the book stores them
            for key, value in ps.items():
                row = dumps(encode_record(ps.factory, value))
                slots_of(again)[slot].restore(load_key(dump_key(key)), decode_record(ps.factory, loads(row)))
        got += [h for h in (again.observe(s, series) for s in feed[split:]) if h is not None]
        assert [(h.labels, h.evidence, h.step) for h in got] == [(h.labels, h.evidence, h.step) for h in expected]


def test_keep_firing_for_wait_survives_a_restart(tmp_path):
    """A stateful alert whose condition cleared waits keep_firing_for; a restart in that wait must
    still resolve it (the alert book's clear times are persisted with the memory)."""
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    (rules_dir / "r.yml").write_text(RULES.replace("        params: {condition: decreases",
                                                   "        keep_firing_for: 60s\n        params: {condition: decreases"))
    samples = [s for s in stream() if s.step <= 100]  # the collapse, then the recovery at 100
    p1 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    p1.process(samples)
    (dec,) = [a for a in p1.alerts.alerts.values() if a.rule == "Decreasing"]
    assert dec.state.value == "firing" and p1.alerts.cleared_since()
    store = StateStore(tmp_path / "st")
    store.commit(alerts=list(p1.alerts.alerts.values()), memory=p1.memory_delta())
    p2 = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    p2.alerts.load(store.load_alerts())
    p2.restore_memory(store.load_memory(), 0.0)
    store.close()
    p2.tick(1100.0 + 61)
    (dec,) = [a for a in p2.alerts.alerts.values() if a.rule == "Decreasing"]
    assert dec.state.value == "resolved"


def test_memory_touched_but_unchanged_writes_nothing(tmp_path):
    """The stalled rule's tick looks up its track every evaluation interval: with no new record,
    the rows would be the same, so there is nothing to commit (an idle agent must not write and
    fsync its database every few seconds); a new record, or a failed commit, writes again."""
    d = tmp_path / "rules"
    d.mkdir()
    (d / "r.yml").write_text("groups:\n  - name: g\n    rules:\n      - alert: Stalled\n        kind: stalled\n"
                             "        params: {after: 600, progress: step}\n        labels: {severity: ticket}\n")
    p = Pipeline(load_rules([d]), memory=MemoryBook())
    p.process([sample(LOSS, 3.0, 1)])
    p.tick(1001.0)
    first = p.memory_delta()
    assert first.upserts, "the first commit stores the stalled track"
    for now in (1004.0, 1007.0, 1010.0):
        p.tick(now)
        assert not p.memory_delta(), f"tick at {now} rewrote unchanged memory"
    p.process([sample(LOSS, 2.9, 2)])
    p.tick(1013.0)
    changed = p.memory_delta()
    assert [u[1:3] for u in changed.upserts] == [u[1:3] for u in first.upserts]
    p.memory.requeue(changed)  # the commit failed: everything is written again
    p.tick(1016.0)
    assert p.memory_delta().upserts


def test_weight_memory_is_written_per_changed_weight(tmp_path):
    """Weights are remembered as one row each: a dump that updates one weight writes that row
    (plus the small open-group state), not every weight's stats and sketch again."""
    from precision_agent.dumps.watchpoints import DUMP_TENSOR

    d = tmp_path / "rules"
    d.mkdir()
    (d / "r.yml").write_text("groups:\n  - name: g\n    rules:\n      - alert: WNC\n        kind: weight_not_changed\n"
                             "        labels: {severity: ticket}\n")
    p = Pipeline(load_rules([d]), memory=MemoryBook())

    def weight(step: int, name: str) -> Sample:
        attrs = (("tensor", name), ("role", "weight"), ("fn", ""), ("bias", False), ("count", 8), ("min", -1.0),
                 ("max", 1.0), ("mean", 0.0), ("l2norm", 2.0), ("sketch", np.linspace(-1, 1, 8)), ("step", step))
        return Sample(LABELS, DUMP_TENSOR, 0.0, None, SourcePos(f"/d/step{step}", 0), float(step), None, attrs)

    p.process([weight(1, f"layer{i}.weight") for i in range(50)])
    first = p.memory_delta()
    assert sum(1 for u in first.upserts if u[1] == "_prev") == 50
    p.process([weight(2, "layer7.weight")])
    second = p.memory_delta()
    rows = [u for u in second.upserts if u[1] == "_prev"]
    assert len(rows) == 1 and "layer7.weight" in rows[0][2]
    assert sum(len(u[4]) for u in second.upserts) < sum(len(u[4]) for u in first.upserts) / 5


def test_an_edited_rule_stores_its_memory_again(rules_dir, tmp_path):
    """After an edit the old rows are pruned; a record equal to one written before the edit must
    still be written under the new rule (nothing is skipped as 'unchanged')."""
    p = Pipeline(load_rules([rules_dir]), memory=MemoryBook())
    p.process([sample(LOSS, 3.0, 1)])
    before = {(u[0], u[1], u[2]): u[4] for u in p.memory_delta().upserts}
    assert before
    (rules_dir / "r.yml").write_text(RULES.replace("window: 20, min_before: 10", "window: 21, min_before: 10"))
    p.set_rules(load_rules([rules_dir]))
    p.process([sample(LOSS, 3.0, 1)])  # the same record again: the Stuck rule's track is as before
    after = p.memory_delta()
    stuck = [u for u in after.upserts if "Stuck" in u[0]]
    assert stuck, "the edited rule's memory was not written again"


@pytest.mark.parametrize("field, bad", [
    ("step", "3"), ("step", 2.5), ("time", "now"), ("log_time", [1]), ("producer", 7),
    ("labels", ((("job", 1),))), ("attrs", (((1, 2),))), ("value", True),
])
def test_restored_samples_are_checked_field_by_field(field, bad):
    """A row edited or corrupted on disk fails at restore (where it is counted and that rule
    starts empty), not later inside a detector."""
    s = Sample(LABELS, LOSS, 1.0, 3, SourcePos("/a.log", 1, 0), 1.5, None, (), "hf")
    assert decode(encode(s)) == s
    body = encode(s)
    inner = body["$s"]
    inner[field] = encode(bad)
    with pytest.raises(CodecError):
        decode(body)
