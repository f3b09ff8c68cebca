"""Hostile dump trees (issue 14, dump side): special files never block, stuck workers are seen,
decompression is bounded before it runs, and RSS stays bounded whatever the file size.

Real parts throughout: FIFOs and sparse files made with the OS, zips written by zipfile, the
real CLI and the real daemon as subprocesses (peak RSS from ``wait4``'s ``ru_maxrss``, i.e. the
process's VmHWM at exit).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import numpy.lib.format as npformat
import pytest

from support.agent import AgentProcess
from conftest import wait_for
from support.torchpt import tensor_pickle
from support.torchpt import write_msprobe_pt as write_msprobe

from precision_agent.dumps.npy import read_npz
from precision_agent.dumps.scan import scan_dump
from precision_agent.dumps.torchzip import read_pt
from precision_agent.dumps.types import DumpError
from precision_agent.readers.tailer import LogTailer

CLI_DEADLINE = 60.0


# The command runs under a small launcher: Linux carries a forked child's pre-exec memory
# high-water mark into its ru_maxrss, so a child forked from pytest itself would report pytest's.
LAUNCH = r"""
import json, os, subprocess, sys
out, err, res, cmd = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
with open(out, "wb") as o, open(err, "wb") as e:
    p = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
with open(res, "w") as f:
    json.dump({"rc": os.waitstatus_to_exitcode(status), "maxrss": usage.ru_maxrss * 1024}, f)
"""


def cli(*args: str, timeout: float = CLI_DEADLINE) -> tuple[int, str, int]:
    """(exit status, stdout, peak RSS in bytes) of ``precision-agent ARGS`` in a subprocess."""
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"pa-cli-{os.getpid()}-{threading.get_ident()}"
    out_path, err_path, res_path = (base.with_suffix(s) for s in (".out", ".err", ".json"))
    p = subprocess.Popen([sys.executable, "-c", LAUNCH, str(out_path), str(err_path), str(res_path),
                          sys.executable, "-m", "precision_agent", *args], start_new_session=True)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)   # the launcher and the command it runs
        p.wait()
        raise AssertionError(f"precision-agent {' '.join(args)} did not finish in {timeout}s") from None
    res = json.loads(res_path.read_text())
    text, errors = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    for f in (out_path, err_path, res_path):
        f.unlink()
    assert "Traceback" not in errors and "Exception ignored" not in errors, errors
    return res["rc"], text, res["maxrss"]


def nan_npy(path: Path) -> Path:
    a = np.ones(64, np.float32)
    a[7] = np.nan
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, a)
    return path


def sparse_npy(path: Path, nbytes: int, dtype: str = "<f4") -> Path:
    """A .npy of ``nbytes`` of zeros that takes no disk space (a hole after the header)."""
    with open(path, "wb") as fh:
        npformat.write_array_header_1_0(fh, {"descr": dtype, "fortran_order": False,
                                             "shape": (nbytes // np.dtype(dtype).itemsize,)})
        fh.truncate(fh.tell() + nbytes)
    return path


# -- row 1: special files ------------------------------------------------------------------------------


def test_open_regular_refuses_special_files_without_blocking(tmp_path):
    from precision_agent.safeio import NotRegularFile, open_regular, open_regular_file
    fifo = tmp_path / "x.npy"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFile, match="FIFO"):
        open_regular(fifo)
    with pytest.raises(NotRegularFile, match="character device"):
        open_regular("/dev/null")
    with pytest.raises(NotRegularFile, match="directory"):
        open_regular(tmp_path)
    sock_path = tmp_path / "s.npy"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock_path))
        with pytest.raises(NotRegularFile):
            open_regular(sock_path)
    reg = tmp_path / "r.bin"
    reg.write_bytes(b"abc")
    fd = open_regular(reg)
    try:
        assert os.get_blocking(fd)  # O_NONBLOCK cleared again
        assert os.read(fd, 10) == b"abc"
    finally:
        os.close(fd)
    with open_regular_file(reg) as fh:
        assert fh.read() == b"abc"


def test_scan_cli_lists_a_fifo_as_unreadable_and_finds_the_nan_elsewhere(tmp_path):
    tree = tmp_path / "tree"
    nan_npy(tree / "a" / "nan.npy")
    os.mkfifo(tree / "bad.npy")
    os.mkfifo(tree / "bad.npz")
    rc, out, _ = cli("scan", str(tree), "--json")
    r = json.loads(out)
    reasons = {Path(e["path"]).name: e["reason"] for e in r["errors"]}
    assert "FIFO" in reasons["bad.npy"] and "FIFO" in reasons["bad.npz"]
    assert r["first_nonfinite"]["op"].endswith("nan.npy")
    rc, out, _ = cli("scan", str(tree / "bad.npy"), "--json")   # the FIFO itself as the path
    assert "FIFO" in json.loads(out)["errors"][0]["reason"]


def test_scan_of_msprobe_and_cann_trees_with_fifos_does_not_block(tmp_path):
    rank = write_msprobe(tmp_path / "msprobe" / "step0" / "rank0",
                         {"Functional.linear.0.forward": {"input_args": [np.ones(4, np.float32)],
                                                          "output": [np.ones(4, np.float32)]}})
    tensor = rank / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt"
    tensor.unlink()
    os.mkfifo(tensor)
    os.mkfifo(tmp_path / "msprobe" / "step0" / "dump.json")   # a FIFO dump.json: skipped, never read
    cann = tmp_path / "cann"
    cann.mkdir()
    os.mkfifo(cann / "Add.add_1.2.3.1700000000000000")
    os.mkfifo(cann / "mapping.csv")
    for tree in (tmp_path / "msprobe", cann):
        _rc, out, _ = cli("scan", str(tree), "--json")
        assert any("FIFO" in e["reason"] for e in json.loads(out)["errors"]), out


def test_compare_cli_with_fifos_on_both_sides_does_not_block(tmp_path):
    for side in ("bench", "target"):
        nan_npy(tmp_path / side / "x.npy")
        os.mkfifo(tmp_path / side / "y.npy")
    rc, out, _ = cli("compare", str(tmp_path / "bench"), str(tmp_path / "target"), "--json")
    errors = json.loads(out)["errors"]
    assert {e["side"] for e in errors if "FIFO" in e["reason"]} == {"bench", "target"}


def test_log_tailer_refuses_a_fifo_instead_of_blocking(tmp_path):
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    done = threading.Event()
    events: list = []

    def follow() -> None:
        tailer = LogTailer(str(fifo))
        tailer.read()
        events.extend(tailer.drain_events())
        done.set()

    threading.Thread(target=follow, daemon=True).start()
    try:
        assert done.wait(10), "reading a FIFO named *.log blocked"
        assert any("not a regular file" in msg for _, msg in events)
    finally:
        if not done.is_set():  # an old build is stuck opening the FIFO: a writer releases it
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def _dump_agent(tmp_path: Path, dumps: Path, stall: str | None = None) -> AgentProcess:
    cfg = tmp_path / "config.yml"
    cfg.write_text("dump_settle: 0.3s\nevaluation_interval: 0.2s\n"
                   + (f"limits:\n  worker_stall_timeout: {stall}\n" if stall else ""))
    return AgentProcess(tmp_path / "nolog", tmp_path / "state", "--config", str(cfg), "--watch", f"dump:{dumps}")


def _alerting(agent: AgentProcess, name: str) -> bool:
    return any(a["labels"].get("alertname") == name or a.get("alertname") == name for a in agent.alerts())


def test_daemon_fifo_in_dump_tree_is_an_error_and_later_nan_still_alerts(tmp_path):
    dumps = tmp_path / "dumps"
    (dumps / "step1").mkdir(parents=True)
    agent = _dump_agent(tmp_path, dumps).start()
    try:
        os.mkfifo(dumps / "step1" / "x.npy")
        wait_for(lambda: (agent.metric("precision_agent_errors_total", kind="scan") or 0) >= 1, 30,
                 what="the FIFO counted as a scan error")
        assert "not a regular file (a FIFO)" in agent.stderr()
        nan_npy(dumps / "step2" / "y.npy")
        wait_for(lambda: _alerting(agent, "DumpNonFinite"), 30, what="DumpNonFinite for the later NaN dump")
        assert agent.ready()
        assert agent.metric("precision_agent_worker_stalled", worker="dump-scan") == 0
    finally:
        rc = agent.stop(timeout=20)   # a blocked scan thread made SIGTERM take 32 s
    assert rc == 0


# -- row 2: heartbeats ------------------------------------------------------------------------------------

HANG = """
import os, time
import precision_agent.dumps.scan as scan
_real = scan.statistics
def statistics(t, *args, **kwargs):
    # stands in for a read stuck in the kernel (a hung network mount): no progress while HANG exists
    while os.path.exists(os.path.join(os.path.dirname(t.path), "HANG")):
        time.sleep(0.05)
    return _real(t, *args, **kwargs)
scan.statistics = statistics
"""


def test_daemon_stuck_scan_is_seen_and_other_trees_go_on(tmp_path):
    from support.agent import FakeSystemd
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HANG)
    systemd = FakeSystemd(tmp_path)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    agent = _dump_agent(tmp_path, dumps, stall="1s")
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "400000"}
    agent.start(env)
    try:
        wait_for(lambda: systemd.count("WATCHDOG=1") >= 2, 30, what="watchdog pings while healthy")
        (dumps / "stuck").mkdir()
        (dumps / "stuck" / "HANG").write_text("")
        np.save(dumps / "stuck" / "x.npy", np.zeros(8, np.float32))
        wait_for(lambda: not agent.ready(), 30, what="/-/ready 503 while the scan is stuck")
        assert agent.metric("precision_agent_worker_stalled", worker="dump-scan") == 1
        assert agent.metric("precision_agent_worker_stalled", worker="worker") == 0
        wait_for(lambda: (agent.metric("precision_agent_errors_total", kind="scan") or 0) >= 1, 30,
                 what="the stuck scan reported as a scan error")
        assert "no progress for" in agent.stderr()
        systemd.pump()
        before = systemd.count("WATCHDOG=1")
        # one stuck file does not stop the other trees: a NaN elsewhere still pages
        nan_npy(dumps / "other" / "y.npy")
        wait_for(lambda: _alerting(agent, "DumpNonFinite"), 30, what="DumpNonFinite from another tree")
        assert not agent.ready()
        assert systemd.count("WATCHDOG=1") == before, "watchdog fed while a worker is stuck"
        (dumps / "stuck" / "HANG").unlink()
        wait_for(agent.ready, 30, what="ready again once the stuck scan moved on")
        assert agent.metric("precision_agent_worker_stalled", worker="dump-scan") == 0
        assert (agent.metric("precision_agent_worker_heartbeat_timestamp_seconds", worker="worker") or 0) > 0
    finally:
        rc = agent.stop(timeout=20)
        systemd.close()
    assert rc == 0


# -- row 3: decompression bombs ---------------------------------------------------------------------------

BOMB = 256 << 20   # inflated bytes; the zips are ~256 KiB


def _deflated_zeros(z: zipfile.ZipFile, name: str, nbytes: int, head: bytes = b"") -> None:
    chunk = bytes(8 << 20)
    info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    with z.open(info, "w", force_zip64=True) as w:
        w.write(head)
        for _ in range(nbytes // len(chunk)):
            w.write(chunk)


def pt_bomb(path: Path, nbytes: int = BOMB) -> Path:
    stem = path.stem
    numel = nbytes // 4
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{stem}/data.pkl", tensor_pickle("FloatStorage", numel, (numel,), (1,)))
        z.writestr(f"{stem}/byteorder", "little")
        _deflated_zeros(z, f"{stem}/data/0", nbytes)
    return path


def npz_bomb(path: Path, nbytes: int = BOMB) -> Path:
    import io
    head = io.BytesIO()
    npformat.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": (nbytes // 4,)})
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        _deflated_zeros(z, "x.npy", nbytes, head.getvalue())
    return path


def msprobe_pt_bomb(root: Path) -> Path:
    """An msprobe tensor-mode dump whose one output tensor is a .pt bomb (as torch.save would
    write a 256 MiB float32 tensor of zeros, deflated)."""
    rank = root / "step0" / "rank0"
    (rank / "dump_tensor_data").mkdir(parents=True)
    name = "Functional.linear.0.forward.output.0.pt"
    pt_bomb(rank / "dump_tensor_data" / name)
    item = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [BOMB // 4], "Max": 0.0, "Min": 0.0,
            "Mean": 0.0, "Norm": 0.0, "requires_grad": False, "data_name": name}
    doc = {"task": "tensor", "level": "L1", "framework": "pytorch", "dump_data_dir": None,
           "data": {"Functional.linear.0.forward": {"output": [item]}}}
    (rank / "dump.json").write_text(json.dumps(doc))
    return rank / "dump_tensor_data" / name


@pytest.mark.parametrize("kind", ["pt", "npz"])
def test_scanning_a_decompression_bomb_keeps_rss_bounded(tmp_path, kind):
    if kind == "pt":
        f, target = msprobe_pt_bomb(tmp_path / "msprobe"), tmp_path / "msprobe"
    else:
        f = target = npz_bomb(tmp_path / "bomb.npz")
    assert f.stat().st_size < 2 << 20
    rc, out, rss = cli("scan", str(target), "--json")
    r = json.loads(out)
    assert [t["count"] for t in r["tensors"]] == [BOMB // 4] and r["tensors"][0]["zero_fraction"] == 1.0
    assert rss < 160 << 20, f"peak RSS {rss >> 20} MiB scanning a {BOMB >> 20} MiB bomb"


def test_in_memory_inflation_is_refused_beyond_the_limit_before_inflating(tmp_path, monkeypatch):
    from precision_agent.dumps.types import LIMITS
    monkeypatch.setattr(LIMITS, "max_decompressed_bytes", 16 << 20)
    t = read_pt(pt_bomb(tmp_path / "b.pt", 64 << 20))
    with pytest.raises(DumpError, match="max_decompressed_bytes"):
        t.load()
    [m] = read_npz(npz_bomb(tmp_path / "b.npz", 64 << 20))
    with pytest.raises(DumpError, match="max_decompressed_bytes"):
        m.load()


def test_a_member_declaring_more_than_its_shape_needs_is_refused(tmp_path):
    # the storage says 4 elements, the deflated member declares (and inflates to) 64 MiB
    path = tmp_path / "lie.pt"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("lie/data.pkl", tensor_pickle("FloatStorage", 4, (4,), (1,)))
        _deflated_zeros(z, "lie/data/0", 64 << 20)
    with pytest.raises(DumpError, match="need only"):
        read_pt(path)
    path = tmp_path / "lie.npz"
    import io
    head = io.BytesIO()
    npformat.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": (4,)})
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        _deflated_zeros(z, "x.npy", 64 << 20, head.getvalue())
    with pytest.raises(DumpError, match="needs only"):
        read_npz(path)


def test_limits_max_decompressed_bytes_is_a_config_limit():
    from precision_agent.config import Limits
    assert Limits().max_decompressed_bytes == 128 << 20
    assert Limits(max_decompressed_bytes="64MiB").max_decompressed_bytes == 64 << 20
    assert Limits(worker_stall_timeout="5s").worker_stall_timeout == 5.0


# -- row 4: bounded RSS on huge files ---------------------------------------------------------------------

HUGE = 2 << 30


def test_scanning_a_huge_sparse_npy_keeps_rss_bounded(tmp_path):
    f = sparse_npy(tmp_path / "huge.npy", HUGE)
    rc, out, rss = cli("scan", str(f), "--json")
    [t] = json.loads(out)["tensors"]
    assert t["count"] == HUGE // 4 and t["zero_fraction"] == 1.0 and t["nan"] == 0
    assert rss < 200 << 20, f"peak RSS {rss >> 20} MiB scanning a {HUGE >> 30} GiB .npy"


def test_comparing_huge_sparse_npys_keeps_rss_bounded(tmp_path):
    for side in ("bench", "target"):
        (tmp_path / side).mkdir()
        sparse_npy(tmp_path / side / "x.npy", 512 << 20)
    rc, out, rss = cli("compare", str(tmp_path / "bench"), str(tmp_path / "target"), "--json")
    assert rc == 0, out
    assert rss < 300 << 20, f"peak RSS {rss >> 20} MiB comparing two 512 MiB tensors"


def test_region_scan_equals_the_whole_array_scan(tmp_path):
    """The chunked reads hand the kernels the same blocks as a scan of the whole array."""
    from dataclasses import asdict
    from precision_agent.dumps.scanner import scan_array
    from precision_agent.dumps.windows import scan_region
    rng = np.random.default_rng(3)
    a = rng.standard_normal(2_500_003).astype(np.float32)
    a[[5, 1_000_000]] = [np.nan, -np.inf]
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "be.npy", a[:700_001].astype(">f4"))
    np.save(tmp_path / "h.npy", (a[:900_000] * 1e4).astype(np.float16))
    for name in ("a.npy", "be.npy", "h.npy"):
        t = scan_dump(tmp_path / name)["tensors"][0]
        arr = np.load(tmp_path / name)
        for threads in (1, 3):
            from precision_agent.dumps.npy import read_npy
            reg = read_npy(tmp_path / name).region()
            got = asdict(scan_region(reg, threads=threads, block_elems=4099))
            want = asdict(scan_array(arr, threads=threads, block_elems=4099))
            assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True), name
        assert t["count"] == arr.size


def test_pages_are_kept_only_for_trees_a_comparison_reads(tmp_path):
    """The scan thread drops the pages it read from the page cache, except in trees that a
    comparison reads right after (a watch with compare:, or a benchmark tree)."""
    from precision_agent.config import Config
    from precision_agent.daemon.dumpflow import DumpFlow
    from precision_agent.health import Health
    for d in ("cmp", "plain", "bench"):
        (tmp_path / d / "step1").mkdir(parents=True)
    cfg = Config(state_dir=tmp_path / "state", watches=[
        {"path": tmp_path / "cmp", "kind": "dump", "compare": {"against": tmp_path / "bench"}},
        {"path": tmp_path / "plain", "kind": "dump"}])
    flow = DumpFlow(cfg, Health(), None, None, None)  # type: ignore[arg-type]
    assert flow.keep_cache(str(tmp_path / "cmp" / "step1"))
    assert flow.keep_cache(str(tmp_path / "bench" / "step1"))
    assert not flow.keep_cache(str(tmp_path / "plain" / "step1"))


def test_zip_members_zipfile_cannot_handle_are_errors_not_crashes(tmp_path):
    """Found by the fuzz suite: a member needing a zip version zipfile lacks (NotImplementedError)
    and a member with an empty name (IndexError inside zipfile) made scan_dump raise."""
    import io
    import zipfile
    from precision_agent.dumps.scan import scan_dump
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        arr = io.BytesIO()
        np.save(arr, np.ones(3, np.float32))
        zf.writestr("a.npy", arr.getvalue())
    raw = bytearray(buf.getvalue())
    cd = raw.rfind(b"PK\x01\x02")
    raw[cd + 6:cd + 8] = (255).to_bytes(2, "little")  # version needed to extract: 25.5, beyond zipfile
    raw[4:6] = (255).to_bytes(2, "little")
    (tmp_path / "version.npz").write_bytes(bytes(raw))
    empty = io.BytesIO()
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr(zipfile.ZipInfo(""), b"x")
    (tmp_path / "empty.npz").write_bytes(empty.getvalue())
    np.save(tmp_path / "nan.npy", np.array([1.0, np.nan], np.float32))
    r = scan_dump(tmp_path)
    assert r["first_nonfinite"]["op"] == "nan.npy"
    bad = {e[0].rsplit("/", 1)[-1] if isinstance(e, tuple) else e["path"].rsplit("/", 1)[-1] for e in r["errors"]}
    assert "empty.npz" in bad


def test_msprobe_statistics_past_floats_range_are_unknown_not_a_crash(tmp_path):
    """JSON integers are unbounded: a Max of 10**400 in dump.json (the fuzz suite's case 2245 of
    seed 1001) is no statistic, and the scan goes on (it raised OverflowError)."""
    rank = tmp_path / "step0" / "rank0"
    rank.mkdir(parents=True)
    item = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [4], "Max": 10 ** 400, "Min": -(10 ** 400),
            "Mean": 1, "Norm": 2}
    doc = {"task": "statistics", "level": "L1", "framework": "pytorch", "dump_data_dir": None,
           "data": {"Functional.linear.0.forward": {"input_args": [item], "output": [dict(item, Max=3)]}}}
    (rank / "dump.json").write_text(json.dumps(doc))
    res = scan_dump(tmp_path)
    stats = {(s["io"], s["index"]): s for s in json.loads(json.dumps(res, default=str))["tensors"]}
    assert len(stats) == 2 and not res["errors"]
    assert stats[("input", 0)]["max"] is None and stats[("output", 0)]["max"] == 3.0
