"""The ``alertmanager:`` section of the agent's config: where alerts are pushed, how often, and
the TLS and authentication settings (the pusher is exporters/alertmanager.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import AnyHttpUrl, BeforeValidator, Field, field_validator, model_validator

from .base import Duration, Strict, check_labels, label_value


def _labels(v: Any) -> Any:
    return check_labels({k: label_value(x) for k, x in v.items()}) if isinstance(v, dict) else v


class BasicAuth(Strict):
    """HTTP basic auth; the password inline or (better) in a file read at every request."""

    username: str = Field(min_length=1)
    password: str | None = None
    password_file: Path | None = None

    @model_validator(mode="after")
    def _one_password(self) -> "BasicAuth":
        if (self.password is None) == (self.password_file is None):
            raise ValueError("basic_auth needs exactly one of 'password' or 'password_file'")
        if self.password_file is not None and not self.password_file.is_file():
            raise ValueError(f"password_file {str(self.password_file)!r} is not a readable file")
        return self


class AlertmanagerConfig(Strict):
    """The ``alertmanager:`` section of the agent's config."""

    urls: list[AnyHttpUrl] = Field(min_length=1)   # e.g. http://am1:9093 (a path prefix is kept)
    resend_interval: Duration = 60.0
    lifetime: Duration | None = None               # endsAt ahead of each send; default 4 x resend_interval
    timeout: Duration = 10.0
    retry_backoff: Duration = 1.0                  # first retry delay, doubled up to max_backoff
    max_backoff: Duration | None = None            # default: resend_interval
    queue_size: int = Field(1000, ge=1)            # alerts waiting per URL; beyond, the oldest is dropped
    # added to every alert unless it has the label; ``instance`` here replaces the host name
    external_labels: Annotated[dict[str, str], BeforeValidator(_labels)] = Field(default_factory=dict)
    external_url: AnyHttpUrl | None = None         # base of generatorURL, e.g. http://host:19400
    basic_auth: BasicAuth | None = None
    bearer_token_file: Path | None = None
    ca_file: Path | None = None
    cert_file: Path | None = None                  # client certificate (with key_file)
    key_file: Path | None = None
    insecure_skip_verify: bool = False

    @field_validator("resend_interval", "timeout", "retry_backoff", "lifetime", "max_backoff")
    @classmethod
    def _positive(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            raise ValueError("must be greater than 0")
        return v

    @field_validator("bearer_token_file", "ca_file", "cert_file", "key_file")
    @classmethod
    def _readable(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_file():
            raise ValueError(f"{str(v)!r} is not a readable file")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "AlertmanagerConfig":
        if self.basic_auth is not None and self.bearer_token_file is not None:
            raise ValueError("use either basic_auth or bearer_token_file, not both")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        if self.lifetime is not None and self.lifetime <= self.resend_interval:
            raise ValueError("lifetime must be longer than resend_interval, or alerts flap between resends")
        return self

    @property
    def alert_lifetime(self) -> float:
        return self.lifetime if self.lifetime is not None else 4 * self.resend_interval

    @property
    def backoff_cap(self) -> float:
        return self.max_backoff if self.max_backoff is not None else self.resend_interval


