"""Which file system a watched path lives on, and how many inotify watches this host allows.

inotify reports only changes made through *this* kernel: on NFS, Lustre, GPFS, CIFS, CephFS or a
FUSE mount, writes made by another client (the training job on another node, or a storage
gateway) never raise an event, so such watches are polled instead (``poll: auto``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

MOUNTINFO = "/proc/self/mountinfo"
MAX_USER_WATCHES = "/proc/sys/fs/inotify/max_user_watches"

# file systems whose remote writes inotify cannot see (fuse.* and nfs* are matched by prefix)
NETWORK_FS = frozenset({
    "nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "ceph", "glusterfs", "9p", "afs",
    "ocfs2", "gfs2", "orangefs", "panfs", "wekafs", "fuse", "virtiofs", "vboxsf", "davfs",
})
_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class Mount:
    mount_point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Mounts from the text of /proc/<pid>/mountinfo (see proc(5)); malformed lines are skipped.

    A line is ``id parent major:minor root mount_point options [optional...] - fstype source super``;
    the optional fields vary in number, so the fixed fields after ``-`` are found by the separator.
    """
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 3:
            continue
        mounts.append(Mount(_unescape(fields[4]), _unescape(fields[sep + 1]), _unescape(fields[sep + 2])))
    return mounts


def read_mounts(path: str = MOUNTINFO) -> list[Mount]:
    """This process's mounts; [] when unreadable (then nothing is taken for a network file system)."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return parse_mountinfo(f.read())
    except OSError as exc:
        log.warning("cannot read %s (%s); watches use inotify unless 'poll: true' is set", path, exc)
        return []


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding ``path`` (the deepest mount point containing it; later entries shadow
    earlier ones on the same point). A path that does not exist yet is judged by its nearest
    existing ancestor, where the job will create it."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    real = os.path.realpath(probe)
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point
        inside = real == mp or mp == "/" or real.startswith(mp.rstrip("/") + "/")
        if inside and (best is None or len(mp) >= len(best.mount_point)):
            best = m
    return best


def is_network_fs(fstype: str) -> bool:
    """Whether inotify can miss writes on this file system type (network, cluster or FUSE)."""
    return fstype in NETWORK_FS or fstype.startswith(("fuse.", "nfs"))


def read_watch_limit(path: str = MAX_USER_WATCHES) -> int | None:
    """fs.inotify.max_user_watches, or None when it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def count_dirs(root: str, stop_after: int) -> int:
    """Directories in the tree at ``root`` (itself included) that a recursive inotify watch
    needs one watch each for; stops counting past ``stop_after`` so a huge tree costs little."""
    if not os.path.isdir(root):
        return 0
    n, stack = 0, [root]
    while stack:
        d = stack.pop()
        n += 1
        if n > stop_after:
            return n
        try:
            with os.scandir(d) as it:
                stack.extend(e.path for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return n
