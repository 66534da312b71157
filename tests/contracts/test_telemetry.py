from __future__ import annotations

from contracts.telemetry import SCRUBBED, SENTRY_OPTIONS, scrub_event


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


def test_sentry_options_disable_bodies_locals_and_pii() -> None:
    assert SENTRY_OPTIONS["max_request_body_size"] == "never"
    assert SENTRY_OPTIONS["include_local_variables"] is False
    assert SENTRY_OPTIONS["send_default_pii"] is False
    assert SENTRY_OPTIONS["before_send"] is scrub_event


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
