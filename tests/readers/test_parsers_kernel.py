"""The ``kernel`` log format: NVIDIA Xid lines of real kernel logs (tests/fixtures/kernel, with their
sources) in every shape the kernel log comes in, their meaning and class from the fault-code
catalogue (extendable by a user file), and no false detection in training logs."""

from __future__ import annotations

import re

import pytest

from conftest import REPO, corpus_path
from precision_agent.model import HW_FAULT
from precision_agent.readers import faultcodes
from precision_agent.readers.logstream import LogStream
from precision_agent.readers.parsers import Block, CompositeParser

FIXTURES = REPO / "tests" / "fixtures" / "kernel"


def faults(text: str, fmt: str = "kernel") -> list[dict]:
    parser = CompositeParser(fmt)
    out = []
    for rec in parser.parse(Block(text)):
        for metric, value, attrs in rec.values:
            if metric == HW_FAULT:
                assert value == 1.0 and rec.step is None and rec.rank is None
                out.append({"line": rec.line, "time": rec.log_time, **dict(attrs)})
    assert not parser.errors
    return out


def test_syslog_kern_log_hardware_and_application_xids():
    got = faults((FIXTURES / "kern.log").read_text())
    assert [(f["line"], f["device"], f["code"], f["class"]) for f in got] == [
        (4, "0000:2b:00", 79, "hardware"), (7, "0000:10:1c", 63, "hardware"), (8, "0000:3b:00", 48, "hardware"),
        (9, "0000:41:00", 13, "application"), (10, "0000:41:00", 13, "application"),
        (11, "0000:01:00", 79, "hardware"),   # an older driver: off the bus without an Xid 79 line
        (12, "0000:01:00", 3, "unknown")]   # the older driver's form, without "PCI:"
    assert got[0]["meaning"] == "GPU has fallen off the bus" and got[0]["message"] == "GPU has fallen off the bus."
    assert got[1]["pid"] == 1896 and got[1]["message"].startswith("Row Remapper: New row marked for remapping")
    assert "DBE" in got[2]["meaning"] and "partition 0" in got[2]["message"]
    assert got[5]["inferred"] is True and got[5]["meaning"] == "GPU has fallen off the bus"
    assert got[6]["meaning"] == "Xid 3 (not in the fault-code catalogue)"
    # the "GPU at PCI:..." and "GPU ... has fallen off the bus." lines next to the Xid 79 are no second fault
    assert len(got) == 7 and not any(f.get("inferred") for f in got[:5])


def test_mig_xids_name_the_physical_gpu_and_its_instances():
    """A MIG GPU's Xid carries its GPU instance, and compute instance where known, inside the
    parenthesis (the driver's format, kernel_rc.c): the same fault of the same physical GPU."""
    got = faults("[Mon Aug  5 03:54:13 2024] NVRM: Xid (PCI:0000:3b:00 GPU-I:02 GPU-CI:01): 94, pid=2512125, "
                 "name=python3, Contained: SM (0x1). RST: No, D-RST: No\n"
                 "[Mon Aug  5 03:54:14 2024] NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 43, pid=77, name=python3, "
                 "Ch 00000008\n")
    assert [(f["device"], f["code"], f.get("gpu_instance"), f.get("compute_instance")) for f in got] == [
        ("0000:3b:00", 94, 2, 1), ("0000:3b:00", 43, 5, None)]
    assert got[0]["pid"] == 2512125 and got[0]["message"].startswith("Contained: SM")


def test_dmesg_kmsg_and_journal_shapes():
    dmesg = faults((FIXTURES / "dmesg.txt").read_text())
    assert [(f["code"], f["class"]) for f in dmesg] == [(13, "application")] * 2 + [(109, "unknown")] + \
        [(13, "application")] * 2
    assert "pid" not in dmesg[0] and "process" not in dmesg[0]   # pid='<unknown>', name=<unknown>
    assert dmesg[2]["pid"] == 1797828 and dmesg[2]["process"] == "pt_main_thread"
    assert dmesg[2]["message"].startswith("Ch 00000008, errorString CTX SWITCH TIMEOUT")
    kmsg = faults((FIXTURES / "kmsg.txt").read_text())
    assert [(f["device"], f["code"], f["class"]) for f in kmsg] == [
        ("0000:9b:00", 94, "hardware"), ("0019:01:00", 149, "unknown"), ("0018:01:00", 145, "unknown")]
    assert kmsg[0]["process"] == "python3" and kmsg[0]["message"] == "Contained ECC error"
    journal = faults((FIXTURES / "journal-short-iso.txt").read_text())
    assert [(f["device"], f["code"], f["class"]) for f in journal] == [
        ("0000:dc:00", 45, "application"), ("0000:ed:00", 45, "application")]
    assert journal[0]["time"] == 1779088491.0   # 2026-05-18T07:14:51+0000
    export = faults("MESSAGE=NVRM: Xid (PCI:0000:3b:00): 95, pid=7, name=python, Uncontained: FBHUB.\n")
    assert [(f["code"], f["class"], f["message"]) for f in export] == [(95, "hardware", "Uncontained: FBHUB.")]


def test_auto_detects_only_the_unmistakable_shape():
    text = (FIXTURES / "kern.log").read_text()
    parser = CompositeParser("auto")
    parser.parse(Block(text))
    assert parser.format == "kernel"
    # prose about Xids, or an "Xid" in a training line, is no fault
    for line in ("Xid 79 means the GPU has fallen off the bus\n", "step 10 | loss 2.5 | Xid (PCI): 79\n",
                 "NVRM: Xid (PCI:nothex): 79, x\n", "iteration 5/10 | lm loss: 2.5 | NVRM: Xid list empty\n"):
        assert faults(line, "auto") == []


def test_kernel_format_reads_nothing_else():
    megatron = " iteration        1/      15 | lm loss: 1.048190E+01 | loss scale: 1.0 | grad norm: 3.2 |\n"
    parser = CompositeParser("kernel")
    assert [m for r in parser.parse(Block(megatron)) for m, _, _ in r.values] == []
    assert parser.sparse and not CompositeParser("auto").sparse and not CompositeParser("megatron").sparse


def test_users_extend_the_catalogue_and_a_broken_file_keeps_the_shipped_one(tmp_path, monkeypatch):
    extra = tmp_path / "codes.yml"
    extra.write_text("nvidia_xid:\n  - {code: 149, meaning: NVLink NETIR error, class: hardware, source: ours}\n"
                     "  - {code: 13, meaning: our own words, class: unknown}\n")
    monkeypatch.setenv(faultcodes.ENV_EXTRA, str(extra))
    line = "NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406)\n"
    assert [(f["class"], f["meaning"]) for f in faults(line)] == [("hardware", "NVLink NETIR error")]
    assert faults("NVRM: Xid (PCI:0000:41:00): 13, Graphics Exception\n")[0]["class"] == "unknown"  # ours win
    assert faults("NVRM: Xid (PCI:0000:41:00): 79, gone\n")[0]["class"] == "hardware"  # the shipped rest stays
    extra.write_text("nvidia_xid:\n  - {code: 149, class: broken}\n")
    faultcodes.fault_codes.cache_clear()
    codes, why = faultcodes.current_codes()
    assert why is not None and str(extra) in why and "class" in why
    assert codes[("nvidia_xid", 79)].cls == "hardware"
    assert faults(line)[0]["class"] == "unknown"


def test_every_shipped_entry_names_its_source():
    codes = faultcodes.fault_codes(None)
    nvidia = {c: e for (f, c), e in codes.items() if f == "nvidia_xid"}
    assert {c for c, e in nvidia.items() if e.cls == "application"} == {13, 31, 43, 45}
    assert {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140} <= {c for c, e in nvidia.items() if e.cls == "hardware"}
    assert not {144, 145, 149, 150} & set(nvidia)   # NVLink5: fatal or not is in the intrinfo, not the code
    assert all(e.source.startswith("https://docs.nvidia.com/") for e in nvidia.values())
    ascend = {c: e for (f, c), e in codes.items() if f == "ascend"}
    assert len(ascend) > 150 and all(re.fullmatch(r"0x[0-9A-F]{8}", c) for c in ascend)
    assert all(e.source.startswith("https://github.com/Ascend/mind-cluster/") for e in ascend.values())
    assert ascend["0x80E01801"].cls == "hardware" and "HBM" in ascend["0x80E01801"].meaning
    # informational events and faults MindCluster leaves alone never page
    assert ascend["0x8C2FA009"].cls == ascend["0x81078603"].cls == "unknown"
    assert {c for c, e in ascend.items() if e.cls == "application"} == {"0x80C98002", "0x80CB8002"}


def test_a_kernel_log_followed_as_a_file(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text((FIXTURES / "kern.log").read_text())
    stream = LogStream(str(log), {"host": "gpu-node-a"}, "kernel")
    try:
        samples = stream.poll(1 << 20) + stream.finish()
    finally:
        stream.close()
    assert [(s.metric, s.source.line, s.attr("code")) for s in samples] == [
        (HW_FAULT, 4, 79), (HW_FAULT, 7, 63), (HW_FAULT, 8, 48), (HW_FAULT, 9, 13), (HW_FAULT, 10, 13),
        (HW_FAULT, 11, 79), (HW_FAULT, 12, 3)]
    assert all(s.labels == (("host", "gpu-node-a"),) and s.producer == "kernel" for s in samples)


@pytest.mark.parametrize("name", ["megatron", "hf", "deepspeed"])
def test_no_training_log_of_the_corpus_reads_as_kernel(name):
    root = corpus_path()
    logs = [p for p in sorted(root.rglob("*.log")) if name in str(p).lower()][:20]
    if not logs:
        pytest.skip(f"no {name} logs in the corpus")
    for p in logs:
        assert faults(p.read_text(errors="replace")[:2_000_000], "auto") == [], p


def test_only_the_kernels_lines_are_faults_not_a_users_logger():
    """Anyone may write "NVRM: Xid ..." to syslog (``logger``); syslog names the program that wrote a
    line, and only the kernel's are faults. Lines without a program tag (dmesg, kmsg, the journal's
    export) are the kernel's own."""
    xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=51210, name=python3, GPU has fallen off the bus."
    text = "\n".join([
        f"Nov 28 07:42:14 gpu-node-a kernel: [ 8700.000001] {xid}",
        f"Nov 28 07:42:15 gpu-node-a someone: {xid}",
        f"Nov 28 07:42:16 gpu-node-a python3[812]: {xid}",
        f"2026-11-28T07:42:17.000001+08:00|user|logger[-]|{xid}",
        f"2026-11-28T07:42:18.000001+08:00|err|kernel[-]|[21202266.129771] {xid}",
        f"2026-11-28T07:42:19+0800 gpu-node-a kernel: {xid}",
        f"[ 8710.000001] {xid}",
    ]) + "\n"
    got = faults(text)
    assert [f["line"] for f in got] == [1, 5, 6, 7], got


def test_the_journals_entries_of_programs_are_not_faults():
    """The journal's export and JSON entries name who wrote them in ``_TRANSPORT``: the kernel's
    ring buffer is "kernel"; a user's ``logger`` is "syslog", a service's output "stdout"."""
    xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=51210, name=python3, GPU has fallen off the bus."

    def export(transport: str, stamp: int) -> str:
        return (f"__REALTIME_TIMESTAMP={stamp}\n__MONOTONIC_TIMESTAMP=8700000001\n_TRANSPORT={transport}\n"
                f"SYSLOG_IDENTIFIER=x\nMESSAGE={xid}\nPRIORITY=3\n\n")

    def json_line(transport: str, stamp: int) -> str:
        return ('{"__REALTIME_TIMESTAMP":"%d","_TRANSPORT":"%s","PRIORITY":"3","MESSAGE":"%s"}\n'
                % (stamp, transport, xid))

    exp = export("kernel", 1716058959061820) + export("syslog", 1716058960061820) + export("stdout", 1716058961061820)
    assert [f["line"] for f in faults(exp)] == [5]
    # the transport after the message (field order is not fixed), and an entry without one
    late = f"__REALTIME_TIMESTAMP=1716058959061820\nMESSAGE={xid}\n_TRANSPORT=journal\n\n"
    bare = f"__REALTIME_TIMESTAMP=1716058959061820\nMESSAGE={xid}\n\n"
    assert faults(late) == [] and len(faults(bare)) == 1
    js = json_line("syslog", 1716058960061820) + json_line("kernel", 1716058961061820) + json_line("stdout", 1)
    assert [f["line"] for f in faults(js)] == [2]
