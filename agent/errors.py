"""Small shared definitions that the command line needs before (or without) the heavy modules:
importing pydantic and the config models costs a one-shot command such as ``compare`` ~0.2 s."""

from __future__ import annotations

DEFAULT_PORT = 19400  # outside Prometheus' 9100-9999 default-allocation range; see README
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"


class ConfigError(Exception):
    """A config problem a human can fix: carries the file, the field and the reason.

    A file with several problems carries them all in ``problems`` ((field, reason) pairs, the
    first also in ``field``/``reason``); the message has one ``file: field: reason`` line each."""

    def __init__(self, file: str, field: str, reason: str,
                 problems: list[tuple[str, str]] | None = None) -> None:
        self.file, self.field, self.reason = file, field, reason
        self.problems = problems or [(field, reason)]
        super().__init__("\n".join(f"{file}: {f}: {r}" for f, r in self.problems))
