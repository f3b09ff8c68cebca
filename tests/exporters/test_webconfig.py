"""The exporter-toolkit web config file: what is accepted, what is refused with its field, and the
rate limit and headers on a real listener (in process, real sockets)."""

from __future__ import annotations

import base64
import http.client as http_client
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from precision_agent.errors import ConfigError
from precision_agent.exporters.http import HttpExporter
from precision_agent.exporters.webconfig import load_web_config
from support.agent import bcrypt_hash, make_certs


def load(tmp_path: Path, data: dict):
    p = tmp_path / "web.yml"
    p.write_text(yaml.safe_dump(data))
    return load_web_config(p)


def test_inline_pem_ciphers_curve_and_versions(tmp_path: Path) -> None:
    ca, crt, key = make_certs(tmp_path)
    cfg = load(tmp_path, {"tls_server_config": {
        "cert": crt.read_text(), "key": key.read_text(), "client_ca": ca.read_text(),
        "client_auth_type": "VerifyClientCertIfGiven", "min_version": "TLS12", "max_version": "TLS13",
        "cipher_suites": ["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"], "curve_preferences": ["CurveP256"],
        "prefer_server_cipher_suites": False},
        "http_server_config": {"http2": True, "headers": {"X-Content-Type-Options": "nosniff"}}})
    assert cfg.tls is not None and not cfg.client_verified
    assert cfg.headers == [("X-Content-Type-Options", "nosniff")]


@pytest.mark.parametrize("tls, field", [
    ({"client_auth_type": "RequireAnyClientCert"}, "client_auth_type"),
    ({"client_auth_type": "RequireAndVerifyClientCert"}, "client_ca_file"),
    ({"client_ca_file": "ca.crt"}, "client_auth_type"),
    ({"cipher_suites": ["TLS_FAKE"]}, "cipher_suites"),
    ({"min_version": "TLS13", "max_version": "TLS12"}, "min_version"),
    ({"cert": "x"}, "cert"),
    ({"client_allowed_sans": ["a"]}, "client_allowed_sans"),
    ({"bogus": 1}, "bogus"),
])
def test_refused_tls_settings_name_their_field(tmp_path: Path, tls: dict, field: str) -> None:
    make_certs(tmp_path)
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, {"tls_server_config": {"cert_file": "server.crt", "key_file": "server.key", **tls}})
    assert exc.value.field == f"tls_server_config.{field}"


def test_rate_limit_and_headers_on_a_real_listener(tmp_path: Path) -> None:
    web = load(tmp_path, {"rate_limit": {"interval": "1h", "burst": 2},
                          "http_server_config": {"headers": {"X-Frame-Options": "deny"}}})
    http = HttpExporter("127.0.0.1", 0, CollectorRegistry(), dict, dict, lambda: True, web=web)
    http.start()
    try:
        for _ in range(2):
            with urllib.request.urlopen(http.url + "/-/healthy", timeout=5) as r:
                assert r.status == 200 and r.headers["X-Frame-Options"] == "deny"
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(http.url + "/-/healthy", timeout=5)
        assert exc.value.code == 429
    finally:
        http.stop()


def get_from(http: HttpExporter, source: str, auth: str) -> int:
    """GET /metrics with Basic ``auth`` from the loopback address ``source`` (a client of its own)."""
    conn = http_client.HTTPConnection("127.0.0.1", http.port, timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", "/metrics", headers={"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()})
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_spread_out_flood_does_not_lock_out_a_scraper_not_yet_cached(tmp_path: Path) -> None:
    """Wrong passwords from many addresses empty the shared bcrypt budget; the scraper's first
    scrape (after a restart: its credentials not cached yet) from an address of its own is served."""
    web = load(tmp_path, {"basic_auth_users": {"prom": bcrypt_hash("right")}})
    http = HttpExporter("127.0.0.1", 0, CollectorRegistry(), dict, dict, lambda: True, web=web)
    http.start()
    try:
        codes = []
        for i in range(200):  # until the shared budget is spent: a flooder refused at its first tries
            source = f"127.0.1.{i % 50 + 2}"
            codes.append(get_from(http, source, f"prom:wrong{i}"))
            if codes[-1] == 429:
                break
        assert codes[-1] == 429 and codes.count(401) >= 8, codes
        assert get_from(http, "127.0.0.3", "prom:right") == 200  # its first check: never refused
        assert get_from(http, "127.0.0.3", "prom:right") == 200  # and then cached
    finally:
        http.stop()
