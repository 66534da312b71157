"""Whatever a client sends, the answer is a 4xx in our envelope with a stable code, and a
refused request leaves nothing behind (no record, no ledger entry, nothing queued).

Against an in-process gateway on the private database (no worker needed)."""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from redis import Redis

from contracts.queues import Tier, queue_for
from contracts.registry import AdapterRecord
from gateway.http_protocol import MAX_HEAD_BYTES
from lorafleet.client import auth_headers
from tests.gateway.conftest import NOTHING, admitted_state

DEEP = "[" * 5000 + "]" * 5000
SHALLOW_BUT_TOO_DEEP = "[" * 40 + "]" * 40


def _cold(published: dict[str, AdapterRecord]) -> str:
    return next(r.alias for r in published.values() if r.tier == Tier.COLD)


@pytest.fixture
def http(
    private_gateway: Callable[..., Any], tenant_key: Callable[..., str]
) -> Iterator[httpx.Client]:
    """A client of a private gateway as tenant ``acme``; completions give up at once (no
    worker runs their jobs), so an accepted one answers 504 ``timeout``."""
    key = tenant_key("acme")
    with (
        private_gateway(completion_timeout_s=0.2) as url,
        httpx.Client(base_url=url, headers=auth_headers(key), timeout=60) as client,
    ):
        yield client


def _refused(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"] and error["type"]
    return error


# Each route's body with VALUE in a field it ignores or does not read deeply.
TEMPLATES = {
    "/v1/jobs": '{"adapter": "ADAPTER", "prompt": "hi", "sampling": VALUE}',
    "/v1/completions": '{"model": "ADAPTER", "prompt": "hi", "user": VALUE}',
    "/v1/chat/completions": (
        '{"model": "ADAPTER", "messages": [{"role": "user", "content": "hi"}], "metadata": VALUE}'
    ),
    "/v1/batches": '{"requests": [{"adapter": "ADAPTER", "prompt": "hi"}], "metadata": VALUE}',
}

HOSTILE: dict[str, Callable[[str], bytes]] = {
    "invalid UTF-8": lambda shaped: shaped.replace("VALUE", "{}").encode().replace(b"hi", b"h\xff"),
    "deep nesting in a field the route ignores": lambda shaped: shaped.replace(
        "VALUE", DEEP
    ).encode(),
    "nesting past the bound": lambda shaped: shaped.replace("VALUE", SHALLOW_BUT_TOO_DEEP).encode(),
    "NaN": lambda shaped: shaped.replace("VALUE", "NaN").encode(),
    "-Infinity": lambda shaped: shaped.replace("VALUE", "-Infinity").encode(),
    "1e400": lambda shaped: shaped.replace("VALUE", "1e400").encode(),
    "a 5000-digit integer": lambda shaped: shaped.replace("VALUE", "9" * 5000).encode(),
    "not JSON": lambda shaped: shaped.replace("VALUE", "{").encode(),
    "trailing garbage": lambda shaped: shaped.replace("VALUE", "{}").encode() + b"x",
    "a lone surrogate escape": lambda shaped: shaped.replace("VALUE", '"\\udcff"').encode(),
    # Another reader (a proxy, a log pipeline) may keep the first where Python keeps the last.
    "a key sent twice": lambda shaped: (
        shaped.replace("VALUE", "{}").replace("{", '{"user": "a", "user": "b", ', 1).encode()
    ),
}


@pytest.mark.parametrize("route", list(TEMPLATES))
def test_no_hostile_json_body_is_a_500_or_leaves_anything(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord], route: str
) -> None:
    shaped = TEMPLATES[route].replace("ADAPTER", _cold(published))
    for name, make in HOSTILE.items():
        response = http.post(
            route, content=make(shaped), headers={"content-type": "application/json"}
        )
        error = _refused(response, 422, "validation_error")
        assert "body" in error["message"], (name, error)
    assert admitted_state(private_redis, "acme") == NOTHING


def test_a_deeply_nested_body_without_a_content_type_is_refused_too(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    body = TEMPLATES["/v1/completions"].replace("ADAPTER", _cold(published)).replace("VALUE", DEEP)
    response = http.post("/v1/completions", content=body.encode(), headers={"content-type": ""})
    _refused(response, 422, "validation_error")
    assert admitted_state(private_redis, "acme") == NOTHING


def test_framework_errors_come_in_our_envelope(http: httpx.Client) -> None:
    error = _refused(http.get("/v1/no-such-route"), 404, "route_not_found")
    assert "/v1/no-such-route" in error["message"]
    assert error["type"] == "not_found_error"
    error = _refused(http.delete("/v1/models"), 405, "method_not_allowed")
    assert "DELETE" in error["message"]
    _refused(httpx.get(str(http.base_url).rstrip("/") + "/v1/nothing"), 404, "route_not_found")
    # A multipart body the parser cannot read.
    broken = http.post(
        "/v1/files",
        content=b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch',
        headers={"content-type": "multipart/form-data; boundary=xyz"},
    )
    assert broken.status_code == 422 and broken.json()["error"]["code"] == "validation_error"


def test_who_asks_and_where_come_before_what_the_body_holds(http: httpx.Client) -> None:
    """Without a key, a POST to a route is 401 before its body is read, whatever the body
    (a multipart one the parser cannot read included); a body to a path with no such route
    is 404, and to a route that takes no such method 405, whatever the body."""
    base = str(http.base_url).rstrip("/")
    multipart = {"content-type": "multipart/form-data; boundary=xyz"}
    unreadable = b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch'
    for route, headers in [
        ("/v1/files", multipart),
        ("/v1/jobs", {"content-type": "application/json"}),
        ("/v1/batches", {"content-type": "application/jsonl"}),
        ("/v1/batches/batch_x/cancel", {}),
    ]:
        response = httpx.post(base + route, content=unreadable, headers=headers)
        _refused(response, 401, "unauthorized")
    for route in ("/v1/nope", "/v1/jobs/extra/path"):
        _refused(http.post(route, content=b"{"), 404, "route_not_found")
    _refused(http.put("/v1/jobs", content=b"{"), 405, "method_not_allowed")
    _refused(http.patch("/v1/completions", content=b'{"a": NaN}'), 405, "method_not_allowed")
    # Nor is it waited for: a body that never arrives whole is not read at all.
    address = http.base_url
    for route in ("/v1/jobs", "/v1/batches", "/v1/files"):
        for credential in ("", "Authorization: Bearer nope\r\n"):
            head = (
                f"POST {route} HTTP/1.1\r\nHost: gateway\r\n{credential}"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            ).encode()
            with socket.create_connection((address.host, address.port), timeout=60) as held:
                held.sendall(head + b'{"adapter"')  # and nothing more
                answer = b""
                while chunk := held.recv(65536):  # until the gateway closes it
                    answer += chunk
            status, _, rest = answer.partition(b"\r\n")
            assert status == b"HTTP/1.1 401 Unauthorized", answer  # not 408 after 30 s
            headers, _, payload = rest.partition(b"\r\n\r\n")
            assert b"connection: close" in headers.lower(), answer
            assert json.loads(payload)["error"]["code"] == "unauthorized", answer


def test_a_long_value_a_caller_sent_is_quoted_cut_in_the_error_message(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    long = "x" * 100_000
    chat = [{"role": "user", "content": "hi"}]
    refusals = [
        (http.post("/v1/completions", json={"model": long, "prompt": "hi"}), 404),
        (http.post("/v1/chat/completions", json={"model": long, "messages": chat}), 404),
        (
            http.post("/v1/completions", json={"model": _cold(published), "prompt": "hi", long: 1}),
            422,
        ),
        (
            http.post(
                "/v1/completions",
                json={"model": _cold(published), "prompt": "hi", "logit_bias": {long: 1}},
            ),
            422,
        ),
        (http.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": long}), 422),
        # Paths long but inside the head's bound (16 KiB): past it the head is refused, 431.
        (http.get("/v1/" + "y" * 12_000), 404),
        (http.get("/v1/models/" + "m" * 12_000), 404),
        (http.post("/v1/jobs", json={"adapter": "a", "prompt": "hi", long: 1}), 422),
    ]
    for response, status in refusals:
        assert response.status_code == status, response.text[:300]
        message = response.json()["error"]["message"]
        assert len(message) < 400 and "..." in message, message[:400]
        assert len(response.content) < 2000, response.text[:2000]  # its param, its details
    assert admitted_state(private_redis, "acme") == NOTHING


@pytest.mark.parametrize("route", list(TEMPLATES))
def test_a_json_body_sent_as_another_media_type_is_415(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord], route: str
) -> None:
    """``curl -d`` sends form-urlencoded: the answer says what to send instead of a schema
    error about the body not being an object (and a batch is not read as JSON regardless)."""
    body = TEMPLATES[route].replace("ADAPTER", _cold(published)).replace("VALUE", "null")
    base = str(http.base_url).rstrip("/")
    for media_type in ("application/x-www-form-urlencoded", "text/plain; charset=utf-8"):
        headers = {"content-type": media_type}
        error = _refused(
            http.post(route, content=body, headers=headers), 415, "unsupported_media_type"
        )
        assert (
            "application/json" in error["message"] and media_type.split(";")[0] in error["message"]
        )
        _refused(httpx.post(base + route, content=body, headers=headers), 401, "unauthorized")
    put = http.put(route, content=body, headers={"content-type": "text/plain"})
    _refused(put, 405, "method_not_allowed")  # the method is what is wrong
    assert admitted_state(private_redis, "acme") == NOTHING


@pytest.mark.parametrize("body", [b"A" * 500_000, b"\xff\xfe", b'{"a": NaN}', b"{"])
def test_an_unreadable_body_without_a_key_is_401_not_422(http: httpx.Client, body: bytes) -> None:
    base = str(http.base_url).rstrip("/")
    for headers in ({}, {"authorization": "Basic abc"}, {"authorization": "Bearer nope"}):
        response = httpx.post(f"{base}/v1/jobs", content=body, headers=headers)
        _refused(response, 401, "unauthorized")
        assert response.headers["www-authenticate"] == "Bearer"
    # With a key, the body is what is wrong.
    _refused(http.post("/v1/jobs", content=body), 422, "validation_error")
    # Sent twice, the header is read as the routes read it (the first one): a key.
    twice = [("authorization", http.headers["authorization"]), ("authorization", "Bearer nope")]
    _refused(httpx.post(f"{base}/v1/jobs", content=body, headers=twice), 422, "validation_error")
    # Read as the routes read it, spaces and all.
    spaced = {"authorization": http.headers["authorization"].replace(" ", "  ", 1)}
    _refused(httpx.post(f"{base}/v1/jobs", content=body, headers=spaced), 422, "validation_error")


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/completions"])
def test_an_empty_idempotency_key_is_refused(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord], route: str
) -> None:
    adapter = _cold(published)
    body = (
        {"adapter": adapter, "prompt": "hi"}
        if route == "/v1/jobs"
        else {"model": adapter, "prompt": "hi"}
    )
    for key in ("", "k" * 256):
        response = http.post(route, json=body, headers={"Idempotency-Key": key})
        error = _refused(response, 422, "validation_error")
        assert "Idempotency-Key" in error["message"], error
    assert admitted_state(private_redis, "acme") == NOTHING


def test_over_long_and_non_finite_query_parameters_are_refused(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    line = json.dumps({"adapter": _cold(published), "prompt": "hi"}).encode()
    jsonl = {"content-type": "application/jsonl"}
    for params in (
        {"webhook_url": "https://example.com/" + "a" * 3000},
        {"webhook_url": "https://" + "a" * 100 + ".example.com/hook"},  # IDNA can't encode it
        {"webhook_url": ""},
        {"deadline_s": "nan"},
        {"deadline_s": "-1"},
        {"deadline_s": "1e999"},
    ):
        response = http.post("/v1/batches", content=line, params=params, headers=jsonl)
        assert response.status_code == 422, (params, response.text)
        assert response.json()["error"]["code"] in ("validation_error", "webhook_url_forbidden")
    for wait in ("nan", "inf", "1e999", "-1", "x" * 5000):
        _refused(http.get("/v1/jobs/abc", params={"wait_s": wait}), 422, "validation_error")
    error = _refused(http.get("/v1/jobs/abc", params={"wait_s": "nan"}), 422, "validation_error")
    assert "finite" in error["message"], error
    for path, code in (("jobs", "job_not_found"), ("files", "file_not_found")):
        error = _refused(http.get(f"/v1/{path}/" + "x" * 5000), 404, code)
        assert len(error["message"]) < 200 and "(5000 characters)" in error["message"]
    error = _refused(http.get("/v1/batches/" + "x" * 5000), 404, "batch_not_found")
    assert len(error["message"]) < 200
    assert admitted_state(private_redis, "acme") == NOTHING


def _queued_sampling(redis: Redis) -> dict[str, Any]:
    """The sampling of the one message queued on the cold tier (kombu's envelope)."""
    (queue,) = redis.scan_iter(f"{queue_for(Tier.COLD, '')[:-1]}*")
    (raw,) = redis.lrange(queue, 0, -1)  # type: ignore[misc]
    envelope = json.loads(raw)
    import base64

    args = json.loads(base64.b64decode(envelope["body"]))[0]
    sampling: dict[str, Any] = args[0]["sampling"]
    return sampling


NEUTRAL = [
    {"logprobs": False},
    {"logprobs": 0},
    {"top_logprobs": 0},
    {"tools": []},
    {"tool_choice": "none"},
    {"functions": []},
    {"response_format": {"type": "text"}},
    {"n": 1, "best_of": 1, "echo": False, "suffix": None, "logit_bias": {}},
    {"user": "someone", "metadata": {"a": "b"}, "store": False},
]


@pytest.mark.parametrize("extra", NEUTRAL, ids=lambda e: ",".join(e))
def test_neutral_openai_parameters_are_accepted(
    http: httpx.Client,
    private_redis: Redis,
    published: dict[str, AdapterRecord],
    extra: dict[str, Any],
) -> None:
    body = {"model": _cold(published), "prompt": "hi", "max_tokens": 4} | extra
    response = http.post("/v1/completions", json=body)
    # Admitted and enqueued: no worker runs it here, so the wait ends in 504 timeout.
    _refused(response, 504, "timeout")
    assert admitted_state(private_redis, "acme")["queued"] == 1


def test_an_assistant_message_sent_back_as_a_client_received_it_is_accepted(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    """Clients send the assistant message they were given back in the next turn, with the
    fields OpenAI returns empty (and a participant's ``name``): none changes the output."""
    received = {
        "role": "assistant",
        "content": "four",
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }
    body = {
        "model": _cold(published),
        "messages": [
            {"role": "user", "content": "what is 2+2?", "name": "ann"},
            received,
            {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]},
        ],
        "stream_options": None,
    }
    body["messages"][1] |= {"reasoning_content": None, "reasoning": None}  # as vLLM answers
    _refused(http.post("/v1/chat/completions", json=body), 504, "timeout")
    assert admitted_state(private_redis, "acme")["queued"] == 1
    body = {"model": _cold(published), "prompt": "hi", "stream": True}
    for options in (
        {"include_usage": False},
        {"include_usage": True, "include_obfuscation": False},
    ):
        with http.stream("POST", "/v1/completions", json=body | {"stream_options": options}) as r:
            assert r.status_code == 200, r.read()
    assert admitted_state(private_redis, "acme")["queued"] == 3


def test_output_changing_parameters_reach_the_engine_request(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    body = {
        "model": _cold(published),
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 6,
        "min_tokens": 3,
        "top_k": 5,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.3,
    }
    _refused(http.post("/v1/chat/completions", json=body), 504, "timeout")
    sampling = _queued_sampling(private_redis)
    assert {k: sampling[k] for k in ("max_tokens", "min_tokens", "top_k", "min_p")} == {
        "max_tokens": 6,
        "min_tokens": 3,
        "top_k": 5,
        "min_p": 0.1,
    }
    assert (sampling["presence_penalty"], sampling["frequency_penalty"]) == (0.5, -0.5)
    assert sampling["repetition_penalty"] == 1.3


UNSUPPORTED = [
    ("n", 2),
    ("n", True),  # not 1: a bool
    ("logprobs", True),
    ("logprobs", 3),
    ("top_logprobs", 2),
    ("echo", True),
    ("best_of", 3),
    ("suffix", "end"),
    ("logit_bias", {"50256": -100}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", {"name": "f"}),
    ("response_format", {"type": "json_object"}),
    ("guided_json", {"type": "object"}),
    ("use_beam_search", True),
    ("no_such_parameter", 1),
]


@pytest.mark.parametrize(("name", "value"), UNSUPPORTED, ids=lambda v: str(v)[:20])
def test_output_changing_parameters_lorafleet_does_not_serve_are_refused(
    http: httpx.Client,
    private_redis: Redis,
    published: dict[str, AdapterRecord],
    name: str,
    value: Any,
) -> None:
    body = {"model": _cold(published), "prompt": "hi", name: value}
    error = _refused(http.post("/v1/completions", json=body), 422, "unsupported_parameter")
    assert error["param"] == name and name in error["message"]
    assert admitted_state(private_redis, "acme") == NOTHING


STRICT = [
    ("/v1/completions", {"max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 8.0}, "max_tokens"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"temperature": "1"}, "temperature"),
    ("/v1/completions", {"top_k": "5"}, "top_k"),
    ("/v1/completions", {"seed": 1.5}, "seed"),
    ("/v1/completions", {"stop": 5}, "stop"),
    ("/v1/completions", {"min_tokens": 10, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "a": 1}]}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "a": {}}]}]},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "what is 2+2?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
                    ],
                },
                {"role": "user", "content": "and?"},
            ]
        },
        "messages",
    ),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"stream": True, "stream_options": {"usage": True}}, "stream_options"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ("/v1/jobs", {"sampling": {"max_tokens": "8"}}, "sampling.max_tokens"),
    ("/v1/jobs", {"sampling": {"ignore_eos": "yes"}}, "sampling.ignore_eos"),
    ("/v1/jobs", {"deadline_s": "10"}, "deadline_s"),
    ("/v1/jobs", {"prompt": 5}, "prompt"),
]


@pytest.mark.parametrize(("route", "extra", "field"), STRICT, ids=lambda v: str(v)[:30])
def test_parameters_of_the_wrong_type_are_refused_not_coerced(
    http: httpx.Client,
    private_redis: Redis,
    published: dict[str, AdapterRecord],
    route: str,
    extra: dict[str, Any],
    field: str,
) -> None:
    adapter = _cold(published)
    base: dict[str, Any] = {
        "/v1/jobs": {"adapter": adapter, "prompt": "hi"},
        "/v1/completions": {"model": adapter, "prompt": "hi"},
        "/v1/chat/completions": {"model": adapter, "messages": [{"role": "user", "content": "hi"}]},
    }[route]
    response = http.post(route, json=base | extra)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] in ("validation_error", "unsupported_parameter"), error
    assert field.split(".")[0] in error["message"], error
    assert admitted_state(private_redis, "acme") == NOTHING


def test_batch_fields_of_the_wrong_type_are_refused_not_coerced(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    job = {"adapter": _cold(published), "prompt": "hi"}
    refused = http.post("/v1/batches", json={"requests": [job], "deadline_s": "10"})
    assert _refused(refused, 422, "validation_error")["param"] == "deadline_s"
    lines = [job | {"sampling": {"max_tokens": "8"}}, job | {"custom_id": 7}, job]
    body = "\n".join(json.dumps(line) for line in lines).encode()
    error = _refused(
        http.post("/v1/batches", content=body, headers={"content-type": "application/jsonl"}),
        422,
        "batch_invalid",
    )
    assert [d["line"] for d in error["details"]] == [1, 2]
    assert admitted_state(private_redis, "acme") == NOTHING


def _answer_to_a_stalled_body(http: httpx.Client, request: str) -> bytes:
    """Send ``request``'s head declaring a 1000-byte body (or what it declares), then 10
    bytes, and read until the gateway closes the connection (60 s: its keep-alive is 75)."""
    address = http.base_url
    with socket.create_connection((address.host, address.port), timeout=60) as held:
        held.sendall(request.encode() + b'{"adapter"')
        answer = b""
        while chunk := held.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(
    ("line", "status"),
    [
        ("POST /v1/nope", b"404"),
        ("PUT /v1/jobs", b"405"),
        ("POST /v1/batches/batch_x/cancel", b"401"),
        ("POST /v1/jobs LARGE", b"413"),
    ],
)
def test_an_answer_before_the_body_closes_the_connection(
    http: httpx.Client, line: str, status: bytes
) -> None:
    """Answered before its body arrived (no such route, no such method, no key, declared too
    large): the connection closes with the answer, so the rest of the body is neither waited
    for nor read (it was held for the 75 s keep-alive, and a declared 200 MB body was read)."""
    method_path, large, _ = line.partition(" LARGE")
    length = 10**9 if large else 1000
    head = (
        f"{method_path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    )
    answer = _answer_to_a_stalled_body(http, head)
    assert answer.split(b" ", 2)[1] == status, answer
    headers = answer.partition(b"\r\n\r\n")[0].lower()
    assert b"connection: close" in headers, answer


def test_a_json_body_without_a_content_type_is_read_as_json(
    http: httpx.Client, private_redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    """As the strict-JSON check reads it: a valid job sent with no Content-Type is a job (it
    was refused as "not a valid dictionary")."""
    body = json.dumps({"adapter": _cold(published), "prompt": "hi"}).encode()
    response = http.post("/v1/jobs", content=body, headers={"content-type": ""})
    assert response.status_code == 202, response.text


def _exchange(base_url: str, head: bytes, body: bytes = b"") -> tuple[bytes, bool]:
    """Send ``head`` and ``body`` on a new connection, in pieces of 64 KiB as a client's
    writes arrive; read until the server closes it or 10 s pass. ``(answer, closed)``."""
    host, port = httpx.URL(base_url).host, httpx.URL(base_url).port
    with socket.create_connection((host, port), timeout=10) as conn:
        data = head + body
        try:
            for start in range(0, len(data), 65536):
                conn.sendall(data[start : start + 65536])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before all of it was sent: the answer is read below
        return _read_until_closed(conn)


def _read_until_closed(conn: socket.socket) -> tuple[bytes, bool]:
    """What the server sends until it closes (``True``) or 10 s pass (``False``)."""
    answer = b""
    conn.settimeout(10)
    try:
        while chunk := conn.recv(65536):
            answer += chunk
    except TimeoutError:
        return answer, False
    except ConnectionResetError:
        pass
    return answer, True


def test_a_request_head_past_16_kib_is_431_and_closed_before_it_is_read_whole(
    http: httpx.Client,
) -> None:
    """httptools bounds nothing a client sends before its body (h11 stopped at 16 KiB):
    without the gateway's own bound, a client with no key could make it hold a head of any
    size. Past ``MAX_HEAD_BYTES`` the answer is 431 ``headers_too_large`` and the connection
    closes, whether the head ends later or never; a head under the bound is served, and a
    body, however large, never counts as head."""
    url = str(http.base_url)
    padding = b"X-Padding: " + b"a" * (4 * 1024 * 1024) + b"\r\n"
    for ending in (b"\r\n", b""):  # the head ends after the padding; it never ends
        answer, closed = _exchange(url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + padding + ending)
        status, _, rest = answer.partition(b"\r\n")
        assert status == b"HTTP/1.1 431 Request Header Fields Too Large", answer[:300]
        error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "headers_too_large" and error["message"], error
        assert closed
    small = b"X-Padding: " + b"a" * (MAX_HEAD_BYTES - 1024) + b"\r\n"
    answer, _ = _exchange(url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + small + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    # A prompt of 200 KiB, sent with its head in the same writes: refused for its length (the
    # route read it), not as a head.
    body = json.dumps({"model": "m", "prompt": "word " * 40_000, "max_tokens": 1}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: {http.headers['Authorization']}\r\n".encode()
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    )
    answer, _ = _exchange(url, head, body)
    assert not answer.startswith(b"HTTP/1.1 431"), answer[:300]
    assert answer.startswith(b"HTTP/1.1 4"), answer[:300]


def test_a_head_past_16_kib_that_arrives_in_one_read_is_431_too(http: httpx.Client) -> None:
    """The bound is on the head, not on how the network cut it: a head of 32 KiB whose bytes
    all reach the gateway in one read (one write on a local connection) is refused as one
    trickled in pieces is, and the request is never run."""
    url = str(http.base_url)
    padding = b"X-Padding: " + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\n"
    answer, closed = _exchange(url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n")
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large", answer[:300]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "headers_too_large", error
    assert closed


def test_a_head_refused_while_a_pipelined_response_streams_is_answered_after_it(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    published: dict[str, AdapterRecord],
) -> None:
    """A client that pipelines a second request behind a streamed completion, the second's
    head past ``MAX_HEAD_BYTES``: the 431 is written once the stream before it has ended
    (its last chunk and ``[DONE]``), never into it, and then the connection closes. The
    second head is sent once the stream's head has arrived and before it ends (no worker runs
    the job: the stream ends with the completion's bound, 2 s)."""
    body = json.dumps(
        {"model": _cold(published), "prompt": "hi", "max_tokens": 4, "stream": True}
    ).encode()
    streamed = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: {auth_headers(tenant_key('acme'))['Authorization']}\r\n".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    oversized = (
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Padding: "
        + b"a" * (4 * MAX_HEAD_BYTES)
        + b"\r\n\r\n"
    )
    with private_gateway(completion_timeout_s=2.0) as url:
        address = (httpx.URL(url).host, httpx.URL(url).port)
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(streamed)
            answer = _head(conn)
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
            assert b"text/event-stream" in answer.partition(b"\r\n\r\n")[0].lower(), answer
            assert b"[DONE]" not in answer  # still streaming: the next head arrives in flight
            conn.sendall(oversized)
            rest, closed = _read_until_closed(conn)
    answer += rest
    refused_at = answer.find(b"HTTP/1.1 431 Request Header Fields Too Large")
    assert refused_at > 0, answer[-600:]
    stream = answer[:refused_at]
    assert b"data: [DONE]" in stream, stream[-600:]
    assert stream.endswith(b"0\r\n\r\n"), stream[-200:]  # the stream's last chunk, then the 431
    error = json.loads(answer[refused_at:].partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "headers_too_large", error
    assert closed


def _head(conn: socket.socket) -> bytes:
    """What ``conn`` gives until a response's head has ended (and whatever came with it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, data
        data += chunk
    return data


def _response(conn: socket.socket) -> bytes:
    """One whole response (head and ``Content-Length`` body) read from ``conn``."""
    head, _, body = _head(conn).partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, head + body
        body += chunk
    assert len(body) == length, "more than one response"
    return head + b"\r\n\r\n" + body


def _assert_late(answer: bytes, closed: bool) -> None:
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", answer[:300]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "header_timeout" and "2 s" in error["message"], error
    assert closed


def test_a_head_that_does_not_arrive_in_time_is_408_and_an_idle_connection_is_closed(
    private_gateway: Callable[..., Any],
) -> None:
    """uvicorn bounds nothing before a connection's first request, nor anything once a byte
    came after a response: a client could hold connections for ever by sending nothing, a
    line end, or a head a byte at a time. With ``head_timeout_s`` 2 (keep-alive 5 s): a
    connection that sends nothing is closed unanswered; a head left half-sent or trickled
    past the bound, first on its connection or after a response, is 408 ``header_timeout``
    and closed; a line end after a response does not keep the connection; and heads that
    come whole in time are served, idle between requests as keep-alive allows."""
    get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    with private_gateway(head_timeout_s=2.0) as url:
        address = (httpx.URL(url).host, httpx.URL(url).port)
        with socket.create_connection(address, timeout=10) as conn:
            # Silent: kept past the head's bound (keep-alive's 5 s is longer), then closed.
            time.sleep(3)
            assert select.select([conn], [], [], 0)[0] == []
            assert _read_until_closed(conn) == (b"", True)
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(get)  # and nothing more
            _assert_late(*_read_until_closed(conn))
        with socket.create_connection(address, timeout=10) as conn:
            # A byte every 0.1 s (6 s in all): each within any bound between bytes, so only a
            # bound on the whole head answers before the trickle ends.
            answered_while_sending = False
            try:
                for byte in get + b"X-Slow: " + b"a" * 20:
                    conn.sendall(bytes([byte]))
                    time.sleep(0.1)
                    if select.select([conn], [], [], 0)[0]:
                        answered_while_sending = True
                        break
            except (BrokenPipeError, ConnectionResetError):
                answered_while_sending = True  # cut off: the answer is read below
            assert answered_while_sending
            _assert_late(*_read_until_closed(conn))
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(get + b"\r\n")
            assert _response(conn).startswith(b"HTTP/1.1 200 ")
            conn.sendall(get)  # the next head, half-sent
            _assert_late(*_read_until_closed(conn))
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(get + b"\r\n")
            assert _response(conn).startswith(b"HTTP/1.1 200 ")
            conn.sendall(b"\r\n")  # cancels keep-alive's timer; begins no head
            assert _read_until_closed(conn) == (b"", True)
        with socket.create_connection(address, timeout=10) as conn:
            for _ in range(2):  # each head in two parts 0.5 s apart, then 1.5 s idle
                conn.sendall(get)
                time.sleep(0.5)
                conn.sendall(b"\r\n")
                assert _response(conn).startswith(b"HTTP/1.1 200 ")
                time.sleep(1.5)


@pytest.mark.parametrize(
    "head",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nNo colon in this field\r\n\r\n",
        b"G(T /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS client hello on the plain port
        # A target llhttp takes and uvicorn's URL parser, once the head is whole, does not.
        b"GET http://[::1 HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_a_head_that_is_not_http_is_400_in_our_envelope_and_closed(
    http: httpx.Client, head: bytes
) -> None:
    """Bytes the HTTP parser cannot read (a field without a colon, a method with a bracket, an
    unknown version, TLS sent to the plain-text port) are answered as every other refusal is:
    400 ``malformed_request`` in the error envelope, then the connection closes; nothing ran."""
    answer, closed = _exchange(str(http.base_url), head)
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 400 Bad Request", answer[:300]
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in headers.lower(), headers
    error = json.loads(body)["error"]
    assert error["code"] == "malformed_request", error
    assert error["type"] == "invalid_request_error" and "HTTP" in error["message"], error
    assert closed
    # Behind a request it can read, in the same write: that one is answered first, whole.
    served = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    answer, closed = _exchange(str(http.base_url), served + head)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    second = answer.index(b"HTTP/1.1 400 Bad Request")
    assert answer.count(b"HTTP/1.1 200 ") == answer.count(b"HTTP/1.1 400 ") == 1
    assert b'"malformed_request"' in answer[second:]
    assert closed
    # The gateway still serves (the refusal ended one connection, nothing else).
    assert http.get("/healthz").status_code == 200


def test_a_head_refused_for_its_size_is_answered_once_whatever_follows_it(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A head past ``MAX_HEAD_BYTES`` that arrives whole in one read, followed in that read by
    bytes the parser cannot read: the refusal (431) is the one answer, and the gateway does
    not write again after ending its side (a second answer there was an error in the event
    loop, and could cost the client the first)."""
    padding = b"X-Padding: " + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\n"
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\nNOT HTTP\r\n\r\n"
    answer, closed = _exchange(str(http.base_url), head)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), answer[:300]
    assert answer.count(b"HTTP/1.1 4") == 1 and b"malformed_request" not in answer
    assert closed
    assert http.get("/healthz").status_code == 200
    # The gateway (uvicorn in a thread of this process) logged no failure of its own.
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failures, failures
