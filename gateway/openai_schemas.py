"""OpenAI-compatible request and response bodies (the subset lorafleet serves).

Sampling parameters lorafleet serves are fields (OpenAI's, and vLLM's extensions
``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``), strictly typed. Every other
parameter is refused with ``unsupported_parameter`` unless it is set to a value that changes
nothing (``logprobs: false``, ``tools: []``, ``response_format: {"type": "text"}`` …) or it
never changes the output (``user``, ``metadata`` …): nothing is silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contracts.errors import ErrorCode
from contracts.jobs import MAX_PROMPT_CHARS, JobPublic, ResultMetadata, Sampling, Usage
from gateway.errors import ApiError, shown

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``max_tokens`` when a request leaves it out."""

# Parameter -> the values that change nothing (besides null); anything else is a feature we
# don't serve. A value matches only with the same type: ``n: true`` is not ``n: 1``.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "suffix": ("",),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}

# Parameters that never change what is generated: accepted and not used, as OpenAI does.
_IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)


# A chat message's fields besides ``role`` and ``content`` -> their neutral values: the ones
# OpenAI returns empty on an assistant message, which clients send back in the next turn.
_MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "refusal": (),
    "annotations": ([],),
    "audio": (),
    "function_call": (),
    "tool_calls": ([],),
    # vLLM's server answers these on an assistant message (null unless a reasoning parser ran).
    "reasoning_content": (),
    "reasoning": (),
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return value is None or any(type(value) is type(n) and value == n for n in neutral)


def _refuse_unless_neutral(
    extra: dict[str, Any], neutral: dict[str, tuple[Any, ...]], where: str = ""
) -> None:
    for name, value in extra.items():
        if name not in neutral:
            raise ApiError(
                422,
                ErrorCode.UNSUPPORTED_PARAMETER,
                f"Parameter {shown(where + name)} is not supported by lorafleet; it is refused "
                "rather than ignored. Nothing was enqueued.",
                param=where + name,
            )
        if not _neutral(value, neutral[name]):
            allowed = " or ".join(repr(n) for n in (None, *neutral[name]))
            raise ApiError(
                422,
                ErrorCode.UNSUPPORTED_PARAMETER,
                f"Parameter {shown(where + name)} = {shown(value)} is not supported by "
                f"lorafleet (only {allowed}). Nothing was enqueued.",
                param=where + name,
            )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    include_obfuscation: bool | None = Field(
        default=None, description="accepted; lorafleet's chunks carry no obfuscation padding"
    )


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(description="an adapter alias or channel the tenant is granted")
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    min_tokens: int = Field(default=0, ge=0, le=4096, description="vLLM extension")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="vLLM extension; 0 or -1: every token")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="vLLM extension")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0, description="vLLM extension")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(default=False, description="lorafleet/vLLM extension")
    deadline_s: float | None = Field(default=None, gt=0, description="lorafleet extension")

    def check(self) -> None:
        """Refuse what the schema can't express: features lorafleet does not serve."""
        extra = self.model_extra or {}
        _refuse_unless_neutral({k: v for k, v in extra.items() if k not in _IGNORED}, _NEUTRAL)
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                422,
                ErrorCode.VALIDATION_ERROR,
                "Invalid request: stream_options: only allowed when stream is true. Nothing was "
                "enqueued.",
                param="stream_options",
            )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    def sampling(self, default_max_tokens: int) -> Sampling:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Sampling(
            max_tokens=self.max_tokens or default_max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
        )


class CompletionCreate(OpenAIRequest):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[str] = Field(description="one prompt (a list of exactly one is accepted)")

    def check(self) -> None:
        super().check()
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(prompts) != 1:
            raise ApiError(
                422,
                ErrorCode.UNSUPPORTED_PARAMETER,
                f"prompt: exactly one prompt per request is supported (got {len(prompts)}); "
                "use /v1/batches or several requests. Nothing was enqueued.",
                param="prompt",
            )
        if not 1 <= len(prompts[0]) <= MAX_PROMPT_CHARS:
            raise ApiError(
                422,
                ErrorCode.VALIDATION_ERROR,
                f"Invalid request: prompt: 1 to {MAX_PROMPT_CHARS} characters.",
                param="prompt",
            )

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Other fields: refused unless neutral (``check``), as the request's own parameters are.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = Field(
        default=None, max_length=256, description="passed to the chat template, as vLLM does"
    )

    def check(self, index: int) -> None:
        _refuse_unless_neutral(self.model_extra or {}, _MESSAGE_NEUTRAL, f"messages.{index}.")

    def rendered(self) -> dict[str, str]:
        """As chat templates expect it: ``{"role", "content"}`` with plain-text content (and
        ``name`` when the message has one)."""
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionCreate(OpenAIRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)

    def check(self) -> None:
        super().check()
        for index, message in enumerate(self.messages):
            message.check(index)

    def sampling(self, default_max_tokens: int) -> Sampling:
        sampling = super().sampling(default_max_tokens)
        if self.max_completion_tokens is not None:
            sampling = sampling.model_copy(update={"max_tokens": self.max_completion_tokens})
        return sampling


class LorafleetInfo(BaseModel):
    """Which weights answered: the audit trail every response carries."""

    job_id: str
    adapter: str
    channel: str | None
    revision: str
    metadata: ResultMetadata | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    lorafleet: LorafleetInfo


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    lorafleet: LorafleetInfo


class ModelCard(BaseModel):
    """One ``model`` a tenant may name, with the fields vLLM's server gives an adapter."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str = Field(description="the revision (content digest) the name resolves to now")
    parent: str = Field(description="the base model it runs on")
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def info_of(job: JobPublic) -> LorafleetInfo:
    return LorafleetInfo(
        job_id=job.id,
        adapter=job.adapter,
        channel=job.channel,
        revision=job.revision,
        metadata=job.metadata,
    )


def completion_of(job: JobPublic, model: str, created: int) -> Completion:
    assert job.result is not None
    return Completion(
        id=f"cmpl-{job.id}",
        created=created,
        model=model,
        choices=[CompletionChoice(text=job.result.text, finish_reason=job.result.finish_reason)],
        usage=job.result.usage,
        lorafleet=info_of(job),
    )


def chat_completion_of(job: JobPublic, model: str, created: int) -> ChatCompletion:
    assert job.result is not None
    return ChatCompletion(
        id=f"chatcmpl-{job.id}",
        created=created,
        model=model,
        choices=[
            ChatChoice(
                message=AssistantMessage(content=job.result.text),
                finish_reason=job.result.finish_reason,
            )
        ],
        usage=job.result.usage,
        lorafleet=info_of(job),
    )
