from __future__ import annotations

import inspect
import json
import logging
from typing import Any

import httpx
import sentry_sdk
from sentry_sdk.consts import ClientConstructor
from sentry_sdk.transport import Transport

from contracts.telemetry import SCRUBBED, scrub_event, sentry_options

SECRET = "secret invoice text 7f3a"
CREDENTIAL = "lf_sk_0123456789abcdef"


def test_request_bodies_and_task_arguments_never_leave() -> None:
    event = {
        "request": {"url": "/v1/jobs", "data": {"prompt": "secret invoice text"}},
        "extra": {
            "celery-job": {
                "task_name": "lorafleet.run_job",
                "args": [{"prompt": "x"}],
                "kwargs": {"prompt": "y"},
            }
        },
        "tags": {"job_id": "abc"},
    }
    scrubbed = scrub_event(event, {})
    assert "secret" not in repr(scrubbed)
    assert scrubbed["request"]["data"] == SCRUBBED
    assert scrubbed["extra"]["celery-job"] == {
        "task_name": "lorafleet.run_job",
        "args": SCRUBBED,
        "kwargs": SCRUBBED,
    }
    assert scrubbed["tags"] == {"job_id": "abc"}


class _Recorded(Transport):
    def __init__(self) -> None:
        super().__init__({"dsn": "https://key@sentry.invalid/1"})
        self.envelopes: list[Any] = []

    def capture_envelope(self, envelope: Any) -> None:
        self.envelopes.append(envelope)


def _fails_with_the_prompt_in_a_local(prompt: str) -> None:
    generated = prompt.upper()
    raise RuntimeError(f"engine refused a request of {len(generated)} characters")


def _sentry_major() -> int:
    return int(sentry_sdk.VERSION.split(".")[0])


def _sampled_span(name: str) -> None:
    """A span under an incoming trace whose caller sampled it (``sentry-trace: ...-1``), as
    the gateway's ASGI integration starts one for a request carrying the header."""
    headers = {"sentry-trace": f"{'a' * 32}-{'b' * 16}-1"}
    if _sentry_major() >= 3:
        sentry_sdk.continue_trace(headers)
        with sentry_sdk.start_span(name=name):  # type: ignore[call-arg,unused-ignore]
            pass
        return
    transaction = sentry_sdk.continue_trace(headers, op="http.server", name=name)
    with sentry_sdk.start_transaction(transaction):
        pass


def test_sentry_options_send_only_scrubbed_error_events_on_the_installed_sdk() -> None:
    # A real client with the options, as ``sentry_sdk.init`` builds one (an unknown option is
    # a TypeError there; sentry-sdk 3 removed two that 2 had): CI installs the newest allowed
    # SDK, and this checks whichever is installed. The options turn off the integrations
    # enabled for installed libraries (Celery, redis, Starlette...); the default ones
    # (stdlib, threading, excepthook; logging on 2.x) still patch the process, inert once no
    # client is bound.
    transport = _Recorded()
    client = sentry_sdk.Client(
        dsn="https://key@sentry.invalid/1", transport=transport, release="test", **sentry_options()
    )
    # Each would wrap every task, request, Redis command or call (``error_scope`` instead).
    installed = {"celery", "redis", "starlette", "fastapi", "httpx", "boto3"}
    assert not installed & set(client.integrations), sorted(client.integrations)
    assert "logging" in client.integrations and "dedupe" in client.integrations
    for option, value in (
        ("auto_enabling_integrations", False),
        ("auto_session_tracking", False),
        ("send_client_reports", False),
        ("trace_propagation_targets", []),
    ):
        assert client.options[option] == value, option
    knows = "data_collection" in inspect.signature(ClientConstructor.__init__).parameters
    assert knows or _sentry_major() < 3
    if knows:  # as the SDK resolved it (a key it does not know would be collected)
        collected = client.options["data_collection"]
        assert _sentry_major() < 3 or "mcp" in collected
        assert collected["user_info"] is False
        assert collected["http_bodies"] == []
        for category in (collected["cookies"], collected["url_query_params"]):
            assert category["mode"] == "off"
        assert collected["http_headers"]["request"]["mode"] == "off"
        for category in ("gen_ai", "mcp", "graphql"):  # 2.76 knows no "mcp"
            assert not any(collected.get(category, {}).values()), collected[category]
        assert collected["queues"] is False  # Celery's task arguments: the job's prompt
        assert collected["database_query_data"] is False
        assert collected["stack_frame_variables"] is False
    log = logging.getLogger("lorafleet.telemetry-test")
    log.setLevel(logging.INFO)
    try:
        with sentry_sdk.isolation_scope() as scope:
            scope.set_client(client)
            log.info("job %s started", "j-info")
            log.error("job %s could not be stored", "j-error", extra={"Authorization": CREDENTIAL})
            try:
                _fails_with_the_prompt_in_a_local(SECRET)
            except RuntimeError as exc:
                sentry_sdk.capture_exception(exc)
            _sampled_span("POST /v1/completions")
            client.flush(timeout=5)
    finally:
        client.close()
    items = [item for envelope in transport.envelopes for item in envelope.items]
    sent = b"".join(item.get_bytes() for item in items)
    for secret in (SECRET, SECRET.upper(), CREDENTIAL):
        assert secret.encode() not in sent
    # Errors only: no transaction or span (a caller's sampled trace header must not start
    # one: 3.x follows it even with tracing off), no Sentry log (INFO logs unscrubbed).
    assert {item.type for item in items} == {"event"}, [item.type for item in items]
    events = [item.payload.json for item in items]
    # 2.x turned error logs into events by default; 3.x does only when told (as here).
    logged = [event for event in events if "j-error" in repr(event.get("logentry"))]
    assert logged, events
    assert "threads" not in logged[0] and "stacktrace" not in repr(logged[0])
    assert not any("j-info" in repr(event.get("logentry")) for event in events)
    crashed = [event for event in events if event.get("exception")]
    assert crashed, events
    frames = crashed[0]["exception"]["values"][-1]["stacktrace"]["frames"]
    assert frames and all("vars" not in frame for frame in frames)


def test_credential_keys_are_scrubbed_wherever_they_appear() -> None:
    """sentry-sdk 2.x's own scrubber removed these; with ``data_collection`` it is off (2.76),
    and 3.x has none: ``scrub_event`` does it on every SDK, and for keys that end as a
    credential's do (``CREDENTIAL_ENDINGS``), which 2.x's whole-key lists missed."""
    event = {
        "request": {
            "headers": {
                "Authorization": CREDENTIAL,
                "X-Auth-Token": CREDENTIAL,
                "Accept": "application/json",
            }
        },
        "extra": {
            "api_key": CREDENTIAL,
            "job_id": "j1",
            "max_tokens": 16,
            "oauth": {"client_secret": CREDENTIAL, "access_token": CREDENTIAL},
            "js": {"refreshToken": CREDENTIAL, "clientSecret": CREDENTIAL},
            "env": {"AWS_SECRET_ACCESS_KEY": CREDENTIAL},
            "boto": {"SecretAccessKey": CREDENTIAL, "SessionToken": CREDENTIAL},
            "more": {"signing_key": CREDENTIAL, "basic_auth": CREDENTIAL, "PWD": "/srv"},
            "usage": {"prompt_tokens": 3, "completionTokens": 5},
        },
        "breadcrumbs": {"values": [{"data": {"X-Forwarded-For": "203.0.113.9"}}]},
        "contexts": {"webhook": {"signing_secret": CREDENTIAL}},
        "user": {"ip_address": "203.0.113.9", "id": "acme"},
    }
    scrubbed = scrub_event(event, {})
    assert CREDENTIAL not in repr(scrubbed) and "203.0.113.9" not in repr(scrubbed)
    assert scrubbed["user"] == {"id": "acme"}  # dropped: "[scrubbed]" is no IP address
    assert scrubbed["request"]["headers"]["Accept"] == "application/json"
    assert scrubbed["extra"]["job_id"] == "j1" and scrubbed["extra"]["max_tokens"] == 16
    assert scrubbed["extra"]["usage"] == {"prompt_tokens": 3, "completionTokens": 5}
    assert scrubbed["extra"]["more"]["PWD"] == "/srv"


def test_celery_failure_logs_lose_their_task_arguments() -> None:
    # Celery logs a task failure with its arguments as parameters and as ``extra["data"]``;
    # the logging integration turns those into logentry params, extra and breadcrumb data.
    args = [{"job_id": "j1", "prompt": "secret invoice text", "sampling": {}}]
    event = {
        "logentry": {"message": "Task %(name)s[%(id)s] raised", "params": {"args": args}},
        "extra": {"data": {"args": args, "kwargs": {}, "id": "j1"}},
        "breadcrumbs": {"values": [{"category": "celery", "data": {"args": args}}]},
        "tags": {"job_id": "j1"},
    }
    scrubbed = scrub_event(event, {})
    assert "secret" not in repr(scrubbed)
    assert scrubbed["extra"]["data"]["id"] == "j1"
    assert scrubbed["logentry"]["message"] == "Task %(name)s[%(id)s] raised"
    assert scrubbed["tags"] == {"job_id": "j1"}


def test_urls_called_out_lose_their_path_query_and_password_in_breadcrumbs_and_messages() -> None:
    """A tenant's webhook URL is a capability (Slack's and Discord's carry their secret in the
    path, others in the query or as ``user:password@``): a process's outgoing calls become
    sentry-sdk's HTTP breadcrumbs (its httpx integration, installed here as any SDK set up
    otherwise would; its stdlib one, a default, for ``http.client``), which ride along with
    any later error event of the process; a password in a URL can reach a message (a broker
    or store URL in an error). Sent, the call's host stays, nothing else."""
    from sentry_sdk.integrations.httpx import HttpxIntegration

    from tests.receiver import Receiver

    receiver = Receiver()
    receiver.start()
    transport = _Recorded()
    options = sentry_options()  # on 3.x, with the logging integration it needs
    options["integrations"] = [*options.get("integrations", []), HttpxIntegration()]
    client = sentry_sdk.Client(
        dsn="https://key@sentry.invalid/1", transport=transport, release="test", **options
    )
    hook = f"http://hook-user:{CREDENTIAL}-pw@127.0.0.1:{receiver.port}"
    hook += f"/services/T0/{CREDENTIAL}-path?token={CREDENTIAL}-query#{CREDENTIAL}-fragment"
    log = logging.getLogger("lorafleet.telemetry-test")
    try:
        with sentry_sdk.isolation_scope() as scope:
            scope.set_client(client)
            assert httpx.post(hook, content=b"{}", timeout=10).status_code == 200
            log.error("store unreachable at %s", f"redis://:{CREDENTIAL}-redis@10.0.0.7:6379/0")
            client.flush(timeout=5)
    finally:
        client.close()
        receiver.stop()
    events = [item.payload.json for envelope in transport.envelopes for item in envelope.items]
    assert len(events) == 1, events
    (event,) = events
    sent = json.dumps(event)
    assert CREDENTIAL not in sent, sent
    (crumb,) = [c for c in event["breadcrumbs"]["values"] if c.get("type") == "http"]
    data = crumb["data"]
    assert data["url"] == f"http://127.0.0.1:{receiver.port}/{SCRUBBED}"
    status = data.get("http.response.status_code", data.get("status_code"))  # 3.x / 2.x
    assert data["http.method"] == "POST" and status == 200
    # Where the message was (a password is not all of it): the host of the store stays.
    assert "10.0.0.7:6379" in sent


def test_passwords_in_urls_anywhere_and_http_breadcrumb_urls_are_cut() -> None:
    event = {
        "message": "broker rediss://lorafleet:p@ss:w0rd@redis.internal:6380/0 refused",
        "exception": {"values": [{"value": "cannot reach https://u:hunter2@s3.example/b"}]},
        "tags": {"store": "redis://:hunter2@10.0.0.7:6379"},
        "extra": {"sys.argv": ["celery", "--broker", "redis://:hunter2@h:1/0"]},
        "breadcrumbs": {
            "values": [
                {
                    "type": "http",
                    "data": {"url": "https://[::1]:8443/hook/x?t=1", "http.query": "t=1"},
                },
                {"type": "http", "data": {"url": "https://hooks.example/", "http.fragment": ""}},
                {"type": "http", "data": {"url": "not a url"}},
                {"type": "default", "message": "https://docs.example/a/b stays"},
            ]
        },
    }
    scrubbed = scrub_event(event, {})
    assert "hunter2" not in repr(scrubbed) and "w0rd" not in repr(scrubbed)
    assert (
        scrubbed["message"] == f"broker rediss://lorafleet:{SCRUBBED}@redis.internal:6380/0 refused"
    )
    assert scrubbed["tags"] == {"store": f"redis://:{SCRUBBED}@10.0.0.7:6379"}
    crumbs = scrubbed["breadcrumbs"]["values"]
    assert crumbs[0]["data"] == {"url": f"https://[::1]:8443/{SCRUBBED}", "http.query": SCRUBBED}
    assert crumbs[1]["data"] == {"url": "https://hooks.example", "http.fragment": ""}
    assert crumbs[2]["data"] == {"url": SCRUBBED}
    # Not a call made by the process, and no password: a URL in a message stays as written,
    # and so does a port or a path with an "@" in it.
    assert crumbs[3]["message"] == "https://docs.example/a/b stays"
    glued = scrub_event({"message": "dsn=_redis://:hunter2@h:1"}, {})["message"]
    assert glued == f"dsn=_redis://:{SCRUBBED}@h:1"
    kept = "http://host:8080/a@b and mailto:x@y"
    assert scrub_event({"message": kept}, {})["message"] == kept


def test_each_request_and_job_reports_its_errors_with_its_own_tags() -> None:
    """The isolation the Celery and Starlette integrations gave (they are off): two requests
    served at once through ``gateway.error_scope.ErrorScope``, each setting its own tags,
    interleaved; the one that fails is reported once, with its own tenant and route, never
    the other's; an expected exception (``Reject``, control flow) leaves ``error_scope``
    unreported; and tags set inside a scope do not outlive it."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from contracts.telemetry import error_scope
    from gateway.error_scope import ErrorScope

    both_tagged = asyncio.Event()
    tagged: set[str] = set()

    async def serve(request: Request) -> PlainTextResponse:
        tenant = request.path_params["tenant"]
        sentry_sdk.set_tag("tenant", tenant)
        tagged.add(tenant)
        if len(tagged) == 2:
            both_tagged.set()
        await both_tagged.wait()  # the other request has set its tag meanwhile
        if tenant == "acme":
            raise RuntimeError("engine refused")
        return PlainTextResponse("ok")

    app = ErrorScope(Starlette(routes=[Route("/v1/{tenant}", serve, methods=["POST"])]))
    transport = _Recorded()
    client = sentry_sdk.Client(
        dsn="https://key@sentry.invalid/1", transport=transport, release="test", **sentry_options()
    )

    async def two_requests() -> list[int | BaseException]:
        asgi = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=asgi, base_url="http://gateway") as http:
            answers = await asyncio.gather(
                http.post("/v1/acme"), http.post("/v1/globex"), return_exceptions=True
            )
        return [a.status_code if isinstance(a, httpx.Response) else a for a in answers]

    try:
        with sentry_sdk.isolation_scope() as scope:
            scope.set_client(client)
            # What a pool thread's scope holds of its earlier units: no scope starts with it.
            sentry_sdk.add_breadcrumb(message="task run_job[j-earlier] succeeded")
            assert asyncio.run(two_requests()) == [500, 200]
            try:
                with error_scope(expected=(LookupError,)):
                    sentry_sdk.set_tag("job_id", "j-handed-back")
                    raise KeyError("handed back")
            except KeyError:
                pass
            sentry_sdk.capture_message("after the scopes")
            client.flush(timeout=5)
    finally:
        client.close()
    events = [item.payload.json for envelope in transport.envelopes for item in envelope.items]
    crashed = [event for event in events if event.get("exception")]
    assert len(crashed) == 1, events
    assert crashed[0]["tags"]["tenant"] == "acme"
    assert crashed[0]["tags"]["http.path"] == "/v1/acme"
    assert crashed[0]["tags"]["http.method"] == "POST"
    assert "j-earlier" not in json.dumps(crashed[0])
    (after,) = [event for event in events if not event.get("exception")]
    assert not {"tenant", "job_id", "http.path"} & set(after.get("tags", {})), after
