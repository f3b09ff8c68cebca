"""Differential test of the catch-up path (agent/engine/catchup.py): a backlog handed to
``Pipeline.process`` in one call (long runs of one series: each rule's ``Detector.plan`` leaves
it out of the per-sample loop, ``absorb`` takes the skipped samples in) must conclude exactly
what the same samples conclude handed over one at a time (the per-sample path): the same
findings, alerts, series state and detector memory as the store would save it.

The samples are random (seeded) and made to reach every corner a plan must not skip: NaN/Inf,
-0.0, huge and fp16-extreme values, integers, zeros, plateaus, rises, spikes, loss-scale
back-offs to the floor and growth, skip counters, duplicated records, steps that go back
(restarts), copies of a series, time gaps (stalled), and rules with random parameters."""

import json
import math
import random

import pytest

from precision_agent.detectors.base import explicit, slots_of
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import default_rules_dir, load_rules
from precision_agent.model import Sample, SourcePos, json_safe
from precision_agent.store.book import MemoryBook
from precision_agent.store.memory import dump_key, dumps, encode, encode_record
from precision_agent.store.state import StateStore

SHIPPED = load_rules([default_rules_dir()])
TICK_EVERY = 173  # samples between evaluation ticks, the same in both feeds


def _rule(name, kind, params):
    return {"alert": name, "kind": kind, "params": params, "for": "0s", "labels": {"severity": "page"},
            "annotations": {"summary": "x"}}


def random_rules(rnd: random.Random, path):
    """A rule file of every kind that plans, with random (valid) parameters."""
    metric = rnd.choice(["loss", "eval_loss"])
    rules = [
        _rule("Nf", "nonfinite", {
            "metrics": rnd.sample(["loss", "grad_norm", "eval_loss", "loss_scale", "nonfinite_message"],
                                  rnd.randint(1, 5)),
            "grad_norm_persist": rnd.randint(1, 4), "grad_norm_warmup": rnd.choice([0, 1, 5, 16, 40]),
            "hidden_nan_loss": rnd.random() < 0.7}),
        _rule("Sp", "spike", {"metric": rnd.choice(["loss", "grad_norm", "eval_loss"]),
                              "window": rnd.randint(1, 30), "min_history": rnd.randint(1, 12),
                              "ratio": rnd.choice([1.01, 1.3, 2.0]), "min_delta": rnd.choice([0.0, 0.1, 1.0, 3.0]),
                              "k": rnd.choice([0.0, 2.0, 6.0]), "single_factor": rnd.choice([1.0, 2.0, 5.0])}),
        _rule("Dv", "divergence", {"metric": metric, "rises": rnd.randint(1, 6),
                                   "window": rnd.choice([0, 6, 7, 30, 45]),
                                   "min_rise": rnd.choice([0.0, 0.05, 0.2]), "min_delta": rnd.choice([0.0, 0.2, 1.0])}),
        _rule("St", "stuck", {"metric": rnd.choice(["loss", "eval_loss", "loss"]), "window": rnd.randint(2, 25),
                              "min_before": rnd.randint(1, 12),
                              "min_improvement": rnd.choice([0.0, 0.001, 0.01, 0.3])}),
        _rule("Zl", "zero_loss", {"metrics": rnd.choice([["loss"], ["eval_loss"], ["loss", "eval_loss"]]),
                                  "consecutive": rnd.randint(1, 4), "tolerance": rnd.choice([0.0, 0.0, 1e-3])}),
        _rule("Sl", "stalled", {"after": rnd.choice([5, 60, 600]), "progress": rnd.choice(["record", "step"]),
                                "expire_after": rnd.choice([0, 100, 3600])}),
    ]
    for i, cond in enumerate(["floor", "decreases", "overflow_ratio", "jump", "collapse"]):
        rules.append(_rule(f"Ls{i}", "loss_scale", {
            "condition": cond, "floor": rnd.choice(["auto", 1.0, 0.0, 4.0]),
            "collapse_below": rnd.choice(["auto", 8.0, 1024.0]), "min_backoffs": rnd.randint(1, 4),
            "window": rnd.choice([1, 10, 200, 2000]), "warmup_steps": rnd.choice([0, 5, 200]),
            "min_decreases": rnd.randint(1, 4), "max_overflow_ratio": rnd.choice([0.0, 0.05, 0.5]),
            "min_steps": rnd.choice([1, 10, 100]), "jump_tolerance": rnd.choice([1.0, 1.25, 4.0]),
            "jump_reports": rnd.random() < 0.5, "decrease_factor": rnd.choice([0.5, 0.25])}))
    (path / "r.yml").write_text(json.dumps({"groups": [{"name": "g", "rules": rules}]}))  # JSON is YAML
    rs = load_rules([path])
    assert not rs.errors, rs.errors
    return rs


SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 65504.0, -65504.0, 1e300, -1e300, 1.7e308, -1.7e308, 5e-324,
           3, 0, 1]


def value(rnd, mode, base, t):
    if mode == "steady":
        return base + rnd.gauss(0, 0.01)
    if mode == "fall":
        return base * (1 - 0.002 * t) + rnd.gauss(0, 0.001)
    if mode == "rise":
        return base * (1 + 0.05 * t)
    if mode == "spikes":
        return base * (rnd.choice([3, 10, 100]) if rnd.random() < 0.1 else 1) + rnd.gauss(0, 0.05)
    if mode == "nonfinite":
        return rnd.choice([math.nan, math.inf, -math.inf]) if rnd.random() < 0.2 else base
    if mode == "zeros":
        return rnd.choice([0.0, -0.0, 0.0, 1e-4, base]) if rnd.random() < 0.7 else base
    if mode == "const":
        return base
    if mode == "special":
        return rnd.choice(SPECIAL) if rnd.random() < 0.3 else base
    if mode == "ints":
        return int(base) + rnd.randint(0, 2)
    if mode == "edge":  # exactly at the shipped thresholds (min_delta 1.0, a 1 % improvement)
        return rnd.choice([base, base + 1.0, base + 2.0, base - 1.0, base * 0.99, base * 1.01, base * 1.2])
    return base + rnd.uniform(-1, 1) * 0.001 * t  # "hair": close to the thresholds


MODES = ["steady", "fall", "rise", "spikes", "nonfinite", "zeros", "const", "special", "ints", "edge", "hair"]


class Series:
    """One series of records: a random walk of modes, steps and a loss scale."""

    def __init__(self, rnd: random.Random, labels, producer: str):
        self.rnd, self.labels, self.producer = rnd, labels, producer
        self.step, self.line, self.scale = rnd.randint(0, 5), 0, 2.0 ** 16
        self.base = rnd.choice([8.0, 2.5, 0.5, 100.0])
        self.mode, self.left, self.t = "steady", 0, 0
        self.floor = rnd.choice([1.0, 1e-4, 0.5])
        self.metrics = rnd.sample(["grad_norm", "loss_scale", "skipped_in_interval", "eval_loss", "lr"],
                                  rnd.randint(0, 5))

    def record(self, now: float) -> list[Sample]:
        rnd = self.rnd
        if self.left <= 0:
            self.mode, self.left, self.t = rnd.choice(MODES), rnd.randint(3, 160), 0
            if rnd.random() < 0.3:
                self.base = rnd.choice([8.0, 2.5, 0.5, 1e-3, 65504.0, 3.0])
        self.left -= 1
        self.t += 1
        r = rnd.random()
        if r < 0.02:
            self.step = max(0, self.step - rnd.randint(1, 300))  # a restart from a checkpoint
        elif r < 0.05:
            pass  # the same step again (another value of it, or a copy)
        elif r < 0.1:
            self.step += rnd.randint(2, 50)  # steps not logged
        else:
            self.step += 1
        self.line += 1
        src = SourcePos("/logs/" + "-".join(v for _, v in self.labels) + ".log", self.line)
        if rnd.random() < 0.03:
            src = SourcePos(src.path, self.line - 1)  # a copy of the last line
        skipped = 0
        if self.mode in ("nonfinite", "special", "spikes") and rnd.random() < 0.4 or rnd.random() < 0.05:
            self.scale, skipped = max(self.floor, self.scale / rnd.choice([2, 2, 2, 16])), 1
        elif rnd.random() < 0.05:
            self.scale *= 2
        elif rnd.random() < 0.01:
            self.scale = rnd.choice([self.floor, 1.0, 2.0 ** 24, math.nan, 0.0])
        step = None if rnd.random() < 0.01 else self.step
        mk = lambda m, v, **kw: Sample(self.labels, m, v, step, src, now, None, kw.get("attrs", ()),  # noqa: E731
                                       self.producer)
        out = [mk("loss", value(rnd, self.mode, self.base, self.t))]
        for m in self.metrics:
            if m == "grad_norm":
                out.append(mk(m, value(rnd, self.mode if rnd.random() < 0.5 else "steady", 2.0, self.t)))
            elif m == "loss_scale":
                out.append(mk(m, self.scale))
            elif m == "skipped_in_interval":
                out.append(mk(m, float(skipped + (rnd.randint(1, 3) if rnd.random() < 0.02 else 0))))
            elif m == "eval_loss" and rnd.random() < 0.3:
                out.append(mk(m, value(rnd, self.mode, self.base, self.t)))
            elif m == "lr":
                out.append(mk(m, rnd.choice([3e-4, 3e-4, 0.0, math.nan])))
        if rnd.random() < 0.005:
            out.append(mk("nonfinite_message", 1.0))
        if rnd.random() < 0.01:
            out.append(mk("overflow", 1.0, attrs=(("from", self.scale * 2), ("to", self.scale))))
        rnd.shuffle(out)
        return out


def backlog(seed: int) -> list[Sample]:
    """Several series read in turns (runs of random length), with time gaps and copies."""
    rnd = random.Random(seed)
    producers = ["megatron", "deepspeed", "fairseq", "", "megatron"]
    series = [Series(rnd, (("job", "j"), ("rank", str(i))), rnd.choice(producers)) for i in range(rnd.randint(1, 3))]
    out: list[Sample] = []
    if rnd.random() < 0.3:
        out.append(Sample((("job", "j"),), "precision", 0.0, None, SourcePos("/p", 1), 0.0, None,
                          (("mode", rnd.choice(["fp16", "bf16"])), ("scaler", "dynamic")), ""))
    now = 1000.0
    total = rnd.choice([60, 120, 250, 400, 650, 1200])
    while len(out) < total:
        s = rnd.choice(series)
        turn = rnd.choice([1, 5, 40, 60, 200, 900])
        for _ in range(turn):
            now += rnd.choice([0.0, 1.0, 1.0, 2.0, 30.0, 700.0]) if rnd.random() < 0.3 else 1.0
            rec = s.record(now)
            out += rec
            if rnd.random() < 0.01:  # another file with the same labels: a copy of the record
                out += [Sample(x.labels, x.metric, x.value, x.step, x.source, x.time, x.log_time, x.attrs,
                               x.producer) for x in rec]
    return out


def _no_clock(x):
    if isinstance(x, dict):
        return {k: _no_clock(v) for k, v in x.items() if k != "judged_at"}
    if isinstance(x, list):
        return [_no_clock(v) for v in x]
    return x


def _dump(x) -> str:
    return json.dumps(_no_clock(json_safe(x)), sort_keys=True, default=str)


def memory(p: Pipeline) -> dict:
    """Each rule's detector memory, as the store would write it (store/book.py), its series in
    the order they were last seen (which one a full memory drops first)."""
    out: dict = {}
    for rule in p.rules.rules:
        det = rule.detector
        for slot, ps in slots_of(det).items():
            out[(rule.name, slot)] = [(dump_key(k), dumps(encode_record(ps.factory, v))) for k, v in ps.items()]
        if explicit(det):
            out[(rule.name, "@")] = dumps(encode(det.state()))
    return out


def restarted(p: Pipeline, rules, planned, state) -> Pipeline:
    """The daemon's restart: commit alerts, series and detector memory, load them in a new pipeline."""
    store = StateStore(state)
    store.commit(alerts=list(p.alerts.alerts.values()), deleted_alerts=p.alerts.deleted,
                 series=list(p.series.values()), memory=p.memory_delta())
    store.close()
    store = StateStore(state)
    q = Pipeline(fresh(rules, planned), keep_findings=10 ** 9, memory=MemoryBook())
    q.alerts.load(store.load_alerts())
    for st in store.load_series():
        q.series[st.labels] = st
    q.restore_memory(store.load_memory(), 0.0)
    store.close()
    assert q.memory.errors == []
    return q


def fresh(rules, planned: dict | None):
    """New detectors of ``rules``; with ``planned``, their plans note how much of each run each
    kind leaves out of the per-sample loop."""
    rs = rules.fresh()
    if planned is not None:
        for rule in rs.rules:
            def traced(labels, run, metrics, plan=rule.detector.plan, kind=rule.spec.kind):
                at = plan(labels, run, metrics)
                planned[kind] = planned.get(kind, 0) + at
                return at
            rule.detector.plan = traced
    return rs


def outcome(rules, samples, per_sample: bool, planned: dict | None = None, restart_at=None) -> dict:
    """What the pipeline concluded of ``samples``, handed one at a time or in chunks (one per
    evaluation tick); ``restart_at``: (chunk index, state folder) where the daemon restarts."""
    rs = fresh(rules, planned)
    p = Pipeline(rs, keep_findings=10 ** 9, memory=MemoryBook())
    findings = []
    for c, i in enumerate(range(0, len(samples), TICK_EVERY)):
        if restart_at is not None and c == restart_at[0]:
            p = restarted(p, rules, planned, restart_at[1])
        chunk = samples[i:i + TICK_EVERY]
        if per_sample:
            for s in chunk:
                findings += p.process([s])
        else:
            findings += p.process(chunk)
        p.tick(chunk[-1].time + 20.0)
    p.tick(samples[-1].time + 1e5)
    return {"findings": [_dump(f.to_json()) for f in findings],
            "alerts": sorted(_dump(a.to_json()) for a in p.alerts.alerts.values()),
            "series": sorted(_dump(st.to_dict(context=True)) for st in p.series.values()),
            "memory": memory(p), "totals": p.findings_total, "errors": p.errors}


def check(rules, samples, planned, restart_at):
    bulk = outcome(rules, samples, per_sample=False, planned=planned,
                   restart_at=restart_at and (restart_at[0], restart_at[1] / "bulk"))
    one = outcome(rules, samples, per_sample=True, restart_at=restart_at and (restart_at[0], restart_at[1] / "one"))
    assert not one["errors"]
    for key in ("findings", "alerts", "series", "memory", "totals", "errors"):
        assert bulk[key] == one[key], key
    return one


CASES, BLOCKS = 200, 10


@pytest.mark.parametrize("block", range(BLOCKS))
def test_bulk_judging_equals_one_sample_at_a_time(tmp_path, block):
    global TICK_EVERY
    rules_seen: set[str] = set()
    planned: dict[str, int] = {}
    for seed in range(block * CASES // BLOCKS, (block + 1) * CASES // BLOCKS):
        rnd = random.Random(seed * 7919)
        TICK_EVERY = rnd.choice([173, 997, 4000])
        d = tmp_path / str(seed)
        d.mkdir()
        rules = SHIPPED if seed % 2 == 0 else random_rules(rnd, d)
        samples = backlog(seed)
        restart_at = (rnd.randint(1, 3), d) if rnd.random() < 0.25 else None  # a daemon restart mid-backlog
        try:
            one = check(rules, samples, planned, restart_at)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed} (rules {'shipped' if seed % 2 == 0 else 'random'}): {exc}") from exc
        rules_seen |= {json.loads(f)["rule"] for f in one["findings"]}
    assert len(rules_seen) >= 4  # the data makes rules speak: equal silences would prove nothing
    # and the plans engage: samples of every planning kind were left out of the per-sample loop
    assert {k for k, n in planned.items() if n} >= {"nonfinite", "spike", "divergence", "stuck", "zero_loss",
                                                    "stalled", "loss_scale"}, planned


def _records(labels, steps, metric="grad_norm", value=2.0, t0=1000.0):
    return [Sample(labels, metric, value, s, SourcePos("/" + labels[-1][1], s), t0 + s, None, (), "megatron")
            for s in steps]


def test_absorbed_grad_norms_keep_the_order_series_were_last_seen(tmp_path):
    """nonfinite without the hidden-NaN check only peeks at a series' streak on a finite grad
    norm (it stays where it was in the least-recently-seen order, which decides the series a
    full memory drops first and the store's row order); absorbing them must not move it."""
    (tmp_path / "r.yml").write_text(json.dumps({"groups": [{"name": "g", "rules": [
        _rule("Nf", "nonfinite", {"metrics": ["grad_norm"], "hidden_nan_loss": False})]}]}))
    rules = load_rules([tmp_path])
    a, b = (("job", "j"), ("rank", "0")), (("job", "j"), ("rank", "1"))
    samples = _records(a, range(1, 61)) + _records(b, range(1, 61)) + _records(a, range(61, 121))
    bulk, one = outcome(rules, samples, per_sample=False), outcome(rules, samples, per_sample=True)
    assert one["memory"][("Nf", "_streaks")][0][0] == bulk["memory"][("Nf", "_streaks")][0][0]
    assert bulk["memory"] == one["memory"]
