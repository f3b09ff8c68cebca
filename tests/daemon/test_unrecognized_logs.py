"""Never blind without saying so, with the real agent as a subprocess and logs written by other
processes: a followed file that grows but yields no record raises LogFormatUnrecognized (its last
lines, cleaned, in the evidence; a gauge; the file's verdict in /api/v1/status) and it clears when
records come; a file whose records stop while it grows raises LogRecordsStopped; a file of warnings
beside the run's real log, and the healthy corpus written as a trainer writes it, raise nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.agent import AgentProcess, write_megatron
from conftest import corpus_path, wait_for

# appends N lines no parser knows (one with colour codes and a bell, one very long) and flushes each
NOISE = r"""
import sys
path, first, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "a") as f:
    for i in range(first, first + n):
        if i % 10 == 3:
            f.write(f"\x1b[32mworker {i}\x1b[0m: shard\x07 {i} ready\n")
        elif i % 10 == 7:
            f.write(f"worker {i}: " + "x" * 5000 + "\n")
        else:
            f.write(f"worker {i}: prefetching shard {i} of the dataset\n")
        f.flush()
"""

# appends a file's lines in chunks, flushing each: a trainer writing its log
COPY = r"""
import sys, time
src, dst = sys.argv[1], sys.argv[2]
lines = open(src, encoding="utf-8", errors="replace").read().splitlines(keepends=True)
with open(dst, "a") as f:
    for i in range(0, len(lines), 7):
        f.write("".join(lines[i:i + 7]))
        f.flush()
        time.sleep(0.01)
"""

LIMITS = {"unrecognized_lines": 40, "unrecognized_min_lines": 10, "unrecognized_after": "1h"}


def noise(path: Path, first: int, n: int) -> None:
    subprocess.run([sys.executable, "-c", NOISE, str(path), str(first), str(n)], check=True, timeout=60)


def _agent(tmp_path: Path, limits: dict | None = None) -> tuple[AgentProcess, Path]:
    logs, state = tmp_path / "logs", tmp_path / "state"
    logs.mkdir()
    config = tmp_path / "agent.yml"
    config.write_text(json.dumps({"evaluation_interval": "200ms", "resync_interval": "300ms", "limits": limits or {}}))
    return AgentProcess(logs, state, "--config", str(config)).start(), logs


def _reader_alerts(agent: AgentProcess, name: str, state: str = "firing") -> list[dict]:
    return [a for a in agent.alerts() if a["alertname"] == name and a["state"] == state]


def _files(agent: AgentProcess) -> dict[str, dict]:
    return {f["path"]: f for f in json.loads(agent.get("/api/v1/status"))["data"]["files"]}


def test_an_unrecognised_file_raises_a_ticket_with_its_lines_and_clears_when_records_come(tmp_path):
    agent, logs = _agent(tmp_path, LIMITS)
    log = logs / "train.log"
    try:
        noise(log, 1, 5)
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 5, what="first lines read")
        assert not _reader_alerts(agent, "LogFormatUnrecognized")  # 5 lines: too few to judge
        noise(log, 6, 60)  # the file grows: 65 lines, no record
        wait_for(lambda: _reader_alerts(agent, "LogFormatUnrecognized"), what="LogFormatUnrecognized fires")
        (alert,) = _reader_alerts(agent, "LogFormatUnrecognized")
        assert alert["labels"]["file"] == str(log) and alert["labels"]["run"] == "train"
        assert alert["labels"]["severity"] == "ticket"
        sample = alert["evidence"]["evidence"]["sample"].splitlines()
        assert 1 <= len(sample) <= 5, sample
        assert all(len(s) <= 200 for s in sample), sample
        assert not any(c in s for s in sample for c in "\x1b\x07"), sample  # ANSI and control characters out
        assert any("prefetching shard" in s for s in sample), sample
        assert "prefetching shard" in alert["annotations"]["description"]
        assert agent.metric("precision_agent_log_files_unrecognized") == 1
        assert _files(agent)[str(log)]["unrecognized"] == "unrecognized"
        assert _files(agent)[str(log)]["records"] == 0
        assert not _reader_alerts(agent, "LogRecordsStopped")

        write_megatron(log, 1, 3)  # the trainer's records come (a format the agent reads)
        wait_for(lambda: not _reader_alerts(agent, "LogFormatUnrecognized"), what="the ticket clears")
        wait_for(lambda: agent.metric("precision_agent_log_files_unrecognized") == 0, what="gauge back to 0")
        assert _files(agent)[str(log)]["unrecognized"] is None
    finally:
        agent.stop()


def test_records_that_stop_while_the_file_grows_raise_records_stopped(tmp_path):
    agent, logs = _agent(tmp_path, LIMITS)
    log = logs / "gpt.log"
    try:
        for first in range(1, 31, 5):  # records in several writes: gaps between them are seen
            write_megatron(log, first, first + 4)
        wait_for(lambda: agent.metric("precision_agent_training_step", run="gpt") == 30, what="records read")
        noise(log, 1, 30)  # the trainer was upgraded: its lines are no longer recognised
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 60, what="noise read")
        assert not _reader_alerts(agent, "LogRecordsStopped")  # 30 lines: below the threshold yet
        noise(log, 31, 30)
        wait_for(lambda: _reader_alerts(agent, "LogRecordsStopped"), what="LogRecordsStopped fires")
        (alert,) = _reader_alerts(agent, "LogRecordsStopped")
        assert alert["labels"]["file"] == str(log)
        assert alert["evidence"]["evidence"]["records"] == 30 and alert["evidence"]["evidence"]["reason"] == "stopped"
        assert "iteration" not in alert["evidence"]["evidence"]["sample"]  # the lines since the last record only
        assert not _reader_alerts(agent, "LogFormatUnrecognized")
        assert _files(agent)[str(log)]["unrecognized"] == "stopped"
        log.unlink()  # the file goes away: its ticket is withdrawn
        wait_for(lambda: not _reader_alerts(agent, "LogRecordsStopped"), what="the ticket clears")
    finally:
        agent.stop()


def test_a_file_of_warnings_beside_the_runs_log_raises_nothing(tmp_path):
    """train.err holds no record, but train.log of the same run does: the run is not blind."""
    agent, logs = _agent(tmp_path, LIMITS)
    try:
        write_megatron(logs / "train.log", 1, 5)
        noise(logs / "train.err", 1, 5)
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 10, what="both read")
        write_megatron(logs / "train.log", 6, 10)
        noise(logs / "train.err", 6, 100)
        write_megatron(logs / "train.log", 11, 12)
        noise(logs / "train.err", 106, 100)
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 217, what="all read")
        assert not [a for a in agent.alerts() if a["alertname"] in ("LogFormatUnrecognized", "LogRecordsStopped")]
        assert agent.metric("precision_agent_log_files_unrecognized") == 0
    finally:
        agent.stop()


def test_the_healthy_corpus_written_as_trainers_write_raises_no_reader_ticket(tmp_path):
    healthy = corpus_path("logs", "healthy")
    files = sorted(healthy.glob("*.log"))
    assert files
    agent, logs = _agent(tmp_path)  # the shipped thresholds
    try:
        total = 0
        for f in files:
            subprocess.run([sys.executable, "-c", COPY, str(f), str(logs / f.name)], check=True, timeout=60)
            total += f.read_bytes().count(b"\n")
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == total, what="corpus read")
        assert not [a for a in agent.alerts() if a["alertname"] in ("LogFormatUnrecognized", "LogRecordsStopped")]
        assert agent.metric("precision_agent_log_files_unrecognized") == 0
        assert all(f["records"] > 0 for f in _files(agent).values()), _files(agent)
    finally:
        agent.stop()


@pytest.mark.parametrize("kind", ["healthy", "faulty"])
def test_no_corpus_log_goes_near_the_threshold_without_a_record(kind):
    """The longest run of lines without a record (before the first, between two, after the last)
    in every corpus log stays far below the shipped limits.unrecognized_lines: the ticket cannot
    come from a real trainer's prologue or an evaluation phase of these runs."""
    from precision_agent.config import Config
    from precision_agent.model import HINT_METRICS
    from precision_agent.readers.logstream import LogStream
    root = corpus_path("logs")
    files = sorted((root / "healthy").glob("*.log")) if kind == "healthy" else sorted(root.glob("*.log"))
    limit = Config().limits.unrecognized_lines
    assert files
    for f in files:
        stream = LogStream(str(f), {}, "auto", None)
        try:
            lines = sorted({s.source.line for s in stream.poll(1 << 30) + stream.finish() if s.metric not in HINT_METRICS})
        finally:
            stream.close()
        assert lines, f"{f}: no record"
        edges = [0, *lines, stream.stats.lines + 1]
        longest = max(b - a - 1 for a, b in zip(edges, edges[1:]))
        assert longest < limit / 4, (f.name, longest)
