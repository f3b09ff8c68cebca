"""Sources: the bounded change queue, glob matching, and the resync that catches what
inotify missed (here: no inotify at all)."""

import fnmatch
import os
import random
import threading

from precision_agent.config import Config, Limits, Watch
from precision_agent.sources.queue import ChangeQueue
from precision_agent.sources.watcher import matches, walk, watch_for

from support.agent import write_megatron
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


def test_globs_read_as_fnmatch_reads_them(tmp_path):
    """The compiled globs (one regex per list) say what fnmatch says of every name, strange ones too."""
    rnd = random.Random(7)
    names = ["a.log", "b.txt.gz", "x.tmp", "events.out.tfevents.1.host", "metrics.csv", "m.csv", "a.LOG", "foo",
             ".log", "a.log.1", "a[1].log", "line\nbreak.log", "a.log\n", ""]
    names += ["".join(rnd.choice("ab.*?[]!log\ntx-") for _ in range(rnd.randint(0, 12))) for _ in range(3000)]
    for w in (Watch(path=tmp_path), Watch(path=tmp_path, include=["*.log", "x[!a]*", "[", "a[b-"], exclude=["*b*"]),
              Watch(path=tmp_path, include=[]), Watch(path=tmp_path, include=["*"], exclude=[])):
        for name in names:
            want = not any(fnmatch.fnmatch(name, p) for p in w.exclude) and any(fnmatch.fnmatch(name, p) for p in w.patterns)
            assert matches(w, os.path.join("d", name)) == want, (name, w.include, w.exclude)


def test_resync_alone_finds_new_files_and_appends(tmp_path, monkeypatch):
    """With the inotify observer disabled, the periodic resync still picks everything up."""
    from precision_agent.daemon.agent import Agent
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


# --- network file systems and the inotify watch limit -----------------------------------------------

MOUNTINFO = (
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
    "30 22 0:40 / /mnt/shared\\040data rw,relatime shared:7 master:3 - nfs4 filer:/export/data rw,vers=4.2\n"
    "31 30 0:41 / /mnt/shared\\040data/local rw - tmpfs tmpfs rw\n"
    "40 22 0:50 / /lustre/scratch rw - lustre 10.0.0.1@o2ib:/scratch rw,flock\n"
    "41 22 0:51 / /gcs rw,nosuid - fuse.gcsfuse bucket rw,user_id=0\n"
    "42 22 0:52 / /home/u/tab\\011and\\134back rw - cifs //srv/share rw\n"
    "garbage line without a separator\n"
    "43 22 0:53 / /short rw -\n"
)


def test_mountinfo_parsing_unescapes_and_skips_malformed_lines():
    from precision_agent.sources.mounts import parse_mountinfo
    mounts = parse_mountinfo(MOUNTINFO)
    assert [(m.mount_point, m.fstype) for m in mounts] == [
        ("/", "ext4"), ("/mnt/shared data", "nfs4"), ("/mnt/shared data/local", "tmpfs"),
        ("/lustre/scratch", "lustre"), ("/gcs", "fuse.gcsfuse"), ("/home/u/tab\tand\\back", "cifs")]
    assert mounts[1].source == "filer:/export/data"


def test_network_file_system_types():
    from precision_agent.sources.mounts import is_network_fs
    assert {t: is_network_fs(t) for t in ("nfs4", "nfs", "lustre", "fuse.gcsfuse", "cifs", "smb3", "gpfs", "beegfs",
                                          "ceph", "ext4", "xfs", "tmpfs", "overlay", "fuseblk")} == {
        "nfs4": True, "nfs": True, "lustre": True, "fuse.gcsfuse": True, "cifs": True, "smb3": True, "gpfs": True,
        "beegfs": True, "ceph": True, "ext4": False, "xfs": False, "tmpfs": False, "overlay": False,
        "fuseblk": False}


def test_mount_of_on_a_real_tree(tmp_path):
    from precision_agent.sources.mounts import mount_of, parse_mountinfo
    root = str(tmp_path)
    (tmp_path / "nfs dir" / "local").mkdir(parents=True)
    text = (f"1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
            f"2 1 0:40 / {root}/nfs\\040dir rw - nfs filer:/x rw\n"
            f"3 2 0:41 / {root}/nfs\\040dir/local rw - tmpfs tmpfs rw\n"
            f"4 1 0:42 / {root}/nfs-dir-lookalike rw - nfs filer:/y rw\n")
    mounts = parse_mountinfo(text)
    assert mount_of(f"{root}/nfs dir/run1/logs", mounts).fstype == "nfs"  # not created yet: parent decides
    assert mount_of(f"{root}/nfs dir/local/x", mounts).fstype == "tmpfs"
    assert mount_of(f"{root}/nfs", mounts).fstype == "ext4"  # a prefix of a mount point is not inside it


def _collect(watches, **kw):
    from precision_agent.sources.watcher import TreeWatcher
    seen: list[str] = []
    errors: list[str] = []
    return TreeWatcher(watches, seen.append, lambda: None, errors.append, **kw), seen, errors


def test_auto_polls_watches_on_network_mounts_and_sees_appends(tmp_path):
    from precision_agent.sources.mounts import parse_mountinfo
    (tmp_path / "nfs").mkdir()
    (tmp_path / "local").mkdir()
    mounts = parse_mountinfo(f"1 0 8:1 / / rw - ext4 /dev/sda1 rw\n2 1 0:40 / {tmp_path}/nfs rw - nfs4 f:/x rw\n")
    tw, seen, errors = _collect([Watch(path=tmp_path / "nfs", poll_interval=0.2), Watch(path=tmp_path / "local"),
                                 Watch(path=tmp_path / "forced", poll=True), Watch(path=tmp_path / "never",
                                                                                    poll=False)],
                                mounts=mounts, watch_limit=1000)
    (tmp_path / "forced").mkdir()
    tw.start()
    try:
        assert tw.modes == {str(tmp_path / "nfs"): "poll", str(tmp_path / "local"): "inotify",
                            str(tmp_path / "forced"): "poll", str(tmp_path / "never"): "inotify"}
        assert set(tw.pollers) == {0.2, 2.0}
        log = tmp_path / "nfs" / "train.log"
        log.write_text("one\n")
        wait_for(lambda: str(log) in seen, what="created file seen by polling")
        seen.clear()
        with open(log, "a") as f:
            f.write("two\n")
        wait_for(lambda: str(log) in seen, what="append seen by polling")
        assert errors == []
    finally:
        tw.stop()


def test_watch_limit_leaves_big_trees_to_resync_with_the_sysctl_named(tmp_path):
    from precision_agent.sources.watcher import walk
    small, big = tmp_path / "small", tmp_path / "big"
    (small / "a").mkdir(parents=True)
    for i in range(8):
        (big / f"step_{i}").mkdir(parents=True)
    watches = [Watch(path=small), Watch(path=big)]
    tw, seen, errors = _collect(watches, mounts=[], watch_limit=6)
    tw.start()
    try:
        assert tw.modes == {str(small): "inotify", str(big): "resync"}
        assert len(errors) == 1 and str(big) in errors[0]
        assert "sysctl -w fs.inotify.max_user_watches=" in errors[0] and "max_user_watches=6" in errors[0]
        log = small / "a" / "t.log"
        log.write_text("x\n")
        wait_for(lambda: str(log) in seen, what="the tree that fits is still watched by inotify")
        # the small tree grows past the limit later: the next resync's walk notices, reported once
        for i in range(6):
            (small / f"new_{i}").mkdir()
        list(walk(watches[0], 100))
        tw.schedule_missing()
        tw.schedule_missing()
        assert len(errors) == 2 and "grew to 8 directories" in errors[1], errors
    finally:
        tw.stop()


def test_limit_check_in_the_agent_counts_a_watch_error(tmp_path, monkeypatch):
    """The agent keeps running and counts kind="watch" when a tree does not fit."""
    from precision_agent.daemon.agent import Agent
    from precision_agent.sources import watcher
    monkeypatch.setattr(watcher, "read_watch_limit", lambda: 2)
    logs = tmp_path / "logs"
    for i in range(4):
        (logs / f"r{i}").mkdir(parents=True)
    cfg = Config(listen=f"127.0.0.1:{free_port()}", state_dir=tmp_path / "state", resync_interval=0.3,
                 watches=[Watch(path=logs, poll=False)], limits=Limits(nice=0, io_idle=False))
    agent = Agent(cfg)
    agent.start()
    try:
        assert agent.health.errors["watch"] == 1 and agent.watcher.modes == {str(logs): "resync"}
        write_megatron(logs / "r1" / "train.log", 1, 3)
        wait_for(lambda: agent.health.counters["log_lines_read"] == 3, what="lines found by resync")
    finally:
        agent.shutdown()
