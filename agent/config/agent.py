"""The agent's configuration file: watches, limits, HTTP, Alertmanager, validated at start with
every problem named (``load_config``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from ..errors import DEFAULT_LISTEN, DEFAULT_PORT
from .alertmanager import AlertmanagerConfig
from .regex import UserRegex
from .base import (Duration, LabelValue, Size, Strict, all_problems, check_labels,
                   format_validation_error)
from .yamlfile import load_yaml_mapping

class CompareSpec(Strict):
    """Pair a dump watch with another run's dumps: a benchmark (GPU/CPU run) or a rerun."""

    against: Path                      # root of the other run's dumps, laid out like the watched one
    mode: Literal["benchmark", "rerun"] = "benchmark"
    preset: str = "strict"             # verdict thresholds (rerun mode always asks for bitwise equality)
    csv_dir: Path | None = None        # where full tables go; default <state_dir>/compare

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        from ..compare.verdict import PRESETS  # the verdict module owns the list
        if v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; known: {', '.join(PRESETS)}")
        return v


class Watch(Strict):
    """One watched path. A log watch tails files; a dump watch scans tensor dumps."""

    path: Path
    kind: Literal["log", "dump"] = "log"
    recursive: bool = True
    include: list[str] | None = None  # default: log files for a log watch, every file for a dump watch
    exclude: list[str] = Field(default_factory=lambda: ["*.gz", "*.bz2", "*.xz", "*.zst", "*.zip", "*.tmp"])
    format: str = "auto"
    pattern: str | None = None  # a user-defined format: a regex (RE2 syntax) with named groups (step, loss, ...)
    labels: dict[str, LabelValue] = Field(default_factory=dict)
    # which run a log file's series belong to (agent/readers/runs.py): each file its own run
    # ("file", the default), one run per folder ("parent_dir"), or only the watch's labels ("label")
    run_from: Literal["file", "parent_dir", "label"] = "file"
    start_at_end: bool = False  # for a log that existed before the agent ever saw it
    compare: CompareSpec | None = None  # dump watches: compare each completed step with another run
    fusion_files: list[Path] = Field(default_factory=list)  # dump watches: more places of the job's fusion_result.json
                                # and ge_proto_*_Build.txt (its working directory, DUMP_GRAPH_PATH); docs/fusion.md
    digest: str | None = None   # dump watches: regex (RE2 syntax) over "op io[index]" of tensors that must be equal
                                # on every data-parallel rank (e.g. weights); exported as a digest metric
    # inotify misses other NFS/Lustre/FUSE clients' writes: "auto" polls when the path is on such a
    # file system (read from /proc/self/mountinfo), true always polls, false always uses inotify
    poll: bool | Literal["auto"] = "auto"
    poll_interval: Duration = 2.0   # seconds between two polls of this watch's tree
    follow_symlinks: bool = False   # also read symlinks whose target lies outside the watched roots

    _check_labels = field_validator("labels")(check_labels)

    @property
    def patterns(self) -> list[str]:
        """The include globs in force."""
        if self.include is not None:
            return self.include
        # text logs, TensorBoard event files and Lightning's CSV metric log (agent/readers/streams.py)
        return ["*.log", "*.txt", "*.out", "*.err", "*.jsonl", "events.out.tfevents.*", "metrics.csv"] \
            if self.kind == "log" else ["*"]

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        from ..readers.parsers import FORMATS  # parsers are discovered at import
        if v not in ("auto", "custom", "tfevents", "csv") and v not in FORMATS:
            raise ValueError(f"unknown log format {v!r}; known: auto, custom, tfevents, csv, {', '.join(FORMATS)}")
        return v

    @field_validator("pattern")
    @classmethod
    def _valid_pattern(cls, v: str | None) -> str | None:
        if v is not None:
            from ..readers.parsers.custom import RegexParser
            RegexParser(v)  # raises ValueError with the reason
        return v

    @field_validator("digest")
    @classmethod
    def _valid_digest(cls, v: str | None) -> str | None:
        if v is not None:
            UserRegex(v, "digest")  # raises ValueError with the reason
        return v

    @field_validator("poll", mode="before")
    @classmethod
    def _poll_mode(cls, v: Any) -> Any:
        if isinstance(v, bool) or v == "auto":
            return v
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        raise ValueError(f"poll must be true, false or auto, not {v!r}")

    @field_validator("poll_interval")
    @classmethod
    def _poll_interval(cls, v: float) -> float:
        if v < 0.1:
            raise ValueError("poll_interval must be at least 100ms (each poll lists the whole tree)")
        return v

    @model_validator(mode="after")
    def _custom_needs_pattern(self) -> "Watch":
        if self.format == "custom" and self.pattern is None:
            raise ValueError("format 'custom' needs a 'pattern' (a regex with named groups such as step, loss)")
        if self.kind != "dump" and (self.compare is not None or self.digest is not None):
            raise ValueError("'compare' and 'digest' apply to watches with kind: dump")
        if self.compare is not None and self.compare.against.resolve() == self.path.resolve():
            raise ValueError("compare.against must be another run's dump directory, not the watched one")
        return self


class Limits(Strict):
    """Resource limits: the training job's cycles come first."""

    max_line_bytes: Size = 1 << 20
    read_chunk_bytes: Size = 1 << 20
    read_budget_bytes: Size = 4 << 20       # bytes one file may read per pass (bounds memory while catching up)
    queue_size: int = Field(10_000, ge=10)  # pending changed paths before falling back to a resync
    max_files: int = Field(10_000, ge=1)    # files tracked across all watches
    max_series: int = Field(512, ge=1)      # (run, rank, ...) label sets exported on /metrics
    max_open_files: int = Field(256, ge=4)
    nice: int = Field(10, ge=0, le=19)
    io_idle: bool = True
    # dump files the daemon's scan thread reads at once (threads, each with nice/idle I/O as the
    # agent); 1 keeps it to one core, whatever the dump (`scan --jobs` is the one-shot command's)
    scan_jobs: int = Field(1, ge=1, le=64)
    # a deflated tensor (.npz member, torch.save storage) is inflated into memory (compare,
    # watchpoints) only up to this size; scans stream any size through a bounded buffer
    max_decompressed_bytes: Size = Field(128 << 20, ge=1 << 20)
    # a worker busy without progress for this long is stalled: /-/ready 503, no WATCHDOG=1
    worker_stall_timeout: Duration = Field(30.0, gt=0)
    # a state save that failed (full disk, I/O error) is retried after 1 s, doubling up to this
    state_save_retry_max: Duration = Field(60.0, ge=0.1)
    # a followed file that grows but yields no record raises LogFormatUnrecognized (or
    # LogRecordsStopped once it had records): after this many lines without a record (0: never
    # judge), or after this long with at least unrecognized_min_lines lines (agent/readers/yields.py)
    unrecognized_lines: int = Field(2000, ge=0)
    unrecognized_after: Duration = Field(600.0, gt=0)
    unrecognized_min_lines: int = Field(100, ge=1)


class HttpSettings(Strict):
    """The HTTP listener's own limits: a hostile or broken client must not exhaust the agent."""

    max_connections: int = Field(512, ge=1, le=65536)  # open connections; beyond, new ones are refused
    workers: int = Field(4, ge=1, le=64)                # threads serving complete requests
    header_timeout: Duration = 10.0    # request line + headers must arrive within this
    idle_timeout: Duration = 5.0       # longest silence while they arrive
    write_timeout: Duration = 10.0     # a response must be written within this
    max_header_bytes: Size = 16 << 10  # request line + headers

    @field_validator("header_timeout", "idle_timeout", "write_timeout")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v < 0.1:
            raise ValueError("must be at least 100ms")
        return v

    @field_validator("max_header_bytes")
    @classmethod
    def _room(cls, v: int) -> int:
        if v < 1024:
            raise ValueError("must be at least 1KiB")
        return v


class Config(Strict):
    listen: str = DEFAULT_LISTEN
    web_config_file: Path | None = None    # exporter-toolkit web config: TLS, basic auth (--web.config.file)
    http: HttpSettings = Field(default_factory=HttpSettings)
    state_dir: Path = Path("/var/lib/precision-agent")
    rule_dirs: list[Path] = Field(default_factory=list)
    default_rules: bool = True             # also load the rule files shipped with the package
    resync_interval: Duration = 30.0
    evaluation_interval: Duration = 1.0
    debounce: Duration = 0.05
    dump_settle: Duration = 5.0  # a dump directory is scanned once it has been quiet this long
    series_ttl: Duration = 86400.0  # forget a run's series this long after its last record
    # a hardware-class device fault read this long before an incident makes it suspect="hardware"
    # (agent/engine/suspect.py, docs/hardware.md)
    suspect_window: Duration = Field(600.0, gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    watches: list[Watch] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)
    alertmanager: AlertmanagerConfig | None = None  # push alerts to Alertmanager (docs/alertmanager.md)
    runbook_base_url: str | None = None    # {{ $runbook_base }} in rule annotations; None: the shipped runbooks

    @field_validator("rule_dirs")
    @classmethod
    def _rule_dirs_exist(cls, v: list[Path]) -> list[Path]:
        missing = [str(p) for p in v if not p.exists()]
        if missing:
            raise ValueError("; ".join(f"rule directory {p!r} does not exist" for p in missing))
        return v

    @field_validator("runbook_base_url")
    @classmethod
    def _runbook_base(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://\S+$", v):
            raise ValueError(f"runbook_base_url {v!r} must be an absolute URL such as https://wiki.example/runbooks")
        return v.rstrip("/") if v is not None else None

    @field_validator("web_config_file")
    @classmethod
    def _web_config_exists(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_file():
            raise ValueError(f"web config file {str(v)!r} does not exist")
        return v

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        host, port = split_listen(v)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_listen(value: str) -> tuple[str, int]:
    """Split HOST:PORT (IPv6 as [::1]:PORT); the port must be 0-65535."""
    m = re.match(r"^\[([^\]]+)\]:(\d+)$", value) or re.match(r"^([^:\[\]]*):(\d+)$", value)
    if not m:
        raise ValueError(f"listen address {value!r} must be HOST:PORT, e.g. 127.0.0.1:{DEFAULT_PORT}")
    host, port = m.group(1) or "127.0.0.1", int(m.group(2))
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} out of range")
    return host, port


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Load the config file (if any), apply command-line overrides, validate everything."""
    data: dict[str, Any] = load_yaml_mapping(path) if path is not None else {}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key == "watches":
            data["watches"] = list(data.get("watches") or []) + list(value)
        else:
            data[key] = value
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(str(path) if path else "(command line)", exc,
                                      all_problems(Config, data, exc)) from exc
