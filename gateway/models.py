"""Base-model knowledge the gateway admits prompts with: token counts and chat templates.

Workers publish a ``BaseModelCard`` per base model (``worker.model_card``); the gateway keeps
each card for ``CARD_TTL_S`` and each tokenizer (immutable, named by content hash) for good.
No card yet (no worker has served that base model) means the length check is left to the
worker and chat prompts can't be rendered.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from redis.asyncio import Redis
from tokenizers import Tokenizer

from contracts.keys import base_card_key, tokenizer_key
from contracts.registry import BaseModelCard

CARD_TTL_S = 10.0


class ChatTemplateError(Exception):
    """The model's chat template refused the messages (e.g. roles it doesn't support)."""


@dataclass(frozen=True)
class Tokens:
    """A tokenizer, and the most characters one of its tokens stands for."""

    tokenizer: Tokenizer
    max_token_chars: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Tokens:
        # A vocabulary entry is never shorter than the text its token decodes to (byte-level
        # entries spell one byte a character; others spell their text, markers included).
        longest = max(
            (len(entry) for entry in tokenizer.get_vocab(with_added_tokens=True)), default=1
        )
        return cls(tokenizer, max(1, longest))


@dataclass(frozen=True)
class ServedModel:
    card: BaseModelCard
    tokens: Tokens | None

    def fewest_tokens(self, prompt: str) -> int | None:
        """A lower bound on the prompt's tokens, found without tokenizing it (``None``
        without a tokenizer): no token stands for more than ``max_token_chars`` characters."""
        if self.tokens is None:
            return None
        return -(-len(prompt) // self.tokens.max_token_chars)

    def count_tokens(self, prompt: str, add_special_tokens: bool = True) -> int | None:
        """Prompt tokens as the engine will count them; ``None`` without a tokenizer.

        Holds the GIL for the whole call (``tokenizers`` does not release it): about a
        second a megabyte, so callers bound the prompt first."""
        if self.tokens is None:
            return None
        encoded = self.tokens.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return len(encoded.ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> str | None:
        """The prompt text for ``messages`` with the generation prompt appended, rendered the
        way ``transformers`` renders chat templates; ``None`` if the model has no template."""
        if self.card.chat_template is None:
            return None
        try:
            return _compiled(self.card.chat_template).render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.card.bos_token or "",
                eos_token=self.card.eos_token or "",
            )
        except TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENVIRONMENT = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_ENVIRONMENT.globals["raise_exception"] = _raise_exception
_ENVIRONMENT.globals["strftime_now"] = _strftime_now


@functools.lru_cache(maxsize=32)
def _compiled(source: str) -> Template:
    """A chat template, compiled once: compiling the fixture's took 0.88 ms a request,
    rendering it compiled takes 0.014 ms. A template that does not compile raises each time."""
    return _ENVIRONMENT.from_string(source)


class BaseModels:
    """Cards and tokenizers by base-model digest, read from Redis and cached."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._cards: dict[str, tuple[float, BaseModelCard | None]] = {}
        self._reading: dict[str, asyncio.Future[BaseModelCard | None]] = {}
        self._tokenizers: dict[str, Tokens] = {}

    async def get(self, digest: str) -> ServedModel | None:
        card = await self._card(digest)
        if card is None:
            return None
        return ServedModel(card=card, tokens=await self._tokenizer(card.tokenizer_sha256))

    async def _card(self, digest: str) -> BaseModelCard | None:
        cached = self._cards.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        # One read however many requests find the card stale at once.
        reading = self._reading.get(digest)
        if reading is None:
            reading = self._reading[digest] = asyncio.ensure_future(self._read_card(digest))
            reading.add_done_callback(lambda _: self._reading.pop(digest, None))
        return await asyncio.shield(reading)

    async def _read_card(self, digest: str) -> BaseModelCard | None:
        raw = await self._redis.get(base_card_key(digest))
        card = None if raw is None else BaseModelCard.model_validate_json(raw)
        self._cards[digest] = (time.monotonic() + CARD_TTL_S, card)
        return card

    async def _tokenizer(self, sha256: str | None) -> Tokens | None:
        if sha256 is None:
            return None
        if sha256 not in self._tokenizers:
            raw = await self._redis.get(tokenizer_key(sha256))
            if raw is None:
                return None
            self._tokenizers[sha256] = Tokens.of(Tokenizer.from_str(str(raw)))
        return self._tokenizers[sha256]
