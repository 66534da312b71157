"""Publish-time validation by the engine's rules: numbers out of range, PEFT options vLLM
refuses or ignores, safetensors the loader refuses and non-finite weights are each refused
with a stable code (and the field named), leaving nothing in Redis or S3; what the fixtures
and PEFT itself write still publishes."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from redis import Redis
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from contracts.errors import ErrorCode
from contracts.queues import Tier
from lorafleet import weights
from lorafleet.fixtures import adapter_specs
from lorafleet.publish import Publisher
from lorafleet.stack import LocalStack
from lorafleet.validation import ENGINE_RUNS_ONLY, Limits, ValidationFailure, validate_adapter

LIMITS = Limits(max_lora_rank=8, max_file_bytes=10**7, max_total_bytes=10**7)
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture
def adapter(tmp_path: Path, fixtures_dir: Path) -> Path:
    """A writable copy of a valid rank-8 q/v fixture adapter (float32)."""
    directory = tmp_path / "adapter"
    shutil.copytree(fixtures_dir / "adapters" / "lora-00-r8-qv", directory)
    return directory


def _bucket_keys(s3: Any, bucket: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {item["Key"] for page in pages for item in page.get("Contents", [])}


@pytest.fixture
def refused(
    adapter: Path, publisher: Publisher, infra: LocalStack, redis: Redis, s3: Any
) -> Iterator[Any]:
    """``refused()``: publish ``adapter`` through the real publisher, expect a refusal and
    return it; afterwards, Redis and the bucket hold exactly what they held before."""
    bucket = infra.settings.s3_bucket
    before = (set(redis.keys("lorafleet:*")), _bucket_keys(s3, bucket))  # type: ignore[arg-type]

    def publish() -> ValidationFailure:
        with pytest.raises(ValidationFailure) as caught:
            publisher.publish(adapter, "refused-by-validation", Tier.COLD)
        assert caught.value.message
        return caught.value

    yield publish
    assert publisher.registry.get("refused-by-validation") is None
    assert (set(redis.keys("lorafleet:*")), _bucket_keys(s3, bucket)) == before  # type: ignore[arg-type]


def _config_with(directory: Path, field: str, literal: str | None) -> None:
    """Set ``field`` to the JSON text ``literal`` (``None``: remove it), byte for byte."""
    path = directory / CONFIG
    config = json.loads(path.read_text())
    config.pop(field, None)
    text = json.dumps(config)
    if literal is not None:
        config[field] = "@literal@"
        text = json.dumps(config).replace('"@literal@"', literal)
    path.write_text(text)


NUMBERS = [
    *[("lora_alpha", v) for v in ["NaN", "Infinity", "-Infinity", "1e999", "0", "-16", '"16"']],
    *[("lora_alpha", v) for v in ["true", "null", None]],  # None: left out (vLLM requires it)
    *[("r", v) for v in ["NaN", "1e999", "0", "-8", "8.5", "true", '"8"', None]],
    *[("lora_dropout", v) for v in ["NaN", "Infinity", "-0.1", "1.5", '"0.1"', "null"]],
    ("qalora_group_size", "Infinity"),
    ("megatron_config", '{"hidden": -Infinity}'),
]


@pytest.mark.parametrize(("field", "literal"), NUMBERS)
def test_numbers_out_of_range_are_refused_naming_the_field(
    adapter: Path, refused: Any, field: str, literal: str | None
) -> None:
    _config_with(adapter, field, literal)
    failure = refused()
    assert failure.code == ErrorCode.ADAPTER_CONFIG_INVALID
    named = "megatron_config.hidden" if field == "megatron_config" else field
    assert failure.field == named
    assert named in failure.message


ENGINE_REFUSES_OR_IGNORES = [
    ("bias", '"all"'),
    ("bias", '"lora_only"'),
    ("lora_bias", "true"),
    ("use_dora", "true"),
    ("use_dora", "1"),
    ("modules_to_save", '["lm_head"]'),
    ("fan_in_fan_out", "true"),
    ("layers_to_transform", "[0]"),
    ("layers_to_transform", "0"),
    ("layers_pattern", '"layers"'),
    ("exclude_modules", '["k_proj"]'),
    ("rank_pattern", '{"q_proj": 4}'),
    ("alpha_pattern", '{"q_proj": 4}'),
    ("layer_replication", "[[0, 1]]"),
    ("target_parameters", '["mlp.experts.gate_up_proj"]'),
    ("trainable_token_indices", "[3, 4]"),
    ("alora_invocation_tokens", "[1]"),
    ("use_qalora", "true"),
    ("init_lora_weights", '"pissa"'),
    ("init_lora_weights", '"loftq"'),
    ("init_lora_weights", "1"),
    ("use_rslora", '"yes"'),
]


@pytest.mark.parametrize(("field", "literal"), ENGINE_REFUSES_OR_IGNORES)
def test_peft_options_the_engine_refuses_or_ignores_are_refused(
    adapter: Path, refused: Any, field: str, literal: str
) -> None:
    _config_with(adapter, field, literal)
    failure = refused()
    assert failure.code == ErrorCode.ADAPTER_CONFIG_INVALID
    assert failure.field == field and field in failure.message


def test_config_with_a_key_twice_is_refused(adapter: Path, refused: Any) -> None:
    text = (adapter / CONFIG).read_text()
    (adapter / CONFIG).write_text(text.replace('"r": 8,', '"r": 8, "r": 4,'))
    failure = refused()
    assert failure.code == ErrorCode.ADAPTER_CONFIG_INVALID and "'r' appears twice" in (
        failure.message
    )


@pytest.mark.parametrize("depth", [33, 100_000])
def test_config_nested_too_deep_is_refused_not_a_crash(
    adapter: Path, refused: Any, depth: int
) -> None:
    """Python's own parser dies of recursion at about a thousand levels; either way the
    publisher answers with a code, not a traceback."""
    _config_with(adapter, "megatron_config", "[" * depth + "]" * depth)
    failure = refused()
    assert failure.code == ErrorCode.ADAPTER_CONFIG_INVALID
    assert "nested more than" in failure.message


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("use_rslora", "true"),  # vLLM scales by alpha / sqrt(r), as PEFT does
        ("init_lora_weights", '"gaussian"'),
        ("init_lora_weights", "false"),
        ("lora_alpha", "12.5"),
        ("lora_dropout", "0.1"),
        ("lora_dropout", None),
        ("modules_to_save", "[]"),
        ("rank_pattern", "{}"),
        ("layers_pattern", "null"),
    ],
)
def test_options_the_engine_runs_as_peft_does_are_accepted(
    adapter: Path, fixtures_dir: Path, field: str, literal: str | None
) -> None:
    _config_with(adapter, field, literal)
    base = fixtures_dir / "base"
    assert validate_adapter(adapter, base, str(base), LIMITS).rank == 8


# -- safetensors layout --------------------------------------------------------------------


def _write_safetensors(path: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _entry(start: int, end: int, shape: list[int], dtype: str = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


A_BYTES, B_BYTES = 8 * 128 * 4, 128 * 8 * 4
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "span shorter than its shape": (
        {
            A: _entry(0, A_BYTES - 4, [8, 128]),
            B: _entry(A_BYTES - 4, A_BYTES - 4 + B_BYTES, [128, 8]),
        },
        A_BYTES - 4 + B_BYTES,
    ),
    "overlapping tensors": (
        {
            A: _entry(0, A_BYTES, [8, 128]),
            B: _entry(A_BYTES - 64, A_BYTES - 64 + B_BYTES, [128, 8]),
        },
        A_BYTES - 64 + B_BYTES,
    ),
    "both tensors on the same bytes": (
        {A: _entry(0, A_BYTES, [8, 128]), B: _entry(0, B_BYTES, [128, 8])},
        A_BYTES,
    ),
    "a gap between tensors": (
        {A: _entry(0, A_BYTES, [8, 128]), B: _entry(A_BYTES + 8, A_BYTES + 8 + B_BYTES, [128, 8])},
        A_BYTES + 8 + B_BYTES,
    ),
    "bytes after the last tensor": (
        {A: _entry(0, A_BYTES, [8, 128]), B: _entry(A_BYTES, A_BYTES + B_BYTES, [128, 8])},
        A_BYTES + B_BYTES + 16,
    ),
    "an unknown dtype": (
        {
            A: _entry(0, A_BYTES, [8, 128], "F12"),
            B: _entry(A_BYTES, A_BYTES + B_BYTES, [128, 8]),
        },
        A_BYTES + B_BYTES,
    ),
    "a negative shape": (
        {A: _entry(0, A_BYTES, [-8, -128]), B: _entry(A_BYTES, A_BYTES + B_BYTES, [128, 8])},
        A_BYTES + B_BYTES,
    ),
    "metadata that is not text": (
        {
            "__metadata__": {"format": 1},
            A: _entry(0, A_BYTES, [8, 128]),
            B: _entry(A_BYTES, A_BYTES + B_BYTES, [128, 8]),
        },
        A_BYTES + B_BYTES,
    ),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_safetensors_the_loader_refuses_are_refused(adapter: Path, refused: Any, case: str) -> None:
    _config_with(adapter, "target_modules", '["q_proj"]')
    header, data_bytes = LAYOUTS[case]
    _write_safetensors(adapter / WEIGHTS, header, bytes(data_bytes))
    # The library vLLM loads adapters with refuses the same file.
    with pytest.raises(SafetensorError), safe_open(str(adapter / WEIGHTS), "pt") as handle:
        [handle.get_tensor(name) for name in handle.keys()]  # noqa: SIM118
    failure = refused()
    assert failure.code == ErrorCode.ADAPTER_WEIGHTS_INVALID
    assert "not valid safetensors" in failure.message


def test_a_hand_written_file_with_a_correct_layout_passes(
    adapter: Path, fixtures_dir: Path
) -> None:
    _config_with(adapter, "target_modules", '["q_proj"]')
    header = {A: _entry(0, A_BYTES, [8, 128]), B: _entry(A_BYTES, A_BYTES + B_BYTES, [128, 8])}
    _write_safetensors(adapter / WEIGHTS, header, bytes(A_BYTES + B_BYTES))
    with safe_open(str(adapter / WEIGHTS), "pt") as handle:
        assert set(handle.keys()) == {A, B}
    base = fixtures_dir / "base"
    assert validate_adapter(adapter, base, str(base), LIMITS).target_modules == ("q_proj",)


def test_duplicate_tensor_names_in_the_header_are_refused(adapter: Path, refused: Any) -> None:
    _config_with(adapter, "target_modules", '["q_proj"]')
    text = json.dumps(
        {A: _entry(0, A_BYTES, [8, 128]), B: _entry(A_BYTES, A_BYTES + B_BYTES, [128, 8])}
    )
    text = text.replace(f'"{B}"', f'"{A}"').encode()
    (adapter / WEIGHTS).write_bytes(struct.pack("<Q", len(text)) + text + bytes(A_BYTES + B_BYTES))
    failure = refused()
    assert failure.code == ErrorCode.ADAPTER_WEIGHTS_INVALID and "appears twice" in failure.message


# -- non-finite weights --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.float32, float("nan")),
        (torch.float32, float("inf")),
        (torch.float16, float("-inf")),
        (torch.float16, float("nan")),
        (torch.bfloat16, float("nan")),
        (torch.bfloat16, float("-inf")),
    ],
)
def test_non_finite_weights_are_refused_naming_the_tensor(
    adapter: Path, refused: Any, dtype: torch.dtype, value: float
) -> None:
    tensors = {k: v.to(dtype) for k, v in load_file(str(adapter / WEIGHTS)).items()}
    name = sorted(tensors)[-1]
    tensors[name].view(-1)[-1] = value  # the very last element of the file
    save_file(tensors, str(adapter / WEIGHTS))
    failure = refused()
    assert failure.code == ErrorCode.ADAPTER_WEIGHTS_INVALID
    assert name in failure.message and "NaN or an infinity" in failure.message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_extreme_finite_weights_pass(adapter: Path, fixtures_dir: Path, dtype: torch.dtype) -> None:
    tensors = {k: v.to(dtype) for k, v in load_file(str(adapter / WEIGHTS)).items()}
    info = torch.finfo(dtype)
    flat = next(iter(tensors.values())).view(-1)
    flat[:4] = torch.tensor([info.max, -info.max, info.tiny / 2, -0.0], dtype=dtype)
    save_file(tensors, str(adapter / WEIGHTS))
    base = fixtures_dir / "base"
    validate_adapter(adapter, base, str(base), LIMITS)


def test_the_scan_reads_in_bounded_chunks(
    adapter: Path, fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 64-byte chunks, a NaN in the last chunk of a tensor is still found, and no read
    asks for more than a chunk."""
    tensors = load_file(str(adapter / WEIGHTS))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[-1] = float("nan")
    save_file(tensors, str(adapter / WEIGHTS))
    monkeypatch.setattr(weights, "SCAN_CHUNK_BYTES", 64)
    header = weights.read_header(adapter / WEIGHTS)
    reads: list[int] = []
    real_open = Path.open

    class Counting:
        """A file handle that records the size of each read."""

        def __init__(self, handle: Any) -> None:
            self._handle = handle

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self._handle.close()

        def seek(self, offset: int) -> int:
            return int(self._handle.seek(offset))

        def read(self, size: int) -> bytes:
            reads.append(size)
            return bytes(self._handle.read(size))

    monkeypatch.setattr(Path, "open", lambda self, *a, **k: Counting(real_open(self, *a, **k)))
    assert weights.first_non_finite(adapter / WEIGHTS, header) == name
    assert reads and max(reads) == 64


# -- what must still publish ---------------------------------------------------------------


def test_every_fixture_adapter_still_publishes(fixtures_dir: Path) -> None:
    """The fixtures the README and the correctness tests use (tests/integration/
    test_correctness.py proves each kind's tokens equal PEFT's through the engine)."""
    base = fixtures_dir / "base"
    specs = adapter_specs(12)
    for spec in specs:
        valid = validate_adapter(fixtures_dir / "adapters" / spec.name, base, str(base), LIMITS)
        assert (valid.rank, valid.alpha) == (spec.rank, spec.alpha)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_an_adapter_saved_by_peft_itself_publishes(
    tmp_path: Path, fixtures_dir: Path, use_rslora: bool
) -> None:
    """Every field PEFT writes, at PEFT's defaults, passes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = fixtures_dir / "base"
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=use_rslora
    )
    get_peft_model(model, config).save_pretrained(tmp_path / "peft")
    saved = json.loads((tmp_path / "peft" / CONFIG).read_text())
    assert {"fan_in_fan_out", "layers_to_transform", "rank_pattern", "use_dora"} <= set(saved)
    valid = validate_adapter(tmp_path / "peft", base, str(base), LIMITS)
    assert valid.rank == 4 and valid.alpha == 8


def test_the_readme_documents_every_restricted_option() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("**Supported PEFT options.**")[1].split("\n\n", 2)[1]
    assert all(f"`{option}`" in section for option in ENGINE_RUNS_ONLY), section
