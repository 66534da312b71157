"""One tenant's request costs that request only: files are capped per tenant and checked
against their purpose, JSONL is read by its own rules, a batch that can never be admitted
says so, and a huge request never stalls the gateway for anyone else.

Against an in-process gateway on the private database (no worker needed)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from redis import Redis

from contracts.jobs import MAX_PROMPT_CHARS, Sampling
from contracts.queues import Tier
from contracts.registry import AdapterRecord
from gateway.routes import batches as batch_routes
from gateway.submit import INLINE_PROMPT_CHARS, Submission, Submitter, _size
from lorafleet.client import auth_headers
from lorafleet.registry import Registry
from lorafleet.stack import LocalStack
from tests.gateway.conftest import NOTHING, admitted_state

JSONL = {"content-type": "application/jsonl"}


def _alias(published: dict[str, AdapterRecord], tier: Tier = Tier.COLD) -> str:
    return next(r.alias for r in published.values() if r.tier == tier)


def _openai_line(adapter: str, custom_id: str, prompt: str = "hi") -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": adapter, "prompt": prompt, "max_tokens": 4},
    }


def _upload(http: httpx.Client, content: bytes, purpose: str = "batch") -> httpx.Response:
    return http.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": purpose})


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code, error
    return error


def test_jsonl_lines_end_at_newlines_only_and_every_bad_line_is_reported(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    adapter = _alias(published)

    def line(prompt: str) -> bytes:
        return json.dumps({"adapter": adapter, "prompt": prompt}, ensure_ascii=False).encode()

    # Characters str.splitlines() breaks on, inside prompts: one line each, not several.
    separators = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"]
    good = b"\xef\xbb\xbf" + b"\r\n".join(line(f"a{sep}b") for sep in separators) + b"\r\n"
    bad = b"\n".join(
        [
            line("fine"),
            line("h").replace(b"h", b"h\xff"),  # 2: invalid UTF-8
            b"{" * 3,  # 3: not JSON
            line("fine"),
            json.dumps({"adapter": adapter, "prompt": "x", "deep": [[[[[[[[]]]]]]]]})
            .encode()
            .replace(b"[[[[[[[[]]]]]]]]", b"[" * 5000 + b"]" * 5000),  # 5: too deep
            b'{"adapter": "%s", "prompt": NaN}' % adapter.encode(),  # 6: not JSON
            b"\xef\xbb\xbf" + line("fine"),  # 7: a BOM is only accepted at the very start
        ]
    )
    key = tenant_key("acme")
    with (
        private_gateway() as url,
        httpx.Client(base_url=url, headers=auth_headers(key), timeout=60) as http,
    ):
        refused = http.post("/v1/batches", content=bad, headers=JSONL)
        error = _error(refused, 422, "batch_invalid")
        assert [d["line"] for d in error["details"]] == [2, 3, 5, 6, 7], error["details"]
        assert "UTF-8" in error["details"][0]["message"]
        assert "5 of 7" in error["message"]
        assert admitted_state(private_redis, "acme") == NOTHING

        accepted = http.post("/v1/batches", content=good, headers=JSONL)
        assert accepted.status_code == 202, accepted.text
        assert accepted.json()["request_counts"]["total"] == len(separators)
        jobs = [
            json.loads(entry)
            for entry in http.get(f"/v1/batches/{accepted.json()['id']}/results").text.split("\n")
            if entry
        ]
        assert [j["custom_id"] for j in jobs] == [str(n) for n in range(1, len(separators) + 1)]


def test_a_batch_that_can_never_be_admitted_is_refused_for_good(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    adapter = _alias(published)
    small = tenant_key("small", max_concurrent=3)
    other = tenant_key("other")
    body = {"requests": [{"adapter": adapter, "prompt": "hi"}] * 4}
    with private_gateway(max_admitted_cold=10) as url:
        with httpx.Client(base_url=url, headers=auth_headers(small)) as http:
            error = _error(http.post("/v1/batches", json=body), 422, "batch_exceeds_limits")
            assert "may hold 3 unfinished jobs" in error["message"]
            refused = http.post("/v1/batches", json=body)
            assert "retry-after" not in refused.headers
            assert admitted_state(private_redis, "small") == NOTHING
            # Within the limit it is admitted; over the tier's limit it can never be.
            assert (
                http.post("/v1/batches", json={"requests": body["requests"][:3]}).status_code == 202
            )
        with httpx.Client(base_url=url, headers=auth_headers(other)) as http:
            many = {"requests": [{"adapter": adapter, "prompt": "hi"}] * 11}
            error = _error(http.post("/v1/batches", json=many), 422, "batch_exceeds_limits")
            assert "cold tier" in error["message"]
            # A batch that fits but not now is the retryable 429, with its Retry-After.
            fits = http.post("/v1/batches", json={"requests": body["requests"] * 2})
            assert fits.status_code == 429 and fits.headers["Retry-After"]
            assert admitted_state(private_redis, "other")["tenant_ledger"] == 0


def test_files_are_checked_against_their_purpose_and_returned_byte_for_byte(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    adapter = _alias(published)
    key = tenant_key("acme")
    lines = [json.dumps(_openai_line(adapter, f"r{n}"), ensure_ascii=False) for n in range(3)]
    exact = b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n\n"
    with (
        private_gateway() as url,
        httpx.Client(base_url=url, headers=auth_headers(key), timeout=60) as http,
    ):
        _error(_upload(http, exact, purpose="fine-tune"), 422, "validation_error")
        binary = bytes(range(256)) * 4
        _error(_upload(http, binary), 422, "batch_invalid")
        _error(_upload(http, b""), 422, "batch_invalid")
        mixed = "\n".join(
            [
                lines[0],
                json.dumps(
                    {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}
                ),
                json.dumps(
                    _openai_line(adapter, "y")
                    | {"body": {"model": adapter, "prompt": "hi", "n": 3}}
                ),
                "[1, 2",
            ]
        ).encode()
        error = _error(_upload(http, mixed), 422, "batch_invalid")
        assert [d["line"] for d in error["details"]] == [2, 3, 4]
        assert error["details"][1]["code"] == "unsupported_parameter"
        assert admitted_state(private_redis, "acme") == NOTHING

        uploaded = _upload(http, exact)
        assert uploaded.status_code == 200, uploaded.text
        file_id = uploaded.json()["id"]
        assert uploaded.json()["bytes"] == len(exact)
        assert http.get(f"/v1/files/{file_id}/content").content == exact
        openai_batch = {"input_file_id": file_id, "endpoint": "/v1/completions"}
        # OpenAI's shape with lorafleet's fields, or a window other than OpenAI's only one,
        # is refused, not half read.
        mixed_shapes = openai_batch | {"requests": [{"adapter": adapter, "prompt": "hi"}]}
        error = _error(http.post("/v1/batches", json=mixed_shapes), 422, "validation_error")
        assert "requests" in error["message"] and "input_file_id" in error["message"]
        window = openai_batch | {"completion_window": "1h"}
        error = _error(http.post("/v1/batches", json=window), 422, "validation_error")
        assert "completion_window" in error["message"]
        assert not list(private_redis.scan_iter("lorafleet:batch*"))  # nothing was created
        batch = http.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"}
        )
        assert batch.status_code == 202, batch.text
        assert batch.json()["request_counts"]["total"] == 3


def test_file_storage_is_capped_per_tenant_and_others_are_unaffected(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    adapter = _alias(published)
    content = (json.dumps(_openai_line(adapter, "a")) + "\n").encode()
    greedy, other = tenant_key("greedy"), tenant_key("other")
    with private_gateway(max_files_per_tenant=2, max_file_bytes_per_tenant=4096) as url:
        with httpx.Client(base_url=url, headers=auth_headers(greedy)) as http:
            first = _upload(http, content).json()["id"]
            assert _upload(http, content).status_code == 200
            over = _upload(http, content)
            error = _error(over, 429, "file_quota_exceeded")
            assert "2 files" in error["message"] and "retry-after" not in over.headers
            # Deleting one frees its place; bytes are capped as well as the count.
            assert http.delete(f"/v1/files/{first}").json()["deleted"] is True
            _error(http.get(f"/v1/files/{first}"), 404, "file_not_found")
            big = (json.dumps(_openai_line(adapter, "b", prompt="x" * 4000)) + "\n").encode()
            error = _error(_upload(http, big), 429, "file_quota_exceeded")
            assert "4096 bytes" in error["message"]
            assert _upload(http, content).status_code == 200
            assert len(list(private_redis.scan_iter("lorafleet:file:*"))) == 2
        with httpx.Client(base_url=url, headers=auth_headers(other)) as http:
            assert _upload(http, content).status_code == 200
            _error(http.delete(f"/v1/files/{first}"), 404, "file_not_found")


def test_a_channel_pointing_at_a_retired_alias_is_not_listed(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    alias = _alias(published, Tier.WARM)
    registry = Registry(private_redis)
    registry.set_channel("extract", alias)
    key = tenant_key("acme")
    with private_gateway() as url, httpx.Client(base_url=url, headers=auth_headers(key)) as http:
        listed = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert {"extract", alias} <= listed
        registry.retire(alias)
        listed = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert "extract" not in listed and alias not in listed
        _error(http.get("/v1/models/extract"), 404, "adapter_not_found")
        job = {"adapter": "extract", "prompt": "hi"}
        _error(http.post("/v1/jobs", json=job), 410, "adapter_retired")
    assert admitted_state(private_redis, "acme") == NOTHING


def test_chat_message_names_count_in_what_is_rendered_on_the_event_loop() -> None:
    """A chat's size decides whether it is rendered on the event loop or in a prompt thread;
    a message's ``name`` reaches the template too, so it counts."""
    messages = [{"role": "user", "content": "hi", "name": "n" * 256} for _ in range(8)]
    chat = Submission(adapter="a", sampling=Sampling(), messages=messages)
    assert _size(chat) > INLINE_PROMPT_CHARS


@pytest.mark.parametrize("route", ["/v1/batches", "/v1/chat/completions"])
def test_the_gateway_answers_others_while_a_huge_request_is_checked(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
    route: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 10 MB batch of over-long prompts (or chats as long as a body may be) is parsed,
    rendered and tokenized off the event loop: while its prompt is being checked, a probe from
    another client is answered and another tenant's job is admitted.

    The check of the huge request is held until they have been, so this does not depend on
    timing: were it on the event loop, the probe could not be answered and the test fails at
    the probe's timeout. (It used to compare probe times with the request's length, which a
    shared machine stalling the whole process for 0.66 s once failed.)"""
    adapter = _alias(published)
    prompt = "invoice total " * (MAX_PROMPT_CHARS // 14)
    if route == "/v1/batches":
        line = json.dumps({"adapter": adapter, "prompt": prompt}).encode()
        body, headers = b"\n".join([line] * (10_000_000 // len(line))), JSONL
    else:
        messages = [{"role": "user", "content": prompt[:50_000]}] * 18
        body = json.dumps({"model": adapter, "messages": messages}).encode()
        headers = {"content-type": "application/json"}

    checking, checked = threading.Event(), threading.Event()
    threads: dict[str, set[str]] = {"parse": set(), "check": set()}
    check, parse = Submitter._checked_prompt, batch_routes.jsonl

    def held_check(self: Submitter, request: Submission, *args: Any) -> Any:
        if _size(request) > INLINE_PROMPT_CHARS:  # the huge one's (the other's is small)
            threads["check"].add(threading.current_thread().name)
            if not checking.is_set():
                checking.set()
                checked.wait(60)
        return check(self, request, *args)

    def seen_parse(content: bytes) -> Any:
        threads["parse"].add(threading.current_thread().name)
        return parse(content)

    monkeypatch.setattr(Submitter, "_checked_prompt", held_check)
    monkeypatch.setattr(batch_routes, "jsonl", seen_parse)
    key = tenant_key("heavy")
    settings = {"max_batch_bytes": 16 * 1024 * 1024, "redis_timeout_s": 120.0}
    answers: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(base_url=url, headers=auth_headers(key), timeout=300) as heavy:
            answers.append(heavy.post(route, content=body, headers=headers))

    with private_gateway(**settings) as url, httpx.Client(base_url=url, timeout=20) as probe:
        sender = threading.Thread(target=send)
        sender.start()
        try:
            assert checking.wait(120), "the huge request's prompts were never checked"
            assert probe.get("/healthz").status_code == 200
            other = probe.post(
                "/v1/jobs",
                json={"adapter": adapter, "prompt": "hi", "sampling": {"max_tokens": 4}},
                headers=auth_headers(tenant_key("other")),
            )
            assert other.status_code == 202, other.text
        finally:
            checked.set()
            sender.join()
    (answer,) = answers
    code = "batch_invalid" if route == "/v1/batches" else "prompt_too_long"
    assert answer.status_code == 422 and answer.json()["error"]["code"] == code, answer.text
    # The gateway's event loop runs in the thread ``serving`` names "private-gateway".
    assert threads["check"] and all(name.startswith("prompts") for name in threads["check"])
    if route == "/v1/batches":
        assert threads["parse"] and "private-gateway" not in threads["parse"], threads
    assert admitted_state(private_redis, "heavy") == NOTHING | {
        "records": 1,
        "pool_ledgers": 1,
        "queued": 1,
        "deadlines": 1,
    }


def test_a_full_redis_refuses_admissions_with_503_and_drops_nothing(
    infra: LocalStack,
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    """The local stack's Redis has a ``maxmemory`` and ``noeviction``: once full, writes are
    refused (503, retryable) and nothing already stored is evicted."""
    server = infra.redis()
    config = server.config_get("maxmemory*")
    assert config["maxmemory-policy"] == "noeviction"
    assert int(config["maxmemory"]) == infra.settings.redis_maxmemory_bytes
    key = tenant_key("acme")
    adapter = _alias(published)
    with private_gateway() as url, httpx.Client(base_url=url, headers=auth_headers(key)) as http:
        first = http.post("/v1/jobs", json={"adapter": adapter, "prompt": "hi"})
        assert first.status_code == 202
        used = int(server.info("memory")["used_memory"])
        server.config_set("maxmemory", used // 2)
        try:
            full = http.post("/v1/jobs", json={"adapter": adapter, "prompt": "hi"})
            error = _error(full, 503, "service_unavailable")
            assert full.headers["Retry-After"] and error["message"]
            content = (json.dumps(_openai_line(adapter, "a")) + "\n").encode()
            _error(_upload(http, content), 503, "service_unavailable")
            # Reads still work: the admitted job is there, nothing was evicted.
            assert http.get(f"/v1/jobs/{first.json()['id']}").status_code == 200
        finally:
            server.config_set("maxmemory", config["maxmemory"])
    state = admitted_state(private_redis, "acme")
    assert (state["records"], state["tenant_ledger"], state["queued"]) == (1, 1, 1)
