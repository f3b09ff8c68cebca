"""The daemon's threads, bounded by its configuration and never by the host's CPU count.

A training host has many cores and they belong to training. Native libraries size their thread
pools from the CPU count at load time: OpenBLAS (numpy's BLAS) starts one thread per core when
numpy is imported, OpenMP runtimes and MKL likewise, and numexpr-style pools read the same
variables. The daemon needs none of them (its kernels are single-threaded per call, its scan
workers are its own threads), so ``limit_native_pools`` sets the variables those libraries read
to 1 before numpy is first imported (the ``daemon`` package imports this module first). A value
the user set explicitly is kept.

The daemon's own threads (``expected_threads``): main, worker, dump scan, apscheduler's scheduler
thread and its one job thread,
the HTTP server's I/O thread and ``http.workers`` request threads, watchdog's inotify reader and
observer with one emitter per watched root (inotify or polling), one polling observer per distinct
poll interval of the watches that poll (``poll: auto`` polls on network file systems), and one push
thread per Alertmanager URL."""

from __future__ import annotations

import os
from typing import Any

# the variables OpenBLAS, OpenMP (GNU, LLVM, Intel), MKL, BLIS, Apple Accelerate and numexpr read
POOL_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                  "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "GOTO_NUM_THREADS")

FIXED_THREADS = 6       # main, worker, dump-scan, scheduler, its job thread, http-io
WATCHDOG_THREADS = 2    # inotify reader + observer (emitters counted per watched root)


def limit_native_pools(environ: Any = os.environ) -> dict[str, str]:
    """Set each pool variable to 1 where unset; returns what was set. Only effective before the
    library loads (numpy reads OpenBLAS's at import)."""
    done = {}
    for name in POOL_VARIABLES:
        if not environ.get(name):
            environ[name] = done[name] = "1"
    return done


def expected_threads(config: Any) -> int:
    """The most threads the daemon runs with ``config`` at idle and while scanning dumps
    (``config``: agent.config.Config)."""
    # every watched root has one emitter, inotify or polling; a watch that may poll (``poll: auto``
    # polls on a network file system) may need the polling observer of its interval
    pollers = {w.poll_interval for w in config.watches if w.poll is not False}
    pushers = len(config.alertmanager.urls) if config.alertmanager is not None else 0
    # limits.scan_jobs > 1: that many job threads beside the dump-scan thread, while a scan runs
    jobs = config.limits.scan_jobs
    return (FIXED_THREADS + (jobs if jobs > 1 else 0) + config.http.workers + WATCHDOG_THREADS
            + len(config.watches) + len(pollers) + pushers)
