"""Fit the agent's descriptors under RLIMIT_NOFILE, once at start.

The agent holds descriptors on followed log files (at most ``limits.max_open_files``), on HTTP
connections (at most ``http.max_connections``), and a few more of its own: stdio, the state
database with its journal, the listening socket and its selector, one inotify instance per watched
tree, the dump scan thread (and the stuck ones left behind), the Alertmanager client. When their sum
passes the soft limit, the soft limit is raised up to the hard one; if that is still not enough,
the log-file and connection budgets are lowered to fit, with a warning and
``precision_agent_max_open_files_lowered`` 1, rather than failing later with EMFILE storms.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from typing import Callable

from ..config import Config

log = logging.getLogger("precision_agent")

OWN = 64   # stdio, state DB + WAL/journal, listener, selector, Alertmanager, imports, and some slack
SCANS = 24  # the dump scan thread and up to MAX_STUCK stuck ones, a few descriptors each
MIN_FILES = 4  # the least limits.max_open_files accepts


@dataclass(frozen=True)
class DescriptorPlan:
    max_open_files: int    # descriptors the follower may hold on log files
    max_connections: int   # HTTP connections the server accepts at once
    soft_limit: int        # RLIMIT_NOFILE soft limit in force (-1: unlimited)
    lowered: bool          # the configured budgets did not fit and were lowered


def other_descriptors(config: Config) -> int:
    """Descriptors the agent needs besides log files and HTTP connections."""
    return OWN + SCANS + len(config.watches)  # one inotify instance per watched tree at most


def plan_descriptors(config: Config,
                     getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
                     setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit) -> DescriptorPlan:
    """Raise the soft RLIMIT_NOFILE if the configured budgets need it; lower them if the hard
    limit cannot hold them. Logs what it did."""
    files, conns = config.limits.max_open_files, config.http.max_connections
    other = other_descriptors(config)
    need = files + conns + other
    unlimited = resource.RLIM_INFINITY
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if soft != unlimited and need > soft:
        target = need if hard == unlimited else min(need, hard)
        if target > soft:
            try:
                setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                log.info("raised the open-files soft limit (RLIMIT_NOFILE) from %d to %d for "
                         "max_open_files=%d + max_connections=%d + %d of the agent's own", soft, target,
                         files, conns, other)
                soft = target
            except (ValueError, OSError) as exc:
                log.warning("could not raise the open-files soft limit from %d to %d: %s", soft, target, exc)
    if soft == unlimited or need <= soft:
        return DescriptorPlan(files, conns, -1 if soft == unlimited else soft, False)
    room = max(soft - other, 2 * MIN_FILES)
    new_files = max(MIN_FILES, min(files, room // 2))
    new_conns = max(1, min(conns, room - new_files))
    log.warning("the open-files limit (ulimit -n / LimitNOFILE=) is %d (hard %s), too low for "
                "limits.max_open_files=%d + http.max_connections=%d + about %d descriptors of the agent's own: "
                "using max_open_files=%d and max_connections=%d instead; raise the limit to at least %d",
                soft, "unlimited" if hard == unlimited else hard, files, conns, other, new_files, new_conns, need)
    return DescriptorPlan(new_files, new_conns, soft, True)
