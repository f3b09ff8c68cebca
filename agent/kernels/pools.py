"""Native libraries' thread pools, bounded to one thread each before numpy loads.

OpenBLAS (numpy's BLAS) starts one thread per core when numpy is imported, OpenMP runtimes and
MKL likewise, and numexpr-style pools read the same variables. Nothing of the agent needs them:
its kernels are single-threaded per call (the numpy fallback's dots stay under OpenBLAS's
threading size, scan_numpy.ROW) and its commands and daemon split work on threads of their own.
On a 16-core host those pools cost every command ~2 s of CPU at start-up (bench/README) and the
daemon 16 threads. ``limit_native_pools`` sets the variables to 1 where the user has not set
them; it only works before numpy is first imported (the CLI's entry and the daemon package call
it first)."""

from __future__ import annotations

import os
from typing import Any

# the variables OpenBLAS, OpenMP (GNU, LLVM, Intel), MKL, BLIS, Apple Accelerate and numexpr read
POOL_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                  "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "GOTO_NUM_THREADS")


def limit_native_pools(environ: Any = os.environ) -> dict[str, str]:
    """Set each pool variable to 1 where unset; returns what was set."""
    done = {}
    for name in POOL_VARIABLES:
        if not environ.get(name):
            environ[name] = done[name] = "1"
    return done
