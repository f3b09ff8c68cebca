"""The state store recovers from a damaged database file (moved aside, reported, started empty)
and still refuses a state directory it cannot write."""

import os
import sqlite3
import time

import pytest

from precision_agent.config import ConfigError
from precision_agent.model import Alert, AlertState
from precision_agent.readers.tailer import TailPosition
from precision_agent.store.state import DB_NAME, KEEP_CORRUPT, StateError, StateStore


def corrupt_files(state_dir):
    return sorted(p.name for p in state_dir.iterdir() if ".corrupt-" in p.name)


def test_garbage_file_is_moved_aside_and_store_starts_empty(tmp_path):
    (tmp_path / DB_NAME).write_bytes(os.urandom(8192))
    errors: list[str] = []
    store = StateStore(tmp_path, errors.append)
    try:
        assert store.moved_aside is not None and store.moved_aside.is_file()
        assert store.moved_aside.read_bytes()[:16] != b"SQLite format 3\x00"  # the garbage, kept
        assert len(errors) == 1 and str(store.moved_aside) in errors[0] and "not a usable SQLite" in errors[0]
        assert store.load_offsets() == {}
        store.commit(offsets={"/x.log": TailPosition(1, 2, 30, 4)})
        assert store.load_offsets()["/x.log"].offset == 30
    finally:
        store.close()


def test_healthy_store_is_kept(tmp_path):
    store = StateStore(tmp_path)
    store.commit(offsets={"/x.log": TailPosition(1, 2, 30, 4)})
    store.close()
    errors: list[str] = []
    again = StateStore(tmp_path, errors.append)
    try:
        assert errors == [] and again.moved_aside is None and corrupt_files(tmp_path) == []
        assert again.load_offsets()["/x.log"] == TailPosition(1, 2, 30, 4)
    finally:
        again.close()


def test_damaged_pages_fail_quick_check_and_are_moved_aside(tmp_path):
    store = StateStore(tmp_path)
    store.commit(offsets={f"/logs/{i:05d}.log": TailPosition(1, i, i, i) for i in range(3000)})
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    path = tmp_path / DB_NAME
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 6 * page
    data[3 * page:5 * page] = os.urandom(2 * page)  # b-tree pages of the offsets table; header intact
    path.write_bytes(bytes(data))
    errors: list[str] = []
    again = StateStore(tmp_path, errors.append)
    try:
        assert again.moved_aside is not None, "a store with damaged pages was accepted"
        assert len(errors) == 1 and "integrity check failed" in errors[0], errors
        assert again.load_offsets() == {}
    finally:
        again.close()


def test_foreign_sqlite_file_is_moved_aside(tmp_path):
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("CREATE TABLE offsets (name TEXT)")  # someone else's database at our path
    db.commit()
    db.close()
    errors: list[str] = []
    store = StateStore(tmp_path, errors.append)
    store.close()
    assert store.moved_aside is not None and "table offsets has columns" in errors[0]


def test_at_most_three_moved_aside_copies_are_kept(tmp_path):
    moved = []
    for _ in range(KEEP_CORRUPT + 2):
        (tmp_path / DB_NAME).write_bytes(b"not a database" * 100)
        store = StateStore(tmp_path)
        store.close()
        moved.append(store.moved_aside.name)
    assert len(set(moved)) == len(moved)
    assert corrupt_files(tmp_path) == sorted(moved[-KEEP_CORRUPT:])  # the newest ones


def test_newer_schema_is_refused_not_destroyed(tmp_path):
    store = StateStore(tmp_path)
    store.db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    store.close()
    with pytest.raises(StateError, match="newer than this agent"):
        StateStore(tmp_path)
    assert corrupt_files(tmp_path) == []


def test_unwritable_state_dir_fails_fast_with_field(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as err:
        StateStore(blocker / "state")
    assert err.value.field == "state_dir" and err.value.file == str(blocker / "state")
    assert "Not a directory" in err.value.reason


def test_unreadable_rows_are_skipped_and_reported(tmp_path):
    store = StateStore(tmp_path)
    good = Alert("fp1", "R", (("run", "a"),), AlertState.FIRING, 1.0, 2.0, 1.5, None, {}, {}, 1)
    store.commit(alerts=[good])
    store.db.execute("INSERT INTO alerts VALUES ('fp2','R','not json','firing',1,1,NULL,NULL,'{}','{}',1)")
    store.db.execute("INSERT INTO offsets VALUES ('/y.log','x',1,1,1,?)", (time.time(),))
    store.close()
    errors: list[str] = []
    again = StateStore(tmp_path, errors.append)
    try:
        assert [a.fingerprint for a in again.load_alerts()] == ["fp1"]
        assert again.load_offsets() == {}  # /y.log does not exist: nothing to resume
        assert len(errors) == 2 and "table alerts" in errors[0] and "table offsets" in errors[1]
        assert again.quarantined == {"alerts": 1, "offsets": 1}
        again.commit()  # the next commit moves them to the quarantine table
        assert [r[0] for r in again.db.execute("SELECT tbl FROM quarantine ORDER BY tbl")] == ["alerts", "offsets"]
        assert again.db.execute("SELECT count(*) FROM alerts").fetchone()[0] == 1
    finally:
        again.close()
    third = StateStore(tmp_path, errors.append)
    try:  # set aside for good: not reported again
        assert third.load_alerts() and len(errors) == 2 and third.quarantined == {}
    finally:
        third.close()


# -- detector memory across a restart of the real daemon ----------------------------------------------
from support.agent import AgentProcess, write_megatron  # noqa: E402
from conftest import wait_for  # noqa: E402

DECREASING = """
groups:
  - name: scale
    rules:
      - alert: ScaleDecreasing
        kind: loss_scale
        params: {condition: decreases, min_decreases: 3, window: WINDOW, warmup_steps: 20}
        resolve_after: 3s
        labels: {severity: ticket}
"""


def _agent(tmp_path, window: int = 2000) -> AgentProcess:
    logs, rules = tmp_path / "logs", tmp_path / "rules"
    logs.mkdir(exist_ok=True)
    rules.mkdir(exist_ok=True)
    (rules / "scale.yml").write_text(DECREASING.replace("WINDOW", str(window)))
    cfg = tmp_path / "config.yml"
    cfg.write_text(f"default_rules: false\nrule_dirs: [{rules}]\nevaluation_interval: 200ms\n")
    return AgentProcess(logs, tmp_path / "state", "--config", str(cfg))


def _at_step(agent: AgentProcess, step: int) -> None:
    wait_for(lambda: agent.metric("precision_agent_training_step") == step, what=f"step {step} read")


def _firing(agent: AgentProcess) -> list[dict]:
    return [a for a in agent.alerts() if a["alertname"] == "ScaleDecreasing" and a["state"] == "firing"]


def _first_run(tmp_path, backoffs: list[str], window: int = 2000) -> str:
    """Warm up past step 20, then one 10-step interval per scale in ``backoffs``; stop cleanly."""
    log = tmp_path / "logs" / "train.log"
    agent = _agent(tmp_path, window).start()
    try:
        write_megatron(log, 1, 30, scale="65536.0")
        for i, scale in enumerate(backoffs):
            write_megatron(log, 31 + 10 * i, 40 + 10 * i, scale=scale)
        _at_step(agent, 30 + 10 * len(backoffs))
        assert agent.stop() == 0
        return agent.stderr()
    finally:
        agent.kill()


def test_collapse_split_across_a_restart_fires_once_after_it(tmp_path):
    before = _first_run(tmp_path, ["32768.0", "16384.0"])  # two decreases: fewer than min_decreases
    assert "ScaleDecreasing FIRING" not in before and "stopped; state saved" in before
    agent = _agent(tmp_path).start()
    try:
        write_megatron(tmp_path / "logs" / "train.log", 51, 60, scale="8192.0")  # the third, after the restart
        wait_for(lambda: _firing(agent), what="ScaleDecreasing firing after the restart")
        (alert,) = _firing(agent)
        evidence = alert["evidence"]["evidence"]
        assert evidence["decreases"] == 3 and evidence["since_step"] == 31 and alert["evidence"]["step"] == 51
        # the API shows a page before the worker logs its transition (worker._process): wait for the line
        wait_for(lambda: "alert ScaleDecreasing FIRING" in agent.stderr(), what="the FIRING log line")
        assert agent.stderr().count("alert ScaleDecreasing FIRING") == 1
    finally:
        agent.kill()


def test_firing_stateful_alert_resolves_after_a_restart(tmp_path):
    before = _first_run(tmp_path, ["32768.0", "16384.0", "8192.0"])
    assert before.count("alert ScaleDecreasing FIRING") == 1  # fired before the restart
    agent = _agent(tmp_path).start()
    try:
        assert len(_firing(agent)) == 1  # restored, not re-paged
        write_megatron(tmp_path / "logs" / "train.log", 61, 70, scale="16384.0")  # the scale grows again
        wait_for(lambda: not _firing(agent), what="ScaleDecreasing resolved after the scale recovered")
        wait_for(lambda: "alert ScaleDecreasing resolved" in agent.stderr(), what="the resolved log line")
        assert "ScaleDecreasing FIRING" not in agent.stderr()  # never re-paged
    finally:
        agent.kill()


def test_rule_edited_between_runs_starts_empty(tmp_path):
    _first_run(tmp_path, ["32768.0", "16384.0"])
    agent = _agent(tmp_path, window=1500).start()  # another window: another meaning of the memory
    try:
        write_megatron(tmp_path / "logs" / "train.log", 51, 60, scale="8192.0")
        _at_step(agent, 60)
        write_megatron(tmp_path / "logs" / "train.log", 61, 62, scale="8192.0")
        _at_step(agent, 62)
        assert _firing(agent) == []  # one decrease since the restart; the two before are forgotten
    finally:
        agent.kill()


def test_corrupt_memory_row_is_quarantined_and_its_page_kept(tmp_path):
    _first_run(tmp_path, ["32768.0", "16384.0", "8192.0"])
    db = sqlite3.connect(tmp_path / "state" / DB_NAME)
    assert db.execute("UPDATE memory SET data='{\"decreases\": [[1, 2' WHERE rule LIKE '%ScaleDecreasing'").rowcount
    db.commit()
    db.close()
    agent = _agent(tmp_path).start()
    try:
        wait_for(lambda: agent.metric("precision_agent_state_rows_quarantined_total", table="memory") == 1,
                 what="damaged memory row quarantined")
        assert agent.metric("precision_agent_errors_total", kind="state") == 1
        assert "quarantined a damaged row of table memory" in agent.stderr()
        # the rule starts empty, but the page it had open is kept: an unreadable row is no recovery
        assert len(_firing(agent)) == 1 and "ScaleDecreasing resolved" not in agent.stderr()
        (alert,) = _firing(agent)
        assert alert["evidence"]["memory_lost_at"] > 0
        # with nothing to tell it still holds, it resolves as an event's alert does (resolve_after)
        wait_for(lambda: not _firing(agent), what="kept alert resolved after resolve_after without a hit")
        assert "ScaleDecreasing FIRING" not in agent.stderr()  # never paged again
        write_megatron(tmp_path / "logs" / "train.log", 61, 70, scale="4096.0")
        _at_step(agent, 70)  # and the agent goes on reading
        assert agent.stop() == 0
    finally:
        agent.kill()
    db = sqlite3.connect(tmp_path / "state" / DB_NAME)
    rows = db.execute("SELECT tbl, reason FROM quarantine").fetchall()
    db.close()
    assert len(rows) == 1 and rows[0][0] == "memory" and "not JSON" in rows[0][1], rows
