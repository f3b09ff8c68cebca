"""The follower's read pass: a bug in handling one file is reported once per file and cause
(log line with its traceback, ``errors_total{kind="internal"}``) and the pass goes on with the
other files. Real files and a real config; the downstream (``sink``) fails for one file's samples."""

from __future__ import annotations

from pathlib import Path

from precision_agent.config.agent import Config, Watch
from precision_agent.health import Health, Heartbeat
from precision_agent.readers.following import Follower
from precision_agent.sources.confine import Confinement

RECORD = ("iteration {i}/ 100 | consumed samples: {i} | elapsed time per iteration (ms): 10.0 | learning rate: "
          "1.0E-04 | global batch size: 8 | lm loss: 2.0E+00 | loss scale: 65536.0 | grad norm: 1.5 | "
          "number of skipped iterations: 0 | number of nan iterations: 0 |\n")


def test_one_files_failure_does_not_end_the_pass_for_the_others(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    bad, good = logs / "a.log", logs / "b.log"
    for f in (bad, good):
        f.write_text("".join(RECORD.format(i=i) for i in range(1, 4)))
    config = Config(watches=[Watch(path=logs)])
    health = Health()
    got: list[str] = []

    def sink(samples):
        if any(s.source is not None and s.source.path == str(bad) for s in samples):
            raise RuntimeError("downstream bug")
        got.extend(s.source.path for s in samples if s.source is not None)

    follower = Follower(config, health, Confinement(config.watches), Heartbeat("test"), sink, lambda p: None,
                        lambda p: None, lambda: False)
    follower.read(follower.resync(lambda p: None))
    assert str(good) in got  # read, whichever came first
    assert health.errors["internal"] == 1 and "downstream bug" in health.last_error["internal"]
    with bad.open("a") as f:
        f.write(RECORD.format(i=4))
    follower.read([str(bad)])  # the same cause again: counted once
    assert health.errors["internal"] == 1
    follower.close()
