"""A real Prometheus scrapes the agent over TLS with basic auth, configured as operators configure
any exporter-toolkit exporter: the agent's web config file, Prometheus' ``scheme: https``,
``tls_config`` and ``basic_auth``. A second job with a wrong password is refused."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import yaml

from support.prom import Proc, find_binary, prom_query, start_listening, stop_all, wait_until
from support.agent import TlsAgent, bcrypt_hash, make_certs

pytestmark = pytest.mark.e2e


def test_prometheus_scrapes_over_tls_with_basic_auth(tmp_path: Path) -> None:
    prometheus = find_binary("prometheus")
    ca, crt, key = make_certs(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": str(crt), "key_file": str(key)},
                                   "basic_auth_users": {"prometheus": bcrypt_hash("scrape-me")}}))
    (tmp_path / "logs").mkdir()
    agent = TlsAgent(tmp_path / "logs", tmp_path / "state", "--web.config.file", str(web))
    agent.ctx, agent.auth = ssl.create_default_context(cafile=str(ca)), "prometheus:scrape-me"
    agent.start()
    procs: list[Proc] = []
    try:
        scrape = {"scheme": "https", "tls_config": {"ca_file": str(ca)},
                  "static_configs": [{"targets": [f"127.0.0.1:{agent.port}"]}]}
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": "agent", **scrape, "basic_auth": {"username": "prometheus", "password": "scrape-me"}},
                {"job_name": "intruder", **scrape, "basic_auth": {"username": "prometheus", "password": "guess"}}]}))
        (tmp_path / "prom").mkdir()
        prom, port = start_listening("prometheus", lambda p: [
            prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'prom'}",
            f"--web.listen-address=127.0.0.1:{p}", "--log.level=info"], tmp_path)
        procs.append(prom)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: prom_query(url, 'precision_agent_ready{job="agent"} == 1'), 30,
                   "Prometheus to scrape the agent over TLS", on_timeout=prom.tail)
        wait_until(lambda: prom_query(url, 'up{job="intruder"} == 0'), 30, "the wrong password refused",
                   on_timeout=prom.tail)
        assert prom_query(url, 'up{job="agent"}')[0]["value"][1] == "1"
        _, body = agent.fetch("/metrics", agent.auth)
        failures = [line for line in body.decode().splitlines()
                    if line.startswith("precision_agent_http_auth_failures_total ")]
        assert float(failures[0].split()[1]) >= 1
    finally:
        stop_all(procs)
        agent.stop()

