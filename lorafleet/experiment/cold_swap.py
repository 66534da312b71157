"""The baseline multi-LoRA serving replaces: one transformers + PEFT model object, one request
at a time, the adapter unloaded and the next one loaded from disk whenever consecutive
requests name different adapters (the cold-swap server of the design documents).

It speaks the subset of the OpenAI completions API the experiment's generator uses (streamed
``POST /v1/completions``, greedy) and answers with the same ``lorafleet`` metadata, so the same
generated sequence runs against it unchanged. Each load checks the adapter's files against
the digest it was configured with, as lorafleet's worker does.

    python -m lorafleet.experiment.cold_swap --port 8100 --base DIR --adapter ALIAS=DIR=DIGEST ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from contracts.digests import manifest_of
from lorafleet.validation import ADAPTER_FILES


@dataclass(frozen=True)
class Adapter:
    alias: str
    path: Path
    digest: str


class ColdSwapModel:
    """One model object; ``generate`` swaps the adapter in place when it must."""

    def __init__(self, base_dir: Path, adapters: dict[str, Adapter]) -> None:
        self.adapters = adapters
        self.tokenizer = AutoTokenizer.from_pretrained(base_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        first = next(iter(adapters.values()))
        self.verified = manifest_of(first.path, ADAPTER_FILES).digest() == first.digest
        self.model = PeftModel.from_pretrained(base, first.path, adapter_name=first.alias).eval()
        self.current: str | None = first.alias
        self.lock = threading.Lock()

    def swap(self, alias: str) -> dict[str, float | None]:
        """Unload the adapter in place and load ``alias`` from disk; timings in ms."""
        adapter = self.adapters[alias]
        began = time.perf_counter()
        self.verified = manifest_of(adapter.path, ADAPTER_FILES).digest() == adapter.digest
        verified_at = time.perf_counter()
        if self.current is not None:
            self.model.delete_adapter(self.current)
            self.current = None
        self.model.load_adapter(adapter.path, adapter_name=alias)
        self.model.set_adapter(alias)
        self.current = alias
        return {
            "fetch": None,
            "verify": round((verified_at - began) * 1000, 3),
            "engine_load": round((time.perf_counter() - verified_at) * 1000, 3),
        }

    def tokens(self, prompt: str, max_tokens: int) -> Iterator[int]:
        """Greedy decoding with the KV cache (never stopping at EOS), one token id at a time."""
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        past = None
        with torch.no_grad():
            for _ in range(max_tokens):
                out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                yield token
                ids = torch.tensor([[token]])

    def pieces(self, prompt: str, max_tokens: int) -> Iterator[str]:
        """The text as it grows: per token, the whole characters it added (maybe none)."""
        produced: list[int] = []
        shown = ""
        for token in self.tokens(prompt, max_tokens):
            produced.append(token)
            text = str(self.tokenizer.decode(produced, skip_special_tokens=True))
            text = text.rstrip("\ufffd")
            if len(text) > len(shown) and text.startswith(shown):
                piece, shown = text[len(shown) :], text
            else:
                piece = ""
            yield piece


def create_app(model: ColdSwapModel) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        alias = body.get("model")
        if alias not in model.adapters or not body.get("stream"):
            error = {"code": "adapter_not_found", "message": f"unknown model {alias!r}"}
            return JSONResponse({"error": error}, status_code=404)
        return StreamingResponse(
            _events(model, alias, str(body["prompt"]), int(body.get("max_tokens", 16))),
            media_type="text/event-stream",
        )

    return app


async def _events(
    model: ColdSwapModel, alias: str, prompt: str, max_tokens: int
) -> AsyncIterator[bytes]:
    """Waits for the model object, swaps if needed, streams the pieces, then the metadata."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    arrived = time.perf_counter()

    def work() -> None:
        try:
            answer()
        except Exception as exc:  # reaches the caller as an error event, not a hang
            loop.call_soon_threadsafe(queue.put_nowait, ("error", f"{type(exc).__name__}: {exc}"))

    def answer() -> None:
        with model.lock:
            started = time.perf_counter()
            residency = "gpu" if model.current == alias else "disk"
            timings: dict[str, float | None] = {}
            if residency == "disk":
                timings = model.swap(alias)
            count = 0
            for piece in model.pieces(prompt, max_tokens):
                count += 1
                if piece:
                    loop.call_soon_threadsafe(queue.put_nowait, ("text", piece))
            digest = model.adapters[alias].digest
            metadata = {
                "revision": digest,
                "loaded_digest": digest if model.verified or residency == "gpu" else None,
                "identity_verified": model.verified,
                "residency_before": residency,
                "load_ms": timings,
                "queue_wait_ms": round((started - arrived) * 1000, 3),
            }
            info = {"revision": digest, "adapter": alias, "metadata": metadata}
            loop.call_soon_threadsafe(queue.put_nowait, ("end", (info, count)))

    thread = loop.run_in_executor(None, work)
    while True:
        kind, value = await queue.get()
        if kind == "text":
            yield _sse({"choices": [{"index": 0, "text": value, "finish_reason": None}]})
            continue
        if kind == "error":
            yield _sse({"error": {"code": "engine_error", "message": value}})
            break
        info, count = value
        last = {"index": 0, "text": "", "finish_reason": "length"}
        yield _sse({"choices": [last], "lorafleet": info})
        yield _sse({"choices": [], "usage": {"completion_tokens": count}})
        yield b"data: [DONE]\n\n"
        break
    await thread


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--adapter", action="append", required=True, help="ALIAS=DIR=DIGEST")
    args = parser.parse_args()
    adapters = {}
    for spec in args.adapter:
        alias, path, digest = spec.split("=", 2)
        adapters[alias] = Adapter(alias, Path(path), digest)
    uvicorn.run(create_app(ColdSwapModel(args.base, adapters)), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
