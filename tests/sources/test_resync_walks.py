"""Resyncs: every one walks the watched trees, and one comes at once when inotify may have missed
something or only a walk can follow (an overflow, a directory that came or went, a followed file
deleted), not for a file event inotify told, nor for other files' deletes. Real
inotify, real files, the real agent in-process."""

import logging
import shutil
import subprocess
import sys
import threading

from precision_agent.config import Config, Limits, Watch
from precision_agent.daemon.agent import Agent
from precision_agent.sources.watcher import TreeWatcher

from support.agent import write_megatron
from conftest import free_port, wait_for


MANY = r"""
import sys
for i in range(200):
    with open(f"{sys.argv[1]}/rank{i:03d}.log", "w") as f:
        for it in (1, 2):
            f.write(f" iteration {it:>8}/    1000 | consumed samples: {it*8:>12} | learning rate: 1.000000E-04 | "
                    f"global batch size:     8 | lm loss: {5.0 - it * 0.001:.6E} | loss scale: 65536.0 | "
                    f"grad norm: 1.5 | number of skipped iterations:   0 | number of nan iterations:   0 |\n")
"""


def _watcher(root):
    paths, resyncs = [], threading.Event()
    w = TreeWatcher([Watch(path=root)], paths.append, resyncs.set, lambda msg: None, mounts=[], watch_limit=None)
    w.start()
    return w, paths, resyncs


def test_a_resync_comes_at_once_when_inotify_cannot_tell(tmp_path):
    root = tmp_path / "logs"
    root.mkdir()
    (root / "old.log").write_text("x\n")
    (root / "ckpt.tmp").write_text("x\n")
    w, paths, resyncs = _watcher(root)
    try:
        (root / "a.log").write_text("line\n")
        wait_for(lambda: str(root / "a.log") in paths, what="the event")
        assert not resyncs.is_set()     # a file event is read as it is
        (root / "ckpt.tmp").unlink()    # not a followed file: nothing to let go
        (root / "b.log").write_text("line\n")
        wait_for(lambda: str(root / "b.log") in paths, what="the event after the delete")
        assert not resyncs.is_set()
        # an overflow, as watchdog reports it (a log line)
        logging.getLogger("watchdog.observers.inotify_c").warning("inotify event queue overflowed")
        assert resyncs.is_set()
        resyncs.clear()
        (root / "run2").mkdir()         # files written right after mkdir are often missed
        wait_for(lambda: resyncs.is_set(), what="a resync asked for the new directory")
        resyncs.clear()
        (root / "old.log").unlink()     # its descriptor must be read out and let go: a walk finds it gone
        wait_for(lambda: resyncs.is_set(), what="a resync asked for the deleted file")
    finally:
        w.stop()


def test_a_removed_and_recreated_root_is_watched_again(tmp_path):
    root = tmp_path / "logs"
    root.mkdir()
    w, paths, _ = _watcher(root)
    try:
        assert w.modes[str(root)] == "inotify"
        shutil.rmtree(root)
        wait_for(lambda: str(root) not in w._live_targets(), what="the removed root's inotify watch ended")
        root.mkdir()
        _watched_again(w, root, paths)
    finally:
        w.stop()


def test_a_root_replaced_by_a_rename_is_watched_again(tmp_path):
    """inotify follows the renamed directory's inode; the path now names a new directory whose
    writes it would never tell: the next resync watches the new one."""
    root = tmp_path / "logs"
    root.mkdir()
    w, paths, _ = _watcher(root)
    try:
        root.rename(tmp_path / "logs.old")
        root.mkdir()
        _watched_again(w, root, paths)
    finally:
        w.stop()


def _watched_again(w, root, paths) -> None:
    """After the next resync the new directory at ``root`` is watched: a file written there is seen."""
    w.schedule_missing()            # (every resync)
    assert w.modes[str(root)] == "inotify"
    (root / "b.log").write_text("line\n")
    wait_for(lambda: str(root / "b.log") in paths, what="events from the new directory's watch")


def _agent(tmp_path, **kw):
    logs = tmp_path / "logs"
    logs.mkdir()
    cfg = Config(listen=f"127.0.0.1:{free_port()}", state_dir=tmp_path / "state", watches=[Watch(path=logs)],
                 **kw)
    agent = Agent(cfg)
    agent.start()
    return agent, logs


def test_every_resync_walks_and_finds_what_inotify_cannot_see(tmp_path):
    """The root replaced by a rename: inotify keeps watching the old directory (its inode), so
    only a walk of the path finds the files of the new one; its appends are read once each (by
    the new watch or a walk: test_a_root_replaced_by_a_rename_is_watched_again shows the watch)."""
    agent, logs = _agent(tmp_path, resync_interval=0.2, limits=Limits(nice=0, io_idle=False))
    c = agent.health.counters
    try:
        write_megatron(logs / "train.log", 1, 3)
        wait_for(lambda: c["log_lines_read"] == 3, what="lines read")
        logs.rename(tmp_path / "logs.old")
        logs.mkdir()
        write_megatron(logs / "late.log", 1, 2)
        wait_for(lambda: c["log_lines_read"] == 5, what="the new root's file found by a walk")
        resyncs = c["resyncs"]
        write_megatron(logs / "late.log", 3, 4)
        wait_for(lambda: c["log_lines_read"] == 7, what="its appends read")
        wait_for(lambda: c["resyncs"] >= resyncs + 3, what="resyncs go on")
        assert c["log_lines_read"] == 7     # nothing read twice by the walks
    finally:
        agent.shutdown()


def test_files_created_while_the_queue_overflowed_are_found(tmp_path):
    """No periodic walk for an hour: the queue's overflow alone makes the next resync walk."""
    agent, logs = _agent(tmp_path, resync_interval=3600, limits=Limits(nice=0, io_idle=False, queue_size=10))
    c = agent.health.counters
    try:
        wait_for(lambda: c["resyncs"] >= 1, what="the first walk")
        # 200 files at once from another process: far more paths than the queue holds
        subprocess.run([sys.executable, "-c", MANY, str(logs)], check=True, timeout=60)
        wait_for(lambda: c["log_lines_read"] == 400, timeout=60, what="every file read")
        assert c["queue_overflows"] > 0 and c["resyncs"] >= 2
        (logs / "rank000.log").unlink()   # a deleted file is let go without waiting for a periodic walk
        wait_for(lambda: str(logs / "rank000.log") not in agent.streams, what="the deleted file dropped")
    finally:
        agent.shutdown()
