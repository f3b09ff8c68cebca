"""The Kubernetes manifests (exporters/kubernetes/), checked against the upstream schemas.

- the DaemonSet validates against Kubernetes' own schema (apps/v1 DaemonSet, v1.29, strict:
  no unknown field anywhere), runs unprivileged with a read-only root file system, and mounts the
  logs and dumps read-only from the host;
- its ConfigMap holds a config the agent itself accepts, listening where the pod's port is;
- the PodMonitor and the PrometheusRule validate against prometheus-operator's CRD schemas
  (openAPIV3Schema, made strict as `kubectl apply --validate=strict` is: an unknown field is an
  error), and the PodMonitor gives the job name the shipped rules select;
- the PrometheusRule's groups are exactly exporters/prometheus/alerts.yml's.

Schemas vendored in tests/exporters/k8s_schemas/ (README there: sources, versions, licences).
``python tests/exporters/test_kubernetes_manifests.py --write`` regenerates prometheusrule.yaml from alerts.yml.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "exporters" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
ALERTS = REPO / "exporters" / "prometheus" / "alerts.yml"
RULE_HEADER = """\
# Prometheus Operator: the shipped Prometheus rules (exporters/prometheus/alerts.yml), as a
# PrometheusRule. Generated: spec.groups is exactly alerts.yml's groups (a test checks it);
# after changing alerts.yml run  python tests/exporters/test_kubernetes_manifests.py --write
# The Prometheus resource must select it (ruleSelector): `release: prometheus` is what
# kube-prometheus-stack selects by default; change it to yours.
"""


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _one(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs(name) if d["kind"] == kind]
    return doc


def _crd_schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((SCHEMAS / f"monitoring.coreos.com_{plural}.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(v1["schema"]["openAPIV3Schema"])


def _strict(schema: Any) -> Any:
    """An object schema with properties refuses other keys, unless it says it keeps them."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _errors(schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    v = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


# --- DaemonSet -------------------------------------------------------------------------------------

def test_daemonset_matches_the_kubernetes_schema() -> None:
    schema = json.loads((SCHEMAS / "daemonset-apps-v1.json").read_text())
    ds = _one("daemonset.yaml", "DaemonSet")
    assert not _errors(schema, ds)
    broken = copy.deepcopy(ds)   # the schema is strict: a typo is caught
    broken["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    assert any("securityContxt" in e for e in _errors(schema, broken))


def test_daemonset_is_unprivileged_and_reads_the_host_read_only() -> None:
    ds = _one("daemonset.yaml", "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert "hostPort" not in c["ports"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    host = [n for n, v in volumes.items() if "hostPath" in v]
    assert sorted(host) == ["dumps", "logs"]
    for n in host:   # every host path is mounted read-only
        assert mounts[n]["readOnly"] is True, n
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"


def test_configmap_is_a_config_the_agent_accepts(tmp_path: Path) -> None:
    from precision_agent.config import load_config
    ds = _one("daemonset.yaml", "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    cfg = yaml.safe_load(_one("daemonset.yaml", "ConfigMap")["data"]["config.yml"])
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    # where the config says, the pod mounts: web config (Secret), logs, dumps, state
    assert str(Path(cfg["web_config_file"]).parent) in mounts
    for w in cfg["watches"]:
        assert mounts[w["path"]]["readOnly"] is True, w
    assert cfg["state_dir"] in mounts and not mounts[cfg["state_dir"]].get("readOnly")
    assert c["args"][c["args"].index("--config") + 1] in mounts
    host, port = cfg["listen"].rsplit(":", 1)
    assert host == "0.0.0.0" and int(port) == c["ports"][0]["containerPort"]  # a pod's loopback is its own
    del cfg["web_config_file"]   # the Secret's file does not exist here
    cfg["state_dir"] = str(tmp_path / "state")
    (tmp_path / "config.yml").write_text(yaml.safe_dump(cfg))
    loaded = load_config(tmp_path / "config.yml")
    assert [w.kind for w in loaded.watches] == ["log", "dump"]


# --- Prometheus Operator --------------------------------------------------------------------------

def test_podmonitor_matches_the_crd_schema() -> None:
    pm = _one("podmonitor.yaml", "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    schema = _crd_schema("podmonitors")
    assert not _errors(schema, pm)
    broken = copy.deepcopy(pm)
    broken["spec"]["podMetricsEndpoints"][0]["honorLabel"] = True
    assert any("honorLabel" in e for e in _errors(schema, broken))


def test_podmonitor_scrapes_what_the_daemonset_serves() -> None:
    pm, ds = _one("podmonitor.yaml", "PodMonitor"), _one("daemonset.yaml", "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pm["metadata"]["namespace"] in pm["spec"]["namespaceSelector"]["matchNames"]
    assert pm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    job = pod_labels[pm["spec"]["jobLabel"]]
    assert re.fullmatch(r"precision[-_]?agent.*", job), job   # what alerts.yml selects
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    (port,) = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert ep["port"] == port["name"] and ep["honorLabels"] is True and ep["scheme"] == "HTTPS"


def _prometheusrule() -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "precision-agent", "namespace": "monitoring",
                         "labels": {"app.kubernetes.io/name": "precision-agent", "release": "prometheus"}},
            "spec": {"groups": yaml.safe_load(ALERTS.read_text())["groups"]}}


def test_prometheusrule_matches_the_crd_schema() -> None:
    pr = _one("prometheusrule.yaml", "PrometheusRule")
    schema = _crd_schema("prometheusrules")
    assert not _errors(schema, pr)
    broken = copy.deepcopy(pr)
    broken["spec"]["groups"][0]["rules"][0]["expresion"] = "up"
    assert any("expresion" in e for e in _errors(schema, broken))


def test_prometheusrule_groups_are_exactly_alerts_yml() -> None:
    pr = _one("prometheusrule.yaml", "PrometheusRule")
    assert pr["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"], (
        "exporters/kubernetes/prometheusrule.yaml differs from alerts.yml: "
        "python tests/exporters/test_kubernetes_manifests.py --write")
    assert pr == _prometheusrule()


def _write() -> None:
    class Block(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, s: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
    Block.add_representer(str, text)
    body = yaml.dump(_prometheusrule(), Dumper=Block, sort_keys=False, width=1 << 16, allow_unicode=True)
    (K8S / "prometheusrule.yaml").write_text(RULE_HEADER + body)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/exporters/test_kubernetes_manifests.py --write")
    _write()
