"""Tensor-health watchpoints: which dumped tensors are weights, gradients or activations, and the
per-tensor samples the ``tensor_*`` / ``weight_*`` / ``activation_range`` rule kinds judge.

A scan result (:func:`.scan.scan`) lists statistics per tensor but not what the tensor *is*.
MindInsight's watchpoints (reference/ascend-formats.md §5) target weights, gradients and
activations, so each tensor is classified from a *subject* string ``{name}:{io}:{index}``
(``{op_type}.{name}:{io}:{index}`` when the file name carries an op type, as CANN and MindSpore
dump names do) by ordered, overridable regexes: exclude, gradient, weight, activation. Tensors
that are none of these (forward inputs that are not weights, backward inputs) are copies of a
neighbouring op's output and are not emitted.

:func:`tensor_samples` turns one scan result into samples of metric :data:`DUMP_TENSOR`: one per
relevant tensor, in execution order per (step, rank), each followed by a *step end* marker so a
kind can report once per step (first offender, how many) instead of once per tensor. Weights
also carry a *sketch*: ``SKETCH_SIZE`` elements read at fixed positions from the tensor's data
file, when the dump has data, so the change kinds can compare steps element by element without
keeping whole tensors.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from ..config.regex import UserRegex
from ..model import DUMP_TENSOR, Sample, SourcePos, make_labels
from .cann import parse_dump_name, read_cann_dump
from .mindspore import parse_npy_name
from .npy import read_npy
from .torchzip import read_pt
from .types import DumpError

log = logging.getLogger(__name__)

STEP_END = "step_end"             # attr ``event`` of the marker closing one (step, rank)
ROLES = ("weight", "gradient", "activation")
SKETCH_SIZE = 256                 # elements kept per weight for step-to-step comparison
MAX_SKETCHES = 4096               # per call: bounds the data read for one scan result
MAX_SAMPLES = 200_000             # per call: bounds the samples one (hostile) scan can produce

_SEP = r"(?:^|[._/\-])"
_END = r"(?:$|[._/\-:])"
_API = r"^(?:Functional|Torch|Tensor|NPU)\."
_NOT_MSPROBE = r"^(?!(?:Module|Functional|Torch|Tensor|NPU|Distributed|Aten|VF|MindSpeed)\.)"
DEFAULT_EXCLUDE: tuple[str, ...] = ()
DEFAULT_GRADIENT = (
    r"^Module\..+\.parameters_grad\.\d+:param:\d+$",            # msprobe parameter gradients
    r"\.backward(?:\.\d+)?:output:\d+$",                        # msprobe grad_inputs of a backward
    r"(?i)" + _SEP + r"gradients?[/_\-].*:output:\d+$",           # MindSpore Gradients/, TF gradients/
)
DEFAULT_WEIGHT = (
    r"^Module\..+\.forward\.\d+:param:\d+$",                     # msprobe module parameters (mix, L0)
    _API + r"(?:linear|bilinear|conv[123]d|conv_transpose[123]d|embedding)\.\d+\.forward:input:[12]$",
    _API + r"(?:layer_norm|group_norm)\.\d+\.forward:input:[23]$",
    _API + r"batch_norm\.\d+\.forward:input:[34]$",
    r"^Parameter\.",                                            # MindSpore parameter dumps
    _NOT_MSPROBE + r"(?i:.*" + _SEP + r"(?:weight|kernel|gamma|beta|bias|embedding_table)s?" + _END + r")(?!.*:input:)",
)
DEFAULT_BIAS = (
    r"^Module\..+\.forward\.\d+:param:1$",                       # msprobe: (weight, bias) in order
    _API + r"(?:linear|bilinear|conv[123]d|conv_transpose[123]d)\.\d+\.forward:input:2$",
    _API + r"(?:layer_norm|group_norm)\.\d+\.forward:input:3$",
    _API + r"batch_norm\.\d+\.forward:input:4$",
    _NOT_MSPROBE + r"(?i:.*" + _SEP + r"(?:bias|beta)" + _END + r")",
)
DEFAULT_ACTIVATION = (
    r"\.forward(?:\.\d+)?:output:\d+$",                         # msprobe forward outputs
    r"^[^:]*:output:\d+$",                                      # any other op output
)
# Op outputs that are no activations: a training step's optimizer and bookkeeping (msprobe dumps
# everything between start() and stop(), optimizer.step() included). In-place tensor methods
# (``Tensor.mul_``, ``add_``, ``addcmul_``, ``lerp_``, ``zero_`` on the moment buffers and the
# weights), ``Torch._foreach_*`` (the multi-tensor optimizers) and tensor constructors
# (``zeros_like`` for a fresh moment buffer): the zero-initialised Adam moments at step 0 are all
# zero by design. An in-place activation function (``relu_``, ``sigmoid_``, ...) stays an activation.
DEFAULT_NOT_ACTIVATION = (
    r"^Tensor\.(?!(?:relu|relu6|sigmoid|tanh|gelu|silu|elu|selu|leaky_relu|hardtanh|hardswish|hardsigmoid|mish)_\.)"
    r"[A-Za-z0-9_]*[A-Za-z0-9]_\.\d+\.forward:",
    r"^(?:Torch|Tensor)\._foreach_",
    r"^Torch\.(?:zeros|zeros_like|ones|ones_like|empty|empty_like|full|full_like|arange|tensor|scalar_tensor)\.\d+\.forward:",
)
DEFAULT_FUNCTIONS: dict[str, str] = {
    "tanh": r"(?i)" + _SEP + r"tanh_?" + _END,
    "sigmoid": r"(?i)" + _SEP + r"sigmoid_?" + _END,
    "relu": r"(?i)(?:^|[./\-]|(?<!leaky)_)relu_?" + _END,     # not leaky_relu: it is never dead
}


# The defaults above are ours (some need lookaround, which RE2 lacks) and run on ``re``; a list a
# rule file gives is the user's and runs on RE2, linear in the tensor name whatever it holds.
_BUILTIN = frozenset((*DEFAULT_EXCLUDE, *DEFAULT_GRADIENT, *DEFAULT_WEIGHT, *DEFAULT_BIAS, *DEFAULT_ACTIVATION,
                      *DEFAULT_NOT_ACTIVATION,
                      *DEFAULT_FUNCTIONS.values()))


def _compile(patterns: Iterable[str], what: str) -> tuple[re.Pattern[str] | UserRegex, ...]:
    """Raises ValueError naming ``what`` for a regex RE2 cannot take."""
    return tuple(re.compile(p) if p in _BUILTIN else UserRegex(p, what) for p in patterns)


@dataclass(frozen=True)
class Role:
    role: str          # weight | gradient | activation | other
    fn: str = ""       # activation function (tanh, sigmoid, relu) when recognised
    bias: bool = False


class Classifier:
    """Ordered regex classification of a tensor subject; rule files may override any list."""

    def __init__(self, exclude: Iterable[str] = DEFAULT_EXCLUDE, gradient: Iterable[str] = DEFAULT_GRADIENT,
                 weight: Iterable[str] = DEFAULT_WEIGHT, bias: Iterable[str] = DEFAULT_BIAS,
                 activation: Iterable[str] = DEFAULT_ACTIVATION,
                 functions: Mapping[str, str] = DEFAULT_FUNCTIONS,
                 not_activation: Iterable[str] = DEFAULT_NOT_ACTIVATION) -> None:
        self.exclude = _compile(exclude, "exclude")
        self.gradient = _compile(gradient, "gradient")
        self.weight = _compile(weight, "weight")
        self.bias = _compile(bias, "bias")
        self.activation = _compile(activation, "activation")
        self.not_activation = _compile(not_activation, "not_activation")
        self.functions = {fn: _compile([p], f"functions.{fn}")[0] for fn, p in functions.items()}

    def classify(self, subject: str) -> Role:
        def hit(pats: tuple[re.Pattern[str] | UserRegex, ...]) -> bool:
            return any(p.search(subject) for p in pats)
        if hit(self.exclude):
            return Role("other")
        if hit(self.gradient):
            return Role("gradient")
        if hit(self.weight):
            return Role("weight", bias=hit(self.bias))
        if hit(self.activation) and not hit(self.not_activation):
            op = subject.split(":", 1)[0]
            fn = next((f for f, p in self.functions.items() if p.search(op)), "")
            return Role("activation", fn)
        return Role("other")


DEFAULT_CLASSIFIER = Classifier()


def subject_of(t: Mapping[str, Any]) -> str:
    """``[op_type.]name:io:index`` of a scan-result tensor: what the role patterns match."""
    base = os.path.basename(str(t.get("path") or ""))
    meta = parse_dump_name(base) or parse_npy_name(base)
    name = str(t.get("name", ""))
    if meta and meta.get("op_type") and not name.startswith(meta["op_type"] + "."):
        name = f"{meta['op_type']}.{name}"
    return f"{name}:{t.get('io', '')}:{t.get('index', 0)}"


# --- statistics ---------------------------------------------------------------------------------

def rms(t: Mapping[str, Any]) -> float | None:
    """Root mean square over the finite elements: l2norm / sqrt(finite count)."""
    norm, count = t.get("l2norm"), int(t.get("count") or 0)
    finite = count - _nonfinite(t)
    if norm is None or finite <= 0 or not math.isfinite(norm):
        return None if norm is None or finite <= 0 else float(norm)
    return float(norm) / math.sqrt(finite)


def abs_mean(t: Mapping[str, Any]) -> tuple[float | None, str]:
    """mean(|x|) and how it was obtained. Exact when the statistics carry it (``abs_mean``: every
    tensor the scanner read) or the tensor has one sign (then |mean|); otherwise (statistics-only
    dumps, older stored results) the RMS, an upper bound (mean|x| <= rms)."""
    if t.get("abs_mean") is not None:
        return float(t["abs_mean"]), "exact"
    mn, mx, mean = t.get("min"), t.get("max"), t.get("mean")
    if mean is not None and mn is not None and mx is not None and (mn >= 0 or mx <= 0):
        return abs(float(mean)), "exact"
    return rms(t), "rms"


def _nonfinite(t: Mapping[str, Any]) -> int:
    return int(t.get("nan") or 0) + int(t.get("pos_inf") or 0) + int(t.get("neg_inf") or 0)


# --- sketches -----------------------------------------------------------------------------------

def sketch_positions(count: int, k: int = SKETCH_SIZE) -> np.ndarray:
    """Fixed, evenly spread flat positions: the same tensor shape gives the same positions."""
    if count <= k:
        return np.arange(count, dtype=np.int64)
    return np.unique(np.linspace(0, count - 1, k).round().astype(np.int64))


def _load(t: Mapping[str, Any]) -> np.ndarray | None:
    path = str(t.get("path") or "")
    base = os.path.basename(path)
    if path.endswith(".pt"):
        return read_pt(path).load()  # type: ignore[misc]
    if path.endswith(".npy"):
        return read_npy(path).load()  # type: ignore[misc]
    if parse_dump_name(base):
        for d in read_cann_dump(path):
            if d.io == t.get("io") and d.index == t.get("index") and d.load is not None:
                return d.load()
    return None


def sketch(t: Mapping[str, Any], k: int = SKETCH_SIZE) -> np.ndarray | None:
    """``k`` elements of the tensor's data at :func:`sketch_positions` as float64, or None when
    the dump holds statistics only. Reads only those elements (fancy indexing of a memmap)."""
    count = int(t.get("count") or 0)
    if count <= 0:
        return None
    arr = _load(t)
    if arr is None or arr.size != count:
        return None
    pos = sketch_positions(count, k)
    vals = np.asarray(arr[np.unravel_index(pos, arr.shape)] if arr.ndim else arr.reshape(1)[pos])
    if t.get("dtype") == "bfloat16":
        vals = (vals.astype(np.uint32) << 16).view(np.float32)
    return vals.astype(np.float64)


# --- samples ------------------------------------------------------------------------------------

_STAT_KEYS = ("count", "nan", "pos_inf", "neg_inf", "min", "max", "mean", "l2norm", "zero_fraction",
              "abs_mean", "dtype")


def _groups(tensors: list[dict]) -> list[tuple[tuple[int, int], list[tuple[int, dict]]]]:
    groups: dict[tuple[int, int], list[tuple[int, dict]]] = {}
    for i, t in enumerate(tensors):
        key = (t.get("step") if t.get("step") is not None else -1, t.get("rank") if t.get("rank") is not None else -1)
        groups.setdefault(key, []).append((i, t))
    return sorted(groups.items())


def tensor_samples(result: dict, labels: dict[str, str], classifier: Classifier | None = None,
                   sketches: bool = True) -> list[Sample]:
    """Per-tensor samples (metric :data:`DUMP_TENSOR`) for the tensors any watchpoint kind judges,
    with their statistics, role and (weights, data dumps) sketch as attrs; a ``step_end`` marker
    closes every (step, rank). Labels are ``labels`` plus ``rank``: tensor names stay in attrs.
    The step is the attr ``step``; ``Sample.step`` stays None, so the dump series never looks like
    a training stream to step-based kinds (``stalled`` would call a finished dump a hung job)."""
    cls = classifier or DEFAULT_CLASSIFIER
    out: list[Sample] = []
    now = time.time()
    n_sketch = 0
    where = str(result.get("path", ""))
    for (step, rank), items in _groups(list(result.get("tensors") or [])):
        lab = dict(labels)
        if rank >= 0:
            lab["rank"] = str(rank)
        series = make_labels(lab)
        st = step if step >= 0 else None
        rows = [(i, t, subject_of(t)) for i, t in items]
        roles = [cls.classify(s) for _i, _t, s in rows]
        # msprobe mix/L0: a weight is both an API input and a module parameter; keep the module one
        modules = any(r.role == "weight" and s.startswith("Module.") for (_i, _t, s), r in zip(rows, roles))
        emitted = 0
        for (i, t, subj), role in zip(rows, roles):
            if role.role == "other" or (modules and role.role == "weight" and not subj.startswith("Module.")):
                continue
            if len(out) >= MAX_SAMPLES:
                log.warning("%s: more than %d tensors, the rest are not judged", where, MAX_SAMPLES)
                return out
            attrs: list[tuple[str, Any]] = [("tensor", subj), ("role", role.role), ("fn", role.fn),
                                            ("bias", role.bias), ("order", i),
                                            ("shape", tuple(t.get("shape") or ()))]
            attrs += [(k, t.get(k)) for k in _STAT_KEYS if k in t]
            if role.role == "weight" and sketches and n_sketch < MAX_SKETCHES:
                try:
                    sk = sketch(t)
                except (DumpError, OSError, ValueError, TypeError, IndexError) as exc:
                    sk = None
                    attrs.append(("sketch_error", str(exc)[:200]))
                if sk is not None:
                    n_sketch += 1
                    attrs.append(("sketch", sk))
            value = rms(t)
            attrs.append(("step", st))
            out.append(Sample(series, DUMP_TENSOR, value if value is not None and math.isfinite(value) else 0.0,
                              None, SourcePos(str(t.get("path") or where), 0), now, None, tuple(attrs)))
            emitted += 1
        out.append(Sample(series, DUMP_TENSOR, float(emitted), None, SourcePos(where, 0), now, None,
                          (("event", STEP_END), ("tensors", emitted), ("step", st))))
    return out
