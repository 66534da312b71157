"""The OpenAPI document the gateway serves is valid and documents every endpoint's errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
from openapi_spec_validator import validate

from contracts.errors import ErrorCode
from gateway.app import create_app
from gateway.config import GatewaySettings
from gateway.errors import ADMISSION

_FASTAPI_OWN = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def _codes(operation: dict[str, Any]) -> set[str]:
    return {
        code
        for response in operation["responses"].values()
        for code in response.get("x-error-codes", ())
    }


def test_openapi_document_is_valid_and_lists_every_endpoint_with_its_error_codes(
    private_gateway: Callable[..., Any],
) -> None:
    with private_gateway() as url:
        document = httpx.get(f"{url}/openapi.json").json()
    validate(document)

    served = {
        (method.upper(), route.path)  # type: ignore[attr-defined]
        for route in create_app(GatewaySettings()).routes
        for method in getattr(route, "methods", ())
        if route.path not in _FASTAPI_OWN and method != "HEAD"  # type: ignore[attr-defined]
    }
    documented = {
        (method.upper(), path) for path, item in document["paths"].items() for method in item
    }
    assert served == documented

    for method, path in documented - {("GET", "/healthz"), ("GET", "/readyz")}:
        operation = document["paths"][path][method.lower()]
        codes = _codes(operation)
        assert {"unauthorized", "service_unavailable", "validation_error"} <= codes, path
        assert operation["security"] == [{"HTTPBearer": []}], path
        for status, response in operation["responses"].items():
            if status.startswith(("4", "5")):
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorEnvelope"}, (path, status)

    admission = {code.value for code in ADMISSION}
    for path in ("/v1/jobs", "/v1/completions", "/v1/chat/completions"):
        assert admission <= _codes(document["paths"][path]["post"]), path
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert {"timeout", "unsupported_parameter", "deadline_exceeded"} <= _codes(
            document["paths"][path]["post"]
        )
    assert "job_finished" in _codes(document["paths"]["/v1/jobs/{job_id}"]["delete"])
    operations = [op for item in document["paths"].values() for op in item.values()]
    everything = set().union(*(_codes(op) for op in operations))
    gateway_codes = {code.value for code in ErrorCode} - _WORKER_OR_CLI_ONLY - _FRAMEWORK
    assert gateway_codes <= everything, gateway_codes - everything


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_every_reference_in_the_openapi_document_resolves() -> None:
    document = create_app(GatewaySettings()).openapi()
    schemas = document["components"]["schemas"]
    refs = set(_refs(document))
    assert "#/components/schemas/BatchCreate" in refs  # the batch route's two body shapes
    dangling = {
        ref
        for ref in refs
        if not ref.startswith("#/components/schemas/")
        or ref.removeprefix("#/components/schemas/") not in schemas
    }
    assert not dangling, dangling
    for name, field in (("BatchCreate", "requests"), ("OpenAIBatchCreate", "input_file_id")):
        assert field in schemas[name]["required"], schemas[name]


_WORKER_OR_CLI_ONLY = {
    "tenant_not_found",
    "tenant_exists",
    "key_not_found",
    "name_invalid",
    "name_taken",
    "channel_not_found",
    "alias_exists",
    "pins_exceed_slots",
    "adapter_config_missing",
    "adapter_config_invalid",
    "adapter_unsafe_format",
    "adapter_weights_missing",
    "adapter_weights_invalid",
    "rank_too_large",
    "target_modules_unknown",
    "adapter_shape_mismatch",
    "adapter_too_large",
}
"""Codes no HTTP endpoint answers (the CLI's, or unused by the gateway)."""

_FRAMEWORK = {"route_not_found", "method_not_allowed"}
"""Codes answered for requests that reach no endpoint."""
