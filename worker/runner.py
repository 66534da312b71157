"""Runs one job on the engine: check the base model, make the adapter resident, generate.

A plain class that knows nothing of Celery; the task module is a thin shell around it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind

from contracts.errors import ErrorCode
from contracts.jobs import EngineInfo, JobMessage, JobResult, ResultMetadata, Sampling, Usage
from contracts.registry import BaseModelRef
from worker.engine import ENGINE_NAME, ENGINE_VERSION, EngineHost
from worker.errors import AdapterIntegrityError, JobFailure
from worker.residency import EngineAdapters


@dataclass(frozen=True)
class Generation:
    result: JobResult
    ttft_ms: float | None


def _sampling_params(sampling: Sampling) -> SamplingParams:
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=sampling.stop or None,
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
    )


class JobRunner:
    """Turns a ``JobMessage`` into a result plus observed metadata, or raises ``JobFailure``."""

    def __init__(
        self, host: EngineHost, adapters: EngineAdapters, base_model: BaseModelRef, hostname: str
    ) -> None:
        self._host = host
        self._adapters = adapters
        self._base_model = base_model
        self._hostname = hostname

    @property
    def base_model(self) -> BaseModelRef:
        return self._base_model

    def run(self, message: JobMessage) -> tuple[JobResult, ResultMetadata]:
        started = time.time()
        if message.base_model.digest != self._base_model.digest:
            raise JobFailure(
                ErrorCode.BASE_MODEL_MISMATCH,
                f"Adapter {message.adapter} targets base model {message.base_model.digest}, "
                f"but this worker serves {self._base_model.digest}.",
            )
        resident = self._adapters.make_resident(message.adapter, message.revision)
        handed = self._adapters.handed_digest(resident.request)
        verified = resident.loaded_digest == message.revision and handed == message.revision
        if not verified:
            # Fail closed: the engine holds something other than the admitted revision.
            raise AdapterIntegrityError(
                f"Revision {message.revision} was admitted but the engine holds {handed}."
            )
        generation = self._host.run(
            self._generate(message.job_id, message.prompt, message.sampling, resident.request)
        )
        finished = time.time()
        metadata = ResultMetadata(
            adapter=message.adapter,
            revision=message.revision,
            loaded_digest=resident.loaded_digest,
            identity_verified=verified,
            base_model=self._base_model,
            residency_before=resident.residency_before,
            load_ms=resident.load_ms,
            queue_wait_ms=round((started - message.accepted_at) * 1000, 3),
            ttft_ms=generation.ttft_ms,
            e2e_ms=round((finished - message.accepted_at) * 1000, 3),
            worker=self._hostname,
            engine=EngineInfo(name=ENGINE_NAME, version=ENGINE_VERSION),
        )
        return generation.result, metadata

    async def _generate(
        self, job_id: str, prompt: str, sampling: Sampling, lora: LoRARequest
    ) -> Generation:
        # Unique per attempt: a redelivered job must not collide with a stale engine request.
        request_id = f"{job_id}-{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        first_token: float | None = None
        token_ids: list[int] = []
        pieces: list[str] = []
        prompt_tokens = 0
        finish_reason: str | None = None
        async for output in self._host.engine.generate(
            {"prompt": prompt}, _sampling_params(sampling), request_id, lora_request=lora
        ):
            if output.prompt_token_ids is not None:
                prompt_tokens = len(output.prompt_token_ids)
            completion = output.outputs[0]
            if completion.token_ids and first_token is None:
                first_token = time.perf_counter()
            token_ids.extend(completion.token_ids)
            pieces.append(completion.text)
            finish_reason = completion.finish_reason or finish_reason
        ttft = None if first_token is None else round((first_token - start) * 1000, 3)
        result = JobResult(
            text="".join(pieces),
            token_ids=token_ids,
            finish_reason=finish_reason,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=len(token_ids),
                total_tokens=prompt_tokens + len(token_ids),
            ),
        )
        return Generation(result=result, ttft_ms=ttft)
