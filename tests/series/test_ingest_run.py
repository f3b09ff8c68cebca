"""``SeriesState.ingest_run`` (a run of samples in one call, as the pipeline catches up on a
backlog) answers and leaves the state exactly as ``ingest`` a sample at a time: the values of a
record after its first take a short way only where ``ingest`` would do nothing more."""

import json
import math
import random

import pytest

from conftest import CORPUS
from precision_agent.model import (GRAD_NORM, LEARNING_RATE, LOSS, LOSS_SCALE, NONFINITE_MESSAGE, OVERFLOW,
                                   PRECISION, SKIPPED_INTERVAL, Sample, SourcePos, json_safe)
from precision_agent.readers.logstream import LogStream
from precision_agent.series.state import SeriesState

LABELS = (("job", "j"),)


def state(st: SeriesState) -> str:
    types = [type(st.scale_last).__name__, type(st.last.get(LOSS_SCALE)).__name__]
    return json.dumps(json_safe({"dict": st.to_dict(context=True), "last": st.last, "nonfinite": st.nonfinite,
                                 "explained": st.gradnorm_explained, "types": types}), sort_keys=True, default=str)


def one_at_a_time(samples, st=None):
    st = st or SeriesState(LABELS)
    return [list(st.ingest(s)) for s in samples], state(st)


def in_runs(samples, quiet, rnd, st=None):
    """ingest_run over random cuts of ``samples``: the answers of every sample (the quiet ones
    answered themselves)."""
    st = st or SeriesState(LABELS)
    out, i = [], 0
    while i < len(samples):
        stop = min(len(samples), i + rnd.choice([1, 2, 5, 40, 10 ** 6]))
        k, accepted = st.ingest_run(samples, i, stop, quiet)
        out += [[s] for s in samples[i:k]]
        if accepted is not None:
            out.append(list(accepted))
            k += 1
        i = k
    return out, state(st)


def records(seed: int) -> list[Sample]:
    """Records of several values (one SourcePos object each), with what must leave the short
    way: a value of another step, time or producer under the same position, ints, NaN/Inf,
    scales that move or equal the last, attributes, overflow messages, restarts, copies."""
    rnd = random.Random(seed)
    out, step, scale, t = [], 0, 65536.0, 1000.0
    for line in range(1, rnd.choice([30, 200, 600])):
        r = rnd.random()
        step = max(0, step - rnd.randint(1, 50)) if r < 0.03 else step if r < 0.08 else step + 1
        t += rnd.choice([0.0, 1.0, 1.0, 90.0])
        src = SourcePos("/l", line) if rnd.random() > 0.03 else SourcePos("/l", line - 1)
        if rnd.random() < 0.1:
            scale = rnd.choice([scale / 2, scale * 2, 1.0, math.nan, 65536])
        prod = rnd.choice(["megatron", "megatron", "megatron", "deepspeed", ""])
        metrics = [LOSS, LOSS_SCALE, GRAD_NORM, LEARNING_RATE]
        metrics += rnd.sample([SKIPPED_INTERVAL, NONFINITE_MESSAGE, OVERFLOW, "eval_loss"], rnd.randint(0, 1))
        if rnd.random() < 0.5:
            rnd.shuffle(metrics)
        for m in metrics:
            v = scale if m == LOSS_SCALE else float(rnd.randint(0, 2)) if m in (SKIPPED_INTERVAL, OVERFLOW) else \
                rnd.choice([2.5, 2.5, 0.0, -0.0, math.nan, math.inf, 3, 1e308])
            st, tt, pp, attrs = step, t, prod, ()
            x = rnd.random()
            if x < 0.03:
                st = None if rnd.random() < 0.5 else step + rnd.choice([-1, 1])
            elif x < 0.05:
                tt = t + rnd.choice([-1.0, 1.0, math.nan])
            elif x < 0.07:
                pp = "fairseq"
            elif x < 0.09 and m == LOSS_SCALE:
                attrs = (("frm", scale * 2),) if rnd.random() < 0.5 else (("decrease", True),)
            elif x < 0.1:
                attrs = (("epoch", rnd.randint(0, 3)),)
            if m == OVERFLOW:
                attrs = (("held", True),) if rnd.random() < 0.3 else (("frm", scale), ("to", scale / 2))
            out.append(Sample(LABELS, m, v, st, src, tt, None, attrs, pp))
        if rnd.random() < 0.02:
            out.append(Sample(LABELS, PRECISION, 0.0, None, src, t, None, (("mode", "fp16"),), ""))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_ingest_run_equals_ingest_one_at_a_time(seed):
    samples = records(seed)
    rnd = random.Random(seed)
    metrics = {s.metric for s in samples}
    quiet = set(rnd.sample(sorted(metrics), rnd.randint(0, len(metrics)))) if seed % 3 else metrics
    assert in_runs(samples, quiet, rnd) == one_at_a_time(samples)


def test_a_restored_state_with_odd_scale_fields_takes_the_long_way():
    """A stored series whose scale fields break the usual order (the last scale outside the
    range seen, an int where a float comes): the short way is for what it can prove."""
    src = SourcePos("/l", 7)
    samples = [Sample(LABELS, m, v, 7, src, 5.0, None, (), "megatron")
               for m, v in ((LOSS, 2.0), (LOSS_SCALE, 8.0), (GRAD_NORM, 1.0), (LOSS_SCALE, 8.0))]
    for fields in ({"scale_last": 8.0, "scale_min": None, "scale_max": 4.0, "scale_first": 8.0},
                   {"scale_last": 8, "scale_min": 8, "scale_max": 8, "scale_first": None},
                   {"scale_last": 8.0, "scale_min": 16.0, "scale_max": 32.0, "scale_first": 8.0}):
        data = {"last_step": 6, "first_step": 1, **fields}
        one = one_at_a_time(samples, SeriesState.from_dict(LABELS, data))
        run = in_runs(samples, {LOSS, LOSS_SCALE, GRAD_NORM}, random.Random(0), SeriesState.from_dict(LABELS, data))
        assert run == one, fields


def corpus_logs():
    logs = CORPUS / "logs"
    if not logs.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason="shared corpus absent"))]
    return sorted(p.name for p in logs.iterdir() if p.suffix == ".log")


@pytest.mark.corpus
@pytest.mark.parametrize("name", corpus_logs())
def test_real_logs_ingest_alike_in_runs(name):
    stream = LogStream(str(CORPUS / "logs" / name), {"job": "j"})
    try:
        samples = stream.finish(now=0.0)
    finally:
        stream.close()
    samples = [s for s in samples if s.labels == samples[0].labels] if samples else []
    metrics = {s.metric for s in samples}
    assert in_runs(samples, metrics, random.Random(1)) == one_at_a_time(samples)
