"""The daemon's dump side, between the scan thread and the pipeline.

On the scan thread (``after_scan``): the duties a dump watch's config asks for beyond the scan,
i.e. the comparison with a benchmark run or rerun, and the cross-rank digest. On the worker
(``handle``): count the files read, report unreadable files (each once per change of the file,
counted always: ``_errors``), feed every sample (first bad op, overflows,
saturation, watchpoints, divergence) to the rules, export digests and comparison outcomes, and
remember the directory's signature so that a restart does not scan it again.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..compare.live import DumpWork, after_scan, compare_sample
from ..config import Config, Watch
from ..dumps.cache import cause_of
from ..dumps.results import DumpBook
from ..dumps.samples import labelled
from ..dumps.schedule import AfterScan, DumpScheduler, ScanResult
from ..dumps.types import LIMITS
from ..engine.pipeline import Pipeline
from ..fusion.suspect import CATALOGUE_ERROR_PATH
from .fusionfiles import FusionPickup, watch_places
from ..health import Health
from ..model import DUMP_NONFINITE, DUMP_OVERFLOW, DUMP_STEP, make_labels
from ..readers.runs import dump_run_labels
from ..sources.watcher import watch_for
from ..store.saving import SaveTracker
from ..store.state import StateError, StateStore

log = logging.getLogger("precision_agent")
MAX_LOGGED = 100_000    # (path, reason, file identity) of scan errors already logged
LINES_PER_CAUSE = 10    # error lines per scan and cause; the rest in one summary line


WRITTEN_METRICS = frozenset({DUMP_NONFINITE, DUMP_OVERFLOW, DUMP_STEP})


class DumpFlow:
    def __init__(self, config: Config, health: Health, pipeline: Pipeline, store: StateStore,
                 book: DumpBook, saves: SaveTracker | None = None) -> None:
        self.config, self.health, self.pipeline, self.store, self.book = config, health, pipeline, store, book
        self.saves = saves
        self.scheduler = DumpScheduler(config.dump_settle, 64, {}, self.after_scan, self.keep_cache,
                                       lambda msg: health.error("scan", "%s", msg), config.limits.scan_jobs)
        LIMITS.max_decompressed_bytes = config.limits.max_decompressed_bytes
        self.fusion = FusionPickup(watch_places(self._watch))   # the jobs' fusion reports and graphs
        self.scheduler.fusion = self.fusion.annotate
        self._catalogue_errors: set[str] = set()
        self._logged: OrderedDict[int, None] = OrderedDict()   # hashes of scan errors and notes logged
        self.origins_unsaved = False   # the dump-origin records changed since the last commit that worked

    def unsaved_origins(self) -> list[Any] | None:
        """The dump-origin records for the next commit, when they changed since the last one that worked."""
        return self.book.origins.rows() if self.origins_unsaved else None

    def restore(self) -> None:
        """At start: each rank's first non-finite dump, as saved before a restart."""
        try:
            bad = self.book.origins.restore(self.store.load_dump_origins())
            if bad:
                self.health.error("state", "skipped %d unreadable dump-origin record(s)", bad)
        except StateError as exc:
            self.health.error("state", "could not read the dump-origin records: %s", exc)

    def keep_cache(self, unit: str) -> bool:
        """Scan thread: keep a unit's pages in the page cache when a comparison will read them
        next (its watch compares it, or it lies under some watch's benchmark tree)."""
        watch = self._watch(unit)
        if watch is not None and watch.compare is not None:
            return True
        u = os.path.abspath(unit)
        for w in self.config.watches:
            if w.compare is not None:
                against = os.path.abspath(w.compare.against)
                if u == against or u.startswith(against + os.sep):
                    return True
        return False

    def _watch(self, unit: str) -> Watch | None:
        return watch_for(self.config.watches, os.path.join(unit, "x")) or watch_for(self.config.watches, unit)

    def work(self, watch: Watch) -> DumpWork:
        spec = watch.compare
        csv_dir = (spec.csv_dir if spec is not None and spec.csv_dir is not None
                   else self.config.state_dir / "compare")
        return DumpWork(Path(watch.path), spec, watch.digest, Path(csv_dir))

    def after_scan(self, unit: str) -> AfterScan:
        """Scan thread: comparison and digest, when the unit's watch asks for them."""
        watch = self._watch(unit)
        if watch is None:
            return AfterScan()
        work = self.work(watch)
        if not work.needed:
            return AfterScan()
        return after_scan(unit, replace(work, fusion=self.fusion.context(unit)), self.config.dump_settle)

    def handle(self, r: ScanResult) -> None:
        """Worker thread: one scanned (or re-compared) dump directory."""
        watch = self._watch(r.unit)
        labels = (dump_run_labels(r.unit, str(watch.path), watch.run_from, dict(watch.labels))
                  if watch is not None else {})
        if r.signature is not None:
            self._scanned(r, labels)
        self._after(r.unit, r.after, labels)
        for message in self.pipeline.errors:
            self.health.error("internal", "%s", message)
        self.pipeline.errors.clear()

    def _scanned(self, r: ScanResult, labels: dict[str, str]) -> None:
        if r.error is not None or r.result is None:
            self.health.error("scan", "%s: %s", r.unit, r.error)
            return
        assert r.signature is not None
        self.health.inc("dump_files_scanned", r.files_read)
        self._errors(r)
        for w in r.result.get("warnings") or ():
            if self._remember(("warning", w)):
                log.warning("scan of %s: %s", r.unit, w)
        written = r.signature[2] / 1e9
        for s in r.samples:   # when the dump was written: how the incident kinds tell a restart from a late scan
            if s.metric in WRITTEN_METRICS:
                s.attrs += (("written", written),)
        self.pipeline.process(labelled(r.samples, labels))
        if self.book.origins.observe(r.result, labels, r.unit, written):
            self.origins_unsaved = True   # saved with the batch by the worker's commit (and retried with it)
        try:
            self.store.record_scanned(r.unit, 0, 0, r.signature[1], r.signature[2] / 1e9,
                                      ",".join(map(str, r.signature)))
        except StateError as exc:  # reported once per cause with the other failed saves
            if self.saves is None:
                self.health.error("state", "could not record the scan of %s: %s", r.unit, exc)
            else:
                self.saves.failed(exc, time.time(), f"record the scan of {r.unit}")

    def _remember(self, key: tuple[Any, ...]) -> bool:
        """True the first time ``key`` is seen (a bounded memory of hashes: the oldest are forgotten)."""
        key = hash(key)
        if key in self._logged:
            self._logged.move_to_end(key)
            return False
        self._logged[key] = None
        while len(self._logged) > MAX_LOGGED:
            self._logged.popitem(last=False)
        return True

    def _errors(self, r: ScanResult) -> None:
        """A scan's unreadable files: each one found anew is counted (``errors_total{kind="scan"}``
        and ``dump_unreadable_total{cause}``); its line is written once per change of the file (its
        identity), at most LINES_PER_CAUSE per scan and cause, the rest summed up in one line.
        Errors answered from the scan cache (the file did not change) were reported before."""
        assert r.result is not None
        hidden: dict[str, int] = {}
        shown: dict[str, int] = {}
        for e in r.result["errors"]:
            key = (e["path"], e["reason"])
            if key not in r.fresh_errors or not self._first_time(e):
                continue
            cause = cause_of(e["reason"])
            self.health.inc(f"dump_unreadable_{cause}")
            new = self._remember((*key, r.fresh_errors[key]))
            if new and shown.get(cause, 0) < LINES_PER_CAUSE:
                shown[cause] = shown.get(cause, 0) + 1
                self.health.error("scan", "%s: %s", e["path"], e["reason"])
            else:
                hidden[cause] = hidden.get(cause, 0) + int(new)
                self.health.error("scan", "%s: %s", e["path"], e["reason"], logged=False)
        for cause, n in hidden.items():
            if n:
                log.warning("scan of %s: %d more unreadable file(s) (%s) not logged one by one; counted in "
                            "precision_agent_dump_unreadable_total{cause=\"%s\"}", r.unit, n, cause, cause)

    def _first_time(self, e: dict[str, Any]) -> bool:
        """False for a broken fused-API catalogue already counted: one ``config`` error per error
        (the file named by $PRECISION_AGENT_FUSED_APIS), not one per scan or comparison."""
        if e.get("path") != CATALOGUE_ERROR_PATH:
            return True
        if e.get("reason") not in self._catalogue_errors:
            self._catalogue_errors.add(str(e.get("reason")))
            self.health.error("config", "%s: %s", CATALOGUE_ERROR_PATH, e.get("reason"))
        return False

    def _after(self, unit: str, x: AfterScan, labels: dict[str, str]) -> None:
        if x.error is not None:
            self.health.error("compare", "%s: %s", unit, x.error)
        for d in x.digests:
            ls = make_labels(labels, rank=str(d.rank)) if d.rank is not None else make_labels(labels)
            self.book.set_digest(ls, d.step, d.value, d.tensors)
        if x.waiting_for is not None:
            if not self.scheduler.retry_later(unit):
                self.health.error("compare", "%s: gave up waiting for %s", unit, x.waiting_for)
            return
        self.scheduler.done_waiting(unit)
        res = x.compare
        if res is None:
            return
        if "csv_error" in res:
            self.health.error("compare", "%s: %s", unit, res["csv_error"])
        for e in res.get("errors") or ():
            if self._first_time(e):
                self.health.error("compare", "%s (%s): %s", e.get("path"), e.get("side"), e.get("reason"))
        sample = compare_sample(res, labels, unit)
        self.book.record_compare(make_labels(labels, mode=res.get("mode", "")), unit, res, bool(sample.value),
                                 time.time())
        self.pipeline.process([sample])
