"""infra/ validates against the published schemas a user's tools apply: the compose file
against the compose specification's JSON schema (vendored by ``check-jsonschema``), the
Kubernetes kinds against the API's strict JSON schemas (``kubernetes-validate``: an unknown
field is an error, as with ``kubectl apply --validate=strict``), and the custom resources
(KEDA's ScaledObject, the Prometheus operator's PrometheusRule and ServiceMonitor) against
models generated from their CRDs (``cloudcoil-models-*``), with every field of the manifest
required to be one the CRD declares. Each check is also shown to refuse a broken manifest."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pydantic
import pytest
import yaml
from cloudcoil.models.keda import v1alpha1 as keda
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator

INFRA = Path(__file__).resolve().parents[1] / "infra"
# API groups of the operators' custom resources (``*.k8s.io`` groups are Kubernetes' own).
CUSTOM_GROUPS = {"keda.sh", "monitoring.coreos.com"}
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"
# The oldest Kubernetes release the KEDA version the models come from (2.16) supports.
KUBERNETES = "1.30.0"
CUSTOM_RESOURCES: dict[tuple[str, str], type[pydantic.BaseModel]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): keda.ScaledObject,
    ("monitoring.coreos.com/v1", "PrometheusRule"): prometheus_operator.PrometheusRule,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): prometheus_operator.ServiceMonitor,
}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


def _dropped(given: Any, kept: Any, path: str = "") -> list[str]:
    """Paths of the keys in ``given`` that the model did not keep: fields the CRD lacks."""
    if isinstance(given, dict):
        if not isinstance(kept, dict):
            return [path or "."]
        out = []
        for key, value in given.items():
            where = f"{path}.{key}"
            out += _dropped(value, kept[key], where) if key in kept else [where]
        return out
    if isinstance(given, list) and isinstance(kept, list) and len(given) == len(kept):
        pairs = enumerate(zip(given, kept, strict=True))
        return [p for i, (g, k) in pairs for p in _dropped(g, k, f"{path}[{i}]")]
    return [] if given == kept else [f"{path} ({given!r} became {kept!r})"]


def _validate(doc: dict[str, Any]) -> None:
    """Raise if ``doc`` is not valid for its kind; for a custom resource, also if it holds a
    field its CRD does not declare (the API server would prune it without a word)."""
    model = CUSTOM_RESOURCES.get((doc["apiVersion"], doc["kind"]))
    if model is None:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        return
    parsed = model.model_validate(doc)
    kept = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    unknown = _dropped(doc, kept)
    if unknown:
        raise ValueError(f"{doc['kind']}: fields its CRD does not declare: {unknown}")


def test_every_manifest_kind_has_a_schema() -> None:
    core = kubernetes_validate.utils.all_versions()
    assert any(v.startswith(KUBERNETES.rsplit(".", 1)[0]) for v in core)
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in _documents()}
    assert {k for k in kinds if k[0].split("/")[0] in CUSTOM_GROUPS} <= set(CUSTOM_RESOURCES)
    assert set(CUSTOM_RESOURCES) <= kinds


@pytest.mark.parametrize("doc", [d for _, d in _documents()], ids=[n for n, _ in _documents()])
def test_kubernetes_manifest_validates_against_its_schema(doc: dict[str, Any]) -> None:
    _validate(doc)


def _first(kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(d for _, d in _documents() if d["kind"] == kind))


def test_the_kubernetes_checks_refuse_broken_manifests() -> None:
    broken = []
    deployment = _first("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    broken.append(deployment)
    deployment = _first("Deployment")
    deployment["spec"]["replicas"] = "two"
    broken.append(deployment)
    scaled = _first("ScaledObject")
    scaled["spec"]["minReplicaCont"] = 1
    broken.append(scaled)
    scaled = _first("ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = {"value": 1}
    broken.append(scaled)
    scaled = _first("ScaledObject")
    del scaled["spec"]["scaleTargetRef"]
    broken.append(scaled)
    rule = _first("PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["expresion"] = "up"
    broken.append(rule)
    for doc in broken:
        with pytest.raises((ValueError, kubernetes_validate.ValidationError)):
            _validate(doc)


def _check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_validates_against_the_compose_spec(tmp_path: Path) -> None:
    checked = _check_compose(INFRA / "compose.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    service = next(iter(compose["services"].values()))
    service["restart_polcy"] = "always"
    broken = tmp_path / "compose.yaml"
    broken.write_text(yaml.safe_dump(compose))
    refused = _check_compose(broken)
    assert refused.returncode == 1 and "restart_polcy" in refused.stdout, refused.stdout
