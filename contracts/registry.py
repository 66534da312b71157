"""Registry records: an alias names exactly one immutable adapter artifact."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contracts.queues import Tier

SLUG_PATTERN = r"^[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?$"


class BaseModelRef(BaseModel):
    """The base model an adapter was trained for (or a worker serves): its id and digest."""

    model_config = ConfigDict(frozen=True)

    id: str
    digest: str


class AdapterRecord(BaseModel):
    """One published adapter revision. Immutable: new bytes need a new alias."""

    model_config = ConfigDict(frozen=True)

    alias: str = Field(pattern=SLUG_PATTERN)
    digest: str = Field(description="sha256 of the artifact's canonical manifest")
    base_model: BaseModelRef
    rank: int = Field(gt=0)
    alpha: float = Field(gt=0, allow_inf_nan=False)
    target_modules: tuple[str, ...]
    size_bytes: int = Field(ge=0)
    tier: Tier
    owner: str = "default"
    created_at: datetime


class UnreadableRecord(Exception):
    """The record stored under an alias does not parse as this version's ``AdapterRecord``
    (written by another version, or by hand). Readers skip it; only its own jobs fail."""

    def __init__(self, alias: str, reason: str) -> None:
        super().__init__(f"registry record of {alias!r} is unreadable: {reason}")
        self.alias = alias
        self.reason = reason


def read_record(alias: str, raw: str | bytes) -> AdapterRecord:
    """The record stored under ``alias``'s key; raises ``UnreadableRecord`` if it does not
    parse or names another alias (a record never vouches for a name it was not stored under)."""
    try:
        record = AdapterRecord.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'record'}: {error['msg']}"
            for error in exc.errors(include_url=False)
        )
        raise UnreadableRecord(alias, problems) from exc
    if record.alias != alias:
        raise UnreadableRecord(alias, f"it names alias {record.alias!r}")
    return record


class BaseModelCard(BaseModel):
    """What the gateway needs to know of a base model to admit prompts for it, written by the
    workers serving it: the context length their engines run with, and the tokenizer (stored
    separately under its content hash) with its chat template."""

    model_config = ConfigDict(frozen=True)

    base_model: BaseModelRef
    max_model_len: int = Field(gt=0)
    tokenizer_sha256: str | None = Field(description="`tokenizer.json`; None if there is none")
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
