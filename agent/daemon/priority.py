"""Lower the agent's CPU and I/O priority: a training host's cycles belong to training."""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_WHO_PROCESS = 1


def lower_priority(nice: int, io_idle: bool) -> None:
    if nice > 0:
        try:
            current = os.getpriority(os.PRIO_PROCESS, 0)
            if current < nice:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError as exc:
            log.warning("could not lower CPU priority: %s", exc)
    if io_idle:
        nr = _IOPRIO_SET.get(platform.machine())
        if nr is None or not hasattr(ctypes, "CDLL"):
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.syscall(nr, _IOPRIO_WHO_PROCESS, 0, _IOPRIO_CLASS_IDLE << 13) != 0:
                log.warning("could not set idle I/O priority: errno %d", ctypes.get_errno())
        except OSError as exc:
            log.warning("could not set idle I/O priority: %s", exc)
