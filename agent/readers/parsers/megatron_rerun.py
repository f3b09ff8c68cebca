"""Megatron-LM's rerun state machine: the job's own verdict on a suspicious result (issue 22).

``megatron/core/rerun_state_machine.py`` (NVIDIA/Megatron-LM, since Dec 2024) validates results
such as the loss (``rejection_func=torch.isnan``): a rejected result is re-run in place on the same
GPU and, when it reproduces there, re-run from a checkpoint on another GPU. Its log lines (Python
``logging``, e.g. ``ERROR:megatron.core.rerun_state_machine:...``), as of commit d98e8a64 and older:

* detection: ``Unexpected result nan on rank 3 at iteration #1235 invocation #1 (message='loss is
  NaN')`` (older: ``Unexpected result nan at FILE line N, invokation #1 at iteration #1235 (...)``);
  with reruns disabled: ``Rank 3, node n1, device 3, iteration 1235: Unexpected result nan (message='...')``;
* first rerun (same GPU): ``First rerun: unexpected result is not reproducible within the tolerance
  (x != y)`` then ``Possible transient error!``, or ``... is reproducible within the tolerance (x = y).
  Need to rerun on a different GPU to verify correctness``;
* second rerun (another GPU): ``Second rerun: unexpected result is not reproducible on a different
  GPU, therefore was likely incorrect`` then ``Possible persistent error!``, or ``... is reproducible
  on a different GPU, therefore it was likely correct`` then ``Correct result (but possible
  Application error) (message)``;
* ``log_failure`` prefixes ``Rank R, node N, device D, iteration #I: `` (older: without the
  iteration, oldest: ``Rank R, node N, device D: ``) and appends ``!``;
* the tracker file (``--result-rejected-tracker-filename``): ``ts=... node=... device=... jobID=...
  rank=R iteration=I status=first_rerun_not_reproducible result=... message='...'`` (the status may
  read ``RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE``: Python 3.11+ formats the str enum so).

Each becomes a ``rerun_verdict`` sample (value 1, step = the iteration) with attrs ``verdict``:
``detected`` (rejected, no rerun yet), ``transient`` (not reproducible on the same GPU),
``reproducible_same_gpu`` (pending the rerun on another GPU), ``persistent`` (not reproducible on
another GPU: the first GPU computed wrong), ``reproducible`` (the same on another GPU: a correct
result, a numerical problem); and ``rank``, ``node``, ``device``, ``result``, ``message`` where the
line has them. A line without its iteration (older releases) takes the last detection's of the file.
The suspect verdict (agent/engine/suspect.py) reads them.

Where the rejected result was NaN/Inf, the outcome of the reruns (or the detection, with reruns
disabled) is also a ``nonfinite_message`` sample: the state machine stops or repeats the iteration
before its loss is printed, so its lines are the only record of the incident. It comes once per
iteration and outcome, with the verdict already noted (same record, the verdict first).

A hint parser: it runs beside whichever format reads the file, first (priority 5: it also sees the
lines another reader claims, e.g. ``user_print`` reading ``(message='loss is NaN')``), and claims no line.
"""

from __future__ import annotations

import re

from ...model import NONFINITE_MESSAGE, RERUN_VERDICT
from .base import Block, Parser, Record

MESSAGE_CHARS = 200
LINE_CHARS = 1000  # of a line looked at after a keyword, at most
PER_LINE = 4       # messages read on one line, at most (a line holds one; a hostile one may repeat them)
_KEY_RE = re.compile(
    r"(?P<first>First rerun: unexpected result is (?P<fnot>not )?reproducible within the tolerance)"
    r"|(?P<second>Second rerun: unexpected result is (?P<snot>not )?reproducible on a different GPU)"
    r"|(?P<transient>Possible transient error!)|(?P<persistent>Possible persistent error!)"
    r"|(?P<correct>Correct result \(but possible Application error\))"
    r"|(?P<unexpected>Unexpected result )"
    r"|(?P<tracker>\bjobID=\S{1,200} rank=(?P<trank>\d{1,9}) iteration=(?P<tit>\d{1,19}) "
    r"status=(?:RerunValidationStatus\.)?(?P<status>[A-Za-z_]{1,40}) )")
_PREFIX_RE = re.compile(r"Rank (?P<rank>\d{1,9}), node (?P<node>[^,\n]{1,255}), device (?P<device>\d{1,9})"
                        r"(?:, iteration #?(?P<it>\d{1,19}))?: ")
_ON_RANK_RE = re.compile(r" on rank (\d{1,9})")
_AT_IT_RE = re.compile(r"at iteration #(\d{1,19})")
_MSG_RE = re.compile(r"\(message='([^\n]{0,%d}?)'\)" % MESSAGE_CHARS)
_STOP_RE = re.compile(r" on rank | at | \(message=")
_NODE_RE = re.compile(r"\bnode=(\S{1,255}) device=(\S{1,40})")
_RESULT_RE = re.compile(r"\bresult=(.{0,200}?) message=")
_NONFINITE_RE = re.compile(r"(?<![A-Za-z])[-+]?(?:nan|inf)(?![A-Za-z])", re.IGNORECASE)
_STATUS = {"rerun_disabled": "detected", "initial_run": "detected",
           "first_rerun_not_reproducible": "transient", "first_rerun_reproducible": "reproducible_same_gpu",
           "second_rerun_not_reproducible": "persistent", "second_rerun_reproducible": "reproducible"}
# verdicts that end the state machine's work on an iteration: the incident's record (nonfinite_message)
_OUTCOMES = frozenset({"transient", "reproducible_same_gpu", "persistent", "reproducible"})


class MegatronRerunParser(Parser):
    name = "megatron_rerun"
    priority = 5     # first: it must see every line, whichever producer claims it (it claims none)
    hint = True       # beside any format (a Megatron log read as `megatron` or auto)
    per_file = True   # the last detection's iteration, result and message, for lines without them
    keywords = ("rerun: unexpected", "Possible transient", "Possible persistent", "Correct result (but",
                "Unexpected result", "jobID=")

    def __init__(self) -> None:
        self._it: int | None = None     # the last detection: iteration, result, message, rank
        self._result = ""
        self._message = ""
        self._rank: str | None = None
        self._told: set[tuple[int | None, str]] = set()  # (iteration, outcome) already a nonfinite_message

    def parse_spans(self, block: Block) -> tuple[list[Record], list[tuple[int, int]] | None]:
        return self.parse(block), []  # claims no line

    def parse(self, block: Block) -> list[Record]:
        text, out = block.text, []
        line_start, on_line = -1, 0
        for m in _KEY_RE.finditer(text):
            start = text.rfind("\n", 0, m.start()) + 1
            on_line = on_line + 1 if start == line_start else 1
            line_start = start
            if on_line > PER_LINE:
                continue
            end = text.find("\n", m.end(), m.end() + LINE_CHARS)
            line_rest = text[m.end():end if end >= 0 else min(len(text), m.end() + LINE_CHARS)]
            attrs: dict[str, object] = {}
            i = text.rfind("Rank ", max(start, m.start() - 300), m.start())
            p = _PREFIX_RE.fullmatch(text, i, m.start()) if i >= 0 else None  # ``log_failure``'s prefix
            if p is not None:
                attrs.update(rank=p.group("rank"), node=p.group("node").strip(), device=p.group("device"))
            it = int(p.group("it")) if p is not None and p.group("it") else None
            if m.group("tracker"):
                verdict = _STATUS.get(m.group("status").lower())
                if verdict is None:
                    continue
                it = int(m.group("tit"))
                attrs["rank"] = m.group("trank")
                line = text[start:end if end >= 0 else len(text)]
                if n := _NODE_RE.search(line):
                    attrs.update(node=n.group(1), device=n.group(2))
                if r := _RESULT_RE.search(line):
                    attrs["result"] = r.group(1)
                if g := _MSG_RE.search(line.replace("message='", "(message='", 1) + ")"):
                    attrs["message"] = g.group(1)
                if verdict == "detected":
                    self._remember(it, attrs)
            elif m.group("unexpected"):
                stop = _STOP_RE.search(line_rest)
                attrs["result"] = line_rest[:stop.start() if stop else MESSAGE_CHARS][:MESSAGE_CHARS].strip()
                if r := _ON_RANK_RE.search(line_rest):
                    attrs.setdefault("rank", r.group(1))
                if i := _AT_IT_RE.search(line_rest):
                    it = int(i.group(1))
                if g := _MSG_RE.search(line_rest):
                    attrs["message"] = g.group(1)
                verdict = "detected"
                self._remember(it, attrs)
            else:
                verdict = ("reproducible_same_gpu" if m.group("first") and not m.group("fnot") else
                           "transient" if m.group("first") or m.group("transient") else
                           "persistent" if m.group("snot") or m.group("persistent") else "reproducible")
                if it is None:
                    it = self._it
                attrs.setdefault("result", self._result)
                attrs.setdefault("message", self._message)
                if "rank" not in attrs and self._rank is not None:
                    attrs["rank"] = self._rank
            rec = block.record(m.start(), it, self.name)
            if "rank" not in attrs and rec.rank is not None:
                attrs["rank"] = rec.rank  # the line's ``[rankN]:`` prefix
            attrs["verdict"] = verdict
            rec.values.append((RERUN_VERDICT, 1.0, tuple(attrs.items())))
            self._incident(rec, it, verdict, p is not None, attrs)
            out.append(rec)
        return out

    def _remember(self, it: int | None, attrs: dict[str, object]) -> None:
        self._it, self._rank = it, attrs.get("rank")  # type: ignore[assignment]
        self._result, self._message = str(attrs.get("result", "")), str(attrs.get("message", ""))

    def _incident(self, rec: Record, it: int | None, verdict: str, prefixed: bool, attrs: dict[str, object]) -> None:
        """The ``nonfinite_message`` of a rejected NaN/Inf: at the reruns' outcome, or at once where
        no rerun follows (reruns disabled: the detection carries the ``Rank ..., iteration N:`` prefix)."""
        final = verdict in _OUTCOMES or (verdict == "detected" and prefixed)
        if not final or not _NONFINITE_RE.search(str(attrs.get("result", ""))):
            return
        key = (it, "detected" if verdict == "detected" else "outcome")
        if key in self._told:
            return
        if len(self._told) > 4096:
            self._told.clear()
        self._told.add(key)
        msg = str(attrs.get("message", "")).lower()
        # Megatron checks each rank's own loss and its local (not yet all-reduced) gradient norm
        what = "loss" if "loss" in msg else "local_grad_norm" if "grad" in msg else "result_validation"
        rec.values.append((NONFINITE_MESSAGE, 1.0, (("what", what), ("rerun_verdict", verdict))))
