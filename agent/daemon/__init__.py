"""The resident agent: wiring and lifecycle (``agent.py``), the worker thread (``worker.py``),
reloads (``reload.py``), the dump side (``dumpflow.py``), thread bounds (``threads.py``), systemd notify and process priority.

Importing this package bounds native libraries' thread pools (BLAS, OpenMP) to one thread each
before anything of the daemon imports numpy (threads.py): they would otherwise start one thread
per CPU of the host; and it bounds the C allocator's arenas before any thread starts (heap.py:
each thread would otherwise keep an arena of freed memory of its own)."""

from .heap import limit_malloc_arenas
from .threads import limit_native_pools

limit_native_pools()
limit_malloc_arenas()
