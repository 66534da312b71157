"""What may leave a process in error reports: never prompts, outputs or request bodies.

Plain functions (no sentry import) so both the gateway and the worker share one policy.
"""

from __future__ import annotations

from typing import Any

SCRUBBED = "[scrubbed]"

SENSITIVE_KEYS = frozenset({"args", "kwargs", "prompt", "messages", "text", "token_ids", "body"})
"""Keys whose values are replaced wherever they appear in an event: task arguments (a job's
prompt) that Celery's integration copies into ``extra`` and Celery's own failure log passes
as log parameters (which become ``logentry.params``, ``extra`` and breadcrumb ``data``), and
any prompt or output field."""


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: SCRUBBED if key in SENSITIVE_KEYS else _scrub(item) for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_scrub(item) for item in value]
    return value


def scrub_event(event: dict[str, Any], _hint: dict[str, Any]) -> dict[str, Any]:
    """``before_send`` hook: drop request bodies, task arguments, prompts and outputs."""
    request = event.get("request")
    if isinstance(request, dict) and "data" in request:
        request["data"] = SCRUBBED
    for section in ("extra", "logentry", "breadcrumbs", "contexts"):
        if section in event:
            event[section] = _scrub(event[section])
    return event


SENTRY_OPTIONS: dict[str, Any] = {
    "send_default_pii": False,
    "max_request_body_size": "never",
    # Local variables of a failing frame can hold the prompt or the generated text.
    "include_local_variables": False,
    "before_send": scrub_event,
}
