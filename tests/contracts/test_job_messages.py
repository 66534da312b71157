"""The job message on the wire stays readable by the workers of the release before it
(rolling deploys: new gateways, old workers) unless a job uses a parameter they lack."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contracts.jobs import ADDED_SAMPLING, JobMessage, Sampling
from contracts.queues import Tier
from contracts.registry import BaseModelRef


class FirstReleaseSampling(BaseModel):
    """``Sampling`` as workers of the first release parse it (``git show 2b5f351``)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=64, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list, max_length=8)
    ignore_eos: bool = False


def _message(sampling: Sampling) -> JobMessage:
    return JobMessage(
        job_id="j1",
        tenant="t",
        adapter="a",
        revision="sha256:" + "0" * 64,
        base_model=BaseModelRef(id="m", digest="sha256:" + "1" * 64),
        tier=Tier.HOT,
        prompt="hello",
        sampling=sampling,
        accepted_at=1.0,
        deadline_at=2.0,
    )


def test_the_release_before_reads_a_job_that_uses_none_of_the_new_parameters() -> None:
    wire = _message(Sampling(max_tokens=8, temperature=0.5, stop=["\n"])).wire()
    assert not set(ADDED_SAMPLING) & set(wire["sampling"])  # type: ignore[arg-type]
    FirstReleaseSampling.model_validate(wire["sampling"])
    assert JobMessage.model_validate(wire) == _message(
        Sampling(max_tokens=8, temperature=0.5, stop=["\n"])
    )


@pytest.mark.parametrize(
    "used",
    [
        {"top_k": 5},
        {"min_tokens": 2},
        {"min_p": 0.1},
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.5},
        {"repetition_penalty": 1.2},
    ],
)
def test_a_job_that_uses_a_new_parameter_carries_it(used: dict[str, float]) -> None:
    message = _message(Sampling(**used))  # type: ignore[arg-type]
    wire = message.wire()
    assert JobMessage.model_validate(wire) == message  # the new worker runs it as asked
    with pytest.raises(ValidationError):  # an old worker refuses it rather than ignore it
        FirstReleaseSampling.model_validate(wire["sampling"])


def test_every_sampling_field_is_known_to_the_first_release_or_listed_as_added() -> None:
    first = set(FirstReleaseSampling.model_fields)
    assert set(Sampling.model_fields) == first | set(ADDED_SAMPLING)
