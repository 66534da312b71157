"""What may leave a process in error reports: never prompts, outputs or request bodies.

Plain functions, so the gateway and the workers share one policy; sentry is imported only by
``sentry_options``, which a process calls when it has a DSN.
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


SENTRY_2_OPTIONS: dict[str, Any] = {
    "send_default_pii": False,
    "max_request_body_size": "never",
    # Local variables of a failing frame can hold the prompt or the generated text.
    "include_local_variables": False,
    "before_send": scrub_event,
}
"""sentry-sdk 2.x without ``data_collection`` (2.40 has none, 2.76 has it): no user data,
request bodies or local variables."""

SENTRY_DATA_COLLECTION: dict[str, Any] = {
    "user_info": False,
    "cookies": {"mode": "off"},
    "http_headers": {"request": {"mode": "off"}},
    "http_bodies": [],
    "url_query_params": {"mode": "off"},
    "gen_ai": {"inputs": False, "outputs": False},
    # Celery's integration copies a task's arguments (the job message, its prompt) into events.
    "queues": False,
    "database_query_data": False,
    # Local variables of a failing frame can hold the prompt or the generated text.
    "stack_frame_variables": False,
}
"""An SDK with ``data_collection`` (2.76, 3.x) collects most categories unless told
otherwise (3.x removed ``send_default_pii`` and ``include_local_variables``: passing either is
a ``TypeError``), so every category that could carry a prompt, an output, a caller's identity
or a credential is off."""


def sentry_options() -> dict[str, Any]:
    """Keyword arguments for ``sentry_sdk.init`` (besides the DSN), for the installed SDK.

    The same policy on every SDK: nothing a caller sent or the engine generated leaves, and
    error logs (``ERROR`` and above) become events. An SDK that knows ``data_collection``
    (2.76 does) is told with it (``send_default_pii`` is deprecated there, gone in 3.x);
    3.x no longer turns error logs into events unless told, and sends every ``INFO`` log as a
    Sentry log (which ``before_send`` does not see): its logging integration is set to do
    what 2.x's did by default.
    """
    import inspect
    import logging

    import sentry_sdk
    from sentry_sdk.consts import ClientConstructor

    if "data_collection" not in inspect.signature(ClientConstructor.__init__).parameters:
        return dict(SENTRY_2_OPTIONS)
    options: dict[str, Any] = {
        "data_collection": SENTRY_DATA_COLLECTION,
        "max_request_body_size": "never",
        "before_send": scrub_event,
    }
    if int(sentry_sdk.VERSION.split(".")[0]) >= 3:
        from sentry_sdk.integrations.logging import LoggingIntegration

        # 3.x's signature (``level`` is the Sentry logs' level there, the breadcrumbs' in 2.x).
        events_from_error_logs = LoggingIntegration(  # type: ignore[call-arg,unused-ignore]
            level=None, event_level=logging.ERROR, breadcrumb_level=logging.INFO
        )
        options["integrations"] = [events_from_error_logs]
    return options
