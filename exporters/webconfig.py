"""The web configuration file of Prometheus' exporter-toolkit (``--web.config.file``): TLS, basic
authentication with bcrypt hashes, response headers, a rate limit. Operators reuse the file
their exporters already have; the format is exporter-toolkit's docs/web-configuration.md.

Everything is checked when the file is loaded (at start and on SIGHUP): a bad file is a
:class:`ConfigError` naming the file, the field and the reason. Differences from the Go
implementation, each refused with its reason rather than silently ignored: ``client_auth_type``
``RequestClientCert`` and ``RequireAnyClientCert`` (unverified certificates; Python's ssl cannot
ask for one without verifying it), and ``curve_preferences`` beyond the first curve.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..config import load_yaml_mapping, parse_duration
from ..errors import ConfigError

TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
# Go's names of the TLS 1.2 suites it offers -> OpenSSL's (TLS 1.3 suites are not configurable, as in Go)
CIPHERS = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
}
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}
HEADERS = ("Content-Security-Policy", "X-Frame-Options", "X-Content-Type-Options", "X-XSS-Protection",
           "Strict-Transport-Security")
TLS_KEYS = {"cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
            "client_allowed_sans", "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites",
            "curve_preferences"}


@dataclass
class WebConfig:
    """What the HTTP exporter applies; built by :func:`load_web_config`."""

    path: str
    tls: ssl.SSLContext | None = None
    client_verified: bool = False          # RequireAndVerifyClientCert: clients authenticate by certificate
    allowed_sans: list[str] = field(default_factory=list)
    users: dict[str, bytes] = field(default_factory=dict)   # user -> bcrypt hash
    headers: list[tuple[str, str]] = field(default_factory=list)
    rate_interval: float = 0.0
    rate_burst: int = 0

    def peer_check(self, cert: dict[str, Any] | None) -> str | None:
        """``client_allowed_sans``: the reason to refuse this client certificate, or None."""
        if not self.allowed_sans:
            return None
        sans = {v for _k, v in (cert or {}).get("subjectAltName", ())}
        if sans & set(self.allowed_sans):
            return None
        return "no subject alternative name of the client certificate is in client_allowed_sans"


def _err(path: Path, fld: str, reason: str) -> ConfigError:
    return ConfigError(str(path), fld, reason)


def _strings(path: Path, fld: str, v: Any) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _err(path, fld, "expected a list of strings")
    return v


def _pem(path: Path, tls: dict[str, Any], inline: str, file: str, base: Path) -> tuple[str | None, str | None]:
    """(inline PEM, file path) of one of cert/key/client_ca; both at once is an error."""
    text, name = tls.get(inline), tls.get(file)
    for k, v in ((inline, text), (file, name)):
        if v is not None and not isinstance(v, str):
            raise _err(path, f"tls_server_config.{k}", "expected a string")
    if text and name:
        raise _err(path, f"tls_server_config.{inline}", f"give either {inline} or {file}, not both")
    if name:
        p = Path(name) if os.path.isabs(name) else base / name
        if not p.is_file():
            raise _err(path, f"tls_server_config.{file}", f"{p}: no such file")
        return None, str(p)
    return text or None, None


def _tls(path: Path, tls: Any, cfg: WebConfig) -> None:
    if not isinstance(tls, dict):
        raise _err(path, "tls_server_config", "expected a mapping")
    unknown = sorted(set(tls) - TLS_KEYS)
    if unknown:
        raise _err(path, f"tls_server_config.{unknown[0]}", "unknown setting")
    base = path.parent
    cert, cert_file = _pem(path, tls, "cert", "cert_file", base)
    key, key_file = _pem(path, tls, "key", "key_file", base)
    ca, ca_file = _pem(path, tls, "client_ca", "client_ca_file", base)
    if not (cert or cert_file):
        raise _err(path, "tls_server_config.cert_file", "missing: a server certificate is required")
    if not (key or key_file):
        raise _err(path, "tls_server_config.key_file", "missing: the certificate's private key is required")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        with tempfile.TemporaryDirectory() as tmp:  # the ssl module loads inline PEM from files only
            if cert is not None:
                cert_file = os.path.join(tmp, "cert.pem")
                Path(cert_file).write_text(cert)
            if key is not None:
                key_file = os.path.join(tmp, "key.pem")
                fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(key)
            ctx.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError) as exc:
        raise _err(path, "tls_server_config.cert_file", f"cannot load the certificate and key: {exc}") from None
    auth = tls.get("client_auth_type", "NoClientCert")
    if auth not in CLIENT_AUTH:
        why = ("unverified client certificates are not supported; use RequireAndVerifyClientCert"
               if auth in ("RequestClientCert", "RequireAnyClientCert") else
               f"unknown value {auth!r}; use one of {', '.join(CLIENT_AUTH)}")
        raise _err(path, "tls_server_config.client_auth_type", why)
    if (ca or ca_file) and auth == "NoClientCert":
        raise _err(path, "tls_server_config.client_auth_type",
                   "a client CA is configured without a client_auth_type that verifies client certificates")
    if auth != "NoClientCert" and not (ca or ca_file):
        raise _err(path, "tls_server_config.client_ca_file", f"client_auth_type {auth} needs a client CA")
    if ca or ca_file:
        try:
            ctx.load_verify_locations(cafile=ca_file, cadata=ca)
        except (ssl.SSLError, OSError) as exc:
            raise _err(path, "tls_server_config.client_ca_file", f"cannot load the client CA: {exc}") from None
    ctx.verify_mode = CLIENT_AUTH[auth]
    cfg.client_verified = auth == "RequireAndVerifyClientCert"
    cfg.allowed_sans = _strings(path, "tls_server_config.client_allowed_sans", tls.get("client_allowed_sans"))
    if cfg.allowed_sans and auth != "RequireAndVerifyClientCert":
        raise _err(path, "tls_server_config.client_allowed_sans", "needs client_auth_type RequireAndVerifyClientCert")
    for k, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = tls.get(k, default)
        if v not in TLS_VERSIONS:
            raise _err(path, f"tls_server_config.{k}", f"unknown TLS version {v!r}; use one of {', '.join(TLS_VERSIONS)}")
    try:
        ctx.minimum_version = TLS_VERSIONS[tls.get("min_version", "TLS12")]
        ctx.maximum_version = TLS_VERSIONS[tls.get("max_version", "TLS13")]
    except (ValueError, ssl.SSLError) as exc:
        raise _err(path, "tls_server_config.min_version", str(exc)) from None
    if ctx.minimum_version > ctx.maximum_version:
        raise _err(path, "tls_server_config.min_version", "is above max_version")
    suites = _strings(path, "tls_server_config.cipher_suites", tls.get("cipher_suites"))
    bad = [s for s in suites if s not in CIPHERS]
    if bad:
        raise _err(path, "tls_server_config.cipher_suites", f"unknown or unsupported suite {bad[0]!r}")
    if suites:
        ctx.set_ciphers(":".join(CIPHERS[s] for s in suites))
    if tls.get("prefer_server_cipher_suites", True):
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    curves = _strings(path, "tls_server_config.curve_preferences", tls.get("curve_preferences"))
    if [c for c in curves if c not in CURVES]:
        raise _err(path, "tls_server_config.curve_preferences", f"unknown curve; use {', '.join(CURVES)}")
    if len(curves) > 1:
        raise _err(path, "tls_server_config.curve_preferences", "only one curve can be set here")
    if curves:
        ctx.set_ecdh_curve(CURVES[curves[0]])
    cfg.tls = ctx


def _users(path: Path, users: Any, cfg: WebConfig) -> None:
    if not isinstance(users, dict):
        raise _err(path, "basic_auth_users", "expected a mapping of user name to bcrypt hash")
    for user, h in users.items():
        if not isinstance(user, str) or not isinstance(h, str) or not h.startswith(("$2a$", "$2b$", "$2y$")) \
                or len(h) != 60:
            raise _err(path, f"basic_auth_users.{user}", "expected a bcrypt hash such as $2y$10$... "
                       "(htpasswd -nBC 10 \"\" | tr -d ':\\n')")
        cfg.users[user] = h.encode()


def _server(path: Path, http: Any, cfg: WebConfig) -> None:
    if not isinstance(http, dict):
        raise _err(path, "http_server_config", "expected a mapping")
    for k in set(http) - {"http2", "headers"}:
        raise _err(path, f"http_server_config.{k}", "unknown setting")
    headers = http.get("headers") or {}
    if not isinstance(headers, dict):
        raise _err(path, "http_server_config.headers", "expected a mapping")
    for name, value in headers.items():
        if name not in HEADERS:
            raise _err(path, f"http_server_config.headers.{name}", f"not one of {', '.join(HEADERS)}")
        if not isinstance(value, str) or "\n" in value or "\r" in value:
            raise _err(path, f"http_server_config.headers.{name}", "expected a one-line string")
        if value:
            cfg.headers.append((name, value))


def load_web_config(path: Path) -> WebConfig:
    """Read and check an exporter-toolkit web config file."""
    data = load_yaml_mapping(path)
    cfg = WebConfig(str(path))
    for key in data:
        if key not in ("tls_server_config", "basic_auth_users", "http_server_config", "rate_limit"):
            raise _err(path, str(key), "unknown setting")
    if data.get("tls_server_config") is not None:
        _tls(path, data["tls_server_config"], cfg)
    if data.get("basic_auth_users") is not None:
        _users(path, data["basic_auth_users"], cfg)
    if data.get("http_server_config") is not None:
        _server(path, data["http_server_config"], cfg)
    rate = data.get("rate_limit")
    if rate is not None:
        if not isinstance(rate, dict) or set(rate) - {"interval", "burst"}:
            raise _err(path, "rate_limit", "expected {interval: DURATION, burst: N}")
        try:
            cfg.rate_interval = parse_duration(rate.get("interval", 0))
        except ValueError as exc:
            raise _err(path, "rate_limit.interval", str(exc)) from None
        burst = rate.get("burst", 0)
        if not isinstance(burst, int) or isinstance(burst, bool) or burst < 0:
            raise _err(path, "rate_limit.burst", "expected a non-negative integer")
        cfg.rate_burst = burst
    return cfg


class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes. bcrypt costs ~50-100 ms per check,
    so a flood of wrong credentials must not buy one each:

    * checked credentials are cached, both ways (keyed by an HMAC of user, hash and password
      under a per-process key, as exporter-toolkit does): a scraper with the right password, and
      a flood repeating a wrong one, cost no bcrypt after the first time;
    * a client address whose last attempts failed gets at most ``FAIL_BURST`` more bcrypt checks,
      one more per ``FAIL_INTERVAL`` seconds; and all such clients together get one per
      ``GLOBAL_INTERVAL`` s (bursts of ``GLOBAL_BURST``). Beyond, the answer is 429 without a
      bcrypt check (``verify`` says "throttled"), so a flood costs the host little and the cached
      scraper is served as fast as ever;
    * a client address not seen failing is never refused (its check still takes from the global
      budget): a flood spread over many addresses cannot lock out a scraper whose credentials are
      not cached yet (its first scrape after a restart or a reload), which would read ``up == 0``.
      Each flooding address gets that one check, then it is throttled like any failing client.

    Unknown users pay the same cost as known ones."""

    MAX_CACHE = 1024
    FAIL_BURST, FAIL_INTERVAL = 5, 2.0
    GLOBAL_BURST, GLOBAL_INTERVAL = 8, 0.25

    def __init__(self, users: dict[str, bytes]) -> None:
        import bcrypt  # the one dependency only this feature needs
        self._bcrypt = bcrypt
        self.users = users
        self._key = os.urandom(32)
        self._ok: dict[bytes, None] = {}
        self._bad: dict[bytes, None] = {}
        self._clients: dict[str, RateLimit] = {}  # address -> budget of bcrypt checks after failures
        self._budget = RateLimit(self.GLOBAL_INTERVAL, self.GLOBAL_BURST)
        self._lock = threading.Lock()
        self._dummy = bcrypt.hashpw(b"x", bcrypt.gensalt(10)) if users else b""

    def check(self, header: str | None, client: str = "") -> bool:
        return self.verify(header, client) == "ok"

    def verify(self, header: str | None, client: str = "") -> str:
        """"ok", "denied" (wrong or missing credentials) or "throttled" (not checked: too many
        failed attempts from ``client``, or too many bcrypt checks at all, just now)."""
        if not header or not header[:6].lower() == "basic ":
            return "denied"
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return "denied"
        if not sep:
            return "denied"
        hashed = self.users.get(user)
        key = hmac.new(self._key, b"\0".join((user.encode(), hashed or b"", password.encode())),
                       hashlib.sha256).digest()
        with self._lock:
            if hashed is not None and key in self._ok:
                return "ok"
            if key in self._bad:
                return "denied"
            bucket = self._clients.get(client)
            if bucket is not None and not (bucket.allow() and self._budget.allow()):
                return "throttled"
            if bucket is None:
                self._budget.allow()  # counts against the others, never refused (see the class)
        try:
            ok = self._bcrypt.checkpw(password.encode(), hashed or self._dummy) and hashed is not None
        except ValueError:
            ok = False
        with self._lock:
            cache = self._ok if ok else self._bad
            if len(cache) >= self.MAX_CACHE:
                cache.clear()
            cache[key] = None
            if not ok and client not in self._clients:
                if len(self._clients) >= self.MAX_CACHE:  # the oldest out, not all: the rest stay throttled
                    del self._clients[next(iter(self._clients))]
                self._clients[client] = RateLimit(self.FAIL_INTERVAL, self.FAIL_BURST)
        return "ok" if ok else "denied"


class RateLimit:
    """exporter-toolkit's token bucket: one request per ``interval``, bursts of ``burst``."""

    def __init__(self, interval: float, burst: int) -> None:
        self.interval, self.burst = interval, max(burst, 1)
        self.tokens, self.last = float(self.burst), time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) / self.interval)
            self.last = now
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False


def is_loopback(addresses: Iterable[str]) -> bool:
    """Whether every address the server listens on is a loopback address."""
    for a in addresses:
        try:
            if not ipaddress.ip_address(a.split("%")[0]).is_loopback:
                return False
        except ValueError:
            return False
    return True

