"""The C allocator's share of the daemon's memory (daemon/heap.py): its threads share
MALLOC_ARENAS glibc arenas, and the heap's free pages go back to the system."""

import os
import subprocess
import sys

import pytest

from precision_agent.daemon.heap import MALLOC_ARENAS, limit_malloc_arenas


# A process whose threads each allocate: how many glibc arenas (64 MiB-aligned heaps of their own,
# a read-write head and the reserved rest) it made, read from its own /proc/self/maps.
ARENAS = r"""
import sys, threading
if sys.argv[1] == "daemon":
    import precision_agent.daemon  # what the daemon does first
both = threading.Barrier(8)
def work():  # all 8 alive at once: an ended thread's arena would go to the next one
    both.wait()
    keep = [bytearray(4096) for _ in range(2000)]  # malloc, not pymalloc (> 512 bytes)
    both.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
regions = []
with open("/proc/self/maps") as f:
    for line in f:
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        regions.append((lo, hi, perms))
heap = 64 << 20
print(sum(1 for (lo, hi, p), (lo2, hi2, p2) in zip(regions, regions[1:])
          if lo % heap == 0 and p == "rw-p" and p2 == "---p" and hi == lo2 and hi2 == lo + heap))
"""


def test_daemon_bounds_malloc_arenas() -> None:
    """The idle daemon's memory: each thread that allocates would keep a glibc arena of its own
    (what the first pass over 10,000 files freed stays there); the daemon shares MALLOC_ARENAS."""
    if not limit_malloc_arenas({}):
        pytest.skip("no glibc mallopt here")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    plain, daemon = (int(subprocess.run([sys.executable, "-c", ARENAS, how], env=env, check=True,
                                        capture_output=True, text=True, timeout=120).stdout)
                     for how in ("plain", "daemon"))
    assert plain >= 4  # the measure sees the arenas 8 threads make by default
    assert daemon <= MALLOC_ARENAS - 1  # the main thread's arena is not one of these heaps



def test_a_users_malloc_arena_max_is_kept() -> None:
    assert limit_malloc_arenas({"MALLOC_ARENA_MAX": "8"}) is False
    assert limit_malloc_arenas({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0:glibc.malloc.arena_max=8"}) is False


RSS = r"""
import sys
import precision_agent.daemon.heap as heap
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:"))
keep = [bytearray(4000) for _ in range(20000)]  # 80 MB from malloc, in the heap
del keep[::2], keep[:-1]                         # freed, the last one still holds the heap's top
before = rss()
print(heap.give_back(), before - rss())
"""


def test_give_back_returns_free_heap_pages() -> None:
    if not limit_malloc_arenas({}):
        pytest.skip("no glibc malloc here")
    out = subprocess.run([sys.executable, "-c", RSS], check=True, capture_output=True, text=True, timeout=120).stdout
    went_back, kib = out.split()
    assert went_back == "True" and int(kib) > 40_000  # most of the 80 MB freed below the heap's top
