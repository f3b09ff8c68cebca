"""The kernels on aarch64 (Kunpeng, Grace hosts), from an x86-64 machine: Debian's cross
compiler builds the loops of agent/kernels/ (the very sources of the extension modules) with
a Python-free harness (tests/kernels/harness.c), qemu-user runs it, and its output must be
the native builds' byte for byte (every result printed as bits); the hot loops must be NEON
vector code (the 64-byte GNU C vectors of the old portable loops compiled to scalar compares
there). CI installs the tools (.ci/run); elsewhere the test skips without them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from conftest import REPO
from precision_agent import kernels

SRC = REPO / "agent" / "kernels"
HARNESS = REPO / "tests" / "kernels" / "harness.c"
CROSS, QEMU, OBJDUMP = "aarch64-linux-gnu-gcc", "qemu-aarch64", "aarch64-linux-gnu-objdump"
SYSROOT = Path("/usr/aarch64-linux-gnu")
FLAGS = ["-O3", "-std=c11", "-fno-strict-aliasing", "-ffp-contract=off", "-Wall", "-Werror", f"-I{SRC}"]
# the x86-64 variants setup.py builds: (name in kernels.variants(), -D flags, -march)
X86 = {"baseline": ("16", "base", []), "avx2": ("32", "v3", ["-march=x86-64-v3"]),
       "avx512": ("64", "v4", ["-march=x86-64-v4"])}


@pytest.fixture(scope="module")
def tools():
    need = [CROSS, QEMU, OBJDUMP, os.environ.get("CC", "cc")]
    missing = [t for t in need if shutil.which(t) is None]
    if missing or not (SYSROOT / "lib").is_dir():
        assert os.environ.get("CI") != "true", f"CI installs the aarch64 tools (.ci/run): missing {missing or SYSROOT}"
        pytest.skip(f"no aarch64 cross tools here: {missing or SYSROOT}")
    return need[3]


def _build(cc: str, out: Path, vw: str, variant: str, extra: list[str]) -> Path:
    cmd = [cc, *FLAGS, f"-DVW={vw}", f"-DKERNEL_VARIANT={variant}", *extra, str(HARNESS), "-o", str(out), "-lm"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return out


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.fixture(scope="module")
def arm_harness(tools, tmp_path_factory) -> Iterator[Future[Path]]:
    """The harness cross-built for aarch64 (the sources' longest build, half a minute), once for
    both tests: started here, in the background, so the native builds overlap it."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_build, CROSS, tmp_path_factory.mktemp("aarch64") / "h_neon", "16", "neon", [])


def test_aarch64_build_gives_the_native_bits(tools, arm_harness, tmp_path):
    # the native build of each x86-64 variant this CPU runs (the baseline where nothing is built)
    names = [v for v in kernels.variants() if v in X86] or ["baseline"]
    with ThreadPoolExecutor() as pool:   # the builds take most of the time
        native = {n: pool.submit(_build, tools, tmp_path / f"h_{X86[n][1]}", *X86[n]) for n in names}
        arm = _run([QEMU, "-L", str(SYSROOT), str(arm_harness.result())])
        assert arm.count("\ncompare n=") == 90 and arm.startswith("scan n=1 ")   # every case ran
        for name, exe in native.items():
            assert _run([str(exe.result())]) == arm, f"aarch64 and x86-64 {name} differ"


def _function(dump: str, name: str) -> str:
    m = re.search(rf"^[0-9a-f]+ <{name}>:\n(.*?)(?:\n\n|\Z)", dump, re.S | re.M)
    assert m, f"{name} not in the object"
    return m.group(1)


def test_aarch64_hot_loops_are_vector_code(arm_harness):
    """Pass 1 of a float32 compare, pass 2 (KLD's terms) and the float32 scan: comparisons,
    divisions and sums on NEON registers (v0.2d, v1.4s, ...), none of them split into lanes.
    Read in the aarch64 harness: it compiles the kernels' very sources (it includes scan.c and
    compare.c) with FLAGS, the same code as each source compiled alone with them."""
    dump = _run([OBJDUMP, "-d", str(arm_harness.result())])

    def count(body: str, pattern: str) -> int:
        return len(re.findall(pattern, body))
    vcmp = r"\bfcm(?:eq|gt|ge|lt|le)\s+v\d+\.[24][sd]"
    pass1 = _function(dump, "block_1_0_0_0")
    assert count(pass1, vcmp) >= 16 and count(pass1, r"\bfdiv\s+v\d+\.2d") >= 4
    assert count(pass1, r"\bfadd\s+v\d+\.2d") >= 16 and count(pass1, r"\bfdiv\s+d\d+") == 0
    pass2 = _function(dump, "block_0_0_0_2")
    assert count(pass2, vcmp) >= 4 and count(pass2, r"\bfdiv\s+v\d+\.2d") >= 4
    assert count(pass2, r"\bfdiv\s+d\d+") == 0
    f32 = _function(dump, "scan_f32")
    assert count(f32, vcmp) >= 12 and count(f32, r"\bfadd\s+v\d+\.4s") >= 8
    assert count(f32, r"\bfmul\s+v\d+\.4s") >= 4
