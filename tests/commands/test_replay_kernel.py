"""``replay`` of real kernel logs (tests/fixtures/kernel): a hardware Xid is a page finding naming the
device and code (exit 1), application Xids are none (exit 0), and a kernel log without a fault is a
clean replay, never "no record recognised" (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "kernel"


def replay(*args: str, env: dict | None = None) -> tuple[int, dict, str]:
    p = subprocess.run([sys.executable, "-m", "precision_agent", "replay", "--json", *args],
                       capture_output=True, text=True, timeout=120, env=env)
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else {}, p.stderr


def test_hardware_xids_page_application_xids_do_not():
    rc, out, _ = replay(str(FIXTURES / "kern.log"))
    assert rc == 1 and out["format"] == "kernel" and out["records"] == 7
    assert [(f["rule"], f["severity"], f["line"]) for f in out["findings"]] == [
        ("GpuHardwareFault", "page", 4), ("GpuHardwareFault", "page", 7), ("GpuHardwareFault", "page", 8),
        ("GpuHardwareFault", "page", 11)]   # 11: an older driver's "fallen off the bus" without an Xid 79
    assert out["findings"][0]["summary"] == "GPU 0000:2b:00 hardware fault: Xid 79 (GPU has fallen off the bus)"
    rc, out, _ = replay(str(FIXTURES / "journal-short-iso.txt"), "--format", "kernel")   # Xid 45 only
    assert rc == 0 and out["records"] == 2 and out["findings"] == []
    rc, out, _ = replay(str(FIXTURES / "dmesg.txt"))   # Xid 13 and an unknown 109
    assert rc == 0 and out["records"] == 5 and out["findings"] == []


def test_a_kernel_log_without_faults_is_a_clean_replay(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("May 18 19:02:31 gpu-node-a kernel: [ 8713.220981] IPv6: ADDRCONF(NETDEV_CHANGE): veth0: link "
                   "becomes ready\n" * 50)
    rc, out, err = replay(str(log), "--format", "kernel")
    assert rc == 0 and out["records"] == 0 and out["unrecognized"] is None and out["findings"] == []
    rc, out, err = replay(str(log))   # auto: no format knows it, as before
    assert rc == 2 and out["unrecognized"] is not None


def test_a_broken_user_catalogue_is_reported_and_the_shipped_one_kept(tmp_path):
    bad = tmp_path / "codes.yml"
    bad.write_text("nvidia_xid: {not: a list}\n")
    rc, out, err = replay(str(FIXTURES / "kern.log"), env={**os.environ, "PRECISION_AGENT_FAULT_CODES": str(bad)})
    assert rc == 1 and len(out["findings"]) == 4
    assert f"fault codes: {bad}" in err


def test_ascend_npu_faults_and_journal_exports_page_like_xids():
    rc, out, _ = replay(str(FIXTURES / "ascend-messages.txt"))   # auto-detected
    assert rc == 1 and out["format"] == "kernel" and out["records"] == 3   # the "Event resume" line is none
    assert [(f["rule"], f["line"]) for f in out["findings"]] == [("GpuHardwareFault", 2), ("GpuHardwareFault", 3)]
    assert out["findings"][1]["summary"].startswith("NPU 3 hardware fault: fault 0x80E01801 (")   # no "GPU", no "Xid"
    assert "HBM" in out["findings"][1]["summary"]
    rc, out, _ = replay(str(FIXTURES / "journal-export.txt"), "--format", "kernel")   # Xid 94 and 48
    assert rc == 1 and out["records"] == 2 and [f["line"] for f in out["findings"]] == [11, 23]
