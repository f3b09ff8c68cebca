"""Hardware faults from the host's kernel log, with the real agent as a subprocess and a kern.log
appended by another process (as rsyslog does) under a ``format: kernel`` watch: an application Xid
(13) pages no one, a hardware Xid (79) pages GpuHardwareFault naming the device and the code, and
the kernel's other lines never make the file "unrecognized"."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import wait_for
from support.agent import AgentProcess
from support.kernel import append_lines, kernel_agent

PREFIX = "May 18 19:02:{:02d} gpu-node-a kernel: [ 87{:02d}.061820] "
NOISE = ["IPv6: ADDRCONF(NETDEV_CHANGE): veth3c1e2f0: link becomes ready",
         'audit: type=1400 audit(1716058950.104:412): apparmor="STATUS" operation="profile_load"',
         "nvidia-nvlink: Nvlink Core is being initialized, major device number 506"]
XID13 = ("NVRM: Xid (PCI:0000:41:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
         "(GPC 1, TPC 0, SM 0): Illegal Instruction Encoding")
XID79 = "NVRM: Xid (PCI:0000:3B:00): 79, pid=51210, name=python3, GPU has fallen off the bus."


def write(path: Path, lines: list[str]) -> None:
    lines = [PREFIX.format(i % 60, i % 100) + line for i, line in enumerate(lines)]
    append_lines(path, lines)


@pytest.fixture
def agent(tmp_path):
    proc, kern, _logs = kernel_agent(tmp_path, limits={"unrecognized_lines": 40, "unrecognized_min_lines": 10,
                                                       "unrecognized_after": "1h"})
    yield proc.start(), kern
    proc.kill()


def _firing(agent: AgentProcess, name: str) -> list[dict]:
    return [a for a in agent.alerts() if a["alertname"] == name and a["state"] == "firing"]


def test_hardware_xid_pages_naming_device_and_code_application_xid_does_not(agent):
    agent, log = agent
    write(log, NOISE * 20 + [XID13] * 3 + NOISE * 10)   # 93 lines: over unrecognized_lines, 3 application faults
    wait_for(lambda: agent.metric("precision_agent_log_lines_read_total") == 93, what="kernel lines read")
    # the pass that read them judged them: the agent's records count them, no alert came of them
    wait_for(lambda: (agent.metric("precision_agent_log_records_parsed_total") or 0) >= 3, what="the Xid 13 records")
    assert not _firing(agent, "GpuHardwareFault")
    assert not _firing(agent, "LogFormatUnrecognized")   # a kernel log is mostly other lines, by nature

    write(log, NOISE + [XID79] + NOISE)
    alerts = wait_for(lambda: _firing(agent, "GpuHardwareFault"), what="GpuHardwareFault fires")
    (alert,) = alerts
    assert alert["labels"]["device"] == "0000:3b:00" and alert["labels"]["code"] == "79"
    assert alert["labels"]["severity"] == "page"
    assert "fallen off the bus" in alert["annotations"]["summary"]
    assert alert["evidence"]["evidence"]["process"] == "python3"
    assert not _firing(agent, "LogFormatUnrecognized")
