"""The C allocator's share of the idle daemon's memory (glibc; elsewhere these do nothing).

Python objects of more than 512 bytes, and every buffer a read makes, come from malloc. Two things
keep what the first pass over 10,000 files freed resident although the idle agent never uses it
again: glibc gives each thread that allocates an arena of its own (up to eight per core), each
keeping what was freed into it; and freed pages inside the heap stay mapped until someone asks for
them back. ``limit_malloc_arenas`` (at import of the daemon package, before any thread starts) has
the threads share two arenas; ``give_back`` (``malloc_trim``) returns the free pages after a
catch-up (the worker calls it once the follower has no backlog left)."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from typing import Any, Callable

# glibc's mallopt parameter (malloc.h) and the arenas the daemon's threads share
M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def _libc(name: str) -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # no C library with it (not glibc)
        return None
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def limit_malloc_arenas(environ: Any = os.environ) -> bool:
    """At most MALLOC_ARENAS glibc malloc arenas for the whole process: glibc gives each thread
    that allocates an arena of its own (up to eight per core), and each arena keeps what was freed
    into it for reuse by that thread alone. The worker's first pass over 10,000 files (1 MiB reads,
    decoded text, samples) leaves memory free in arenas that the idle agent never uses again
    (~1.6 MB of its resident memory in one run at 10,000 files). The daemon's threads allocate
    little at the same time (one worker reads and judges; the others mostly wait). A
    ``MALLOC_ARENA_MAX`` or ``GLIBC_TUNABLES=glibc.malloc.arena_max=N`` the user set is kept (glibc
    read it at start); elsewhere than glibc this does nothing. Returns whether the bound was set.
    Only effective before the threads allocate (arenas are made once)."""
    user = environ.get("MALLOC_ARENA_MAX") or "glibc.malloc.arena_max" in environ.get("GLIBC_TUNABLES", "")
    mallopt = None if user else _libc("mallopt")
    if mallopt is None:
        return False
    return mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(MALLOC_ARENAS)) == 1


def give_back() -> bool:
    """Return the heap's free pages to the system (``malloc_trim(0)``: a few milliseconds for a
    100 MB heap; ~2.4 MB of the idle agent after a first pass over 10,000 files). A full garbage
    collection first (tens of milliseconds, once per catch-up): the readers and the pipeline hold
    the collector while they work (``model.gc_paused``), and an idle agent allocates too little to
    trigger one, so the catch-up's cyclic garbage stayed (~2 MB after 10,000 files). Returns
    whether any memory went back."""
    gc.collect()
    trim = _libc("malloc_trim")
    return trim is not None and trim(ctypes.c_size_t(0)) == 1
