"""When a kernel-log line was written: the stamp in front of the message, in every shape the kernel
log reaches a file in. Used by the ``kernel`` format (kernel.py); no parser of its own.

``line_time(text, start, pos)`` reads the line that begins at ``start`` up to the message at ``pos``
and answers ``(log_time, uptime, basis)``: ``log_time`` in Unix seconds (true UTC, not "as if UTC"
like a trainer's naive stamp) or None, ``uptime`` the seconds since boot the kernel printed (or
None), ``basis`` how the time was read (``BASES``). The rule is never to guess wrongly:

* an offset or ``Z`` printed on the line wins (rsyslog RFC 3339 ``2024-05-18T19:02:39.123+00:00``,
  ``journalctl -o short-iso[-precise]`` ``2026-11-28T07:42:14+0800``, ``dmesg --time-format iso``
  ``2025-05-27T04:18:56,089671+00:00``, a ``short-full`` stamp ending in UTC/GMT): basis "offset";
* epoch stamps are exact: ``journalctl -o short-unix`` (``1716058959.123456 host kernel: ...``), the
  ``__REALTIME_TIMESTAMP`` of ``-o export`` (an earlier line of the same entry) and ``-o json``
  (a field of the same line): basis "epoch";
* local wall-clock stamps without a zone are read in the zone of the host the agent runs on (the
  agent follows its own host's kernel log; set ``TZ`` to read another host's file): syslog /
  ``/var/log/kern.log`` and ``journalctl`` default and ``-o short-precise`` (``Nov 28 07:42:14[.123456]
  host kernel: ...``), ``dmesg -T`` (``[Fri Aug 30 11:43:09 2024] ...``), a ``short-full`` stamp
  whose zone name is the host's: basis "local". Syslog stamps carry no year: the year is the one
  that puts the stamp at most a day after now (or after the ``reference_time`` a replay sets, the
  file's mtime), so a December line read in January is last year's;
* ``dmesg`` raw (``[12345.678901] ...``), ``journalctl -o short-monotonic`` and ``/dev/kmsg``
  records (``6,1234,5678901,-;...``, microseconds) only count from boot: no wall time is made up
  from them (the boot they count from is not in the file), ``log_time`` stays None, ``uptime`` is
  given: basis "uptime". A stamp that is no real date (month 13, hour 25, a zone name not the
  host's) gives basis "none" and no time.
"""

from __future__ import annotations

import calendar
import contextlib
import re
import time
from contextvars import ContextVar
from typing import Iterator

BASES = ("offset", "epoch", "local", "uptime", "none")
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep",
                                       "Oct", "Nov", "Dec"), 1)}
_MON = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
_DAY = "Mon|Tue|Wed|Thu|Fri|Sat|Sun"
_HMS = r"(?P<H>\d\d):(?P<M>\d\d):(?P<S>\d\d)(?:[.,](?P<f>\d{1,9}))?"

# The stamp a line starts with (after an optional ``dmesg -x`` "kern  :err   : " facility/level).
_LEAD = re.compile(
    r"(?:[a-z]{2,8} *:[a-z]{2,7} *: )?(?:"
    r"(?P<Y>\d{4})-(?P<m>\d\d)-(?P<d>\d\d)[T ]" + _HMS + r"(?P<tz>Z|[+-]\d\d(?::?\d\d)?)?(?![\d.])"
    r"|(?:" + _DAY + r") (?P<fY>\d{4})-(?P<fm>\d\d)-(?P<fd>\d\d) (?P<fH>\d\d):(?P<fM>\d\d):(?P<fS>\d\d)"
    r"(?:\.(?P<ff>\d{1,9}))? (?P<fz>[A-Za-z][A-Za-z0-9_/+-]{0,31})"
    r"|\[(?:" + _DAY + r") (?P<cmon>" + _MON + r") {1,2}(?P<cd>\d{1,2}) (?P<cH>\d\d):(?P<cM>\d\d):(?P<cS>\d\d)"
    r" (?P<cY>\d{4})\]"
    r"|(?P<smon>" + _MON + r") {1,2}(?P<sd>\d{1,2}) (?P<sH>\d\d):(?P<sM>\d\d):(?P<sS>\d\d)(?:\.(?P<sf>\d{1,9}))? "
    r"|(?P<unix>\d{9,11}(?:\.\d{1,9})?) "
    r"|<?\d{1,4}>?,\d{1,20},(?P<kus>\d{1,20}),[^;\n]{0,8};"
    r")")
_UPTIME = re.compile(r"\[ *(?P<up>\d{1,12}\.\d{1,9})\]")
_EXPORT_RT = re.compile(r"(?m)^__REALTIME_TIMESTAMP=(?P<us>\d{1,20})$")
_JSON_RT = re.compile(r'"__REALTIME_TIMESTAMP" ?: ?"(?P<us>\d{1,20})"')
_JSON_MONO = re.compile(r'"__MONOTONIC_TIMESTAMP" ?: ?"(?P<us>\d{1,20})"')
_EXPORT_MONO = re.compile(r"(?m)^__MONOTONIC_TIMESTAMP=(?P<us>\d{1,20})$")

_LOCAL_CACHE: dict[tuple, float | None] = {}   # (zone, stamp minute) -> local minute's Unix seconds
_CACHE_MAX = 4096
DAY = 86400.0
EPOCH_END = 253402300800.0  # 10000-01-01T00:00:00Z
_clock = time.time  # "now" for the year of a syslog stamp (tests set it)
_reference: ContextVar[float | None] = ContextVar("kernel_log_reference", default=None)


@contextlib.contextmanager
def reference_time(t: float | None) -> Iterator[None]:
    """Read syslog stamps without a year against ``t`` instead of now: a finished file's mtime
    when it is replayed (its last line was written before it), so an old file's lines get their
    own year. The live agent needs none (now is the file's mtime to within a read)."""
    token = _reference.set(t)
    try:
        yield
    finally:
        _reference.reset(token)


def _frac(f: str | None) -> float:
    return int(f) / 10 ** len(f) if f else 0.0


def _valid(y: int, mo: int, d: int, h: int, mi: int, s: int) -> bool:
    return (1970 <= y <= 9999 and 1 <= mo <= 12 and 1 <= d <= calendar.monthrange(y, mo)[1]
            and h <= 23 and mi <= 59 and s <= 60)


def utc_seconds(y: int, mo: int, d: int, h: int, mi: int, s: int) -> float | None:
    """Unix seconds of a UTC wall-clock time; None when it is no real date."""
    if not _valid(y, mo, d, h, mi, s):
        return None
    return float(calendar.timegm((y, mo, d, h, mi, 0, 0, 0, 0)) + s)


def local_seconds(y: int, mo: int, d: int, h: int, mi: int, s: int) -> float | None:
    """Unix seconds of a wall-clock time in the host's zone (``TZ``, daylight saving included);
    None when it is no real date. The minute is converted once (lines share it)."""
    if not _valid(y, mo, d, h, mi, s):
        return None
    key = (time.tzname, time.timezone, y, mo, d, h, mi)
    base = _LOCAL_CACHE.get(key)
    if base is None:
        try:
            base = time.mktime((y, mo, d, h, mi, 0, 0, 0, -1))
        except (OverflowError, ValueError):
            return None
        if len(_LOCAL_CACHE) >= _CACHE_MAX:
            _LOCAL_CACHE.clear()
        _LOCAL_CACHE[key] = base
    return base + s


def syslog_year(mo: int, d: int, h: int, mi: int, s: int, now: float | None = None) -> int | None:
    """The year of a syslog stamp without one: the latest year that puts it at most a day after
    ``now`` (a December line read in January is last year's; 29 February goes back to a leap year)."""
    if now is None:
        now = _reference.get()
        now = _clock() if now is None else now
    year = time.localtime(now).tm_year
    for y in range(year + 1, year - 9, -1):
        t = local_seconds(y, mo, d, h, mi, s)
        if t is not None and t <= now + DAY:
            return y
    return None


def _offset(tz: str) -> float | None:
    """Seconds east of UTC of ``Z``, ``+08``, ``+0800`` or ``+08:00``; None past ±23:59."""
    if tz == "Z":
        return 0.0
    digits = tz[1:].replace(":", "")
    hours, minutes = int(digits[:2]), int(digits[2:] or 0)
    if hours > 23 or minutes > 59:
        return None
    return (hours * 3600 + minutes * 60) * (1 if tz[0] == "+" else -1)


def _zone_name(name: str) -> str | None:
    """How a ``journalctl -o short-full`` zone name reads: "utc", "local" (the host's own zone
    name) or None (another zone: its offset is not known here, so no time is made up)."""
    if name in ("UTC", "GMT", "Z", "Etc/UTC", "UCT"):
        return "utc"
    if name in time.tzname:
        return "local"
    return None


def _uptime(text: str, start: int, end: int) -> float | None:
    m = _UPTIME.search(text, start, min(end, start + 160))
    return float(m.group("up")) if m else None


def _exported(text: str, start: int) -> tuple[float | None, float | None]:
    """``__REALTIME_TIMESTAMP`` / ``__MONOTONIC_TIMESTAMP`` of the journal-export entry whose
    ``MESSAGE=`` line starts at ``start``: the entry's earlier lines, back to its blank line."""
    blank = text.rfind("\n\n", 0, start)
    lo = 0 if blank < 0 else blank + 2
    real, mono = _EXPORT_RT.search(text, lo, start), _EXPORT_MONO.search(text, lo, start)
    return (int(real.group("us")) / 1e6 if real else None), (int(mono.group("us")) / 1e6 if mono else None)


def line_time(text: str, start: int, pos: int, now: float | None = None) -> tuple[float | None, float | None, str]:
    """``(log_time, uptime, basis)`` of the line that starts at ``start`` with its message at ``pos``.
    A time before 1970 or after the year 9999 is no time (basis "none")."""
    t, up, basis = _line_time(text, start, pos, now)
    if t is not None and not 0.0 <= t < EPOCH_END:
        return None, up, "none"
    return t, up, basis


def _line_time(text: str, start: int, pos: int, now: float | None) -> tuple[float | None, float | None, str]:
    if text.startswith("MESSAGE=", start):                      # journalctl -o export
        real, mono = _exported(text, start)
        if real is not None:
            return real, mono, "epoch"
        return None, mono, "uptime" if mono is not None else "none"
    if text.startswith("{", start):                             # journalctl -o json
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        rt, mono = _JSON_RT.search(text, start, end), _JSON_MONO.search(text, start, end)
        up = int(mono.group("us")) / 1e6 if mono else None
        if rt:
            return int(rt.group("us")) / 1e6, up, "epoch"
        return None, up, "uptime" if up is not None else "none"
    m = _LEAD.match(text, start, max(pos, start))
    if m is None:
        up = _uptime(text, start, pos)
        return None, up, "uptime" if up is not None else "none"
    g = m.groupdict()
    up = _uptime(text, m.end(), pos)
    t: float | None
    if g["Y"]:
        y, mo, d, h, mi, s = (int(g[k]) for k in ("Y", "m", "d", "H", "M", "S"))
        if g["tz"]:
            off = _offset(g["tz"])
            t = utc_seconds(y, mo, d, h, mi, s)
            t = None if t is None or off is None else t - off + _frac(g["f"])
            return t, up, "offset" if t is not None else "none"
        t = local_seconds(y, mo, d, h, mi, s)
        return (t + _frac(g["f"]), up, "local") if t is not None else (None, up, "none")
    if g["fY"]:
        args = tuple(int(g[k]) for k in ("fY", "fm", "fd", "fH", "fM", "fS"))
        zone = _zone_name(g["fz"])
        t = utc_seconds(*args) if zone == "utc" else local_seconds(*args) if zone == "local" else None
        if t is None:
            return None, up, "none"
        return t + _frac(g["ff"]), up, "offset" if zone == "utc" else "local"
    if g["cY"]:
        t = local_seconds(int(g["cY"]), _MONTHS[g["cmon"]], int(g["cd"]), int(g["cH"]), int(g["cM"]), int(g["cS"]))
        return (t, up, "local") if t is not None else (None, up, "none")
    if g["smon"]:
        mo, d, h, mi, s = _MONTHS[g["smon"]], int(g["sd"]), int(g["sH"]), int(g["sM"]), int(g["sS"])
        y = syslog_year(mo, d, h, mi, s, now)
        t = None if y is None else local_seconds(y, mo, d, h, mi, s)
        return (t + _frac(g["sf"]), up, "local") if t is not None else (None, up, "none")
    if g["unix"]:
        return float(g["unix"]), up, "epoch"
    return None, int(g["kus"]) / 1e6, "uptime"                  # /dev/kmsg
