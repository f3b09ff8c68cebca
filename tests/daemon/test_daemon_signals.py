"""The real daemon as a subprocess, talking to a fake systemd.

A fake ``NOTIFY_SOCKET`` (an AF_UNIX datagram socket bound in the test's tmp dir) stands in for
systemd: the agent must send READY=1 once its first pass is done, WATCHDOG=1 every
WATCHDOG_USEC/2, STOPPING=1 on SIGTERM and then exit 0. SIGHUP reloads rule files; a broken
file is counted as an error and its last good version stays in force. A bad config exits 2 and
names the file and the field. Every wait is a poll with a deadline; every process is killed in
teardown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest
from support.agent import FakeSystemd

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "systemd" / "config.example.yml"
START_DEADLINE = 30.0   # interpreter + numpy/pydantic imports on a slow CI runner
DEADLINE = 10.0
T = TypeVar("T")

EXTRA_RULE = """\
groups:
  - name: extra
    rules:
      - alert: ExtraRule
        kind: nonfinite
        params: {metrics: [loss]}
        labels: {severity: warning}
        annotations: {summary: "x {{ $value }}"}
"""
BROKEN_RULE = EXTRA_RULE.replace("kind: nonfinite", "kind: bogus")


# -- helpers -------------------------------------------------------------------------------------------


def wait_for(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "precision-agent"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "precision_agent"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Agent:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(agent_cmd() + args, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        finally:
            self._out.close()


@pytest.fixture
def fake_systemd(tmp_path: Path) -> Iterator[FakeSystemd]:
    fs = FakeSystemd(tmp_path)
    yield fs
    fs.close()


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[..., Agent]]:
    agents: list[Agent] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> Agent:
        a = Agent(args, env or clean_env(), tmp_path / f"agent{len(agents)}.log")
        agents.append(a)
        return a

    yield start
    for a in agents:
        a.stop()


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    out = {name: tmp_path / name for name in ("logs", "state", "rules")}
    for d in out.values():
        d.mkdir()
    # resync_interval 1h: a rule change can only be picked up by SIGHUP, not by the periodic resync
    cfg = tmp_path / "agent.yml"
    cfg.write_text("resync_interval: 1h\nevaluation_interval: 200ms\ndebounce: 10ms\n")
    out["config"] = cfg
    return out


def run_args(dirs: dict[str, Path], port: int) -> list[str]:
    return ["run", "--config", str(dirs["config"]), "--watch", str(dirs["logs"]),
            "--listen", f"127.0.0.1:{port}", "--state", str(dirs["state"]), "--rules", str(dirs["rules"])]


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def status(port: int) -> dict:
    code, body = http_get(port, "/api/v1/status")
    assert code == 200, (code, body)
    return json.loads(body)["data"]


def rule_names(port: int) -> list[str]:
    return [r["alert"] for r in status(port)["rules"]]


def rule_file_errors(port: int) -> float:
    code, body = http_get(port, "/metrics")
    assert code == 200, code
    m = re.search(r'^precision_agent_errors_total\{kind="rule_file"\} (\S+)$', body.decode(), re.M)
    assert m, body.decode()[:2000]
    return float(m.group(1))


def wait_ready(agent: Agent, port: int) -> None:
    def ready() -> bool:
        assert agent.alive(), f"agent exited early:\n{agent.output()}"
        return http_get(port, "/-/ready")[0] == 200
    wait_for(ready, START_DEADLINE, "/-/ready")


# -- sd_notify: READY, WATCHDOG, STOPPING, exit 0 --------------------------------------------------------


def test_ready_watchdog_stopping_and_clean_exit(dirs, fake_systemd: FakeSystemd, start_agent) -> None:
    (dirs["logs"] / "train.log").write_text("iteration 1/ 10 | lm loss: 2.5 |\n")
    port = free_port()
    agent = start_agent(run_args(dirs, port),
                        clean_env(NOTIFY_SOCKET=str(fake_systemd.path), WATCHDOG_USEC="400000"))

    def ready() -> bool:
        assert agent.alive(), f"agent exited before READY=1:\n{agent.output()}"
        return fake_systemd.index("READY=1") >= 0
    wait_for(ready, START_DEADLINE, "READY=1")
    ready_msg = fake_systemd.messages[fake_systemd.index("READY=1")][1]
    assert any(line.startswith("STATUS=") for line in ready_msg), ready_msg
    # READY=1 is sent after the first pass, so the HTTP readiness probe agrees at once
    assert http_get(port, "/-/ready")[0] == 200

    # WATCHDOG_USEC=400000 -> a ping every 0.2 s; at least two after READY
    def pings_after_ready() -> int:
        i = fake_systemd.index("READY=1")
        n = sum(msg.count("WATCHDOG=1") for _, msg in fake_systemd.messages[i + 1:])
        return n if n >= 2 else 0
    wait_for(pings_after_ready, DEADLINE, "two WATCHDOG=1 after READY=1")
    times = [t for t, msg in fake_systemd.messages if "WATCHDOG=1" in msg]
    assert all(b - a < 1.5 for a, b in zip(times, times[1:])), "pings far apart for a 0.2 s period"

    agent.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: fake_systemd.index("STOPPING=1") >= 0, DEADLINE, "STOPPING=1")
    rc = agent.proc.wait(timeout=DEADLINE + 30)  # the agent may wait for the current batch
    assert rc == 0, agent.output()
    assert (dirs["state"] / "state.sqlite3").is_file()
    assert "state saved" in agent.output()
    assert fake_systemd.count("READY=1") == 1


def test_no_notify_socket_no_problem(dirs, start_agent) -> None:
    """Outside systemd (no NOTIFY_SOCKET) the agent runs and stops the same way."""
    port = free_port()
    agent = start_agent(run_args(dirs, port))
    wait_ready(agent, port)
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=DEADLINE + 30) == 0, agent.output()


# -- SIGHUP: rule reload, bad file keeps the last good version -----------------------------------------


def test_sighup_reloads_rules_and_keeps_last_good_version(dirs, start_agent) -> None:
    port = free_port()
    agent = start_agent(run_args(dirs, port))
    wait_ready(agent, port)
    assert "ExtraRule" not in rule_names(port)
    baseline = rule_file_errors(port)

    rule = dirs["rules"] / "extra.yml"
    rule.write_text(EXTRA_RULE)
    time.sleep(0.3)  # nothing but SIGHUP may load it (resync_interval is 1h)
    assert "ExtraRule" not in rule_names(port)
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "ExtraRule" in rule_names(port), DEADLINE, "ExtraRule after SIGHUP")
    assert status(port)["rule_errors"] == {}
    assert rule_file_errors(port) == baseline

    rule.write_text(BROKEN_RULE)
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: rule_file_errors(port) > baseline, DEADLINE, 'errors_total{kind="rule_file"} to go up')
    assert agent.alive(), agent.output()
    assert rule_file_errors(port) == baseline + 1  # one reload, one error
    st = status(port)
    assert "ExtraRule" in [r["alert"] for r in st["rules"]], "the last good version must stay in force"
    assert str(rule) in st["rule_errors"] and "bogus" in st["rule_errors"][str(rule)]
    assert http_get(port, "/-/healthy")[0] == 200

    # fixing the file and reloading again clears the error
    rule.write_text(EXTRA_RULE.replace("ExtraRule", "ExtraRuleFixed"))
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "ExtraRuleFixed" in rule_names(port), DEADLINE, "ExtraRuleFixed after SIGHUP")
    st = status(port)
    assert "ExtraRule" not in [r["alert"] for r in st["rules"]] and st["rule_errors"] == {}

    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=DEADLINE + 30) == 0, agent.output()


# -- bad config: exit 2, file and field named ----------------------------------------------------------


@pytest.mark.parametrize("body,field", [
    ('listen: "nonsense"\nwatches: [{path: /x}]\n', "listen"),
    ("watches: [{path: /x, kind: bogus}]\n", "watches.0.kind"),
])
def test_bad_config_exits_2_naming_file_and_field(tmp_path: Path, body: str, field: str) -> None:
    cfg = tmp_path / "bad.yml"
    cfg.write_text(body)
    r = subprocess.run(agent_cmd() + ["run", "--config", str(cfg), "--state", str(tmp_path / "state")],
                       capture_output=True, text=True, timeout=START_DEADLINE, env=clean_env(),
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"{cfg}: {field}: " in r.stderr, r.stderr


# -- the shipped example config starts the real daemon -------------------------------------------------


def test_example_config_starts_the_daemon(tmp_path: Path, fake_systemd: FakeSystemd, start_agent) -> None:
    """systemd/config.example.yml (paths that do not exist here, state and port overridden the way
    /etc/default/precision-agent's ARGS would) gets the agent to READY=1 and a clean stop."""
    port = free_port()
    state = tmp_path / "state"
    agent = start_agent(["run", "--config", str(EXAMPLE), "--state", str(state), "--listen", f"127.0.0.1:{port}"],
                        clean_env(NOTIFY_SOCKET=str(fake_systemd.path)))

    def ready() -> bool:
        assert agent.alive(), f"agent exited before READY=1:\n{agent.output()}"
        return fake_systemd.index("READY=1") >= 0
    wait_for(ready, START_DEADLINE, "READY=1")
    st = status(port)
    assert len(st["watches"]) == 2 and st["rules"], st
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=DEADLINE + 30) == 0, agent.output()


def test_sighup_rereads_the_config_file_and_names_what_needs_a_restart(tmp_path):
    """SIGHUP re-reads --config as at start: a changed setting is named in the log and raises
    precision_agent_config_restart_needed (the running configuration stays); a broken file is a
    config error that keeps the agent running; the original content again clears the gauge."""
    from support.agent import AgentProcess
    watch = tmp_path / "logs"
    watch.mkdir()
    cfg = tmp_path / "agent.yml"
    cfg.write_text("resync_interval: 60s\n")
    agent = AgentProcess(watch, tmp_path / "state", "--config", str(cfg)).start()
    try:
        assert agent.metric("precision_agent_config_restart_needed") == 0
        cfg.write_text("resync_interval: 30s\n")
        agent.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: agent.metric("precision_agent_config_restart_needed") == 1, DEADLINE,
                 "restart needed after an edit")
        assert agent.metric("precision_agent_config_reloads_total", result="success") == 1
        wait_for(lambda: "changed resync_interval" in agent.stderr(), DEADLINE, "the log names the field")
        cfg.write_text("resync_interval: [\n")
        agent.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: agent.metric("precision_agent_config_reloads_total", result="failure") == 1,
                 DEADLINE, "a failed reload counted")
        assert agent.metric("precision_agent_errors_total", kind="config") >= 1
        assert "keeping the running configuration" in agent.stderr()
        cfg.write_text("resync_interval: 60s\n")
        agent.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: agent.metric("precision_agent_config_restart_needed") == 0, DEADLINE,
                 "the original content clears the gauge")
        assert agent.ready()
    finally:
        agent.stop()
