"""The daemon's periodic jobs (agent/daemon/ticker.py): a failing job runs again at its next
time, each job keeps its own interval, and nothing runs after shutdown."""

import threading

import pytest

from conftest import wait_for

from precision_agent.daemon.ticker import Ticker


def test_failing_job_runs_again_and_shutdown_stops_all() -> None:
    calls = {"bad": 0, "good": 0}
    lock = threading.Lock()

    def bad() -> None:
        with lock:
            calls["bad"] += 1
        raise RuntimeError("a bug in one job")

    def good() -> None:
        with lock:
            calls["good"] += 1

    t = Ticker()
    t.add(bad, 0.02, "bad")
    t.add(good, 0.05, "good")
    t.start()
    wait_for(lambda: calls["bad"] >= 3 and calls["good"] >= 2, 10, what="both jobs run repeatedly")
    t.shutdown()
    with lock:
        after = dict(calls)
    t.shutdown()  # idempotent
    assert not t._thread.is_alive() and calls == after


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Ticker().add(lambda: None, 0, "never")
