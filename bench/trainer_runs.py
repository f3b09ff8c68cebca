"""Real trainers, trained for a few dozen steps on CPU: the runs behind the trainers canary
(``bench/trainers.py``) and the committed fixtures (``tests/fixtures/trainers/make.py``).

Each trainer version gets a throw-away venv with CPU torch, kept under
``~/.cache/precision-agent/trainers/<pkg>-<version>[-<flavour>]/`` (``$PRECISION_AGENT_TRAINERS_CACHE``)
and reused. A run is ``python <script> OUT ...`` with stdout and stderr sent to ``OUT/train.log``
(not a terminal, as ``python train.py > train.log 2>&1`` makes it), the trainer's loggers writing
under ``OUT`` too. A faulty run has the weights made NaN just before a known step (fp16 overflow
needs a GPU; the output's shape does not depend on the device).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "trainer_scripts"
CACHE = Path(os.environ.get("PRECISION_AGENT_TRAINERS_CACHE",
                            Path.home() / ".cache" / "precision-agent" / "trainers"))
# CPU torch: the wheel of PyTorch's CPU index (a plain "torch" would bring CUDA's gigabytes)
TORCH = os.environ.get("PRECISION_AGENT_TRAINERS_TORCH", "torch==2.13.0+cpu")
FAULT_STEP = 30
STEPS = 50

# the versions the committed fixtures were made with (the canary takes the newest of each series)
PINNED = {"transformers": ("5.24.0", "4.57.6"), "lightning": ("2.6.6",), "deepspeed": ("0.19.8",)}
SERIES = {"transformers": ("5.", "4.57."), "lightning": ("2.6.",), "deepspeed": ("0.19.",)}
EXTRAS = {"transformers": ["tensorboard", "accelerate"], "lightning": ["tensorboard"], "deepspeed": []}


@dataclass
class Run:
    """One training run: which trainer, its flags, where the fault is and the steps it must page at."""

    trainer: str                 # "transformers" | "lightning" | "deepspeed"
    version: str
    flavour: str                 # "" or "rich" (Lightning with rich installed: RichProgressBar)
    variant: str                 # folder name: healthy, nan, nan-ls4, ...
    args: list[str] = field(default_factory=list)
    fault: int = 0               # the step (as the trainer's loggers number it) the NaN is planted at; 0: none
    logging_steps: int = 1
    expect_page: int | None = None  # the first logged step whose values show the fault (None: healthy)

    @property
    def name(self) -> str:
        return f"{self.trainer}-{self.version}{'-' + self.flavour if self.flavour else ''}"

    @property
    def venv(self) -> Path:
        return CACHE / self.name


def hf_page_step(fault: int, logging_steps: int) -> int:
    """The first HF report whose whole logging window is at or after the fault: there the NaN
    filter's loss is 0 beside a NaN grad norm. (A report whose window holds finite steps too
    shows the mean of those finite losses and only the grad norm is NaN, which is what a loss
    scaler's skipped step looks like in fp16: not a page on its own.)"""
    first = -(-fault // logging_steps) * logging_steps
    return first if first - logging_steps + 1 >= fault else first + logging_steps


def runs_for(trainer: str, version: str) -> list[Run]:
    k = FAULT_STEP
    if trainer == "transformers":
        return [Run(trainer, version, "", "healthy", ["--logging-steps", "1"]),
                Run(trainer, version, "", "nan", ["--logging-steps", "1", "--fault", str(k)], k, 1, hf_page_step(k, 1)),
                Run(trainer, version, "", "healthy-ls4", ["--logging-steps", "4"], 0, 4),
                Run(trainer, version, "", "nan-ls4", ["--logging-steps", "4", "--fault", str(k)], k, 4,
                    hf_page_step(k, 4)),
                Run(trainer, version, "", "nan-printer", ["--logging-steps", "1", "--printer", "--fault", str(k)],
                    k, 1, hf_page_step(k, 1))]
    if trainer == "lightning":
        out = []
        for flavour in ("", "rich"):
            out += [Run(trainer, version, flavour, "healthy"),
                    Run(trainer, version, flavour, "nan", ["--fault", str(k)], k, 1, k)]
        return out
    if trainer == "deepspeed":
        return [Run(trainer, version, "", "healthy"),
                Run(trainer, version, "", "nan", ["--fault", str(k)], k, 1, k)]
    raise ValueError(trainer)


def newest(pkg: str, prefix: str) -> str | None:
    """The newest release of ``pkg`` starting with ``prefix`` (one ``pip index`` look-up), None offline."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", pkg], capture_output=True,
                             text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Available versions:\s*(.*)", out)
    for v in (m.group(1).split(", ") if m else []):
        if v.startswith(prefix) and re.fullmatch(r"[\d.]+", v):
            return v
    return None


def ensure_venv(run: Run, log: Path | None = None) -> Path:
    """The run's venv, made (CPU torch, the trainer, its loggers) unless a finished one is cached."""
    venv = run.venv
    if (venv / ".ok").exists():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    pkgs = [TORCH, f"{run.trainer}=={run.version}", "numpy", *EXTRAS[run.trainer]]
    if run.flavour == "rich":
        pkgs.append("rich")
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, stdout=out, stderr=out)
        pip = [str(venv / "bin" / "pip"), "install", "-q", *pip_index_args()]
        if run.trainer == "deepspeed":  # an sdist whose build imports torch: build it against the CPU one
            subprocess.run([*pip, TORCH, "setuptools", "wheel"], check=True, stdout=out, stderr=out, timeout=1800)
            pip.append("--no-build-isolation")
        subprocess.run([*pip, *pkgs], check=True, stdout=out, stderr=out, timeout=1800)
        if run.flavour != "rich":  # lightning does not require rich, but another package may bring it
            subprocess.run([str(venv / "bin" / "pip"), "uninstall", "-q", "-y", "rich"], stdout=out, stderr=out)
    finally:
        if log:
            out.close()
    (venv / ".ok").write_text(" ".join(pkgs) + "\n")
    return venv


def pip_index_args() -> list[str]:
    """Where pip finds the CPU torch wheel: ``$PRECISION_AGENT_TRAINERS_PIP_ARGS`` if set, nothing
    when pip's configuration already has find-links (a local wheel folder), else PyTorch's CPU index."""
    env = os.environ.get("PRECISION_AGENT_TRAINERS_PIP_ARGS")
    if env is not None:
        return env.split()
    conf = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    return [] if "find-links" in conf else ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]


SCRIPT_OF = {"transformers": "hf_train.py", "lightning": "lightning_train.py", "deepspeed": "deepspeed_train.py"}


def train(run: Run, out: Path, timeout: float = 900) -> subprocess.Popen:
    """Start the run: its output folder ``out`` gets ``train.log`` and the loggers' files, and
    ``run.json`` (what was planted where). Returns the trainer process (the caller waits)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps({k: v for k, v in asdict(run).items() if k != "args"}
                                             | {"args": run.args}, indent=1) + "\n")
    env = {**os.environ, "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TQDM_MININTERVAL": "0", "NO_COLOR": "", "PYTHONUNBUFFERED": "1"}
    env.pop("NO_COLOR")
    log = open(out / "train.log", "wb")
    try:
        return subprocess.Popen([str(run.venv / "bin" / "python"), str(SCRIPTS / SCRIPT_OF[run.trainer]), str(out),
                                 *run.args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=out)
    finally:
        log.close()


def train_and_wait(run: Run, out: Path, timeout: float = 900) -> int:
    proc = train(run, out)
    t0 = time.monotonic()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{run.name}/{run.variant} did not finish in {time.monotonic() - t0:.0f} s") from None
