"""Shared pieces of the benches: the real agent as a subprocess, /proc readings, a tiny
Prometheus-text reader, statistics and the JSON result files.

Nothing here imports the agent's internals except its config defaults (to report the debounce
floor) and its version; the agent under test always runs as a separate process, exactly as
``precision-agent run`` runs it in production.
"""

from __future__ import annotations

import argparse

import datetime as _dt
import http.client
import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1_000_000  # the goals are in MB; MiB would flatter the numbers by 5 %

METRIC = "precision_agent_"


# -- Megatron-LM log lines ---------------------------------------------------------------------
def megatron_line(iteration: int, loss: float = 6.123456, when: float | None = None) -> str:
    """One Megatron-LM training log line (newline-terminated), as the agent's parser expects."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() if when is None else when))
    return (f" [{stamp}] iteration {iteration:8d}/{100000:8d} | consumed samples: {iteration * 256:12d} |"
            f" elapsed time per iteration (ms): 412.3 | learning rate: 3.000000E-04 |"
            f" global batch size:   256 | lm loss: {loss:.6E} | loss scale: 65536.0 | grad norm: 2.513 |"
            f" number of skipped iterations:   0 | number of nan iterations:   0 |\n")


# -- /proc ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcSample:
    """One reading of the agent process from /proc (all threads together)."""

    t: float            # time.monotonic() of the reading
    cpu_s: float        # utime + stime, seconds (includes threads that already exited)
    rss_bytes: int      # VmRSS
    hwm_bytes: int      # VmHWM: peak RSS since start
    threads: int
    ctx_switches: int   # voluntary + involuntary, summed over the live threads
    run_ns: int = 0     # /proc/<pid>/task/*/schedstat run time, summed over the *live* threads:
                        # ns resolution, but the time of threads that already exited is missing


def _status_fields(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    with open(path, encoding="ascii", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def _kb(value: str) -> int:
    return int(value.split()[0]) * 1024


def proc_sample(pid: int) -> ProcSample:
    t = time.monotonic()
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is field 3 (state) of proc(5)
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime (14), stime (15)
    st = _status_fields(f"/proc/{pid}/status")
    ctx = run_ns = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                ts = _status_fields(f"/proc/{pid}/task/{tid}/status")
                with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                    run_ns += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):  # the thread ended meanwhile; no schedstat
                continue
            ctx += int(ts.get("voluntary_ctxt_switches", 0)) + int(ts.get("nonvoluntary_ctxt_switches", 0))
    except OSError:
        pass
    return ProcSample(t, cpu, _kb(st.get("VmRSS", "0 kB")), _kb(st.get("VmHWM", "0 kB")),
                      int(st.get("Threads", 0)), ctx, run_ns)


def cpu_percent(a: ProcSample, b: ProcSample) -> float:
    """CPU used between two samples, as % of one core."""
    return 100.0 * (b.cpu_s - a.cpu_s) / max(b.t - a.t, 1e-9)


# -- statistics ------------------------------------------------------------------------------------
def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): always one of the measured values."""
    v = sorted(values)
    if not v:
        return math.nan
    k = max(1, math.ceil(q / 100.0 * len(v)))
    return v[min(k, len(v)) - 1]


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "min_s": math.nan, "median_s": math.nan, "p90_s": math.nan,
                "max_s": math.nan, "mean_s": math.nan}
    return {"n": len(values), "min_s": min(values), "median_s": percentile(values, 50),
            "p90_s": percentile(values, 90), "max_s": max(values), "mean_s": sum(values) / len(values)}


# -- HTTP ------------------------------------------------------------------------------------------
# what Prometheus 3 sends with each scrape (its default scrape_protocols), and it takes gzip
PROMETHEUS_SCRAPE_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
              "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    "Accept-Encoding": "gzip",
}


def http_get(port: int, path: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.M)


def metric_values(text: str, name: str) -> list[float]:
    """Values of every series of ``name`` in a Prometheus text exposition."""
    out = []
    for m in _SAMPLE_RE.finditer(text):
        if m.group(1) == name:
            try:
                out.append(float(m.group(3)))
            except ValueError:
                pass
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the agent under test ----------------------------------------------------------------------
class AgentError(RuntimeError):
    pass


class AgentProcess:
    """``python -m precision_agent run`` on a private tmp dir and a free loopback port.

    Use as a context manager; on exit the agent gets SIGTERM (then SIGKILL after ``stop_timeout``)
    and the tmp dir is removed.
    """

    def __init__(self, watch_dir: Path | None = None, *, ready_timeout: float = 30.0,
                 stop_timeout: float = 15.0, extra_args: list[str] | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="precision-agent-bench-")
        self.root = Path(self._tmp.name)
        self.watch_dir = watch_dir or self.root / "logs"
        self.watch_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.root / "state"
        self.ready_timeout, self.stop_timeout = ready_timeout, stop_timeout
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self.port = 0
        self.startup_s = math.nan  # from Popen to the first 200 on /-/ready
        self.exit_code: int | None = None
        self.stop_s = math.nan     # from SIGTERM to exit

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "AgentProcess":
        last = ""
        for _attempt in range(3):  # the free port may be taken between probe and bind
            self.port = free_port()
            self._log = open(self.root / "agent.log", "ab")
            cmd = [sys.executable, "-m", "precision_agent", "run", "--watch", str(self.watch_dir),
                   "--listen", f"127.0.0.1:{self.port}", "--state", str(self.state_dir),
                   "--log-level", "warning", *self.extra_args]
            t0 = time.monotonic()
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
            deadline = t0 + self.ready_timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    status, _ = http_get(self.port, "/-/ready", timeout=1.0)
                    if status == 200:
                        self.startup_s = time.monotonic() - t0
                        return self
                except OSError:
                    pass
                time.sleep(0.02)
            last = self.log_tail()
            if self.proc.poll() is None:
                raise AgentError(f"agent not ready after {self.ready_timeout:.0f} s:\n{last}")
            self._log.close()
        raise AgentError(f"agent exited at start (exit {self.proc.returncode if self.proc else '?'}):\n{last}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.root / "agent.log").read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def metrics(self) -> str:
        status, body = http_get(self.port, "/metrics")
        if status != 200:
            raise AgentError(f"/metrics answered {status}")
        return body.decode("utf-8", "replace")

    def scrape(self) -> int:
        """One scrape as Prometheus makes it (OpenMetrics, gzip): the bytes that crossed the wire."""
        status, body = http_get(self.port, "/metrics", headers=PROMETHEUS_SCRAPE_HEADERS)
        if status != 200:
            raise AgentError(f"/metrics answered {status}")
        return len(body)

    def sample(self) -> ProcSample:
        return proc_sample(self.pid)

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.exit_code = self.proc.wait(self.stop_timeout)
                self.stop_s = time.monotonic() - t0
            except subprocess.TimeoutExpired:
                self._kill()
                self.exit_code = self.proc.returncode
        else:
            self.exit_code = self.proc.returncode
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> "AgentProcess":
        try:
            return self.start()
        except BaseException:
            self._kill()
            if self._log is not None:
                self._log.close()
            self._tmp.cleanup()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            self._tmp.cleanup()


# -- results -----------------------------------------------------------------------------------
def host_info() -> dict[str, Any]:
    try:
        from precision_agent import __version__ as agent_version
    except Exception:  # pragma: no cover - the bench runs in the project's venv
        agent_version = "?"
    cpu_model = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.partition(":")[2].strip()
                    break
    except OSError:
        pass
    try:
        cpus_allowed = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus_allowed = os.cpu_count() or 0
    return {"cpus": os.cpu_count(), "cpus_allowed": cpus_allowed, "cpu_model": cpu_model,
            "python": platform.python_version(), "platform": platform.platform(),
            "agent_version": agent_version, "hostname": platform.node()}


def agent_defaults() -> dict[str, Any]:
    """The agent's own config defaults that bound what the benches can measure."""
    from precision_agent.config import Config
    c = Config()
    return {"debounce_s": c.debounce, "evaluation_interval_s": c.evaluation_interval,
            "resync_interval_s": c.resync_interval, "nice": c.limits.nice}


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_result(name: str, result: dict[str, Any], results_dir: Path | None = None) -> Path:
    d = Path(results_dir) if results_dir is not None else RESULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(result), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def ratio_text(value: float, goal: float, unit: str = "", fmt: str = "{:.3g}") -> str:
    r = value / goal
    verdict = "within goal" if r < 1 else "OVER GOAL"
    return f"{fmt.format(value)}{unit} vs goal < {fmt.format(goal)}{unit}: ratio {r:.3f} ({verdict})"


def best_of(fn: Any, repeat: int) -> float:
    """The shortest wall time of ``repeat`` calls of ``fn`` (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_main(module: Any, name: str, argv: list[str] | None = None) -> int:
    """``python -m bench.<name>``: the module's own options plus --quick and --results-dir;
    run it, write bench/results/<name>.json, print the report."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=(module.__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--results-dir", type=Path, default=None)
    module.add_arguments(p)
    args = p.parse_args(argv)
    res = module.run_from_args(args)
    path = write_result(name, res, args.results_dir)
    print(module.report(res))
    print(f"  (written to {path})")
    return 0
