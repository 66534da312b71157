"""What the look-ahead reads from the queues' heads: kombu envelopes as the gateway writes
them (``contracts.task_messages``), the next to be taken first, queue by queue."""

from __future__ import annotations

from contracts.task_messages import task_message
from worker.prefetch import waiting_jobs

BASE = "sha256:" + "b" * 64
OTHER = "sha256:" + "c" * 64


def _raw(job_id: str, adapter: str, base: str = BASE) -> str:
    job = {
        "job_id": job_id,
        "adapter": adapter,
        "revision": f"sha256:{adapter}",
        "base_model": {"id": "m", "digest": base},
    }
    return task_message("lorafleet.run_job", job_id, "q", [job], f"job {job_id}")


def test_the_next_job_of_each_queue_comes_first_and_other_bases_are_skipped() -> None:
    # LRANGE returns a list oldest-last as kombu LPUSHes: index -1 is taken next.
    own = [_raw("o2", "x"), _raw("o1", "y")]
    pool = [_raw("p3", "z"), _raw("p2", "w", OTHER), _raw("p1", "x")]
    assert waiting_jobs([own, pool], BASE) == [
        ("o1", "y", "sha256:y"),
        ("o2", "x", "sha256:x"),
        ("p1", "x", "sha256:x"),
        ("p3", "z", "sha256:z"),
    ]


def test_a_message_that_does_not_parse_is_skipped() -> None:
    assert waiting_jobs([["not json", '{"body": "!!"}', _raw("a", "x")]], BASE) == [
        ("a", "x", "sha256:x")
    ]
