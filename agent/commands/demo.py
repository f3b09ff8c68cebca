"""``precision-agent demo``: the real agent on a temporary directory, fed by a simulated job.

The job runs as a separate process and writes a Megatron-style log in which dynamic loss
scaling collapses to its floor and the gradient norm turns NaN. The demo prints the alerts as
the agent fires them, and the URLs to look at, then keeps serving until Ctrl-C (or --duration).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.alerts import Transition
from ..config import DEFAULT_LISTEN, Config, Limits, Watch, split_listen
from ..model import AlertState

if TYPE_CHECKING:
    from ..daemon.agent import Agent

INTERVAL_S = 0.12


def simulated_job(path: Path, iterations: int = 60, pause: float = INTERVAL_S) -> None:
    """Write a Megatron-LM log: healthy start, an overflow storm down to scale 1, then NaN."""
    scale, loss = 65536.0, 10.9
    with open(path, "a", encoding="utf-8") as f:
        f.write("[before the start of training step] datetime: 2026-11-22 10:00:00\n")
        for it in range(1, iterations + 1):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
            head = (f" [{stamp}] iteration {it:>8}/{iterations:>8} | consumed samples: {it * 256:>12} | "
                    f"elapsed time per iteration (ms): 412.3 | learning rate: {min(it, 10) * 3e-5:.6E} | "
                    f"global batch size:   256 |")
            if 12 <= it < 28:  # an overflow storm: every step skipped, the scale halves each time
                scale = max(1.0, scale / 2)
                line = f"{head} loss scale: {scale:.1f} | number of skipped iterations:   1 | number of nan iterations:   0 |"
            elif it >= 40:
                line = (f"{head} lm loss: {loss:.6E} | loss scale: {scale:.1f} | grad norm: nan | "
                        "number of skipped iterations:   0 | number of nan iterations:   0 |")
            else:
                loss = loss * 0.97 if it < 12 else loss * 0.995
                line = (f"{head} lm loss: {loss:.6E} | loss scale: {scale:.1f} | grad norm: {2.5 + it * 0.01:.3f} | "
                        "number of skipped iterations:   0 | number of nan iterations:   0 |")
            f.write(line + "\n")
            f.flush()
            time.sleep(pause)


def _free_listen(wanted: str | None) -> str:
    host, port = split_listen(wanted or DEFAULT_LISTEN)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
            return wanted or DEFAULT_LISTEN
        except OSError:
            if wanted:
                raise
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"


def run_demo(duration: float | None = None, listen: str | None = None) -> int:
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("precision_agent").setLevel(logging.ERROR)  # the demo prints alerts itself
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGHUP):    # a stopped demo leaves no temporary folder behind
        signal.signal(sig, lambda *_: stop.set())
    tmp = Path(tempfile.mkdtemp(prefix="precision-agent-demo-"))
    agent = job = None
    try:
        agent, job = _start(tmp, listen)
        stop.wait(duration)                       # None: until Ctrl-C, SIGTERM or SIGHUP
    except KeyboardInterrupt:
        print()
    finally:
        try:
            if job is not None and job.poll() is None:
                job.terminate()
                job.wait(5)
            if agent is not None:
                firing = [a for a in agent.pipeline.alerts.active() if a.state == AlertState.FIRING]
                print(f"{len(firing)} alert(s) firing at exit; stopping the demo agent.", flush=True)
                agent.shutdown()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _start(tmp: Path, listen: str | None) -> tuple[Agent, subprocess.Popen]:
    """The agent on ``tmp``, and the simulated job writing into it."""
    logs = tmp / "logs"
    logs.mkdir()
    config = Config(listen=_free_listen(listen), state_dir=tmp / "state", resync_interval=5.0,
                    watches=[Watch(path=logs, labels={"cluster": "demo", "run": "gpt-demo"})],
                    limits=Limits(nice=0, io_idle=False))
    t0 = time.monotonic()
    lock = threading.Lock()

    def show(t: Transition) -> None:
        if t.new == AlertState.PENDING:
            return
        a = t.alert
        word = "FIRING  " if t.new == AlertState.FIRING else "resolved"
        labels = ", ".join(f"{k}={v}" for k, v in a.labels)
        with lock:
            print(f"[{time.monotonic() - t0:5.1f}s] {word} {a.rule} {{{labels}}}\n"
                  f"         {a.annotations.get('summary', '')}", flush=True)

    from ..daemon.agent import Agent
    agent = Agent(config, on_transition=show)
    try:
        agent.start()
    except BaseException:
        agent.shutdown()
        raise
    url = agent.http.url
    log_file = logs / "train.log"
    print(f"precision-agent demo: watching {logs}\n"
          f"  metrics: {url}/metrics\n  alerts:  {url}/api/v1/alerts\n  status:  {url}/api/v1/status\n"
          f"A simulated Megatron job now writes {log_file.name}; its loss scale collapses, then its "
          "grad norm turns NaN.\n", flush=True)
    job = subprocess.Popen([sys.executable, "-c",
                            "import sys; from precision_agent.commands.demo import simulated_job; "
                            "from pathlib import Path; simulated_job(Path(sys.argv[1]))", str(log_file)])
    return agent, job
