"""Large results to S3 and back, against a real S3 protocol server (moto over HTTP), worker
side (the writer, and the webhook worker's reader) and gateway side (its reader)."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from redis import Redis

from contracts.errors import ErrorCode
from contracts.jobs import (
    EngineInfo,
    JobPublic,
    JobResult,
    JobStatus,
    LoadTimings,
    ResultMetadata,
    Usage,
)
from contracts.registry import BaseModelRef
from contracts.settings import ServiceSettings
from contracts.storage import StoredResultDamaged, encode_result, longest_call_s
from gateway.errors import ApiError
from gateway.result_store import ResultReader
from lorafleet.processes import free_port
from lorafleet.stack import LOCAL_AWS, LocalStack, s3_client
from tests.helpers import new_job
from tests.sockets import tcp_server
from worker.result_store import WRITE_BUDGET_S, ResultStore, may_exceed
from worker.webhooks.config import WebhookSettings
from worker.webhooks.deliver import Deliverer, _for_good

LIMIT = 512


def _result(tokens: int) -> JobResult:
    return JobResult(
        text="word " * tokens,
        token_ids=[1000 + n for n in range(tokens)],
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=tokens, total_tokens=3 + tokens),
    )


def _metadata() -> ResultMetadata:
    return ResultMetadata(
        adapter="a",
        revision="sha256:x",
        loaded_digest="sha256:x",
        identity_verified=True,
        base_model=BaseModelRef(id="b", digest="sha256:b"),
        residency_before="gpu",
        load_ms=LoadTimings(),
        queue_wait_ms=1,
        ttft_ms=1,
        e2e_ms=2,
        worker="w",
        engine=EngineInfo(name="vllm", version="0"),
    )


def _job(result: JobResult | None, metadata: ResultMetadata) -> JobPublic:
    """A succeeded job of tenant ``acme`` (``tests.helpers.new_job``)."""
    return new_job(status=JobStatus.SUCCEEDED, tenant="acme", result=result, metadata=metadata)


@pytest.fixture
def store(s3: Any, infra: LocalStack) -> ResultStore:
    return ResultStore(s3, infra.settings.s3_bucket, LIMIT)


@pytest.fixture
def reader(infra: LocalStack, monkeypatch: pytest.MonkeyPatch) -> Iterator[ResultReader]:
    for name, value in LOCAL_AWS.items():
        monkeypatch.setenv(name, value)
    settings = ServiceSettings(
        s3_endpoint_url=infra.s3_endpoint_url, s3_bucket=infra.settings.s3_bucket
    )
    reader = ResultReader(settings)
    yield reader
    reader.close()


def test_the_size_bound_is_never_below_the_encoded_size() -> None:
    # Characters JSON escapes (6 bytes), 4-byte UTF-8, plain ASCII; token ids of every width.
    alphabet = ["\x00", "\x1f", '"', "\\", "a", "é", "€", "𝄞", "\n"]
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randrange(0, 80)
        result = JobResult(
            text="".join(rng.choice(alphabet) for _ in range(n)),
            token_ids=[rng.randrange(0, 2**31) for _ in range(rng.randrange(0, 40))],
            finish_reason=rng.choice([None, "stop", "length"]),
            usage=Usage(prompt_tokens=2**31, completion_tokens=2**31, total_tokens=2**32),
        )
        size = encode_result("t", result)[0].size_bytes
        assert may_exceed(result, size - 1), (size, result)


def test_a_small_result_stays_in_the_record(store: ResultStore, s3: Any) -> None:
    small = _result(4)
    kept, metadata = store.place("acme", small, _metadata())
    assert kept == small and metadata.result_stored is None


def test_a_job_near_its_deadline_keeps_its_result_in_redis(store: ResultStore) -> None:
    large = _result(200)
    kept, metadata = store.place("acme", large, _metadata(), budget_s=WRITE_BUDGET_S - 1)
    assert kept == large and metadata.result_stored is None


def test_the_webhook_worker_gives_up_only_on_what_asking_again_cannot_mend() -> None:
    def client_error(status: int, code: str) -> ClientError:
        response: Any = {"Error": {"Code": code}, "ResponseMetadata": {}}
        response["ResponseMetadata"]["HTTPStatusCode"] = status
        return ClientError(response, "GetObject")

    assert _for_good(client_error(404, "NoSuchKey"))
    assert _for_good(client_error(403, "AccessDenied"))
    assert _for_good(StoredResultDamaged("other bytes"))
    assert not _for_good(client_error(403, "RequestTimeTooSkewed"))
    assert not _for_good(client_error(403, "SignatureDoesNotMatch"))
    assert not _for_good(client_error(503, "SlowDown"))
    assert not _for_good(client_error(500, "InternalError"))
    assert not _for_good(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))


def test_a_large_result_goes_to_s3_and_every_reader_gets_it_back(
    store: ResultStore, reader: ResultReader, s3: Any, infra: LocalStack
) -> None:
    large = _result(200)
    kept, metadata = store.place("acme", large, _metadata())
    stored = metadata.result_stored
    assert kept is None and stored is not None
    assert stored.size_bytes > LIMIT and stored.key.startswith("results/acme/sha256/")
    body = s3.get_object(Bucket=infra.settings.s3_bucket, Key=stored.key)["Body"].read()
    assert body == encode_result("acme", large)[1]

    record = _job(None, metadata)
    assert store.read(record).result == large  # the webhook worker's read
    assert asyncio.run(reader.read(record)).result == large  # the gateway's
    inline = _job(large, _metadata())
    assert asyncio.run(reader.read(inline)) is inline  # nothing to read


def test_a_missing_or_damaged_object_is_an_error_not_a_wrong_result(
    store: ResultStore, reader: ResultReader, s3: Any, infra: LocalStack
) -> None:
    _, metadata = store.place("acme", _result(300), _metadata())
    stored = metadata.result_stored
    assert stored is not None
    record = _job(None, metadata)
    bucket = infra.settings.s3_bucket

    s3.put_object(Bucket=bucket, Key=stored.key, Body=b'{"text": "forged"}')
    with pytest.raises(StoredResultDamaged):
        store.read(record)
    with pytest.raises(ApiError) as damaged:
        asyncio.run(reader.read(record))
    assert damaged.value.status_code == 500 and damaged.value.code == ErrorCode.INTERNAL_ERROR
    assert "damaged" in damaged.value.message

    s3.delete_object(Bucket=bucket, Key=stored.key)
    with pytest.raises(ApiError) as gone:
        asyncio.run(reader.read(record))
    assert gone.value.status_code == 500 and stored.key in gone.value.message
    assert "LORAFLEET_JOB_TTL_S" in gone.value.message


def test_an_unreachable_store_keeps_the_result_in_redis_and_is_a_503_to_readers(
    monkeypatch: pytest.MonkeyPatch, infra: LocalStack
) -> None:
    for name, value in LOCAL_AWS.items():
        monkeypatch.setenv(name, value)
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = ServiceSettings(s3_endpoint_url=nowhere, s3_max_attempts=1)
    down = ResultStore(
        s3_client(nowhere, settings.s3_region, local=True), settings.s3_bucket, LIMIT
    )
    large = _result(200)
    kept, metadata = down.place("acme", large, _metadata())
    assert kept == large and metadata.result_stored is None  # the outcome is not lost

    stored, _ = encode_result("acme", large)
    record = _job(None, _metadata().model_copy(update={"result_stored": stored}))
    reader = ResultReader(settings)
    with pytest.raises(ApiError) as unreachable:
        asyncio.run(reader.read(record))
    reader.close()
    assert unreachable.value.status_code == 503
    assert unreachable.value.code == ErrorCode.SERVICE_UNAVAILABLE
    assert unreachable.value.headers and "Retry-After" in unreachable.value.headers


@pytest.mark.parametrize("timeout_s", [0.5, 10.0, 60.0])
def test_a_webhook_attempt_reading_a_stored_result_ends_within_its_events_lease(
    timeout_s: float,
) -> None:
    # Past the lease the dispatcher hands the event to another attempt: a read that could
    # stall longer than the lease leaves (read + POST) would let both attempts POST.
    settings = WebhookSettings(webhook_timeout_s=timeout_s)
    deliverer = Deliverer(Redis(), settings)  # Redis is not asked here
    try:
        client = deliverer._result_store()._s3
        assert longest_call_s(client) + settings.webhook_timeout_s < settings.lease_s
    finally:
        deliverer.close()


def _stall(conn: socket.socket) -> None:
    """An S3 endpoint that takes a request and never answers (until the test closes it)."""
    try:
        while conn.recv(65536):
            pass
    except OSError:
        pass


def _stalled_record() -> JobPublic:
    stored, _ = encode_result("acme", _result(200))
    return _job(None, _metadata().model_copy(update={"result_stored": stored}))


def test_a_gateway_read_of_a_stalled_store_is_a_503_within_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in LOCAL_AWS.items():
        monkeypatch.setenv(name, value)
    with tcp_server(_stall) as (port, _):
        settings = ServiceSettings(s3_endpoint_url=f"http://127.0.0.1:{port}")
        reader = ResultReader(settings, budget_s=0.5)
        try:
            with pytest.raises(ApiError) as stalled:
                asyncio.run(reader.read(_stalled_record()))
            # The one bound is the budget (a request's), not botocore's retries.
            assert stalled.value.status_code == 503
            assert "no answer within 0.5 s" in stalled.value.message
            # And the thread left behind ends within seconds, whatever the settings.
            assert longest_call_s(reader._s3()) < 30
        finally:
            reader.close()


def test_reads_past_the_waiting_bound_are_refused_at_once_and_the_bound_is_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in LOCAL_AWS.items():
        monkeypatch.setenv(name, value)

    async def go(reader: ResultReader) -> list[str]:
        record = _stalled_record()
        waiting = [asyncio.ensure_future(reader.read(record)) for _ in range(2)]
        await asyncio.sleep(0)  # both have started and wait on the stalled store
        messages = []
        with pytest.raises(ApiError) as refused:
            await reader.read(record)
        messages.append(refused.value.message)
        assert not any(task.done() for task in waiting)  # refused while they still wait
        for task in waiting:
            with pytest.raises(ApiError) as stalled:
                await task
            messages.append(stalled.value.message)
        with pytest.raises(ApiError) as after:  # the bound was released: it waits again
            await reader.read(record)
        messages.append(after.value.message)
        return messages

    with tcp_server(_stall) as (port, _):
        settings = ServiceSettings(s3_endpoint_url=f"http://127.0.0.1:{port}")
        reader = ResultReader(settings, budget_s=1.0, max_waiting=2)
        try:
            refused, *stalled, after = asyncio.run(go(reader))
        finally:
            reader.close()
    assert "2 reads of it waiting already" in refused
    assert all("no answer within 1 s" in message for message in [*stalled, after])
