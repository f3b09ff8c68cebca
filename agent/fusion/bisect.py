"""Bisection to the fusion pass that breaks a run.

Premise: the run is bad with fusion on and healthy with fusion off (the accuracy guide's "fusion
exception" check). Candidates: the passes the fusion report says were applied (effect_times > 0).
Each round switches off half of the remaining candidates (every other pass stays on) and the user
runs training with that round's ``fusion_switch.cfg``:

* ``good``: that run was healthy, so the culprit is among the passes it switched off;
* ``bad``: it was not, so the culprit is among the remaining passes it left on.

One candidate is left after at most ⌈log2 N⌉ rounds (exactly ⌈log2 N⌉ in the worst case, and for
every culprit when N is a power of two). The session then names it (``status: found``) and writes
the switch file that turns off only that pass; one more run with it may be recorded as a
confirmation: ``good`` confirms it, ``bad`` means no single pass explains the answers (two passes
together, or a flaky run), and the session ends ``inconsistent`` with the smallest set of passes
whose switching off was seen to help.

The session is a JSON file, replaced atomically (temporary file + rename) after every change and
guarded by a lock file, so it survives restarts and two commands cannot interleave.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from ..safeio import FileTooBig, read_regular
from .switch import GRAPH, UB, SwitchConfig, write_atomic

VERSION = 1
RUNNING, FOUND, CONFIRMED, INCONSISTENT = "running", "found", "confirmed", "inconsistent"
MAX_SESSION_BYTES = 16 << 20


class BisectError(ValueError):
    """Bad use of a session (a result for a finished session, a corrupt file): a clear message."""


@dataclass
class Round:
    number: int
    off: tuple[str, ...]
    result: str | None = None        # "good" | "bad" | None (pending)
    confirm: bool = False            # the run with only the named culprit off


@dataclass
class BisectSession:
    report: list[str]
    candidates: tuple[str, ...]
    sections: dict[str, tuple[str, ...]]     # pass -> ("GraphFusion",) / ("UBFusion",) / both
    remaining: tuple[str, ...]
    rounds: list[Round] = field(default_factory=list)
    status: str = RUNNING
    culprit: str | None = None
    smallest_set: tuple[str, ...] = ()       # the smallest off set seen to make the run healthy

    # --- life cycle -------------------------------------------------------------------------------

    @classmethod
    def start(cls, report: list[str], candidates: list[str], sections: dict[str, tuple[str, ...]]) -> BisectSession:
        if not candidates:
            raise BisectError("no effective fusion pass in the report (effect_times > 0): nothing to bisect")
        cands = tuple(candidates)
        s = cls(list(report), cands, {p: sections[p] for p in cands}, cands, smallest_set=cands)
        s._next()
        return s

    def _next(self) -> None:
        if len(self.remaining) == 1:
            self.culprit = self.remaining[0]
            last_good = next((r for r in reversed(self.rounds) if r.result == "good"), None)
            self.status = CONFIRMED if last_good is not None and last_good.off == self.remaining else FOUND
            return
        half = (len(self.remaining) + 1) // 2
        self.rounds.append(Round(len(self.rounds) + 1, self.remaining[:half]))

    @property
    def pending(self) -> Round | None:
        return self.rounds[-1] if self.status == RUNNING and self.rounds and self.rounds[-1].result is None else None

    @property
    def done(self) -> bool:
        return self.status != RUNNING

    @property
    def rounds_done(self) -> int:
        return sum(1 for r in self.rounds if r.result is not None and not r.confirm)

    def record(self, result: str) -> None:
        """Record the outcome of the run made with the current switch file."""
        if result not in ("good", "bad"):
            raise BisectError(f"result {result!r}: expected good or bad")
        if self.status in (CONFIRMED, INCONSISTENT):
            raise BisectError(f"this session is finished ({self.status}); start a new session file")
        if self.status == FOUND:
            assert self.culprit is not None
            self.rounds.append(Round(len(self.rounds) + 1, (self.culprit,), result, confirm=True))
            if result == "good":
                self.status = CONFIRMED
                self.smallest_set = (self.culprit,)
            else:
                self.status, self.culprit = INCONSISTENT, None
            return
        r = self.pending
        assert r is not None
        r.result = result
        off = set(r.off)
        if result == "good":
            self.remaining = tuple(p for p in self.remaining if p in off)
            if len(r.off) < len(self.smallest_set):
                self.smallest_set = r.off
        else:
            self.remaining = tuple(p for p in self.remaining if p not in off)
        self._next()

    # --- what the next run uses -------------------------------------------------------------------

    def off_now(self) -> tuple[str, ...]:
        """The passes the switch file for the next run turns off."""
        if self.status == RUNNING:
            r = self.pending
            return r.off if r else ()
        if self.status == INCONSISTENT:
            return self.smallest_set
        return (self.culprit,) if self.culprit else ()

    def switch_cfg(self) -> SwitchConfig:
        off = self.off_now()
        return SwitchConfig(tuple(p for p in off if GRAPH in self.sections.get(p, ())),
                            tuple(p for p in off if UB in self.sections.get(p, ())))

    def message(self, cfg_path: str) -> str:
        n = len(self.candidates)
        if self.status == RUNNING:
            r = self.pending
            assert r is not None
            return (f"round {r.number} of at most {max_rounds(n)}: run training with {cfg_path} "
                    f"({len(r.off)} of the {len(self.remaining)} remaining passes off), then record "
                    f"--result good if that run was healthy, --result bad if not")
        if self.status == FOUND:
            return (f"culprit: {self.culprit} (after {self.rounds_done} round(s), {n} candidates). {cfg_path} "
                    f"now turns off only this pass: optionally run with it and record --result to confirm")
        if self.status == CONFIRMED:
            return (f"confirmed culprit: {self.culprit}: the run with only it off was healthy; "
                    f"{cfg_path} turns it off (the workaround)")
        return (f"inconsistent answers: switching off the last candidate alone did not help, so no single pass "
                f"explains the results (two passes at once, or a flaky run). Smallest set found whose switching "
                f"off helped ({len(self.smallest_set)} pass(es)): {', '.join(self.smallest_set)}; {cfg_path} "
                f"turns those off")

    def to_json(self, cfg_path: str) -> dict[str, object]:
        """The ``fusion bisect --json`` object: ``round`` is the pending round's number while running,
        else the number of bisection rounds recorded."""
        pending = self.pending
        return {"round": pending.number if pending else self.rounds_done,
                "remaining": list(self.remaining),
                "switch_cfg": self.switch_cfg().to_json(),
                "switch_cfg_path": cfg_path,
                "off": list(self.off_now()),
                "culprit": self.culprit,
                "done": self.done,
                "status": self.status,
                "candidates": len(self.candidates),
                "max_rounds": max_rounds(len(self.candidates)),
                "smallest_set": list(self.smallest_set),
                "history": [{"round": r.number, "off": list(r.off), "result": r.result, "confirm": r.confirm}
                            for r in self.rounds],
                "message": self.message(cfg_path)}


def max_rounds(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


# --- the session file ----------------------------------------------------------------------------

def dump_session(s: BisectSession) -> str:
    return json.dumps({
        "version": VERSION, "report": s.report, "candidates": list(s.candidates),
        "sections": {p: list(k) for p, k in s.sections.items()}, "remaining": list(s.remaining),
        "rounds": [{"round": r.number, "off": list(r.off), "result": r.result, "confirm": r.confirm}
                   for r in s.rounds],
        "status": s.status, "culprit": s.culprit, "smallest_set": list(s.smallest_set)}, indent=1) + "\n"


def _strs(doc: dict[str, object], key: str) -> tuple[str, ...]:
    v = doc.get(key)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise BisectError(f"'{key}' is not a list of pass names")
    return tuple(v)


def parse_session(text: str) -> BisectSession:
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise BisectError(f"not a session file (not JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise BisectError(f"not a fusion-bisect session file (version {VERSION} expected)")
    rounds = []
    for r in doc.get("rounds") or []:
        if not isinstance(r, dict) or r.get("result") not in (None, "good", "bad"):
            raise BisectError("a round of the session is malformed")
        number = r.get("round", 0)
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise BisectError(f"a round of the session is malformed: round {str(number)[:40]!r} is not a number")
        rounds.append(Round(number, _strs(r, "off"), r.get("result"), bool(r.get("confirm"))))
    sections = doc.get("sections")
    if not isinstance(sections, dict):
        raise BisectError("'sections' is not an object")
    status = doc.get("status")
    if status not in (RUNNING, FOUND, CONFIRMED, INCONSISTENT):
        raise BisectError(f"unknown status {status!r}")
    culprit = doc.get("culprit")
    s = BisectSession([str(x) for x in doc.get("report") or []], _strs(doc, "candidates"),
                      {str(p): tuple(str(x) for x in k) for p, k in sections.items() if isinstance(k, list)},
                      _strs(doc, "remaining"), rounds, status, culprit if isinstance(culprit, str) else None,
                      _strs(doc, "smallest_set"))
    if not s.remaining or not set(s.remaining) <= set(s.candidates) or (status == RUNNING and s.pending is None):
        raise BisectError("the session's remaining candidates do not fit its rounds")
    return s


def load_session(path: str | os.PathLike[str]) -> BisectSession:
    try:
        raw = read_regular(path, MAX_SESSION_BYTES)   # a FIFO is refused at once, never waited on
    except FileTooBig:
        raise BisectError(f"{path}: too big for a session file") from None
    except OSError as exc:
        raise BisectError(f"{path}: {exc.strerror or exc}") from None
    try:
        return parse_session(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BisectError(f"{path}: not a session file (not UTF-8)") from None
    except BisectError as exc:
        raise BisectError(f"{path}: {exc}") from None


def save_session(path: str | os.PathLike[str], s: BisectSession) -> None:
    write_atomic(path, dump_session(s))


@contextmanager
def locked(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``<session>.lock`` so that two commands on one session run one after the other."""
    lock = f"{os.fspath(path)}.lock"
    # created if missing, never blocking on open: a FIFO or device in its place is an error
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BisectError(f"{lock}: not a regular file; refused as the session's lock file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
