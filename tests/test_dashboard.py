"""The Grafana dashboard (``infra/grafana/lorafleet.json``) asks only for what the code exports:
every metric a query names is registered by the gateway, the worker, or vLLM's engine, and
every label it filters or groups by is one that metric carries. A renamed metric or label
breaks this test, not the operator's dashboard. The compose file provisions it."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from gateway.metrics import GatewayMetrics
from worker import metrics as worker_metrics

INFRA = Path(__file__).resolve().parents[1] / "infra"
DASHBOARD = json.loads((INFRA / "grafana" / "lorafleet.json").read_text())
METRIC = r"\b(lorafleet_[a-z0-9_]+|vllm:[a-z0-9_:]+)"
TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every series it scrapes."""
VLLM = {
    "vllm:num_requests_running": {"model_name", "engine"},
    "vllm:num_requests_waiting": {"model_name", "engine"},
    "vllm:kv_cache_usage_perc": {"model_name", "engine"},
}
"""The engine's gauges the dashboard reads (served on the worker's metrics port)."""
REQUIRED = {
    "lorafleet_queue_depth",
    "lorafleet_queue_oldest_age_seconds",
    "lorafleet_admitted_unfinished",
    "lorafleet_jobs_finished_total",
    "lorafleet_job_e2e_seconds_bucket",
    "lorafleet_job_queue_wait_seconds_bucket",
    "lorafleet_job_ttft_seconds_bucket",
    "lorafleet_adapter_lookups_total",
    "lorafleet_adapter_load_seconds_bucket",
    "lorafleet_adapter_evictions_total",
    "lorafleet_adapters_resident",
    "lorafleet_adapter_requests_total",
    "lorafleet_identity_checks_total",
    *VLLM,
}
"""What an operator needs on it (issue 20's list)."""


def _series(metric: MetricWrapperBase) -> dict[str, set[str]]:
    """Series name -> label names, as the exposition writes them."""
    name, labels = metric._name, set(metric._labelnames)
    if isinstance(metric, Counter):
        return {f"{name}_total": labels}
    if isinstance(metric, Histogram):
        return {f"{name}_bucket": labels | {"le"}, f"{name}_sum": labels, f"{name}_count": labels}
    assert isinstance(metric, Gauge), type(metric)
    return {name: labels}


def _exported() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    gateway = GatewayMetrics(top_adapters=10)
    for owner in (vars(worker_metrics).values(), vars(gateway).values()):
        for metric in owner:
            if isinstance(metric, MetricWrapperBase):
                found.update(_series(metric))
    # The engine's names, read from the vLLM installed: a rename there shows here.
    from vllm.v1.metrics import loggers

    source = inspect.getsource(loggers)
    for name, labels in VLLM.items():
        assert f'"{name}"' in source, f"vLLM no longer exports {name}"
        found[name] = labels
    return found


EXPORTED = _exported()


def _panels() -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    found = []
    for panel in DASHBOARD["panels"]:
        found += [panel, *panel.get("panels", [])]
    return found


def _targets() -> list[tuple[str, dict[str, Any]]]:
    return [(panel["title"], target) for panel in _panels() for target in panel.get("targets", [])]


def _queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query, the template variables' included (the query
    Grafana runs: it must be the one it shows)."""
    queries = [(title, target["expr"]) for title, target in _targets()]
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["definition"] == variable["query"]["query"], variable["name"]
            queries.append((f"${variable['name']}", variable["query"]["query"]))
    return queries


@pytest.mark.parametrize(("title", "expr"), _queries())
def test_each_query_names_exported_metrics_and_their_labels(title: str, expr: str) -> None:
    used = re.findall(METRIC, expr)
    assert used, f"{title}: no metric"
    unknown = set(used) - EXPORTED.keys()
    assert not unknown, f"{title}: {unknown} are not exported"
    carried = set.union(*(EXPORTED[name] for name in used)) | TARGET_LABELS
    for name, matchers in re.findall(METRIC + r"\{([^}]*)\}", expr):
        for label in re.findall(r"(\w+)\s*(?:=~|!=|!~|=)", matchers):
            assert label in EXPORTED[name] | TARGET_LABELS, f"{title}: {name} has no {label}"
    groupings = [
        [part.strip() for part in grouping.split(",") if part.strip()]
        for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
    ]
    for grouping in groupings:
        for label in grouping:
            assert label in carried, f"{title}: grouped by {label}, which it does not carry"
        if "histogram_quantile" in expr:
            assert "le" in grouping, f"{title}: a quantile needs its buckets (le) kept"
    for label in re.findall(r"label_values\([^,]+,\s*(\w+)\)", expr):
        assert label in carried, f"{title}: no {label} label to list"


@pytest.mark.parametrize(("title", "target"), _targets())
def test_each_legend_names_labels_its_query_keeps(title: str, target: dict[str, Any]) -> None:
    expr, legend = target["expr"], target.get("legendFormat", "")
    outer = re.search(r"\bby\s*\(([^)]*)\)", expr)  # the first is the outermost here
    kept = {part.strip() for part in outer.group(1).split(",")} if outer else None
    for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
        assert kept is None or label in kept, f"{title}: legend {label} is aggregated away"


def test_the_dashboard_covers_what_an_operator_needs() -> None:
    used = {name for _, expr in _queries() for name in re.findall(METRIC, expr)}
    assert used >= REQUIRED, REQUIRED - used
    ids = [panel["id"] for panel in _panels()]
    assert len(ids) == len(set(ids))
    for panel in _panels():
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]


def test_compose_provisions_prometheus_and_the_dashboard() -> None:
    compose: dict[str, Any] = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    mounts = {
        volume.split(":")[1]: volume.split(":")[0] for volume in services["grafana"]["volumes"]
    }
    assert (INFRA / mounts["/var/lib/grafana/dashboards/lorafleet.json"]).resolve() == (
        INFRA / "grafana" / "lorafleet.json"
    )
    provisioning = INFRA / mounts["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "lorafleet.yaml").read_text())[
        "providers"
    ]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in services
    config_mount = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    config = yaml.safe_load((INFRA / config_mount["/etc/prometheus/prometheus.yml"]).read_text())
    targets = {
        target
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    # every service that serves metrics is scraped: the gateway (public here), each worker
    assert services["gateway"]["environment"]["LORAFLEET_METRICS_PUBLIC"] == "true"
    workers = [name for name in services if name.startswith("worker-")]
    assert targets == {"gateway:8000", *(f"{name}:9400" for name in workers)}
