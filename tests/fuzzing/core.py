"""The fuzz runner: deterministic cases, a per-case time budget, a memory cap, crash isolation.

A *target* turns a ``random.Random`` into one hostile input (``make``) and feeds it to the real
code (``run``). Case ``i`` of target ``t`` under seed ``s`` always draws from
``random.Random(f"{s}:{t}:{i}")``, so any single case replays on its own:

    PRECISION_AGENT_FUZZ_SEED=14 python -m tests.fuzzing.replay TARGET INDEX     (see replay.py)

Each batch of cases runs in a forked child with ``RLIMIT_AS`` set (a case that allocates without
bound gets ``MemoryError`` there, reported as such) and reports its progress through shared
memory; the parent kills a child whose current case makes no progress for ``hang_s`` seconds
(a regex stuck in C cannot be interrupted from inside) or that dies by a signal, records the case
and carries on with the next one in a fresh child. Inside the child a case also fails when it
raises anything but its target's documented error types or takes longer than ``slow_s``.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import resource
import select
import shutil
import signal
import struct
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

SEED_ENV = "PRECISION_AGENT_FUZZ_SEED"
DEFAULT_SEED = 14


def seed_from_env() -> int:
    return int(os.environ.get(SEED_ENV, DEFAULT_SEED))


@dataclass(frozen=True)
class Target:
    name: str
    make: Callable[[random.Random], Any]           # one hostile input
    run: Callable[[Any, Path], None]               # feed it to the real code (a scratch dir given)
    allowed: tuple[type[BaseException], ...] = ()  # the documented error types of that code


class CaseTimeout(BaseException):
    """Raised by SIGALRM inside a case that ran past its budget (Python code only)."""


@dataclass
class Failure:
    target: str
    seed: int
    index: int
    kind: str        # exception | slow | hang | crash | memory | harness
    detail: str
    preview: str = ""

    def __str__(self) -> str:
        return (f"{self.target} seed={self.seed} case={self.index}: {self.kind}: {self.detail}"
                f"{chr(10) + '    input: ' + self.preview if self.preview else ''}")


@dataclass
class Report:
    target: str
    seed: int
    cases: int = 0
    seconds: float = 0.0
    slowest_s: float = 0.0
    slowest_index: int = -1
    rss_growth_mb: float = 0.0       # largest peak-RSS growth of a child over its start
    failures: list[Failure] = field(default_factory=list)


def case_rng(seed: int, target: str, index: int) -> random.Random:
    return random.Random(f"{seed}:{target}:{index}")


def preview(payload: Any, n: int = 300) -> str:
    text = repr(payload)
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} chars)"


def _on_alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout()


def run_case(target: Target, seed: int, index: int, work: Path, slow_s: float = 2.0,
             hang_s: float = 10.0) -> tuple[float, Failure | None]:
    """Run one case in this process; (seconds, failure or None)."""
    try:
        payload = target.make(case_rng(seed, target.name, index))
    except Exception as exc:  # noqa: BLE001 - a generator bug: reported, the run goes on
        return 0.0, Failure(target.name, seed, index, "harness", f"generator failed: {exc!r}")
    d = work / f"c{index}"
    d.mkdir(parents=True, exist_ok=True)
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, hang_s)
    fail: Failure | None = None
    t0 = time.perf_counter()
    try:
        target.run(payload, d)
    except target.allowed:
        pass
    except CaseTimeout:
        fail = Failure(target.name, seed, index, "hang", f"still running after {hang_s:.0f} s")
    except MemoryError as exc:
        fail = Failure(target.name, seed, index, "memory", f"MemoryError {exc}")
    except Exception as exc:  # noqa: BLE001 - that is what a fuzzer looks for
        tb = traceback.extract_tb(exc.__traceback__)[-3:]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb))
        fail = Failure(target.name, seed, index, "exception", f"{type(exc).__name__}: {str(exc)[:300]} at {where}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        dt = time.perf_counter() - t0
        shutil.rmtree(d, ignore_errors=True)
    if fail is None and dt > slow_s:
        fail = Failure(target.name, seed, index, "slow", f"{dt:.2f} s (budget {slow_s:.1f} s)")
    if fail is not None:
        fail.preview = preview(payload)
    return dt, fail


def _status_kb(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _child(target: Target, seed: int, start: int, stop: int, work: Path, progress: mmap.mmap, out: int,
           slow_s: float, hang_s: float, mem_mb: int) -> None:
    import logging
    logging.disable(logging.CRITICAL)  # the code under test logs every bad input: expected, noisy
    vm = _status_kb("VmSize") * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (mem_mb << 20), resource.RLIM_INFINITY))
    try:
        with open("/proc/self/clear_refs", "w") as f:  # peak RSS := current RSS
            f.write("5")
    except OSError:
        pass
    rss0 = _status_kb("VmRSS")
    res: dict[str, Any] = {"cases": 0, "slowest_s": 0.0, "slowest_index": -1, "failures": []}
    for i in range(start, stop):
        struct.pack_into("<q", progress, 0, i)
        dt, fail = run_case(target, seed, i, work, slow_s, hang_s)
        res["cases"] += 1
        if dt > res["slowest_s"]:
            res["slowest_s"], res["slowest_index"] = dt, i
        if fail is not None:
            res["failures"].append(asdict(fail))
    res["rss_growth_mb"] = max(_status_kb("VmHWM") - rss0, 0) / 1024
    data = json.dumps(res).encode()
    view = memoryview(data)
    while view:
        n = os.write(out, view)
        view = view[n:]


def run_target(target: Target, seed: int, count: int, *, start: int = 0, slow_s: float = 2.0,
               hang_s: float = 10.0, mem_mb: int = 1024, on_progress: Callable[[int], None] | None = None,
               ) -> Report:
    """Cases ``start .. start+count-1`` of ``target``, each batch in a forked, memory-capped child."""
    rep = Report(target.name, seed)
    t_begin = time.monotonic()
    nxt, stop = start, start + count
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{target.name}-") as tmp:
        while nxt < stop:
            progress = mmap.mmap(-1, 8)
            struct.pack_into("<q", progress, 0, nxt)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns into the caller (pytest, the bench)
                code = 0
                try:
                    os.close(r)
                    _child(target, seed, nxt, stop, Path(tmp), progress, w, slow_s, hang_s, mem_mb)
                except BaseException:  # noqa: BLE001
                    traceback.print_exc()
                    code = 70
                os._exit(code)
            os.close(w)
            chunks, last_idx, last_change, killed = [], nxt, time.monotonic(), None
            while True:
                ready, _, _ = select.select([r], [], [], 0.1)
                if ready:
                    b = os.read(r, 1 << 16)
                    if not b:
                        break
                    chunks.append(b)
                idx = struct.unpack_from("<q", progress, 0)[0]
                now = time.monotonic()
                if idx != last_idx:
                    last_idx, last_change = idx, now
                    if on_progress is not None:
                        on_progress(idx - start)
                elif now - last_change > hang_s + 5:  # stuck where SIGALRM cannot reach (C code)
                    os.kill(pid, signal.SIGKILL)
                    killed = idx
                    last_change = now
            os.close(r)
            _, status = os.waitpid(pid, 0)
            idx = struct.unpack_from("<q", progress, 0)[0]
            progress.close()
            if killed is not None or not chunks:
                if killed is not None:
                    kind, detail = "hang", f"no progress for {hang_s + 5:.0f} s (killed)"
                elif os.WIFSIGNALED(status):
                    sig = os.WTERMSIG(status)
                    kind, detail = "crash", f"child died by signal {signal.Signals(sig).name}"
                else:
                    kind, detail = "harness", f"child exited {os.WEXITSTATUS(status)} without a report"
                try:
                    shown = preview(target.make(case_rng(seed, target.name, idx)))
                except Exception as exc:  # noqa: BLE001
                    shown = f"(generator failed: {exc!r})"
                rep.failures.append(Failure(target.name, seed, idx, kind, detail, shown))
                rep.cases += idx - nxt + 1
                nxt = idx + 1
                continue
            res = json.loads(b"".join(chunks))
            rep.cases += res["cases"]
            if res["slowest_s"] > rep.slowest_s:
                rep.slowest_s, rep.slowest_index = res["slowest_s"], res["slowest_index"]
            rep.rss_growth_mb = max(rep.rss_growth_mb, res["rss_growth_mb"])
            rep.failures += [Failure(**f) for f in res["failures"]]
            nxt = stop
    rep.seconds = time.monotonic() - t_begin
    return rep
