"""Keep the agent's reads inside the watched trees: a symlink in a watched folder whose target
resolves outside every watched root (``/etc/passwd``, another user's home) is not followed,
unless its watch says ``follow_symlinks: true``.

Three places ask: the resync walk (links are skipped before they become followed files or dump
files), the tailer (on every open it checks the real path of the *opened descriptor*, from
``/proc/self/fd``, so a name swapped for a link between a check and the open is caught too), and
the dump scan thread, whose many readers all open through Python's ``open``/``os.open``: an audit
hook (PEP 578), active only on the threads that :meth:`Confinement.guard` marks, refuses opening
a path that leaves the roots with a ``PermissionError``, which the readers report as an
unreadable file. Each skipped link is logged once and counted.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from ..config import Watch
from .watcher import watch_for

log = logging.getLogger(__name__)


class LinkRefused(PermissionError):
    """Opening this path would follow a symlink out of the watched roots (already reported)."""

    reported = True


class Confinement:
    """The watched roots (their real paths, plus each dump watch's ``compare.against``, read on
    purpose) and what may be read through a symlink. ``on_skip(path)``: called once per refused
    link (the daemon counts it)."""

    def __init__(self, watches: list[Watch], on_skip: Callable[[str], None] | None = None) -> None:
        self.watches = watches
        self.on_skip = on_skip
        self._reported: set[str] = set()
        self._lock = threading.Lock()
        self.refresh()

    def refresh(self) -> None:
        """Resolve the roots again (a watched directory, or a link to it, may appear later)."""
        dirs, files, lexical = [], set(), []
        roots = [w.path for w in self.watches] + [w.compare.against for w in self.watches if w.compare is not None]
        for path in roots:
            real = os.path.realpath(path)
            files.add(real)
            if not os.path.isfile(real):
                dirs.append(real.rstrip("/") + "/")
            lexical.append(os.path.abspath(path).rstrip("/") + "/")
        self._dirs, self._files, self._lexical = tuple(dirs), frozenset(files), tuple(lexical)

    def inside(self, real: str) -> bool:
        """Whether a resolved path lies in a watched root."""
        return real in self._files or real.startswith(self._dirs)

    def allows(self, path: str, real: str | None = None) -> bool:
        """Whether ``path`` (resolved: ``real``) may be read; reports a refused link once."""
        if real is None:
            real = os.path.realpath(path)
        if self.inside(real):
            return True
        w = watch_for(self.watches, path)
        if w is not None and w.follow_symlinks:
            return True
        self.skipped(path)
        return False

    def skipped(self, path: str) -> None:
        with self._lock:
            if path in self._reported:
                return
            if len(self._reported) > 100_000:
                self._reported.clear()
            self._reported.add(path)
        log.warning("not following %s: it is a symlink to a file outside the watched roots "
                    "(follow_symlinks: true on its watch allows it)", path)
        if self.on_skip is not None:
            self.on_skip(path)

    def check_fd(self, path: str, fd: int) -> None:
        """The tailer's check after ``os.open``: the real path of what was opened."""
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: the name as it resolves now
            real = os.path.realpath(path)
        if real.endswith(" (deleted)") and not os.path.exists(real):
            real = real[: -len(" (deleted)")]
        if not self.allows(path, real):
            raise LinkRefused("symlink to a file outside the watched roots")

    # -- the scan thread's guard -------------------------------------------------------------------
    @contextmanager
    def guard(self) -> Iterator[None]:
        """While active on this thread, opening a path that resolves outside the roots fails."""
        _install_hook()
        prev = getattr(_active, "confinement", None)
        _active.confinement = self
        try:
            yield
        finally:
            _active.confinement = prev

    def _audit_open(self, path: object) -> None:
        if isinstance(path, int):
            return  # a descriptor: opened (and checked) already
        try:
            p = os.path.abspath(os.fsdecode(path))  # type: ignore[arg-type]
        except TypeError:
            return
        # only names inside a watched tree are the trees' business: imports, the state directory,
        # /proc and CSV reports are opened by their own names
        if (p + "/").startswith(self._lexical) and not self.allows(p):
            raise LinkRefused("symlink to a file outside the watched roots")


_active = threading.local()
_hook_installed = False
_hook_lock = threading.Lock()


def _hook(event: str, args: tuple) -> None:
    if event != "open":
        return
    c = getattr(_active, "confinement", None)
    if c is not None and args:
        _active.confinement = None  # the check itself must not recurse into the hook
        try:
            c._audit_open(args[0])
        finally:
            _active.confinement = c


def _install_hook() -> None:
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            sys.addaudithook(_hook)
            _hook_installed = True


__all__ = ["Confinement", "LinkRefused"]
