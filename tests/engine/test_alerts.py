"""Alert lifecycle through the real pipeline: for, resolve_after, clear, keep_firing_for, dedup."""

import textwrap

from precision_agent.model import GRAD_NORM, LOG_UNRECOGNIZED, LOSS_SCALE, AlertState, Sample, SourcePos, fingerprint
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import load_rules

RULES = """
groups:
  - name: t
    rules:
      - alert: Floor
        kind: loss_scale
        params: {floor: 1}
        for: 10s
        keep_firing_for: 5s
        labels: {severity: page}
        annotations: {summary: "scale {{ $value }}"}
      - alert: NaN
        kind: nonfinite
        params: {grad_norm_persist: 1, grad_norm_warmup: 0}   # every non-finite grad norm hits (none is a skipped step)
        resolve_after: 60s
        labels: {severity: ticket}
"""
RUN = (("run", "r1"),)


def pipeline(tmp_path):
    (tmp_path / "r.yml").write_text(textwrap.dedent(RULES))
    return Pipeline(load_rules([tmp_path]))


def sample(metric, value, t, step=1):
    return Sample(RUN, metric, value, step, SourcePos("x.log", step), t)


def states(p):
    return {a.rule: a.state for a in p.alerts.alerts.values()}


def test_for_delays_firing_and_clear_resolves_after_keep_firing_for(tmp_path):
    p = pipeline(tmp_path)
    p.process([sample(LOSS_SCALE, 2.0, 99.0, 0)])  # a dynamic scaler backs off to its floor
    p.process([sample(LOSS_SCALE, 1.0, 100.0)])
    assert states(p) == {"Floor": AlertState.PENDING}
    p.tick(105.0)
    assert states(p) == {"Floor": AlertState.PENDING}
    p.process([sample(LOSS_SCALE, 0.5, 111.0, 2)])
    assert states(p) == {"Floor": AlertState.FIRING}
    (alert,) = p.alerts.alerts.values()
    assert alert.count == 2 and alert.annotations["summary"] == "scale 1"  # the onset
    assert alert.finding["latest"]["value"] == 0.5 and alert.finding["step"] == 1
    assert alert.labels == (("run", "r1"), ("severity", "page"), ("suspect", "unknown"))   # no evidence either way
    p.process([sample(LOSS_SCALE, 1024.0, 112.0, 3)])
    assert states(p) == {"Floor": AlertState.FIRING}  # keep_firing_for: 5s
    p.tick(118.0)
    assert states(p) == {"Floor": AlertState.RESOLVED}
    kinds = [(t.old, t.new) for t in p.alerts.drain_transitions()]
    assert kinds == [(None, AlertState.PENDING), (AlertState.PENDING, AlertState.FIRING),
                     (AlertState.FIRING, AlertState.RESOLVED)]


def test_pending_that_clears_never_fires(tmp_path):
    p = pipeline(tmp_path)
    p.process([sample(LOSS_SCALE, 2.0, 99.0, 0), sample(LOSS_SCALE, 1.0, 100.0), sample(LOSS_SCALE, 2.0, 101.0, 2)])
    p.tick(200.0)
    assert states(p) == {}
    assert [t.new for t in p.alerts.drain_transitions()] == [AlertState.PENDING, AlertState.RESOLVED]


def test_event_alert_fires_once_and_resolves_after_quiet_period(tmp_path):
    p = pipeline(tmp_path)
    p.process([sample(GRAD_NORM, float("nan"), 100.0, 1), sample(GRAD_NORM, float("inf"), 101.0, 2)])
    fired = [t for t in p.alerts.drain_transitions() if t.new == AlertState.FIRING]
    assert len(fired) == 1 and dict(fired[0].alert.labels)["metric"] == GRAD_NORM
    p.tick(150.0)
    assert states(p) == {"NaN": AlertState.FIRING}
    p.tick(161.5)
    assert states(p) == {"NaN": AlertState.RESOLVED}
    p.process([sample(GRAD_NORM, float("nan"), 170.0, 3)])  # a new incident: a new alert
    assert states(p) == {"NaN": AlertState.FIRING}


def test_finite_values_do_not_alert(tmp_path):
    p = pipeline(tmp_path)
    assert p.process([sample(GRAD_NORM, 3.0, 100.0), sample(LOSS_SCALE, 65536.0, 100.0)]) == []
    assert states(p) == {}


def test_finished_series_expire(tmp_path):
    p = pipeline(tmp_path)
    p.process([sample(LOSS_SCALE, 1024.0, 100.0)])
    p.process([Sample((("run", "r2"),), LOSS_SCALE, 2048.0, 1, SourcePos("y.log", 1), 5000.0)])
    assert p.expire(5050.0, ttl=3600.0) == [RUN]
    assert list(p.series) == [(("run", "r2"),)]


READING = """
groups:
  - name: r
    rules:
      - alert: Unrecognized
        kind: unrecognized_log
        resolve_after: 30m
        labels: {severity: ticket}
"""


def verdict(path, value, t):
    """The follower's verdict on one file: 1 (no record in it), 0 (records again)."""
    return Sample((("file", path),), LOG_UNRECOGNIZED, value, None, SourcePos(path, 1), t,
                  attrs=(("reason", "unrecognized"), ("units", 5)) if value else ())


def reading(tmp_path):
    (tmp_path / "r.yml").write_text(textwrap.dedent(READING))
    return Pipeline(load_rules([tmp_path]))


def test_clears_without_an_open_alert_hash_nothing(tmp_path):
    """Every followed file's "records again" is a clear: with no alert open for the file, it must
    not hash its labels into ``fingerprint``'s cache (10,000 idle files filled 8,192 entries,
    ~5 MB, for nothing); a clear of an open alert still ends that alert, and only that one."""
    p = reading(tmp_path)
    fingerprint.cache_clear()
    p.process([verdict(f"/logs/{i}.log", 0.0, 100.0) for i in range(300)])
    assert fingerprint.cache_info().currsize == 0 and p.alerts.alerts == {}
    p.process([verdict("/logs/a.log", 1.0, 101.0), verdict("/logs/b.log", 1.0, 101.0)])
    assert [a.state for a in p.alerts.alerts.values()] == [AlertState.FIRING] * 2
    p.process([verdict(f"/logs/{i}.log", 0.0, 102.0) for i in range(300)] + [verdict("/logs/a.log", 0.0, 103.0)])
    assert fingerprint.cache_info().currsize <= 2  # the hits' own
    assert {dict(a.labels)["file"]: a.state for a in p.alerts.alerts.values()} == {
        "/logs/a.log": AlertState.RESOLVED, "/logs/b.log": AlertState.FIRING}
    p.process([verdict("/logs/a.log", 1.0, 104.0)])  # fires again: a new alert, cleared again
    p.process([verdict("/logs/a.log", 0.0, 105.0)])
    assert [t.new for t in p.alerts.drain_transitions()].count(AlertState.RESOLVED) == 2


def test_a_restored_alert_is_cleared(tmp_path):
    p = reading(tmp_path)
    p.process([verdict("/logs/a.log", 1.0, 101.0)])
    (alert,) = p.alerts.alerts.values()
    q = reading(tmp_path)  # a restart: the alert comes back from the state store
    q.alerts.load([alert])
    q.process([verdict("/logs/a.log", 0.0, 102.0)])
    assert states(q) == {"Unrecognized": AlertState.RESOLVED}


def test_a_rule_with_its_own_suspect_label_clears(tmp_path):
    """A rule that sets ``suspect`` itself is not judged; its alert is still one alert whose
    condition clears: the open-alert index is keyed by identity labels, and so is the clear."""
    (tmp_path / "r.yml").write_text(textwrap.dedent("""
        groups:
          - name: t
            rules:
              - alert: Floor
                kind: loss_scale
                params: {floor: 1}
                labels: {severity: page, suspect: numerics}
        """))
    p = Pipeline(load_rules([tmp_path]))
    p.process([sample(LOSS_SCALE, 2.0, 99.0, 0), sample(LOSS_SCALE, 1.0, 100.0)])
    (alert,) = p.alerts.alerts.values()
    assert alert.state == AlertState.FIRING and dict(alert.labels)["suspect"] == "numerics"
    p.process([sample(LOSS_SCALE, 1024.0, 101.0, 2)])
    p.tick(200.0)
    assert states(p) == {"Floor": AlertState.RESOLVED}


def test_tick_visits_only_alerts_time_may_change_and_decides_as_a_full_pass(tmp_path):
    """The alert book ticks only alerts whose state time alone may change (engine/alerts.py): a
    firing alert of a state kind waits for its detector. Decided exactly as a tick over every
    alert, through random hits, clears, ticks and lost memory over many series."""
    import random

    rng = random.Random(7)
    fast, full = pipeline(tmp_path), pipeline(tmp_path)
    runs = [(("run", f"r{i}"),) for i in range(12)]
    t = 100.0
    for op in range(1500):
        t += rng.choice((0.5, 1.0, 3.0, 7.0))
        kind = rng.random()
        if kind < 0.55:
            run = rng.choice(runs)
            metric, value = rng.choice([(LOSS_SCALE, 1.0), (LOSS_SCALE, 0.5), (LOSS_SCALE, 1024.0),
                                        (LOSS_SCALE, 2.0), (GRAD_NORM, float("nan")), (GRAD_NORM, 1.0)])
            batch = [Sample(run, metric, value, op, SourcePos("x.log", op + 1), t)]
            fast.process(batch)
            full.process(list(batch))
        elif kind < 0.97:
            full.alerts._rules_seen = None   # the reference: every alert visited on each tick
            fast.tick(t)
            full.tick(t)
        else:
            fast.alerts.memory_lost("Floor", t)
            full.alerts.memory_lost("Floor", t)
        got = {fp: (a.state, a.last_seen, a.resolved_at) for fp, a in fast.alerts.alerts.items()}
        want = {fp: (a.state, a.last_seen, a.resolved_at) for fp, a in full.alerts.alerts.items()}
        assert got == want, op
        assert ([(tr.alert.fingerprint, tr.old, tr.new) for tr in fast.alerts.drain_transitions()]
                == [(tr.alert.fingerprint, tr.old, tr.new) for tr in full.alerts.drain_transitions()]), op
    assert {a.state for a in fast.alerts.alerts.values()} >= {AlertState.FIRING, AlertState.RESOLVED}


def test_firing_alerts_of_a_state_kind_leave_the_tick(tmp_path):
    p = pipeline(tmp_path)
    runs = [(("run", f"r{i}"),) for i in range(200)]
    for run in runs:
        p.process([Sample(run, LOSS_SCALE, 2.0, 0, SourcePos("x.log", 1), 99.0),
                   Sample(run, LOSS_SCALE, 1.0, 1, SourcePos("x.log", 2), 100.0)])
    p.tick(120.0)   # for: 10s has passed: all fire, and none has anything left for time to do
    assert [a.state for a in p.alerts.alerts.values()] == [AlertState.FIRING] * 200
    assert not p.alerts._due
    p.process([Sample(runs[0], LOSS_SCALE, 1024.0, 2, SourcePos("x.log", 3), 121.0)])   # cleared
    assert len(p.alerts._due) == 1
    p.tick(127.0)   # keep_firing_for: 5s
    assert p.alerts.alerts[fingerprint("Floor", runs[0] + (("severity", "page"),))].state == AlertState.RESOLVED


def test_a_firing_alert_of_a_state_kind_resolves_when_its_rule_is_removed(tmp_path):
    """A firing, uncleared alert of a state kind has left the tick's set; a rule reload
    (Pipeline.set_rules gives the tick a new table of rules) visits it again."""
    p = pipeline(tmp_path)
    p.process([sample(LOSS_SCALE, 2.0, 99.0, 0), sample(LOSS_SCALE, 1.0, 100.0)])
    p.tick(120.0)
    assert states(p) == {"Floor": AlertState.FIRING} and not p.alerts._due
    p.tick(130.0)
    assert states(p) == {"Floor": AlertState.FIRING}
    (tmp_path / "r.yml").write_text(textwrap.dedent(RULES).split("      - alert: NaN")[0].replace(
        "alert: Floor", "alert: Floor2"))
    p.set_rules(load_rules([tmp_path]))
    p.tick(131.0)
    assert states(p) == {"Floor": AlertState.RESOLVED}
