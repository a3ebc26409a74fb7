"""``config/k8s/``: every manifest validates against the Kubernetes OpenAPI schemas of
a pinned version (offline, ``kubernetes-validate``, strict: unknown fields fail), the
Sluice files in the gateway ConfigMap load with Sluice's own loader, and the pieces
refer to each other consistently (Services, ports, Redis URL, scrape annotations, the
HPA's metric and the Prometheus Adapter rule that serves it)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from config.loader import check_cross_refs, load_file
from config.schema import Config

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the dev extra (pip install -e '.[dev]')")

K8S = Path(__file__).resolve().parents[2] / "config" / "k8s"
KUBERNETES_VERSION = "1.32.0"


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str, str], dict]:
    """``(kind, namespace, name)`` → document, over every manifest kubectl would apply
    (``config/k8s/*.yaml``) plus the Prometheus Adapter rules."""
    out: dict[tuple[str, str, str], dict] = {}
    paths = sorted(K8S.glob("*.yaml")) + [K8S / "prometheus-adapter" / "rules.yaml"]
    for path in paths:
        for doc in documents(path):
            key = (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


def test_every_document_validates(manifests) -> None:
    assert len(manifests) >= 9
    for key, doc in manifests.items():
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{key}: {e.message} at {list(e.path)}")


def test_validator_rejects_a_broken_manifest(manifests) -> None:
    bad = yaml.safe_load(yaml.safe_dump(manifests[("Deployment", "sluice", "sluice-gateway")]))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(manifests[("HorizontalPodAutoscaler", "sluice", "vllm-qwen")]))
    bad["spec"]["metrics"][0]["external"]["typo"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_everything_lives_in_the_namespace(manifests) -> None:
    assert ("Namespace", "", "sluice") in manifests
    for (kind, ns, _name), _ in manifests.items():
        if kind != "Namespace" and (kind, _name) != ("ConfigMap", "prometheus-adapter"):
            assert ns == "sluice", (kind, _name)


@pytest.fixture(scope="module")
def sluice_config(manifests, tmp_path_factory) -> Config:
    """The ConfigMap's three files, loaded with Sluice's own loader."""
    data = manifests[("ConfigMap", "sluice", "sluice-config")]["data"]
    assert set(data) == {"gateway.yaml", "engines.yaml", "tenants.yaml"}
    d = tmp_path_factory.mktemp("k8s-config")
    parts = {}
    for name, text in data.items():
        (d / name).write_text(text)
        kind = name.removesuffix(".yaml")
        parts[kind] = load_file(kind, d / name)
    cfg = Config(**parts, paths={k: str(d / f"{k}.yaml") for k in parts})
    check_cross_refs(cfg)
    return cfg


def service_port(manifests, host: str) -> set[int]:
    svc = manifests.get(("Service", "sluice", host))
    assert svc is not None, f"no Service {host}"
    return {p["port"] for p in svc["spec"]["ports"]}


def pod_template(manifests, name: str) -> dict:
    return manifests[("Deployment", "sluice", name)]["spec"]["template"]


def test_configmap_files_load_with_sluice_loader(sluice_config: Config, manifests) -> None:
    gw = sluice_config.gateway
    assert gw.host == "0.0.0.0"
    # engines are external entries pointing at engine Services
    assert sluice_config.engines.engines
    for e in sluice_config.engines.engines:
        assert e.kind == "external"
        u = urlsplit(e.url)
        assert u.port in service_port(manifests, u.hostname), e.url
        target = manifests[("Service", "sluice", u.hostname)]["spec"]["selector"]
        deployment = next(d for (k, _, _), d in manifests.items() if k == "Deployment"
                          and d["spec"]["template"]["metadata"]["labels"].items() >= target.items())
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--served-model-name={e.model}" in args
    # Redis for limits and cache
    for url in (gw.limits.store_url, gw.cache.store_url):
        u = urlsplit(url)
        assert u.scheme == "redis" and u.port in service_port(manifests, u.hostname)
    # at least two tenants with keys and different priorities
    assert len({t.priority for t in sluice_config.tenants.tenants}) >= 2
    assert all(t.api_key_hashes for t in sluice_config.tenants.tenants)


def test_gateway_deployment_matches_its_config(sluice_config: Config, manifests) -> None:
    tpl = pod_template(manifests, "sluice-gateway")
    c = tpl["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == sluice_config.gateway.port
    metrics_port = int(sluice_config.gateway.observability.metrics_listen.rpartition(":")[2])
    assert ports["metrics"] == metrics_port
    ann = tpl["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == metrics_port
    assert c["args"][:2] == ["serve", "--config-dir"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == c["args"][2]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    vol = next(v for v in tpl["spec"]["volumes"] if v["name"] == "config")
    assert vol["configMap"]["name"] == "sluice-config"


def test_engine_deployment(manifests) -> None:
    tpl = pod_template(manifests, "vllm-qwen")
    c = tpl["spec"]["containers"][0]
    assert c["command"] == ["vllm", "serve"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    assert f"--port={port}" in c["args"]
    assert tpl["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_hpa_scales_engines_on_queue_depth_served_by_the_adapter(manifests, sluice_config) -> None:
    hpa = manifests[("HorizontalPodAutoscaler", "sluice", "vllm-qwen")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert ("Deployment", "sluice", ref["name"]) in manifests
    metrics = {m["external"]["metric"]["name"]: m for m in hpa["spec"]["metrics"]}
    assert set(metrics) == {"sluice_queue_depth", "sluice_capacity_desired_engines"}
    # desired engines is a count of engines: an average of 1 per replica asks for it
    assert metrics["sluice_capacity_desired_engines"]["external"]["target"] == {
        "type": "AverageValue", "averageValue": "1"}
    cm = manifests[("ConfigMap", "monitoring", "prometheus-adapter")]
    rules = yaml.safe_load(cm["data"]["config.yaml"])
    external = {r["name"]["as"]: r for r in rules["externalRules"]}
    for name, metric in metrics.items():
        assert metric["type"] == "External"
        model = metric["external"]["metric"]["selector"]["matchLabels"]["model"]
        assert model in sluice_config.engines.model_names()
        # the adapter exposes exactly that external metric
        assert name in external
        assert external[name]["seriesQuery"].startswith(name + "{")
        assert "namespace" in external[name]["resources"]["overrides"]
    # the Helm values carry the same rules
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    assert values["rules"]["external"] == rules["externalRules"]
    assert values["rules"]["custom"] == rules["rules"]
