"""Run-wide facts a log states once: the precision the run trains in, and the normal end of training.

Not a producer of its own (``hint = True``): it runs after whichever producer reads the file, on
the lines no producer claimed, never names the file's format and claims no line. What it reads applies to every series of the run (agent/engine: ``Pipeline``).

Precision, from what trainers and launchers print (``mode`` fp16 | bf16 | fp32, ``scaler``
dynamic | static); a statement that a mode is off (``fp16 ... False``) says nothing:

* Megatron's argument dump ``  bf16 ........ True``, ``  params_dtype .... torch.bfloat16``;
* DeepSpeed's config echo ``fp16_enabled ..... True``, ``bfloat16_enabled ..... True``;
* ``bf16=True`` / ``fp16=True`` in HF ``TrainingArguments(...)`` and fairseq ``Namespace(...)`` reprs,
  ``'fp16': True`` in dict configs, ``"bf16": {"enabled": true`` in DeepSpeed JSON configs;
* launch commands ``--bf16`` / ``--fp16``, accelerate's ``mixed_precision: bf16`` /
  ``Mixed precision type: fp16`` / ``--mixed_precision fp16`` (``no``: fp32);
* Lightning ``Using 16bit Automatic Mixed Precision (AMP)`` / ``Using bfloat16 Automatic ...``;
* apex ``Selected optimization level O1`` (O0: fp32), ``loss_scale : dynamic``;
* MindSpore/MindFormers ``compute_dtype: float16`` and the loss-scale cells/managers
  (``DynamicLossScaleUpdateCell``, ``FixedLossScaleManager``, ...).

Ascend's ``precision_mode`` (``allow_fp32_to_fp16``, ``allow_mix_precision``) says how operators
are cast, not whether the loss is scaled: it is not read. Statements are matched where they stand
as such: ``fp16=True`` followed by ``,`` or ``)`` or the line's end (not inside a warning's prose),
``--bf16`` on a launch command line (``python``, ``torchrun``, ``deepspeed``, ``*.py``), not in help
text, and ``Training completed`` followed by ``.``, ``!`` or the line's end.

End of training: Megatron ``[after training is done]`` and ``exiting program at iteration N``,
HF ``Training completed.`` and the ``{'train_runtime': ...}`` summary ``Trainer.train()`` prints at
its end, torchtitan ``Training completed``, Lightning `` `Trainer.fit` stopped``,
fairseq ``done training in N seconds``, DeepSpeed's launcher ``Process N exits successfully``,
detectron2 ``Total training time:``, MLPerf ``run_stop ... "status": "success"``.
"""

from __future__ import annotations

import re

from ...model import PRECISION, TRAINING_END
from .base import Block, Parser, Record

_DOTS = r"\s*\.{3,}\s*"
_RE = re.compile(
    rf"(?<![\w-])(?P<dump>fp16|bf16){_DOTS}True\b"
    rf"|\bparams_dtype{_DOTS}torch\.(?P<pdtype>float16|bfloat16|float32)\b"
    rf"|\b(?P<ds>fp16|bfloat16|bf16)_enabled{_DOTS}True\b"
    r"|(?<![\w.])(?P<kw>fp16|bf16)=True(?=[,)]|\s*$)"
    r"|['\"](?P<dict>fp16|bf16)['\"]\s*:\s*(?:True|true)\b"
    r"|\"(?P<json>fp16|bf16)\"\s*:\s*\{\s*\"enabled\"\s*:\s*(?:true|True)\b"
    r"|\b[Mm]ixed[_ ]precision(?: type)?\s*[:= ]\s*['\"]?(?P<accel>fp16|bf16|no)\b"
    r"|\bUsing (?P<pl>16bit|bfloat16)\b[^\n]{0,20}Automatic Mixed Precision"
    r"|\bSelected optimization level O(?P<apex>[0-3])\b"
    r"|\bloss_scale\s*:\s*(?P<apexdyn>dynamic)\b"
    r"|\bcompute_dtype['\"]?\s*[:=]\s*['\"]?(?:mstype\.|mindspore\.)?(?P<ms>float16|bfloat16|float32)\b"
    r"|\b(?P<mscell>Dynamic|Fixed)LossScale(?:UpdateCell|Manager)\b"
    # end of training
    r"|(?P<end>\[after training is done\]|\bexiting program at iteration \d+"
    r"|\bTraining completed(?=[.!]|\s*$)|`Trainer\.fit` stopped|\bdone training in [\d.]+ seconds"
    r"|\bProcess \d+ exits successfully|\bTotal training time:|\{'train_runtime':)")
# The two statements that span a line (a launcher ... its flag; MLPerf's run_stop ... its status)
# are found by ``_spanning``, one pass over the line each: as regex alternatives (``[^\n]*?``
# from every launcher word or run_stop key) they were quadratic, and a hostile 1 MB line of
# ``.py .py ... fp16`` held the reader for minutes.
_LAUNCH_RE = re.compile(r"(?:python3?|torchrun|deepspeed|accelerate launch|\.py|\.sh)\b")
_FLAG_RE = re.compile(r"\s--(fp16|bf16)(?=\s|$)")
_RUN_STOP, _SUCCESS = '"key": "run_stop"', '"status": "success"'

_MODES = {"fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
          "16bit": "fp16", "no": "fp32"}
_PREC_GROUPS = ("dump", "pdtype", "ds", "kw", "dict", "json", "accel", "pl", "ms")


class HintsParser(Parser):
    name = "hints"
    priority = 99  # last: its keywords are looked for only in the lines no producer claimed
    hint = True
    keywords = ("fp16", "bf16", "float16", "16bit", "recision", "ization level", ": dynamic", "compute_dtype",
                "LossScale", "training is done", "exiting program", "Training completed", "Trainer.fit",
                "done training", "exits successfully", "Total training time", "run_stop", "train_runtime")

    def parse_spans(self, block: Block) -> tuple[list[Record], list[tuple[int, int]] | None]:
        return self.parse(block), []  # claims no line: the producer's parser reads them all

    def parse(self, block: Block) -> list[Record]:
        """The regex is slow on long text (many alternatives, no common literal): it runs only on
        the lines that hold a keyword, found with ``str.find``."""
        text = block.text
        lines: dict[int, int] = {}
        for kw in self.keywords:
            i = text.find(kw)
            while i != -1:
                start = text.rfind("\n", 0, i) + 1
                end = text.find("\n", i)
                end = len(text) if end < 0 else end
                lines[start] = end
                i = text.find(kw, end)
        out: list[Record] = []
        spanning = False
        for start in sorted(lines):
            for m in _RE.finditer(text, start, lines[start]):
                rec = self._record(block, m)
                if rec is not None:
                    out.append(rec)
            more = self._spanning(block, start, lines[start])
            if more:
                out.extend(more)
                spanning = True
        if spanning:  # records in text order, as the composite parser expects
            out.sort(key=lambda r: r.pos)
        return out

    def _spanning(self, block: Block, start: int, end: int) -> list[Record]:
        """``--fp16``/``--bf16`` after a launcher word on the line (each flag with a launcher
        since the previous flag), and a ``run_stop`` key with a success status after it."""
        text, out = block.text, []
        at = start
        while (launch := _LAUNCH_RE.search(text, at, end)) is not None:
            flag = _FLAG_RE.search(text, launch.end(), end)
            if flag is None:
                break
            rec = self.record(block, launch.start())
            mode = _MODES[flag.group(1)]
            rec.add(PRECISION, 1.0, source=text[launch.start():flag.end()][:60].strip(), mode=mode)
            out.append(rec)
            at = flag.end()
        key = text.find(_RUN_STOP, start, end)
        if key >= 0 and text.find(_SUCCESS, key + len(_RUN_STOP), end) >= 0:
            rec = self.record(block, key)
            rec.add(TRAINING_END, 1.0, marker=text[key:end][:60])
            out.append(rec)
        return out

    def _record(self, block: Block, m: re.Match[str]) -> Record | None:
        g = m.groupdict()
        rec = self.record(block, m.start())
        if g["end"] is not None:
            rec.add(TRAINING_END, 1.0, marker=g["end"][:60])
            return rec
        mode = scaler = None
        for name in _PREC_GROUPS:
            if g[name] is not None:
                mode = _MODES[g[name]]
                break
        else:
            if g["apex"] is not None:
                mode = "fp32" if g["apex"] == "0" else "fp16"
            elif g["apexdyn"] is not None:
                mode, scaler = "fp16", "dynamic"
            elif g["mscell"] is not None:
                scaler = "dynamic" if g["mscell"] == "Dynamic" else "static"
        if mode is None and scaler is None:
            return None
        attrs = {"source": m.group()[:60].strip()}
        if mode is not None:
            attrs["mode"] = mode
        if scaler is not None:
            attrs["scaler"] = scaler
        rec.add(PRECISION, 1.0, **attrs)
        return rec
