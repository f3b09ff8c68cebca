"""systemd notification protocol (sd_notify) without a dependency: READY, WATCHDOG, STOPPING."""

from __future__ import annotations

import os
import socket


def sd_notify(state: str) -> bool:
    """Send ``state`` to $NOTIFY_SOCKET; False when not under systemd (or the send failed)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Half of $WATCHDOG_USEC in seconds (the ping period systemd recommends), if set for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(0.1, int(usec) / 2e6)
    except ValueError:
        return None
