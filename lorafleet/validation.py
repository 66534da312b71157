"""Validate an adapter directory before anything reaches S3 or an engine.

Only headers are read: ``adapter_config.json`` and the safetensors headers of the adapter and
of the base model. No weights are loaded and no pickle is ever opened.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.errors import ErrorCode

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# Formats that deserialise with pickle (arbitrary code execution on load).
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
MAX_HEADER_BYTES = 100 * 1024 * 1024
PEFT_PREFIX = "base_model.model."


class ValidationFailure(Exception):
    """The adapter is refused; ``code`` is stable, ``message`` says what to fix."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Limits:
    """What the fleet accepts: largest rank, per-file and total size in bytes."""

    max_lora_rank: int
    max_file_bytes: int
    max_total_bytes: int


@dataclass(frozen=True)
class ValidAdapter:
    """What publishing needs from a validated adapter directory."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes and shapes from a safetensors header (weights are not read)."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError("file is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header length {length} does not fit the file")
        header = json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_bytes = size - 8 - length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= data_bytes:
            raise ValueError(f"tensor {name} points outside the file")
        tensors[name] = TensorInfo(dtype=str(info["dtype"]), shape=tuple(info["shape"]))
    return tensors


def base_model_modules(base_dir: Path) -> dict[str, tuple[int, int]]:
    """``{module path: (out_features, in_features)}`` of the base model's linear weights."""
    index = base_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = [p.name for p in sorted(base_dir.glob("*.safetensors"))]
    modules = {}
    for shard in shards:
        for name, info in read_safetensors_header(base_dir / shard).items():
            if name.endswith(".weight") and len(info.shape) == 2:
                out_features, in_features = info.shape
                modules[name.removesuffix(".weight")] = (out_features, in_features)
    return modules


def _fail(code: ErrorCode, message: str) -> ValidationFailure:
    return ValidationFailure(code, message)


def _check_files(directory: Path, limits: Limits) -> None:
    unsafe = sorted(p.name for p in directory.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if unsafe:
        raise _fail(
            ErrorCode.ADAPTER_UNSAFE_FORMAT,
            f"{', '.join(unsafe)}: pickle-based weight files are refused (and never opened); "
            "convert the adapter to safetensors.",
        )
    if not (directory / CONFIG_FILE).is_file():
        raise _fail(ErrorCode.ADAPTER_CONFIG_MISSING, f"{directory} has no {CONFIG_FILE}.")
    if not (directory / WEIGHTS_FILE).is_file():
        raise _fail(ErrorCode.ADAPTER_WEIGHTS_MISSING, f"{directory} has no {WEIGHTS_FILE}.")
    total = 0
    for name in ADAPTER_FILES:
        path = directory / name
        if path.is_symlink():
            raise _fail(ErrorCode.ADAPTER_CONFIG_INVALID, f"{name} is a symlink; copy the file.")
        size = path.stat().st_size
        total += size
        if size > limits.max_file_bytes:
            raise _fail(
                ErrorCode.ADAPTER_TOO_LARGE,
                f"{name} is {size} bytes; the limit per file is {limits.max_file_bytes}.",
            )
    if total > limits.max_total_bytes:
        raise _fail(
            ErrorCode.ADAPTER_TOO_LARGE,
            f"The adapter is {total} bytes; the limit is {limits.max_total_bytes}.",
        )


def _read_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(ErrorCode.ADAPTER_CONFIG_INVALID, f"{CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise _fail(ErrorCode.ADAPTER_CONFIG_INVALID, f"{CONFIG_FILE} must declare peft_type LORA.")
    rank, targets = config.get("r"), config.get("target_modules")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(ErrorCode.ADAPTER_CONFIG_INVALID, "r must be a positive integer.")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _fail(
            ErrorCode.ADAPTER_CONFIG_INVALID,
            "target_modules must be a non-empty list of module names (regex strings are "
            "not supported).",
        )
    if not isinstance(config.get("lora_alpha", rank), int | float):
        raise _fail(ErrorCode.ADAPTER_CONFIG_INVALID, "lora_alpha must be a number.")
    for unsupported in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(unsupported):
            raise _fail(ErrorCode.ADAPTER_CONFIG_INVALID, f"{unsupported} is not supported.")
    if config.get("use_dora"):
        raise _fail(ErrorCode.ADAPTER_CONFIG_INVALID, "DoRA adapters are not supported.")
    return config


def _check_base_name(config: dict[str, Any], base_model_id: str) -> None:
    declared = config.get("base_model_name_or_path")
    if not declared:
        return  # nothing declared: the tensor shapes below are the check
    if Path(str(declared)).name.lower() != Path(base_model_id).name.lower():
        raise _fail(
            ErrorCode.BASE_MODEL_MISMATCH,
            f"The adapter was trained for {declared!r}; this fleet serves {base_model_id!r}.",
        )


def _check_tensors(
    tensors: dict[str, TensorInfo],
    rank: int,
    targets: set[str],
    modules: dict[str, tuple[int, int]],
) -> None:
    seen: dict[str, set[str]] = {}
    for name, info in tensors.items():
        if not name.startswith(PEFT_PREFIX) or not name.endswith(
            (".lora_A.weight", ".lora_B.weight")
        ):
            raise _fail(ErrorCode.ADAPTER_SHAPE_MISMATCH, f"Unexpected tensor {name!r}.")
        module, kind = name.removeprefix(PEFT_PREFIX).rsplit(".", 2)[:2]
        if module not in modules:
            raise _fail(
                ErrorCode.ADAPTER_SHAPE_MISMATCH,
                f"Tensor {name!r} adapts {module!r}, which the base model does not have.",
            )
        if module.rsplit(".", 1)[-1] not in targets:
            raise _fail(
                ErrorCode.ADAPTER_SHAPE_MISMATCH,
                f"Tensor {name!r} adapts a module outside target_modules.",
            )
        if info.dtype not in FLOAT_DTYPES:
            raise _fail(
                ErrorCode.ADAPTER_SHAPE_MISMATCH, f"Tensor {name!r} has dtype {info.dtype}."
            )
        out_features, in_features = modules[module]
        expected = (rank, in_features) if kind == "lora_A" else (out_features, rank)
        if info.shape != expected:
            raise _fail(
                ErrorCode.ADAPTER_SHAPE_MISMATCH,
                f"Tensor {name!r} has shape {list(info.shape)}; the base model and r={rank} "
                f"need {list(expected)}.",
            )
        seen.setdefault(module, set()).add(kind)
    if not seen:
        raise _fail(ErrorCode.ADAPTER_WEIGHTS_INVALID, f"{WEIGHTS_FILE} holds no LoRA tensors.")
    unpaired = sorted(module for module, kinds in seen.items() if kinds != {"lora_A", "lora_B"})
    if unpaired:
        raise _fail(
            ErrorCode.ADAPTER_SHAPE_MISMATCH, f"Modules without both lora_A and lora_B: {unpaired}."
        )


def validate_adapter(
    directory: Path, base_dir: Path, base_model_id: str, limits: Limits
) -> ValidAdapter:
    """Check ``directory`` against the fleet's base model and limits; raise or describe it."""
    _check_files(directory, limits)
    config = _read_config(directory)
    rank: int = config["r"]
    if rank > limits.max_lora_rank:
        raise _fail(
            ErrorCode.RANK_TOO_LARGE,
            f"Rank {rank} exceeds the fleet's max_lora_rank {limits.max_lora_rank}.",
        )
    _check_base_name(config, base_model_id)
    modules = base_model_modules(base_dir)
    leaf_names = {module.rsplit(".", 1)[-1] for module in modules}
    unknown = sorted(set(config["target_modules"]) - leaf_names)
    if unknown:
        raise _fail(
            ErrorCode.TARGET_MODULES_UNKNOWN,
            f"The base model has no modules named {unknown}.",
        )
    try:
        tensors = read_safetensors_header(directory / WEIGHTS_FILE)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise _fail(
            ErrorCode.ADAPTER_WEIGHTS_INVALID, f"{WEIGHTS_FILE} is not valid safetensors: {exc}"
        ) from exc
    _check_tensors(tensors, rank, set(config["target_modules"]), modules)
    return ValidAdapter(
        rank=rank,
        alpha=float(config.get("lora_alpha", rank)),
        target_modules=tuple(sorted(config["target_modules"])),
    )
