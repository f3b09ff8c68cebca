"""The pipeline reaches the same findings, alerts and series state whatever the batches it is
handed: one call for a whole backlog (catch-up), or many small ones that cut records apart (a
followed file read as it grows). Its hot loop takes shortcuts per series and per record
(rule tables, rules that need one sample of a record): none of them may change an answer."""

import json
import math
import random
import time

import pytest

from conftest import CORPUS
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import default_rules_dir, load_rules
from precision_agent.model import Sample, SourcePos, json_safe
from precision_agent.readers.logstream import LogStream

RULES = load_rules([default_rules_dir()])
TICK_EVERY = 97  # samples between evaluation ticks (ticks=True)


def _line(it, loss, scale, gn, skipped=0, nan=0):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(1_700_000_000 + it))
    ls = "nan" if math.isnan(loss) else f"{loss:.6E}"
    g = "nan" if math.isnan(gn) else f"{gn:.3f}"
    return (f" [{stamp}] iteration {it:8d}/  100000 | consumed samples: {it * 256:12d} |"
            f" elapsed time per iteration (ms): 412.3 | learning rate: 3.000000E-04 |"
            f" global batch size:   256 | lm loss: {ls} | loss scale: {scale:.1f} | grad norm: {g} |"
            f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} |\n")


def write_log(path, seed):
    """A Megatron backlog that goes through every condition the shipped rules judge: a falling
    loss, a plateau, a divergence, spikes, zero and NaN losses, NaN grad norms, loss-scale
    back-offs down to the floor and a collapse, copies of a line, restarts from a checkpoint."""
    rnd = random.Random(seed)
    scale, loss, it, restarts = 2.0 ** 16, 8.0, 1, 0
    with open(path, "w") as f:
        while it < 1400:
            phase, r = (it // 80) % 8, rnd.random()
            if phase == 0:
                loss = max(0.5, loss * 0.995 + rnd.gauss(0, 0.02))
            elif phase == 1:
                loss += rnd.gauss(0, 0.001)
            elif phase == 2:
                loss *= 1.01
            elif phase == 3:
                loss = loss * (3 if r < 0.02 else 1) + rnd.gauss(0, 0.05)
            elif phase == 4:
                loss = 0.0 if r < 0.3 else abs(loss) + 1
            elif phase == 5:
                loss = math.nan if r < 0.05 else 5 + rnd.gauss(0, 0.1)
            else:
                loss = 4 + rnd.gauss(0, 0.1)
            skipped = 0
            if phase in (5, 6) and r < 0.3:
                scale, skipped = max(1.0, scale / 2), 1
            elif r > 0.99:
                scale *= 2
            if phase == 7 and r < 0.1:
                scale = max(0.5, scale / 16)
            gn = math.nan if phase == 5 and r < 0.1 else abs(rnd.gauss(2, 1))
            text = _line(it, loss, scale, gn, skipped, 1 if phase == 6 and r < 0.01 else 0)
            f.write(text)
            if r < 0.01:
                f.write(text)  # another rank's copy
            if it % 10 == 0:
                f.write(" time (ms) | forward-compute: 1523.4 | backward-compute: 3120.7 |\n")
            if r < 0.004 and it > 400 and restarts < 3:
                it, restarts = it - 200, restarts + 1  # a restart from a checkpoint
            it += 1


def samples_of(path, labels):
    stream = LogStream(str(path), labels)
    try:
        return stream.finish(now=0.0)
    finally:
        stream.close()


def outcome(samples, batches, ticks=False):
    """Everything the pipeline concluded, as comparable data, after feeding ``samples`` in
    batches of the sizes ``batches`` yields (with evaluation ticks between them if ``ticks``)."""
    p = Pipeline(RULES.fresh(), keep_findings=10 ** 9)
    findings, i, now = [], 0, 1000.0
    rnd = random.Random(5)
    if ticks:  # wall-clock times with silences long enough to stall, the same for every batching
        for s in samples:
            s.time, now = now, now + rnd.choice((1.0, 1.0, 1.0, 30.0, 700.0))
    while i < len(samples):
        n = min(next(batches), len(samples) - i)
        if ticks:  # the ticks come at the same samples whatever the batches: every TICK_EVERY
            n = min(n, TICK_EVERY - i % TICK_EVERY)
        findings += p.process(samples[i:i + n])
        i += n
        if ticks and i % TICK_EVERY == 0:
            p.tick(samples[i - 1].time + 650.0)
    p.tick(now + 1e6)
    dump = lambda x: json.dumps(json_safe(x), sort_keys=True, default=str)  # noqa: E731
    return {"findings": [dump(f.to_json()) for f in findings],
            "alerts": sorted(dump(a.to_json()) for a in p.alerts.alerts.values()),
            "series": sorted(dump(st.to_dict(context=True)) for st in p.series.values()),
            "totals": p.findings_total, "errors": p.errors}


def whole(n):
    while True:
        yield n


def small(seed):
    rnd = random.Random(seed)
    while True:
        yield rnd.randint(1, 7)  # cuts records (4 values each) anywhere


@pytest.mark.parametrize("ticks", [False, True])
@pytest.mark.parametrize("turn", [40, 900])  # runs of one series too short to plan, and long ones (catchup.py)
def test_one_batch_and_many_small_batches_agree(tmp_path, ticks, turn):
    a, b = tmp_path / "rank0.log", tmp_path / "rank1.log"
    write_log(a, 1)
    write_log(b, 2)
    # two series whose records interleave, as two files of one job read in turn
    sa, sb = samples_of(a, {"job": "j", "rank": "0"}), samples_of(b, {"job": "j", "rank": "1"})
    samples, i = [], 0
    while i < max(len(sa), len(sb)):
        samples += sa[i:i + turn] + sb[i:i + turn]
        i += turn
    assert len(samples) > 12_000
    one = outcome(samples, whole(len(samples)), ticks)
    rules = {json.loads(f)["rule"] for f in one["findings"]}
    # the log makes the shipped rules speak: a comparison of silences would prove nothing
    assert {"TrainingNonFinite", "TrainingLossSpike", "TrainingLossDivergence", "TrainingLossStuck",
            "TrainingLossZero", "LossScaleAtFloor", "LossScaleCollapse", "TrainingOverflowSteps"} <= rules
    assert not one["errors"]
    for seed in (1, 2):
        assert outcome(samples, small(seed), ticks) == one
    assert outcome(samples, whole(1), ticks) == one  # a sample at a time


def corpus_logs():
    logs = CORPUS / "logs"
    if not logs.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason="shared corpus absent"))]
    return sorted(p.name for p in logs.glob("*.log"))


@pytest.mark.corpus
@pytest.mark.parametrize("name", corpus_logs())
def test_real_logs_agree_in_any_batches(name):
    samples = samples_of(CORPUS / "logs" / name, {"job": "j"})
    one = outcome(samples, whole(max(1, len(samples))))
    assert outcome(samples, small(3)) == one
    assert outcome(samples, whole(1)) == one


def steady_backlog(tmp_path, lines):
    """The samples of a healthy Megatron backlog: a slowly falling loss, a steady scale."""
    path = tmp_path / "steady.log"
    with open(path, "w") as f:
        for it in range(1, lines + 1):
            f.write(_line(it, 6.5 - it * 1e-4, 65536.0, 2.5))
    return samples_of(path, {"job": "j"})


def test_a_steady_backlog_is_judged_in_bulk(tmp_path):
    """Catching up on a healthy backlog, every rule's plan covers whole runs once its memory is
    warm (a rule that always observed would make catch-up slow, not wrong: this guards the speed
    the bench measures), and the answers still equal those of one sample at a time."""
    samples = steady_backlog(tmp_path, 6000)
    rules = RULES.fresh()
    plans: dict[str, list[tuple[int, int]]] = {}
    for rule in rules.rules:
        def traced(labels, run, metrics, plan=rule.detector.plan, name=rule.name):
            at = plan(labels, run, metrics)
            plans.setdefault(name, []).append((at, run.n))
            return at
        rule.detector.plan = traced
    p = Pipeline(rules, keep_findings=10 ** 9)
    p.process(samples)
    judged = {"TrainingNonFinite", "TrainingStalled", "LossScaleOverflowRatio", "TrainingLossSpike",
              "TrainingLossDivergence", "TrainingLossStuck", "TrainingLossZero", "LossScaleAtFloor",
              "LossScaleCollapse", "LossScaleDecreasing", "LossScaleJump"}
    assert judged <= set(plans)
    for name in judged:
        runs = plans[name]
        assert len(runs) >= 4
        assert all(at == n for at, n in runs[2:]), (name, runs)  # past warm-up: the whole run in bulk
    assert outcome(samples, whole(len(samples))) == outcome(samples, whole(1))


def test_rule_matchers_still_choose_the_series_when_tables_are_shared(tmp_path):
    """Series that pass the same label matchers share a rule table (a followed file costs no
    table of its own); a rule that matches some series only must still judge those alone."""
    (tmp_path / "r.yml").write_text("""
groups:
  - name: g
    rules:
      - alert: GptNaN
        kind: nonfinite
        match: {labels: {run: 'gpt-.*'}}
        for: 0s
        labels: {severity: page}
        annotations: {summary: x}
""")
    p = Pipeline(load_rules([tmp_path]).fresh(), keep_findings=100)
    found = []
    for run in ("gpt-1", "bert-1", "gpt-2", "bert-2"):
        labels = (("job", "j"), ("run", run))
        found += [(f.rule, dict(f.labels)["run"]) for f in p.process(
            [Sample(labels, "loss", math.nan, 5, SourcePos("/x.log", 1))])]
    assert found == [("GptNaN", "gpt-1"), ("GptNaN", "gpt-2")]
    assert len({id(t) for t in p._tables.values()}) == 2  # one table per set of matchers passed


def test_a_rule_whose_observe_was_replaced_observes_every_sample(tmp_path):
    """A plan speaks for its kind's own ``observe``: replaced on the instance (a wrapper, a
    probe), the rule is asked for every sample of a backlog, as one sample at a time would."""
    samples = steady_backlog(tmp_path, 300)
    rules = RULES.fresh()
    (spike,) = rules.rule("TrainingLossSpike")
    seen = []
    spike.detector.observe = lambda sample, series: seen.append(sample.step)
    Pipeline(rules).process(samples)
    assert seen == list(range(1, 301))
