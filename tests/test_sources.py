"""Sources: the bounded change queue, glob matching, and the resync that catches what
inotify missed (here: no inotify at all)."""

import threading

from precision_agent.config import Config, Limits, Watch
from precision_agent.sources.queue import ChangeQueue
from precision_agent.sources.watcher import matches, walk, watch_for

from agentproc import write_megatron
from conftest import free_port, wait_for


def test_queue_deduplicates_and_overflow_forces_resync():
    q = ChangeQueue(maxsize=2)
    assert q.put("a") and q.put("a") and q.put("b")
    assert not q.put("c")  # full: not dropped silently, a resync is requested instead
    batch = q.get(timeout=1)
    assert batch.paths == ["a", "b"] and batch.resync and q.overflows == 1
    assert q.get(timeout=0.05).paths == []


def test_queue_wakes_waiter():
    q = ChangeQueue(10)
    got = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=10)))
    t.start()
    q.put("x")
    t.join(10)
    assert got and got[0].paths == ["x"]


def test_globs_and_most_specific_watch(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    outer = Watch(path=tmp_path, labels={"run": "outer"})
    inner = Watch(path=tmp_path / "a", labels={"run": "inner"}, recursive=False)
    assert matches(outer, "x/train.log") and not matches(outer, "x/train.log.gz") and not matches(outer, "x/y.bin")
    assert watch_for([outer, inner], str(tmp_path / "a" / "t.log")) is inner
    assert watch_for([outer, inner], str(tmp_path / "a" / "b" / "t.log")) is outer  # inner is not recursive
    assert watch_for([outer, inner], str(tmp_path / "t.gz")) is None
    for name in ("z.log", "a/y.log", "a/b/x.txt", "a/b/skip.gz"):
        (tmp_path / name).write_text("")
    assert sorted(p.replace(str(tmp_path) + "/", "") for p in walk(outer, 100)) == ["a/b/x.txt", "a/y.log", "z.log"]
    assert len(list(walk(outer, 2))) == 2
    assert list(walk(Watch(path=tmp_path / "absent"), 10)) == []


def test_resync_alone_finds_new_files_and_appends(tmp_path, monkeypatch):
    """With the inotify observer disabled, the periodic resync still picks everything up."""
    from precision_agent.daemon import Agent
    from precision_agent.sources import watcher
    monkeypatch.setattr(watcher.TreeWatcher, "start", lambda self: None)
    logs = tmp_path / "logs"
    logs.mkdir()
    cfg = Config(listen=f"127.0.0.1:{free_port()}", state_dir=tmp_path / "state", resync_interval=0.3,
                 watches=[Watch(path=logs)], limits=Limits(nice=0, io_idle=False))
    agent = Agent(cfg)
    agent.start()
    try:
        (logs / "deep" / "er").mkdir(parents=True)
        write_megatron(logs / "deep" / "er" / "train.log", 1, 3)
        wait_for(lambda: agent.health.counters["log_lines_read"] == 3, what="lines found by resync")
        write_megatron(logs / "deep" / "er" / "train.log", 4, 4)
        wait_for(lambda: agent.health.counters["log_lines_read"] == 4, what="append found by resync")
        assert agent.health.counters["watch_events"] == 0
    finally:
        agent.shutdown()
