from __future__ import annotations

import logging
from typing import Any

import sentry_sdk
from sentry_sdk.transport import Transport

from contracts.telemetry import SCRUBBED, scrub_event, sentry_options

SECRET = "secret invoice text 7f3a"


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


def test_sentry_options_send_no_prompt_body_locals_or_info_logs_on_the_installed_sdk() -> None:
    # A real client with the options, as ``sentry_sdk.init`` builds one (an unknown option is
    # a TypeError there; sentry-sdk 3 removed two that 2 had): CI installs the newest allowed
    # SDK, and this checks whichever is installed.
    transport = _Recorded()
    client = sentry_sdk.Client(
        dsn="https://key@sentry.invalid/1", transport=transport, **sentry_options()
    )
    log = logging.getLogger("lorafleet.telemetry-test")
    log.setLevel(logging.INFO)
    try:
        with sentry_sdk.isolation_scope() as scope:
            scope.set_client(client)
            log.info("job %s started", "j-info")
            log.error("job %s could not be stored", "j-error")
            try:
                _fails_with_the_prompt_in_a_local(SECRET)
            except RuntimeError as exc:
                sentry_sdk.capture_exception(exc)
            client.flush(timeout=5)
    finally:
        client.close()
    items = [item for envelope in transport.envelopes for item in envelope.items]
    sent = b"".join(item.get_bytes() for item in items)
    assert SECRET.encode() not in sent and SECRET.upper().encode() not in sent
    events = [item.payload.json for item in items if item.type == "event"]
    # 2.x turned error logs into events by default; 3.x does only when told (as here).
    assert any("j-error" in repr(event.get("logentry")) for event in events), events
    assert not any("j-info" in repr(event.get("logentry")) for event in events)
    # 3.x ships every INFO log as a Sentry log, unseen by ``before_send``: none here.
    assert b"j-info" not in b"".join(item.get_bytes() for item in items if item.type != "event")
    crashed = [event for event in events if event.get("exception")]
    assert crashed, events
    frames = crashed[0]["exception"]["values"][-1]["stacktrace"]["frames"]
    assert frames and all("vars" not in frame for frame in frames)


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
