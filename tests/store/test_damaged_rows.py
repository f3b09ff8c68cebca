"""Damaged rows in a sound state database, crafted with sqlite3, under the real daemon: the row
is quarantined and counted, its file resumes at a safe point (no lost line, none read twice
where the file tells where it stopped), and the other rows are kept."""

import sqlite3

from support.agent import AgentProcess, write_megatron
from conftest import wait_for
from precision_agent.store.state import DB_NAME


def _agent(tmp_path) -> AgentProcess:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    cfg = tmp_path / "config.yml"
    cfg.write_text("evaluation_interval: 200ms\n")
    return AgentProcess(logs, tmp_path / "state", "--config", str(cfg))


def _first_run(tmp_path) -> None:
    agent = _agent(tmp_path).start()
    try:
        write_megatron(tmp_path / "logs" / "train.log", 1, 20)
        wait_for(lambda: agent.metric("precision_agent_training_step") == 20, what="step 20")
        assert agent.stop() == 0
    finally:
        agent.kill()


def _damage(tmp_path, sql: str) -> None:
    db = sqlite3.connect(tmp_path / "state" / DB_NAME)
    assert db.execute(sql).rowcount == 1
    db.commit()
    db.close()


def _nan_paged_after(tmp_path, lines_read: int) -> str:
    """Append steps 21-25 (a NaN loss at 25), start, and check what was read and paged."""
    write_megatron(tmp_path / "logs" / "train.log", 21, 24)
    write_megatron(tmp_path / "logs" / "train.log", 25, 25, grad="nan")
    agent = _agent(tmp_path).start()
    try:
        wait_for(lambda: agent.metric("precision_agent_alerts", alertname="TrainingNonFinite",
                                      alertstate="firing"), what="the NaN after the damaged row paged")
        wait_for(lambda: agent.metric("precision_agent_state_rows_quarantined_total", table="offsets") == 1,
                 what="the damaged row counted")
        wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == lines_read,
                 what="the lines counted (just after their samples: a scrape may fall between)")
        assert agent.metric("precision_agent_errors_total", kind="state") == 1
        assert agent.stop() == 0
        return agent.stderr()
    finally:
        agent.kill()


def _quarantined(tmp_path) -> list[tuple[str, str]]:
    db = sqlite3.connect(tmp_path / "state" / DB_NAME)
    try:
        return db.execute("SELECT tbl, reason FROM quarantine").fetchall()
    finally:
        db.close()


def test_negative_offset_resumes_after_the_saved_line_count(tmp_path):
    _first_run(tmp_path)
    _damage(tmp_path, "UPDATE offsets SET offset = -5")
    err = _nan_paged_after(tmp_path, lines_read=5)  # exactly the 5 new lines: nothing lost, nothing twice
    assert "quarantined a damaged row of table offsets" in err and "resuming after line 20" in err
    assert [t for t, _ in _quarantined(tmp_path)] == ["offsets"]
    again = _agent(tmp_path).start()  # set aside once: the next start neither reports nor re-reads it
    try:
        write_megatron(tmp_path / "logs" / "train.log", 26, 26)
        wait_for(lambda: again.metric("precision_agent_training_step") == 26, what="step 26")
        wait_for(lambda: again.metric("precision_agent_log_lines_read_total") == 1,
                 what="the lines counted")
        assert again.metric("precision_agent_errors_total", kind="state") == 0
        assert "TrainingNonFinite FIRING" not in again.stderr()
    finally:
        again.kill()


def test_unreadable_offset_and_line_read_the_file_again_without_losing_the_nan(tmp_path):
    _first_run(tmp_path)
    _damage(tmp_path, "UPDATE offsets SET offset = 'x', line = -1")
    err = _nan_paged_after(tmp_path, lines_read=25)  # no safe point in the row: from the start
    assert "read again from its start" in err


def test_damaged_alert_row_is_quarantined_and_the_others_kept(tmp_path):
    _first_run(tmp_path)
    write_megatron(tmp_path / "logs" / "train.log", 21, 21, grad="nan")
    agent = _agent(tmp_path).start()
    try:
        wait_for(lambda: agent.alerts(), what="NaN paged")
        assert agent.stop() == 0
    finally:
        agent.kill()
    db = sqlite3.connect(tmp_path / "state" / DB_NAME)
    db.execute("INSERT INTO alerts SELECT 'bogus', rule, labels, state, 'yesterday', last_seen, fired_at, "
               "resolved_at, annotations, finding, count FROM alerts")
    db.commit()
    db.close()
    again = _agent(tmp_path).start()
    try:
        wait_for(lambda: again.metric("precision_agent_state_rows_quarantined_total", table="alerts") == 1,
                 what="damaged alert row counted")
        assert [a["alertname"] for a in again.alerts()] == ["TrainingNonFinite"]  # the sound one, kept
        assert "TrainingNonFinite FIRING" not in again.stderr()
        assert again.stop() == 0
    finally:
        again.kill()
    assert [t for t, _ in _quarantined(tmp_path)] == ["alerts"]
