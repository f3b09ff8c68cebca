"""A full state disk, for real: the state directory on a small tmpfs filled to the last byte,
the real daemon as a subprocess. The agent names the cause once, keeps paging from memory,
never claims a save that failed, starts on a full disk and saves again once there is room."""

import errno
import os
import subprocess
import uuid

import pytest

from support.agent import AgentProcess, write_megatron
from conftest import wait_for


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only: skipped elsewhere), unmounted after the test."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                       timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def fill(disk) -> list:
    """Fill the file system to its last byte with filler files; returns them (delete to free)."""
    files = []
    for size in (1 << 16, 4096, 512, 1):
        while True:
            path = disk / f"filler-{uuid.uuid4().hex}"
            try:
                with open(path, "wb") as f:
                    files.append(path)
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    return files


def firing(agent, metric):
    return agent.metric("precision_agent_alerts", alertname="TrainingNonFinite", metric=metric, alertstate="firing")


# the failed saves' backoff (1 s doubling to 60 s by default) capped short: the tests wait for the
# save that works once there is room, not for the backoff
RETRY = "limits:\n  state_save_retry_max: 500ms\n"


def agent_on(tmp_path, disk):
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    cfg = tmp_path / "config.yml"
    cfg.write_text("evaluation_interval: 200ms\n" + RETRY)
    agent = AgentProcess(logs, disk / "state", "--config", str(cfg))
    agent.stderr_path = tmp_path / f"agent-{agent.port}.stderr"  # not on the full disk
    return agent, logs / "train.log"


def test_disk_full_while_running_names_the_cause_once_and_keeps_paging(tmp_path, small_disk):
    agent, log = agent_on(tmp_path, small_disk)
    agent.start()
    try:
        write_megatron(log, 1, 20)
        wait_for(lambda: agent.metric("precision_agent_training_step") == 20, what="step 20")
        fill(small_disk)
        for first in range(21, 121, 20):  # batches that must be saved, each one failing
            write_megatron(log, first, first + 19)
            wait_for(lambda: agent.metric("precision_agent_training_step") == first + 19, what="step read")
        write_megatron(log, 121, 121, grad="nan")
        wait_for(lambda: firing(agent, "grad_norm"), what="NaN paged while the disk is full")
        wait_for(lambda: (agent.metric("precision_agent_state_save_failures_total", cause="disk full") or 0) >= 3,
                 timeout=30, what="failed saves counted")
        assert agent.metric("precision_agent_state_unsaved") == 1
        err = agent.stderr()
        assert "cannot rollback" not in err
        assert err.count("cannot save state (disk full)") == 1, err  # once per cause, not per attempt
        assert "retried every 0.5 s at most" in err, err  # limits.state_save_retry_max
        assert agent.metric("precision_agent_errors_total", kind="state") == 1
        assert agent.stop() == 1  # the final save failed: not a clean exit
        err = agent.stderr()
        assert "state saved in" not in err and "state NOT saved" in err and "disk full" in err
    finally:
        agent.kill()


def test_start_on_a_full_disk_runs_from_memory_and_saves_when_room_returns(tmp_path, small_disk):
    agent, log = agent_on(tmp_path, small_disk)
    agent.start()
    try:
        write_megatron(log, 1, 10)
        write_megatron(log, 11, 11, grad="nan")
        wait_for(lambda: firing(agent, "grad_norm"), what="NaN paged")
        assert agent.stop() == 0
    finally:
        agent.kill()
    filler = fill(small_disk)
    write_megatron(log, 12, 20)  # written while the agent was down
    again, _ = agent_on(tmp_path, small_disk)
    again.start()  # a full disk is no configuration error: no exit 2, no restart loop
    try:
        wait_for(lambda: again.metric("precision_agent_training_step") == 20, what="resumed and read on")
        wait_for(lambda: again.metric("precision_agent_log_lines_read_total") == 9,  # resumed from the saved offset
                 what="the lines counted")
        assert firing(again, "grad_norm")  # the alert of the last run, kept, not paged again
        assert "TrainingNonFinite FIRING" not in again.stderr()
        assert again.metric("precision_agent_state_unsaved") == 1
        assert "disk full" in again.stderr()
        write_megatron(log, 21, 23)
        for f in filler:
            f.unlink()
        wait_for(lambda: again.metric("precision_agent_state_unsaved") == 0, timeout=60, what="saved again")
        assert "state saved again" in again.stderr()
        assert again.stop() == 0 and "stopped; state saved" in again.stderr()
    finally:
        again.kill()
    third, _ = agent_on(tmp_path, small_disk)
    third.start()
    try:  # what was read while the disk was full was saved once there was room: nothing read twice
        write_megatron(log, 24, 24)
        wait_for(lambda: third.metric("precision_agent_training_step") == 24, what="step 24")
        wait_for(lambda: third.metric("precision_agent_log_lines_read_total") == 1,
                 what="the lines counted")
    finally:
        third.kill()


def test_dump_origins_on_a_store_that_starts_on_a_full_disk_are_saved_once_there_is_room(small_disk):
    """No state file and no room: the store starts unavailable (no connection at all). Saving the
    dump origins names the cause (a StateError, as every other save), and the next commit that
    works writes them."""
    from precision_agent.store.causes import StateError
    from precision_agent.store.state import StateStore
    filler = fill(small_disk)
    store = StateStore(small_disk / "state")
    assert store.unavailable is not None
    rows = [{"run": "r", "rank": "0", "step": 3}]
    with pytest.raises(StateError) as failed:
        store.save_dump_origins(rows)
    assert failed.value.cause == "disk full"
    with pytest.raises(StateError):
        store.commit(dump_origins=rows)
    for f in filler:
        f.unlink()
    store.commit(dump_origins=rows)
    store.close()
    assert StateStore(small_disk / "state").load_dump_origins() == rows


def test_dumps_scanned_on_a_full_disk_all_page_and_their_origins_are_saved_when_room_returns(tmp_path, small_disk):
    """Started on a full disk with no state file: every NaN dump of the batch pages (a failed save
    of the dump origins once crashed the handling and dropped the rest of the batch), and the
    origins are written by the first save that works."""
    import shutil
    import sqlite3
    from pathlib import Path
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "msprobe_incidents" / "two_runs"
    if not fixtures.is_dir():
        pytest.skip("fixtures not generated")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    cfg = tmp_path / "config.yml"
    cfg.write_text(f"evaluation_interval: 200ms\ndump_settle: 0.3s\nwatches:\n  - path: {dumps}\n    kind: dump\n{RETRY}")
    filler = fill(small_disk)
    agent = AgentProcess(tmp_path / "nolog", small_disk / "state", "--config", str(cfg))
    agent.stderr_path = tmp_path / f"agent-{agent.port}.stderr"
    agent.start()
    try:
        for job in ("job_a", "job_b"):
            shutil.copytree(fixtures / job, dumps / job)
        wait_for(lambda: {a["labels"].get("run") for a in agent.alerts() if a["alertname"] == "DumpNonFinite"}
                 == {"job_a", "job_b"}, timeout=120, what="both runs' NaN dumps paged")
        assert not agent.metric("precision_agent_errors_total", kind="internal"), agent.stderr()
        for f in filler:
            f.unlink()
        wait_for(lambda: agent.metric("precision_agent_state_unsaved") == 0, timeout=60, what="saved again")
        assert agent.stop() == 0
    finally:
        agent.kill()
    db = sqlite3.connect(small_disk / "state" / "state.sqlite3")
    try:
        (row,) = db.execute("SELECT value FROM meta WHERE key='dump_origins'").fetchall()
    finally:
        db.close()
    assert "job_a" in row[0] and "job_b" in row[0]


def test_failed_saves_back_off_from_1_s_doubling_to_the_configured_ceiling(tmp_path):
    """A failed save is retried after 1 s, 2 s, 4 s ... up to 60 s by default
    (limits.state_save_retry_max), so a full disk is not hammered; one that works resets it."""
    from precision_agent.config.agent import Limits
    from precision_agent.health import Health
    from precision_agent.store.causes import StateError
    from precision_agent.store.saving import SaveTracker
    assert Limits().state_save_retry_max == 60.0
    assert Limits(state_save_retry_max="500ms").state_save_retry_max == 0.5
    with pytest.raises(ValueError):
        Limits(state_save_retry_max="10ms")
    for ceiling, want in ((Limits().state_save_retry_max, [1, 2, 4, 8, 16, 32, 60, 60]), (0.5, [0.5] * 3)):
        saves, now, delays = SaveTracker(Health(), tmp_path / "state", ceiling), 100.0, []
        for _ in want:
            assert saves.due(now)
            saves.failed(StateError("no room", "disk full"), now)
            delays.append(saves.next_try - now)
            assert not saves.due(now + delays[-1] - 0.01)
            now += delays[-1]
        assert delays == want
        saves.succeeded()
        assert saves.due(now) and saves.delay == 0.0
