"""Publish-time validation: each refusal has its code, and a refused adapter leaves nothing."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from redis import Redis
from safetensors.torch import save_file

from contracts.errors import ErrorCode
from contracts.queues import Tier
from lorafleet.publish import Publisher
from lorafleet.registry import RegistryError
from lorafleet.stack import LocalStack
from lorafleet.validation import Limits, ValidationFailure, validate_adapter

LIMITS = Limits(max_lora_rank=8, max_file_bytes=10**7, max_total_bytes=10**7)


@pytest.fixture
def adapter(tmp_path: Path, fixtures_dir: Path) -> Path:
    """A writable copy of a valid rank-8 q/v fixture adapter."""
    directory = tmp_path / "adapter"
    shutil.copytree(fixtures_dir / "adapters" / "lora-00-r8-qv", directory)
    return directory


def _config(directory: Path, **changes: Any) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _refusal(directory: Path, fixtures_dir: Path, limits: Limits = LIMITS) -> ValidationFailure:
    base = fixtures_dir / "base"
    with pytest.raises(ValidationFailure) as caught:
        validate_adapter(directory, base, str(base), limits)
    assert caught.value.message
    return caught.value


class _Payload:
    """Unpickling this would create ``marker``: proof that nobody unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def _bucket_keys(s3: Any, bucket: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {item["Key"] for page in pages for item in page.get("Contents", [])}


def test_valid_fixture_adapter_passes(adapter: Path, fixtures_dir: Path) -> None:
    base = fixtures_dir / "base"
    valid = validate_adapter(adapter, base, str(base), LIMITS)
    assert valid.rank == 8 and valid.target_modules == ("q_proj", "v_proj")


def test_pickle_adapter_is_refused_unopened_and_leaves_nothing(
    adapter: Path, tmp_path: Path, publisher: Publisher, infra: LocalStack, redis: Redis, s3: Any
) -> None:
    marker = tmp_path / "unpickled"
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    keys_before = _bucket_keys(s3, infra.settings.s3_bucket)
    registry_before = sorted(redis.keys("lorafleet:*"))  # type: ignore[arg-type]

    with pytest.raises(ValidationFailure) as caught:
        publisher.publish(adapter, "pickled", Tier.COLD)

    assert caught.value.code == ErrorCode.ADAPTER_UNSAFE_FORMAT
    assert "adapter_model.bin" in caught.value.message
    assert not marker.exists()
    assert _bucket_keys(s3, infra.settings.s3_bucket) == keys_before
    assert sorted(redis.keys("lorafleet:*")) == registry_before  # type: ignore[arg-type]


def test_pickle_beside_safetensors_is_refused(adapter: Path, fixtures_dir: Path) -> None:
    (adapter / "optimizer.pt").write_bytes(b"\x80\x04N.")
    assert _refusal(adapter, fixtures_dir).code == ErrorCode.ADAPTER_UNSAFE_FORMAT


def test_missing_config_and_weights(adapter: Path, fixtures_dir: Path) -> None:
    (adapter / "adapter_model.safetensors").unlink()
    assert _refusal(adapter, fixtures_dir).code == ErrorCode.ADAPTER_WEIGHTS_MISSING
    (adapter / "adapter_config.json").unlink()
    assert _refusal(adapter, fixtures_dir).code == ErrorCode.ADAPTER_CONFIG_MISSING


@pytest.mark.parametrize(
    "changes",
    [
        {"peft_type": "IA3"},
        {"r": "8"},
        {"target_modules": "q_proj|v_proj"},
        {"use_dora": True},
        {"modules_to_save": ["lm_head"]},
    ],
)
def test_unsupported_configs_are_refused(
    adapter: Path, fixtures_dir: Path, changes: dict[str, Any]
) -> None:
    _config(adapter, **changes)
    assert _refusal(adapter, fixtures_dir).code == ErrorCode.ADAPTER_CONFIG_INVALID


def test_config_that_is_not_json(adapter: Path, fixtures_dir: Path) -> None:
    (adapter / "adapter_config.json").write_text("{r: 8")
    assert _refusal(adapter, fixtures_dir).code == ErrorCode.ADAPTER_CONFIG_INVALID


def test_rank_above_the_fleet_limit(adapter: Path, fixtures_dir: Path) -> None:
    limits = Limits(max_lora_rank=4, max_file_bytes=10**7, max_total_bytes=10**7)
    failure = _refusal(adapter, fixtures_dir, limits)
    assert failure.code == ErrorCode.RANK_TOO_LARGE
    assert "8" in failure.message and "4" in failure.message


def test_target_module_the_base_model_lacks(adapter: Path, fixtures_dir: Path) -> None:
    _config(adapter, target_modules=["q_proj", "v_proj", "w_magic"])
    failure = _refusal(adapter, fixtures_dir)
    assert failure.code == ErrorCode.TARGET_MODULES_UNKNOWN
    assert "w_magic" in failure.message


def test_adapter_for_another_base_model(adapter: Path, fixtures_dir: Path) -> None:
    _config(adapter, base_model_name_or_path="meta-llama/Llama-2-7b-hf")
    assert _refusal(adapter, fixtures_dir).code == ErrorCode.BASE_MODEL_MISMATCH


def _weights(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(directory / "adapter_model.safetensors"))


PREFIX = "base_model.model.model.layers"


def test_tensor_shapes_that_do_not_fit_the_base_model(adapter: Path, fixtures_dir: Path) -> None:
    _config(adapter, target_modules=["q_proj"])
    _weights(
        adapter,
        {
            f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 100),
            f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(128, 8),
        },
    )
    failure = _refusal(adapter, fixtures_dir)
    assert failure.code == ErrorCode.ADAPTER_SHAPE_MISMATCH
    assert "[8, 100]" in failure.message and "[8, 128]" in failure.message


def test_tensor_for_a_layer_the_base_model_lacks(adapter: Path, fixtures_dir: Path) -> None:
    _config(adapter, target_modules=["q_proj"])
    _weights(
        adapter,
        {
            f"{PREFIX}.9.self_attn.q_proj.lora_A.weight": torch.zeros(8, 128),
            f"{PREFIX}.9.self_attn.q_proj.lora_B.weight": torch.zeros(128, 8),
        },
    )
    assert _refusal(adapter, fixtures_dir).code == ErrorCode.ADAPTER_SHAPE_MISMATCH


def test_unpaired_lora_matrix(adapter: Path, fixtures_dir: Path) -> None:
    _config(adapter, target_modules=["q_proj"])
    _weights(adapter, {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 128)})
    assert _refusal(adapter, fixtures_dir).code == ErrorCode.ADAPTER_SHAPE_MISMATCH


def test_corrupt_safetensors_header(adapter: Path, fixtures_dir: Path) -> None:
    (adapter / "adapter_model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    assert _refusal(adapter, fixtures_dir).code == ErrorCode.ADAPTER_WEIGHTS_INVALID


def test_size_caps(adapter: Path, fixtures_dir: Path) -> None:
    per_file = Limits(max_lora_rank=8, max_file_bytes=1000, max_total_bytes=10**7)
    assert _refusal(adapter, fixtures_dir, per_file).code == ErrorCode.ADAPTER_TOO_LARGE
    total = Limits(max_lora_rank=8, max_file_bytes=10**7, max_total_bytes=1000)
    assert _refusal(adapter, fixtures_dir, total).code == ErrorCode.ADAPTER_TOO_LARGE


@pytest.mark.parametrize(
    "alias", ["../etc", "a/b", "..", ".", "UPPER", "x" * 65, "tab\there", "nul\x00", "-lead", ""]
)
def test_unsafe_alias_names_are_refused(
    adapter: Path, publisher: Publisher, alias: str, redis: Redis
) -> None:
    with pytest.raises(RegistryError) as caught:
        publisher.publish(adapter, alias, Tier.COLD)
    assert caught.value.code == ErrorCode.NAME_INVALID
    assert publisher.registry.get(alias) is None
