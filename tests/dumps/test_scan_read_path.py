"""The scanner's read path (agent/dumps/windows.py, pagecache.py): cached windows scanned in place
in a mapping, the rest through the pread buffer, with the same statistics bit for bit; bounded
RSS; the page cache left as it was found; and a file truncated under a mapped scan is an error,
never a SIGBUS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from precision_agent import kernels
from precision_agent.dumps import pagecache, windows
from precision_agent.dumps.npy import read_npy
from precision_agent.dumps.scanner import scan_array
from precision_agent.dumps.types import DumpError, FileRegion
from precision_agent.dumps.windows import read_counts, scan_region
from support.prom import wait_until

BLOCK = 4099                     # elements: odd, so blocks straddle pages
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page cache and leases")


def leases_here(path: Path) -> bool:
    """Whether this file system and process get read leases (else every scan here is pread)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        lease = pagecache.ReadLease(fd)
        ok = lease.taken
        lease.release()
        return ok
    finally:
        os.close(fd)


def cached_fraction(path: Path, start: int = 0, end: int | None = None) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        end = os.fstat(fd).st_size if end is None else end
        base, ceil = pagecache.page_span(start, end)
        was = pagecache.resident_pages(fd, base, ceil)
        assert was is not None
        return float(was.mean())
    finally:
        os.close(fd)


def planted(n: int, dtype: str, seed: int) -> np.ndarray:
    """``n`` values of ``dtype`` (bfloat16 as raw words) with NaN, +Inf and -Inf planted."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 3).astype(np.float32)
    a[[7, n // 3, n - 2]] = [np.nan, np.inf, -np.inf]
    a[n // 2:n // 2 + 100] = 0
    if dtype == "bfloat16":
        return (a.view(np.uint32) >> 16).astype(np.uint16)
    return a.astype(dtype)


def as_json(s) -> str:
    return json.dumps(asdict(s), sort_keys=True)


@pytest.mark.parametrize("mode", ["auto", "numpy"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", ">f4"])
def test_mapped_and_pread_paths_give_bit_identical_statistics(tmp_path, dtype, mode):
    n = 600_011                                      # not a whole number of blocks or windows
    data = planted(n, dtype, seed=len(dtype))
    raw = data.tobytes()
    isz = data.dtype.itemsize
    kind = "bfloat16" if dtype == "bfloat16" else None
    # starts: a .npy-like 128, a page + 64, 12 (not 64-aligned), one byte off the element size
    starts = [128, 4096 + 64, 12, 4097 if isz > 1 else 4096]
    path = tmp_path / "t.bin"
    lease = None
    for start in starts:
        path.write_bytes(b"\x01" * start + raw + b"\x02" * 333)  # other bytes after it, as in a CANN dump
        lease = leases_here(path) if lease is None else lease
        reg = FileRegion(str(path), start, data.dtype, n, (n,))
        with kernels.forced(mode):
            want = as_json(scan_array(data, dtype=kind, block_elems=BLOCK))
            for threads in (1, 3):
                got = {}
                for read, window in (("pread", None), ("map", None), ("map", BLOCK * isz * 3),
                                     ("map", BLOCK * isz * 7 + 1), ("map", 1)):
                    before = read_counts()
                    s = scan_region(reg, dtype=kind, block_elems=BLOCK, threads=threads, read=read,
                                    window_bytes=window)
                    after = read_counts()
                    got[read, window] = as_json(s)
                    mapped = after["mapped"] - before["mapped"]
                    if read == "pread" or (start % isz and not data.dtype.byteorder == ">"):
                        assert mapped == 0, (start, read)
                    elif lease:
                        assert mapped == n * isz, (start, read, window, threads)
                want_t = as_json(scan_array(data, dtype=kind, block_elems=BLOCK, threads=threads))
                assert set(got.values()) == {want_t}, (start, threads, got)
        assert json.loads(want)["nan"] == 1 and json.loads(want)["pos_inf"] == 1
    # no lease is left behind: a truncation goes through at once
    assert str(os.stat(path).st_ino) not in Path("/proc/locks").read_text()
    os.truncate(path, 10)


def test_pread_is_the_default_and_the_environment_variable_turns_mapping_on(tmp_path, monkeypatch):
    np.save(tmp_path / "a.npy", planted(300_000, "float32", 1))
    reg = read_npy(tmp_path / "a.npy").region()
    monkeypatch.delenv(windows.READ_ENV, raising=False)
    before = read_counts()
    scan_region(reg)
    assert read_counts()["mapped"] == before["mapped"]
    assert read_counts()["copied"] == before["copied"] + 300_000 * 4
    monkeypatch.setenv(windows.READ_ENV, "map")
    before = read_counts()
    scan_region(reg)
    if leases_here(tmp_path / "a.npy"):
        assert read_counts()["mapped"] == before["mapped"] + 300_000 * 4
    monkeypatch.setenv(windows.READ_ENV, "mmap-please")
    with pytest.raises(ValueError, match="pread.*map"):
        scan_region(reg)


def test_a_file_open_for_writing_elsewhere_is_read_with_pread(tmp_path):
    a = planted(500_000, "float32", 2)
    np.save(tmp_path / "a.npy", a)
    writer = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'r+b'); "
                               "print('open', flush=True); sys.stdin.read()", str(tmp_path / "a.npy")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "open"
        before = read_counts()
        s = scan_region(read_npy(tmp_path / "a.npy").region(), block_elems=BLOCK, read="map")
        assert read_counts()["mapped"] == before["mapped"]   # no lease with a writer: never mapped
    finally:
        writer.stdin.close()
        writer.wait(30)
    assert as_json(s) == as_json(scan_array(a, block_elems=BLOCK))


@pytest.mark.parametrize("probe", ["cachestat", "mincore"])
def test_cached_pages_stay_and_pages_read_for_the_scan_are_dropped(tmp_path, monkeypatch, probe):
    if probe == "mincore":   # kernels before 6.5 (or cachestat refused): mincore alone
        monkeypatch.setattr(pagecache, "_cachestat_ok", False)
    path = tmp_path / "a.npy"
    np.save(path, planted(24 << 18, "float32", 3))          # 24 MiB
    fd = os.open(path, os.O_RDONLY)
    try:
        if probe == "cachestat" and pagecache.cached_count(fd, 0, 4096) is None:
            pytest.skip("no cachestat on this kernel")
        os.fsync(fd)
        pagecache.drop(fd, 0, 0)
        if cached_fraction(path) > 0.05:
            pytest.skip("this file system keeps pages that were asked to go (tmpfs)")
        os.pread(fd, 8 << 20, 8 << 20)                         # bytes 8..16 MiB cached by someone else
    finally:
        os.close(fd)
    reg = read_npy(path).region()
    windows_of = 2 << 20
    before = read_counts()
    scan_region(reg, window_bytes=windows_of, read="map")
    if leases_here(path):   # the windows found cached were scanned in place, the others not
        assert 6 << 20 <= read_counts()["mapped"] - before["mapped"] <= 10 << 20
    assert cached_fraction(path, 8 << 20, 16 << 20) == 1.0    # found cached: kept
    # read for the scan: dropped (all but read-ahead past the last window and shared edge pages)
    assert cached_fraction(path, 0, 7 << 20) < 0.05
    assert cached_fraction(path, 17 << 20, 24 << 20) < 0.2
    scan_region(reg, window_bytes=windows_of, drop_cache=False, read="map")   # a comparison reads it next
    assert cached_fraction(path) == 1.0


_CHILD = r"""
import json, os, sys, time
from precision_agent.dumps.npy import read_npy
from precision_agent.dumps.types import DumpError
from precision_agent.dumps.windows import read_counts, scan_region
state = {"paused": False, "resumed": False}
size = os.stat(sys.argv[1]).st_size
def on_bytes(n):
    if state["resumed"]:       # the lease is given up by now: wait until the truncation is done
        deadline = time.monotonic() + 30
        while os.stat(sys.argv[1]).st_size == size and time.monotonic() < deadline:
            time.sleep(0.01)
        state["resumed"] = False
    if not state["paused"] and sum(read_counts().values()) >= (8 << 20):
        state["paused"] = True   # mid-scan: let the parent truncate, wait for its word
        print(json.dumps({"mid": read_counts()}), flush=True)
        sys.stdin.readline()
        state["resumed"] = True
try:
    s = scan_region(read_npy(sys.argv[1]).region(), block_elems=1 << 16, window_bytes=4 << 20, read="map",
                    on_bytes=on_bytes)
    print(json.dumps({"count": s.count}), flush=True)
except DumpError as exc:
    print(json.dumps({"error": str(exc), "counts": read_counts()}), flush=True)
"""


def _scan_child(path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_file_truncated_under_a_mapped_scan_is_an_error_not_a_sigbus(tmp_path):
    path = tmp_path / "big.npy"
    np.save(path, planted(16 << 20, "float32", 4))            # 64 MiB, in the page cache
    if not leases_here(path):
        pytest.skip("no read leases here: the scan never maps (the pread path is tested elsewhere)")
    child = _scan_child(path)
    try:
        mid = json.loads(child.stdout.readline())["mid"]
        assert mid["mapped"] > 0 and mid["copied"] == 0        # it is reading through a mapping
        done = threading.Event()
        cutter = threading.Thread(target=lambda: (os.truncate(path, 1 << 20), done.set()), daemon=True)
        cutter.start()
        ino = f":{os.stat(path).st_ino} "
        # the truncation waits for the scanner's lease (or went through where there was none)
        wait_until(lambda: done.is_set() or any("BREAKING" in ln and ino in ln for ln in
                                               Path("/proc/locks").read_text().splitlines()),
                   30, "the truncation to wait on the lease")
        assert not done.is_set(), "the file was truncated while mapped, with no lease in the way"
        child.stdin.write("go\n")
        child.stdin.flush()
        out = json.loads(child.stdout.readline())
        assert child.wait(60) == 0, child.stderr.read()
        assert done.wait(30) and os.stat(path).st_size == 1 << 20
    finally:
        child.kill()
    assert "shrank" in out["error"] and out["counts"]["copied"] >= 0
    assert out["counts"]["mapped"] < (64 << 20)


def test_a_plain_mapping_of_a_truncated_file_does_die_of_sigbus(tmp_path):
    """What the lease prevents: the same truncation under an ordinary memmap kills the reader."""
    path = tmp_path / "m.bin"
    path.write_bytes(b"\0" * (4 << 20))
    code = ("import numpy as np, os, sys; m = np.memmap(sys.argv[1], mode='r'); m[:4096].sum(); "
            "os.truncate(sys.argv[1], 0); print(int(m[-1]))")
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=60)
    assert p.returncode == -signal.SIGBUS


_RSS = r"""
import json, sys
from precision_agent.dumps.windows import read_counts, scan_file_npy
s = scan_file_npy(sys.argv[1], threads=int(sys.argv[2]), read="map")
with open("/proc/self/status") as f:
    hwm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
print(json.dumps({"hwm": hwm, "count": s.count, **read_counts()}))
"""


@pytest.mark.parametrize("threads", [1, 4])
def test_rss_stays_bounded_while_scanning_in_place(tmp_path, threads):
    path = tmp_path / "big.npy"
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(64 << 20,))  # 256 MiB
    mm[:] = 1                                                # in the page cache
    mm.flush()
    del mm
    lease = leases_here(path)
    out = subprocess.run([sys.executable, "-c", _RSS, str(path), str(threads)], capture_output=True,
                         text=True, timeout=600, check=True)
    res = json.loads(out.stdout)
    assert res["count"] == 64 << 20
    if lease:
        assert res["mapped"] == 256 << 20
    # mapped windows count in RSS while mapped: at most MAPPED_BYTES over all workers, never the file
    assert res["hwm"] < 250 << 20, f"peak RSS {res['hwm'] >> 20} MiB"


def test_mapped_bytes_are_bounded_across_workers_and_scans(tmp_path, monkeypatch):
    """The mapped-bytes budget is the process's, not one scan's: windows that do not fit in it
    are read with pread (scans of many files side by side keep RSS bounded too)."""
    a = planted(1 << 20, "float32", 5)
    np.save(tmp_path / "a.npy", a)
    if not leases_here(tmp_path / "a.npy"):
        pytest.skip("no read leases here: nothing is mapped")
    window = 64 * BLOCK * 4
    peak = [0]

    class Watched(windows._Budget):
        def take(self, n: int) -> bool:
            ok = super().take(n)
            peak[0] = max(peak[0], window + 1 - self.left)
            return ok
    budget = Watched(window + 1)                                  # one window at a time
    monkeypatch.setattr(windows, "_MAPPED", budget)
    reg = read_npy(tmp_path / "a.npy").region()
    want = as_json(scan_array(a, block_elems=BLOCK, threads=3))
    results = []

    def scan() -> None:
        results.append(as_json(scan_region(reg, block_elems=BLOCK, threads=3, window_bytes=window, read="map")))
    before = read_counts()
    scans = [threading.Thread(target=scan) for _ in range(2)]
    for t in scans:
        t.start()
    for t in scans:
        t.join(120)
    assert results == [want, want]
    assert budget.left == window + 1 and 0 < peak[0] <= window + 1   # never more, all given back
    assert read_counts()["mapped"] > before["mapped"]
    # the budget spent elsewhere: every window is read with pread, the same statistics
    assert budget.take(window + 1)
    before = read_counts()
    assert as_json(scan_region(reg, block_elems=BLOCK, threads=3, window_bytes=window, read="map")) == want
    assert read_counts()["mapped"] == before["mapped"]
    assert read_counts()["copied"] == before["copied"] + a.nbytes


def test_the_pread_buffer_sits_where_the_data_sits_in_its_page():
    """windows.read_buffer: the buffer starts at the file offset's place in a page (64-byte
    aligned), so the kernel's copy never stores just ahead of its loads modulo 4 KiB (4K aliasing
    made a fresh process's first buffers, malloc's at 16 bytes into a page, copy ~3.5x slower)."""
    from precision_agent.dumps.windows import read_buffer
    for offset in (0, 16, 128, 4096 + 128, 5000, (1 << 20) + 4095):
        for size in (64, 4 << 20):
            buf = read_buffer(size, offset)
            assert buf.size == size and buf.flags.writeable and buf.dtype == np.uint8
            assert buf.ctypes.data % 64 == 0
            assert buf.ctypes.data % 4096 == offset % 4096 // 64 * 64
