"""What may leave a process in error reports: never prompts, outputs or request bodies.

Plain functions (no sentry import) so both the gateway and the worker share one policy.
"""

from __future__ import annotations

from typing import Any

SCRUBBED = "[scrubbed]"

# Celery's Sentry integration copies task arguments (a job's prompt) into ``extra``.
_CELERY_EXTRA = "celery-job"


def scrub_event(event: dict[str, Any], _hint: dict[str, Any]) -> dict[str, Any]:
    """``before_send`` hook: drop request bodies and task arguments from a Sentry event."""
    request = event.get("request")
    if isinstance(request, dict) and "data" in request:
        request["data"] = SCRUBBED
    extra = event.get("extra")
    if isinstance(extra, dict) and isinstance(extra.get(_CELERY_EXTRA), dict):
        for key in ("args", "kwargs"):
            if key in extra[_CELERY_EXTRA]:
                extra[_CELERY_EXTRA][key] = SCRUBBED
    return event


SENTRY_OPTIONS: dict[str, Any] = {
    "send_default_pii": False,
    "max_request_body_size": "never",
    # Local variables of a failing frame can hold the prompt or the generated text.
    "include_local_variables": False,
    "before_send": scrub_event,
}
