"""Series state: cross-rank deduplication, counter reconciliation, the scale trajectory."""

from precision_agent.model import (LOSS, LOSS_SCALE, OVERFLOW, SKIPPED_CUMULATIVE, SKIPPED_INTERVAL, Sample,
                                   SourcePos)
from precision_agent.series.state import SeriesState

SRC = SourcePos("x.log", 1)


def s(metric, value, step=None, log_time=None, **attrs):
    return Sample((), metric, value, step, SRC, 0.0, log_time, tuple(attrs.items()))


def transition(frm, to, t, step=None):
    return [s(OVERFLOW, 1, step, t, variant="reduce", frm=frm, to=to), s(LOSS_SCALE, to, step, t, frm=frm)]


def feed(st, samples):
    out = []
    for x in samples:
        out.extend(st.ingest(x))
    return out


def test_copies_from_four_ranks_count_once():
    st = SeriesState(())
    samples = []
    for _ in range(4):
        samples += transition(8192.0, 4096.0, 100.0)
    samples.append(s(OVERFLOW, 1, 13437, 100.001))  # "Grad overflow on iteration: 13437"
    accepted = feed(st, samples)
    assert st.overflow_steps == 1 and st.scale_decreases == 1
    assert [a.metric for a in accepted] == [OVERFLOW, LOSS_SCALE]


def test_distinct_transitions_are_distinct_events():
    st = SeriesState(())
    feed(st, transition(2.0**32, 2.0**31, 1.0) + transition(2.0**31, 2.0**30, 1.05))
    assert st.overflow_steps == 2 and st.scale_decreases == 2 and st.scale_first == 2.0**32


def test_same_transition_far_apart_in_time_counts_twice():
    st = SeriesState(())
    feed(st, transition(2.0, 1.0, 10.0) + [s(LOSS_SCALE, 2.0, None, 20.0)] + transition(2.0, 1.0, 30.0))
    assert st.overflow_steps == 2 and st.scale_decreases == 2 and st.scale_increases == 1


def test_progress_between_identical_messages_separates_them():
    st = SeriesState(())
    feed(st, [s(OVERFLOW, 1, None, None, variant="reduce", frm=1.0, to=1.0), s(LOSS, 2.0),
              s(OVERFLOW, 1, None, None, variant="reduce", frm=1.0, to=1.0)])
    assert st.overflow_steps == 2


def test_hysteresis_then_reduce_are_two_skipped_steps_one_decrease():
    st = SeriesState(())
    feed(st, [s(OVERFLOW, 1, None, 1.0, variant="hysteresis", frm=16.0), s(LOSS_SCALE, 16.0, None, 1.0)]
         + transition(16.0, 8.0, 1.01))
    assert st.overflow_steps == 2 and st.scale_decreases == 1


def test_interval_counter_adds_only_unexplained_skips():
    st = SeriesState(())
    feed(st, transition(8.0, 4.0, 1.0) + [s(SKIPPED_INTERVAL, 3, 10)])
    assert st.overflow_steps == 3  # one message + two skips only the counter saw
    feed(st, [s(SKIPPED_INTERVAL, 5, 20)])
    assert st.overflow_steps == 8


def test_cumulative_counter_needs_a_baseline():
    st = SeriesState(())
    feed(st, [s(SKIPPED_CUMULATIVE, 25, 14000)])
    assert st.overflow_steps == 0  # no baseline: the 25 happened before we looked
    feed(st, transition(8.0, 4.0, 1.0) + [s(SKIPPED_CUMULATIVE, 28, 15000)])
    assert st.overflow_steps == 3
    feed(st, [s(SKIPPED_CUMULATIVE, 2, 10)])  # the trainer restarted: new baseline, nothing added
    assert st.overflow_steps == 3


def test_persistence_round_trip():
    st = SeriesState((("run", "a"),))
    feed(st, transition(8.0, 4.0, 1.0) + [s(LOSS, float("nan"), 3)])
    again = SeriesState.from_dict(st.labels, st.to_dict())
    assert again.to_dict() == st.to_dict() or str(again.to_dict()) == str(st.to_dict())
    assert again.scale_last == 4.0 and again.nonfinite == {LOSS: 1} and again.last_step == 3


def test_an_attempts_step_is_kept_apart_from_the_earlier_attempts():
    st = SeriesState((("run", "a"),))
    def at(step, t):
        return Sample((), LOSS, 2.0, step, SourcePos("x.log", step), t)
    feed(st, [at(i, 100.0 + i) for i in range(1, 41)])
    feed(st, [at(i, 500.0 + i) for i in range(20, 26)])   # back from 40 to 20: a restart
    assert st.attempt == 2 and st.attempt_step == 25 and st.last_step == 40
    again = SeriesState.from_dict(st.labels, st.to_dict(context=True))   # as the store keeps it
    assert again.attempt == 2 and again.attempt_step == 25
