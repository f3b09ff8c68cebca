"""Hardware or numerics (issue 22), with the real agent as a subprocess following a kern.log (``format:
kernel``) and Megatron training logs, all appended by other processes: each TrainingNonFinite carries
``suspect`` by what the host and the job said before it, in /api/v1/alerts (label, evidence,
annotation) and in precision_agent_alerts; faults are counted in precision_agent_hardware_faults_total.

One agent, one host: the runs come one after another, each after the kernel lines it is judged by.
The Megatron rerun lines are the real message texts of megatron/core/rerun_state_machine.py
(tests/fixtures/megatron_rerun/README.md)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import wait_for
from support.agent import AgentProcess, write_megatron
from support.kernel import append_lines, kernel_agent

# syslog stamps in the host's zone, of now: a kernel log line is read as it is written (an old
# stamp is backlog, agent/series/hardware.py)
KERNEL = "{} gpu-node-a kernel: [ 8700.{:06d}] "
XID13 = ("NVRM: Xid (PCI:0000:41:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
         "(GPC 1, TPC 0, SM 0): Illegal Instruction Encoding")
XID79 = "NVRM: Xid (PCI:0000:3B:00): 79, pid=51210, name=python3, GPU has fallen off the bus."
NAN_LINE = (" iteration {it:>8}/    1000 | consumed samples: {s:>12} | learning rate: 1.000000E-04 | global batch "
            "size:     8 | lm loss: nan | loss scale: 1.0 | grad norm: nan | number of skipped iterations:   0 | "
            "number of nan iterations:   1 |")
FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron_rerun"


def kernel(path: Path, lines: list[str]) -> None:
    append_lines(path, [KERNEL.format(time.strftime("%b %d %H:%M:%S"), i) + line for i, line in enumerate(lines)])


@pytest.fixture
def agent(tmp_path):
    proc, kern, logs = kernel_agent(tmp_path, {"format": "megatron"}, suspect_window="10m")
    yield proc.start(), kern, logs
    proc.kill()


def nan_incident(agent: AgentProcess, log: Path) -> dict:
    """A healthy bf16 Megatron run that goes NaN at iteration 21; its TrainingNonFinite alert."""
    write_megatron(log, 1, 20, scale="1.0", grad="0.9")
    append_lines(log, [NAN_LINE.format(it=21, s=168)])
    return firing(agent, log.stem)


def firing(agent: AgentProcess, run: str) -> dict:
    alerts = wait_for(lambda: [a for a in agent.alerts() if a["alertname"] == "TrainingNonFinite"
                               and a["state"] == "firing" and a["labels"].get("run") == run],
                      what=f"TrainingNonFinite of {run}")
    return alerts[0]


def suspects(agent: AgentProcess) -> dict[str, str]:
    return {a["labels"]["run"]: a["labels"]["suspect"] for a in agent.alerts() if a["alertname"] == "TrainingNonFinite"}


def test_each_incident_says_hardware_numerics_or_unknown_by_what_came_before_it(agent):
    agent, kern, logs = agent
    # no evidence at all: unknown, never a guess
    a = nan_incident(agent, logs / "quiet.log")
    assert a["labels"]["suspect"] == "unknown"
    assert "no hardware fault" in a["annotations"]["suspect"]

    # an application Xid only: listed, not hardware
    kernel(kern, ["IPv6: ADDRCONF(NETDEV_CHANGE): veth3c1e2f0: link becomes ready", XID13])
    wait_for(lambda: agent.metric("precision_agent_hardware_faults_total", device="0000:41:00", code="13",
                                  **{"class": "application"}) == 1, what="Xid 13 counted")
    a = nan_incident(agent, logs / "app.log")
    assert a["labels"]["suspect"] == "unknown"
    assert [f["code"] for f in a["evidence"]["evidence"]["suspect_evidence"]["not_hardware_faults"]] == [13]

    # Xid 79 read before the NaN: hardware, the fault named beside the first bad step
    kernel(kern, [XID79])
    wait_for(lambda: agent.metric("precision_agent_hardware_faults_total", device="0000:3b:00", code="79",
                                  **{"class": "hardware"}) == 1, what="Xid 79 counted")
    a = nan_incident(agent, logs / "xid.log")
    assert a["labels"]["suspect"] == "hardware"
    ev = a["evidence"]["evidence"]["suspect_evidence"]
    assert ev["first_bad_step"] == 21 and [f["code"] for f in ev["faults"]] == [79]
    assert ev["faults"][0]["device"] == "0000:3b:00" and ev["faults"][0]["at"].endswith("kern.log:3")
    assert "Xid 79" in a["annotations"]["suspect"] and "Suspect: hardware" in a["annotations"]["description"]

    # Megatron's rerun reproduced the NaN on another GPU: numerics, the Xid 79 of this host notwithstanding
    rerun = logs / "rerun.log"
    write_megatron(rerun, 88000, 88020, scale="1.0", grad="0.9")
    append_lines(rerun, (FIXTURES / "second_rerun_reproducible.log").read_text().splitlines())
    a = firing(agent, "rerun")
    assert a["labels"]["suspect"] == "numerics" and a["labels"]["metric"] == "loss"
    ev = a["evidence"]["evidence"]["suspect_evidence"]
    assert {r["verdict"] for r in ev["reruns"]} == {"detected", "reproducible"} and ev["faults"]
    assert "reproduced the result on another GPU at iteration 88021" in a["annotations"]["suspect"]

    assert suspects(agent) == {"quiet": "unknown", "app": "unknown", "xid": "hardware", "rerun": "numerics"}
    for run, s in suspects(agent).items():
        assert agent.metric("precision_agent_alerts", alertname="TrainingNonFinite", alertstate="firing",
                            run=run, suspect=s) == 1
    assert not [x for x in agent.alerts() if x["alertname"] == "GpuHardwareFault" and x["labels"]["code"] == "13"]


def test_megatron_transient_rerun_is_hardware_without_any_kernel_fault(agent):
    agent, _kern, logs = agent
    log = logs / "transient.log"
    append_lines(log, (FIXTURES / "validate_transient.log").read_text().splitlines())
    a = firing(agent, "transient")
    assert a["labels"]["suspect"] == "hardware"
    assert "not reproducible on a rerun on the same GPU" in a["annotations"]["suspect"]
    (r,) = [r for r in a["evidence"]["evidence"]["suspect_evidence"]["reruns"] if r["verdict"] == "transient"]
    assert (r["rank"], r["node"], r["device"], r["iteration"]) == ("3", "gpu-node-a", "3", 1235)


def test_a_fault_read_before_a_restart_of_the_agent_still_decides(agent):
    agent, kern, logs = agent
    kernel(kern, [XID79])
    wait_for(lambda: agent.metric("precision_agent_hardware_faults_total", code="79") == 1, what="Xid 79 counted")
    assert agent.stop() == 0
    agent.start()   # the kernel line is not read again (offsets kept): the fault comes back from the state
    assert agent.metric("precision_agent_hardware_faults_total", code="79") is None   # a counter starts afresh
    a = nan_incident(agent, logs / "after.log")
    assert a["labels"]["suspect"] == "hardware"
    assert [f["code"] for f in a["evidence"]["evidence"]["suspect_evidence"]["faults"]] == [79]
