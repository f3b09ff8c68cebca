"""Why a state read or write failed, in a few stable words ("disk full", "I/O error", ...): the
log says the cause (not the rollback that followed it), the metric
``precision_agent_state_save_failures_total{cause}`` counts it, and a transient cause (a full
disk) keeps the agent running from memory instead of stopping it."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path


class StateError(Exception):
    """The state store could not be read or written (disk full, corrupt file, permissions).
    ``cause`` names the reason in a few words ("disk full", "I/O error", ...): failures are
    reported once per cause, not once per attempt (agent/store/saving.py)."""

    def __init__(self, message: str, cause: str = "error") -> None:
        super().__init__(message)
        self.cause = cause

    @property
    def transient(self) -> bool:
        """A cause that goes away by itself or by freeing space: keep running from memory and retry."""
        return self.cause in TRANSIENT_CAUSES


TRANSIENT_CAUSES = frozenset({"disk full", "quota exceeded", "I/O error"})
_SQLITE_CAUSES = {13: "disk full", 10: "I/O error", 8: "read-only", 3: "permission denied", 5: "locked",
                  6: "locked", 14: "cannot open"}
_ERRNO_CAUSES = {errno.ENOSPC: "disk full", errno.EDQUOT: "quota exceeded", errno.EIO: "I/O error",
                 errno.EROFS: "read-only", errno.EACCES: "permission denied", errno.EPERM: "permission denied"}


def cause_of(exc: BaseException) -> str:
    """A short, stable name for why a state read or write failed (used as a metric label)."""
    if isinstance(exc, StateError):
        return exc.cause
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and code & 0xFF in _SQLITE_CAUSES:
            return _SQLITE_CAUSES[code & 0xFF]
        text = str(exc).lower()
        if "disk is full" in text:
            return "disk full"
        if "disk i/o error" in text:
            return "I/O error"
        return "database error"
    if isinstance(exc, OSError):
        return _ERRNO_CAUSES.get(exc.errno or 0, "OS error")
    return "error"


FULL_BELOW = 256 * 1024  # free bytes under which an I/O error is taken for what it is: a full disk


def state_error(path: Path, exc: BaseException) -> StateError:
    """A StateError naming ``exc`` and its cause. SQLite reports a full disk as a "disk I/O error"
    where it cannot grow its shared-memory file: the free space of the directory tells."""
    cause = cause_of(exc)
    text = f"{path}: {exc}"
    if cause == "I/O error":
        try:
            st = os.statvfs(path.parent)
        except OSError:
            st = None
        if st is not None and st.f_bavail * st.f_frsize < FULL_BELOW:
            cause = "disk full"
            text += f"; its file system has {st.f_bavail * st.f_frsize} bytes free"
    return StateError(text if cause.lower() in text.lower() else f"{text} ({cause})", cause)
