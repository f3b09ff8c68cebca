"""Structured metric files followed by the real daemon (a subprocess), written by other processes:
a TensorBoard event file appended record by record (its last record torn across an agent restart)
and Lightning's metrics.csv rewritten with a new header mid-run. The NaN pages at its step, the
healthy files page nothing, nothing is read twice."""

from __future__ import annotations

import shutil

from conftest import wait_for
from precision_agent.readers.streams import open_stream
from support.agent import AgentProcess
from support.metricfiles import (HF_NAN_STEP, LIGHTNING_NAN_STEP, append_spans, before_rewrite, csv_file,
                                 event_file, record_spans)


def nonfinite_page(agent: AgentProcess, run: str) -> list[dict]:
    """The firing TrainingNonFinite alerts of ``run``."""
    return [a for a in agent.alerts() if (a["alertname"], a["state"], a["labels"].get("run"))
            == ("TrainingNonFinite", "firing", run)]


def lines_read(agent: AgentProcess) -> float:
    return agent.metric("precision_agent_log_lines_read_total") or 0


def test_event_file_appended_record_by_record_with_a_torn_record_across_a_restart(tmp_path):
    logs, state = tmp_path / "logs", tmp_path / "state"
    src = event_file("hf_nan")
    run = logs / "runs" / "Nov28_04-00-00_host"
    run.mkdir(parents=True)
    dest = run / src.name
    spans = record_spans(src)
    k = 100  # records before the torn one (the NaN comes later, at step 37)
    agent = AgentProcess(logs, state).start()
    try:
        append_spans(src, dest, spans[:k])
        torn = spans[k]
        cut = torn[0] + (torn[1] - torn[0]) // 2
        append_spans(src, dest, [(torn[0], cut)])
        wait_for(lambda: lines_read(agent) == k, what=f"the whole records read ({lines_read(agent)})")
        assert agent.metric("precision_agent_training_step", run="Nov28_04-00-00_host") is not None
        assert not agent.alerts() and agent.metric("precision_agent_errors_total", kind="parse") == 0
        assert agent.stop() == 0
    finally:
        agent.kill()
    append_spans(src, dest, [(cut, torn[1])] + spans[k + 1:])  # the rest, while the agent is down
    agent2 = AgentProcess(logs, state).start()
    try:
        alert = wait_for(lambda: nonfinite_page(agent2, "Nov28_04-00-00_host"), what="TrainingNonFinite")[0]
        assert alert["evidence"]["step"] == HF_NAN_STEP, alert
        wait_for(lambda: lines_read(agent2) == len(spans) - k, what="the rest read, nothing twice")
        assert agent2.metric("precision_agent_metric_records_skipped_total") == 0
    finally:
        agent2.stop()


def test_csv_rewritten_mid_run_and_healthy_event_files(tmp_path):
    logs, state = tmp_path / "logs", tmp_path / "state"
    for case in ("hf_ok", "megatron_ok"):  # healthy runs in the same watch: no page
        shutil.copytree(event_file(case).parent, logs / case / event_file(case).parent.name)
    version = logs / "lightning_logs" / "version_0"
    version.mkdir(parents=True)
    early, final = before_rewrite("lightning_nan")
    assert b"nan" not in early
    agent = AgentProcess(logs, state).start()
    try:
        (version / "metrics.csv").write_bytes(early)
        wait_for(lambda: agent.metric("precision_agent_training_step", run="logs_lightning_logs_version_0"),
                 what="the CSV's first rows")
        wait_for(lambda: agent.metric("precision_agent_training_step", run="megatron_ok") == 60, what="megatron")
        assert not agent.alerts()
        with open(version / "metrics.csv", "wb") as f:  # the logger's rewrite (same inode)
            f.write(final)
        alert = wait_for(lambda: nonfinite_page(agent, "logs_lightning_logs_version_0"),
                         what="TrainingNonFinite from the CSV")[0]
        assert alert["evidence"]["step"] == LIGHTNING_NAN_STEP, alert
        expected = 0
        for path in [version / "metrics.csv"] + [event_file(c) for c in ("hf_ok", "megatron_ok")]:
            s = open_stream(str(path))
            s.finish(now=0.0)
            expected += s.stats.records
        wait_for(lambda: agent.metric("precision_agent_log_records_parsed_total") == expected,
                 what=f"{expected} records, none read twice")
        assert {a["labels"]["run"] for a in agent.alerts()} == {"logs_lightning_logs_version_0"}
    finally:
        agent.stop()


def test_a_user_metric_map_extends_the_shipped_one_and_a_broken_one_is_said_once(tmp_path):
    logs, state = tmp_path / "logs", tmp_path / "state"
    for name in ("a", "b"):
        (logs / name).mkdir(parents=True)
    extra = tmp_path / "map.yml"
    extra.write_text("metrics:\n  loss: [objective/total]\n")
    rows = b"step,objective/total\r\n" + b"".join(b"%d,%s\r\n" % (i, b"nan" if i == 7 else b"1.5")
                                                   for i in range(10))
    agent = AgentProcess(logs, state).start(env={"PRECISION_AGENT_METRIC_MAP": str(extra)})
    try:
        (logs / "a" / "metrics.csv").write_bytes(rows)
        alert = wait_for(lambda: nonfinite_page(agent, "a"), what="a page from the user's column")[0]
        assert alert["evidence"]["step"] == 7
    finally:
        agent.stop()
    extra.write_text("metrics: [not, a, mapping]\n")
    broken = AgentProcess(logs, tmp_path / "state2").start(env={"PRECISION_AGENT_METRIC_MAP": str(extra)})
    try:
        (logs / "b" / "metrics.csv").write_bytes(b"step,train_loss\n1,2.0\n2,nan\n")
        wait_for(lambda: nonfinite_page(broken, "b"), what="the shipped names still read")
        assert not nonfinite_page(broken, "a")  # the user's column is unknown without the user's map
        assert broken.metric("precision_agent_errors_total", kind="config") == 1  # two files, said once
        assert "metric map" in broken.stderr() and str(extra) in broken.stderr()
    finally:
        broken.stop()
