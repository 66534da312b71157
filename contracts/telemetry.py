"""What may leave a process in error reports: never prompts, outputs or request bodies.

Plain functions, so the gateway and the workers share one policy; sentry is imported only by
``sentry_options``, which a process calls when it has a DSN, and by ``error_scope`` (which,
without a DSN, only forks sentry's inert scopes).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

SCRUBBED = "[scrubbed]"

SENSITIVE_KEYS = frozenset({"args", "kwargs", "prompt", "messages", "text", "token_ids", "body"})
"""Keys whose values are replaced wherever they appear in an event: task arguments (a job's
prompt) that Celery's integration copies into ``extra`` and Celery's own failure log passes
as log parameters (which become ``logentry.params``, ``extra`` and breadcrumb ``data``), and
any prompt or output field."""


CREDENTIAL_KEYS = frozenset(
    {
        # sentry-sdk 2.x's own event scrubber's lists (``sentry_sdk.scrubber``), which it
        # applies only without ``data_collection``; 3.x has none.
        "password", "passwd", "secret", "api_key", "apikey", "auth", "credentials",
        "mysql_pwd", "privatekey", "private_key", "token", "session", "csrftoken",
        "sessionid", "x_csrftoken", "set_cookie", "cookie", "authorization",
        "proxy_authorization", "x_api_key", "aiohttp_session", "connect.sid", "csrf_token",
        "csrf", "_csrf", "_csrf_token", "phpsessid", "_session", "symfony", "user_session",
        "_xsrf", "xsrf_token", "x_forwarded_for", "x_real_ip", "ip_address", "remote_addr",
        # lorafleet's own: tenant keys, signing secrets.
        "api_keys", "tenant_key", "webhook_secret", "signing_secret",
    }
)  # fmt: skip
"""Keys (lower case, ``-`` read as ``_``, matched whole) whose values are replaced in an event's
request headers, cookies and environment, ``extra``, log parameters, breadcrumbs and contexts,
and dropped from its user, as sentry-sdk 2.x's event scrubber did: with ``data_collection``
(2.76) it is off, and 3.x has none. Frame variables are never sent (``data_collection``)."""

CREDENTIAL_ENDINGS = (
    "token", "secret", "secrets", "password", "passwd", "passphrase", "apikey", "accesskey",
    "secretkey", "privatekey", "signingkey", "credentials", "auth",
)  # fmt: skip
"""Endings that make a key a credential's too, read in lower case without ``_`` and ``-``
(beyond sentry-sdk's whole-key lists): ``X-Auth-Token``, ``access_token``, ``accessToken``,
``client_secret``, ``aws_secret_access_key``, botocore's ``SecretAccessKey`` and
``SessionToken``, ``signing_key``, ``basic_auth``. Counts (``max_tokens``) end otherwise; so
does a working directory (``PWD``: ``mysql_pwd`` is listed whole). A tokenizer's ``eos_token``
is scrubbed too, which loses nothing of a credential's kind."""


def _sensitive(key: object) -> bool:
    if not isinstance(key, str):
        return False
    if key in SENSITIVE_KEYS:
        return True
    key = key.lower().replace("-", "_")
    return key in CREDENTIAL_KEYS or key.replace("_", "").endswith(CREDENTIAL_ENDINGS)


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: SCRUBBED if _sensitive(key) else _scrub(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(item) for item in value]
    return value


_URL_PASSWORD = re.compile(
    r"(?P<head>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:]*:)[^\s/?#]*@"
)
"""The password of a URL (``redis://:pw@host``, ``https://user:pw@host``), up to the last ``@``
of its authority, as URL parsers read it (a password written with a raw ``@`` is all taken).
A scheme starts where no scheme character precedes it (``x=_redis://...`` too), which also keeps
the search linear on long runs of them (``\b`` let a match start after every ``.``)."""


def _without_passwords(value: Any) -> Any:
    """Every string of ``value`` (nested) with the passwords of the URLs it holds replaced."""
    if isinstance(value, str):
        return _URL_PASSWORD.sub(lambda match: f"{match['head']}{SCRUBBED}@", value)
    if isinstance(value, dict):
        return {key: _without_passwords(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_without_passwords(item) for item in value]
    return value


def _origin(url: str) -> str:
    """Where a call went, without what could be a capability: ``scheme://host:port``, then
    ``/[scrubbed]`` if it had a path, query or fragment (a user and password are dropped)."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme.isascii() or not scheme.isalpha():
        return SCRUBBED
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    host = rest[:end].rpartition("@")[2]  # sentry-sdk writes "[Filtered]:[Filtered]@"
    if not host:
        return SCRUBBED
    return f"{scheme}://{host}" + (f"/{SCRUBBED}" if rest[end:] not in ("", "/") else "")


def _http_breadcrumbs(breadcrumbs: Any) -> None:
    """The URLs of the process's own HTTP calls (sentry-sdk's httpx and stdlib integrations
    record one breadcrumb per call, sent with its next error event) cut to their origin: a
    webhook URL is a tenant's capability, its secret in the path (Slack, Discord), the query
    or the fragment."""
    values = breadcrumbs.get("values") if isinstance(breadcrumbs, dict) else breadcrumbs
    for crumb in values if isinstance(values, list) else ():
        if not isinstance(crumb, dict) or crumb.get("type") != "http":
            continue
        data = crumb.get("data")
        if not isinstance(data, dict):
            continue
        for key, item in data.items():
            if key in ("url", "url.full", "http.url") and isinstance(item, str):
                data[key] = _origin(item)
            elif key in ("http.query", "http.fragment", "url.query", "url.fragment") and item:
                data[key] = SCRUBBED


def scrub_event(event: dict[str, Any], _hint: dict[str, Any]) -> dict[str, Any]:
    """``before_send`` hook: drop request bodies, task arguments, prompts and outputs, and
    values under credential-like keys (``CREDENTIAL_KEYS``); cut the URLs of the process's
    own HTTP calls to their origin; replace the password of any URL written anywhere in the
    event (messages, exceptions, tags, the process's ``argv``)."""
    request = event.get("request")
    if isinstance(request, dict):
        if "data" in request:
            request["data"] = SCRUBBED
        for part in ("headers", "cookies", "env"):
            if part in request:
                request[part] = _scrub(request[part])
    for section in ("extra", "logentry", "breadcrumbs", "contexts"):
        if section in event:
            event[section] = _scrub(event[section])
    user = event.get("user")
    if isinstance(user, dict):  # dropped, not replaced: "[scrubbed]" is no IP address
        event["user"] = {key: value for key, value in _scrub(user).items() if value != SCRUBBED}
    if "breadcrumbs" in event:
        _http_breadcrumbs(event["breadcrumbs"])
    scrubbed: dict[str, Any] = _without_passwords(event)
    return scrubbed


EVERY_SDK: dict[str, Any] = {
    # Nothing but error events: no release-health sessions, no client reports, and no
    # ``sentry-trace``/``baggage`` headers on the process's own requests (by default every
    # outgoing request carries them: a tenant's webhook URL would receive the DSN's public
    # key, the release and the trace).
    "auto_session_tracking": False,
    "send_client_reports": False,
    "trace_propagation_targets": [],
    "max_request_body_size": "never",
    "before_send": scrub_event,
    # Only the default integrations (logging, threading, excepthook...): the ones enabled
    # because a library is installed (Celery, Starlette and FastAPI, Redis, httpx, boto3...)
    # wrap every task, request, command or call in spans, breadcrumbs and scopes, and cost
    # the control plane about a quarter more CPU per job with a DSN set
    # (``benchmarks/results/sentry_cost.2026-12-07-972f40d.txt``). What the errors need of
    # them, a scope of its own per job and per request, with the job's tags, is
    # ``error_scope`` (the worker's task) and ``gateway.error_scope`` (each request).
    "auto_enabling_integrations": False,
}
"""Options of every sentry-sdk from 2.0 on."""

SENTRY_2_OPTIONS: dict[str, Any] = {
    **EVERY_SDK,
    "send_default_pii": False,
    # Local variables of a failing frame can hold the prompt or the generated text.
    "include_local_variables": False,
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
    "mcp": {"inputs": False, "outputs": False},
    "graphql": {"document": False, "variables": False},
    # Celery's integration copies a task's arguments (the job message, its prompt) into events.
    "queues": False,
    "database_query_data": False,
    # Local variables of a failing frame can hold the prompt or the generated text.
    "stack_frame_variables": False,
}
"""An SDK with ``data_collection`` (2.76, 3.x) collects every category it is not told about
(3.x removed ``send_default_pii`` and ``include_local_variables``: passing either is a
``TypeError``), so each category that could carry a prompt, an output, a caller's identity or
a credential is off."""


@contextlib.contextmanager
def error_scope(expected: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """A Sentry isolation scope of its own for one unit of work (a job, a request): the tags
    set within it (``sentry_sdk.set_tags``) and its breadcrumbs go with its errors only, and
    an exception that leaves it is reported from within it, tagged, unless it is one of
    ``expected`` (control flow, such as Celery's ``Reject``). A framework's own error log of
    the same exception, outside the scope, is then dropped as a duplicate (sentry-sdk's
    default ``dedupe`` integration). It starts with no breadcrumbs: a pool thread's scope,
    which it forks, holds those of the thread's earlier units (Celery's "succeeded" logs).
    Without an initialised SDK nothing is sent (the scopes are forked all the same)."""
    import sentry_sdk

    with sentry_sdk.isolation_scope() as scope:
        scope.clear_breadcrumbs()
        try:
            yield
        except expected:
            raise
        except Exception as exc:
            sentry_sdk.capture_exception(exc)
            raise


def _never_sampled(_context: dict[str, Any]) -> float:
    return 0.0


def sentry_options() -> dict[str, Any]:
    """Keyword arguments for ``sentry_sdk.init`` (besides the DSN), for the installed SDK.

    The same policy on every SDK: error events only (no transactions, spans, Sentry logs,
    sessions or client reports, and no trace headers on outgoing requests), nothing a caller
    sent or the engine generated, and error logs (``ERROR`` and above) become events.
    An SDK that knows ``data_collection`` (2.76 does) is told with it (``send_default_pii`` is
    deprecated there, gone in 3.x). 3.x changed three defaults this policy relies on: it has
    no logging integration unless given one (error logs would not become events), it follows
    an incoming trace's sampling decision even with tracing off (a caller's ``sentry-trace:
    ...-1`` header would make the gateway send spans, which ``before_send`` does not see), and
    it attaches the current stack to error-log events.
    """
    import copy
    import inspect
    import logging

    import sentry_sdk
    from sentry_sdk.consts import ClientConstructor

    # Copies: the module's lists and dicts stay as written whatever an SDK does with its options.
    if "data_collection" not in inspect.signature(ClientConstructor.__init__).parameters:
        return copy.deepcopy(SENTRY_2_OPTIONS)
    options: dict[str, Any] = {
        **copy.deepcopy(EVERY_SDK),
        "data_collection": copy.deepcopy(SENTRY_DATA_COLLECTION),
    }
    if int(sentry_sdk.VERSION.split(".")[0]) >= 3:
        from sentry_sdk.integrations.logging import LoggingIntegration

        # 3.x's signature (``level`` is the Sentry logs' level there, the breadcrumbs' in 2.x).
        events_from_error_logs = LoggingIntegration(  # type: ignore[call-arg,unused-ignore]
            level=None, event_level=logging.ERROR, breadcrumb_level=logging.INFO
        )
        options["integrations"] = [events_from_error_logs]
        # A sampler decides over an incoming trace's flag; a sample rate of 0 does not.
        options["traces_sampler"] = _never_sampled
        options["attach_stacktrace"] = False
    return options
