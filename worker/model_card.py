"""Describe the served base model for the gateway: context length, tokenizer, chat template.

The gateway decides ``prompt_too_long`` and renders chat prompts with exactly the tokenizer
and context length this engine uses, so it reads them from what the engine loaded rather
than from its own configuration.
"""

from __future__ import annotations

import hashlib
from typing import Any

from redis import Redis

from contracts.keys import base_card_key, tokenizer_key
from contracts.registry import BaseModelCard, BaseModelRef


def describe(engine: Any, base_model: BaseModelRef) -> tuple[BaseModelCard, str | None]:
    """The card of ``engine``'s model and its ``tokenizer.json`` (``None``: a slow tokenizer)."""
    tokenizer = engine.get_tokenizer()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tokenizer_json = backend.to_str() if backend is not None else None
    card = BaseModelCard(
        base_model=base_model,
        max_model_len=engine.model_config.max_model_len,
        tokenizer_sha256=(
            hashlib.sha256(tokenizer_json.encode()).hexdigest() if tokenizer_json else None
        ),
        chat_template=getattr(tokenizer, "chat_template", None),
        bos_token=getattr(tokenizer, "bos_token", None),
        eos_token=getattr(tokenizer, "eos_token", None),
    )
    return card, tokenizer_json


def publish(redis: Redis, card: BaseModelCard, tokenizer_json: str | None) -> None:
    """Store the tokenizer (once per content) and then the card that names it."""
    if tokenizer_json is not None and card.tokenizer_sha256 is not None:
        redis.set(tokenizer_key(card.tokenizer_sha256), tokenizer_json)
    redis.set(base_card_key(card.base_model.digest), card.model_dump_json())
