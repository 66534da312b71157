"""Validate an adapter directory before anything reaches S3 or an engine, by the engine's
own rules: what passes here loads in vLLM and runs as PEFT runs it.

``adapter_config.json`` and the safetensors headers are read first; the adapter's weights are
then scanned, streamed, for values that are not finite. No weights are loaded into a model
and no pickle is ever opened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from contracts import strict_json
from contracts.errors import ErrorCode
from lorafleet.weights import (
    SCANNED_DTYPES,
    TensorInfo,
    check_layout,
    first_non_finite,
    read_header,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# Formats that deserialise with pickle (arbitrary code execution on load).
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
PEFT_PREFIX = "base_model.model."

# PEFT options vLLM refuses, or ignores and so would run otherwise than PEFT: a config may
# leave each out or give it one of these values (README: "Supported PEFT options").
ENGINE_RUNS_ONLY: dict[str, tuple[object, ...]] = {
    "bias": ("none",),  # vLLM refuses trained biases
    "lora_bias": (False,),
    "use_dora": (False,),  # vLLM refuses DoRA
    "modules_to_save": (None, []),  # vLLM refuses them for a causal LM
    "layer_replication": (None, []),
    "alora_invocation_tokens": (None, []),
    "use_qalora": (False,),
    "use_bdlora": (None, False, {}),
    "fan_in_fan_out": (False,),  # ignored by vLLM: the weights would run transposed
    "layers_to_transform": (None, []),  # ignored by vLLM: PEFT adapts only those layers
    "layers_pattern": (None, [], ""),
    "exclude_modules": (None, [], ""),
    "target_parameters": (None, []),  # ignored by vLLM: it adapts modules, not parameters
    "trainable_token_indices": (None, [], {}),  # ignored by vLLM: trained token embeddings
    # Per-module ranks and alphas: every tensor is checked against the one ``r``.
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
}
# Initialisations that leave a saved adapter a plain LoRA (the ones vLLM accepts); the others
# (PiSSA, OLoRA, LoftQ, ...) change the base weights when PEFT loads the adapter.
PLAIN_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica", "lora_ga"})


class ValidationFailure(Exception):
    """The adapter is refused; ``code`` is stable, ``message`` says what to fix, ``field``
    names the config field at fault, if one is."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


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


def base_model_modules(base_dir: Path) -> dict[str, tuple[int, int]]:
    """``{module path: (out_features, in_features)}`` of the base model's linear weights."""
    index = base_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = [p.name for p in sorted(base_dir.glob("*.safetensors"))]
    modules = {}
    for shard in shards:
        for name, info in read_header(base_dir / shard).tensors.items():
            if name.endswith(".weight") and len(info.shape) == 2:
                out_features, in_features = info.shape
                modules[name.removesuffix(".weight")] = (out_features, in_features)
    return modules


def _fail(code: ErrorCode, message: str, field: str | None = None) -> ValidationFailure:
    return ValidationFailure(code, message, field)


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
        config = strict_json.loads((directory / CONFIG_FILE).read_bytes())
    except strict_json.JsonRefusal as exc:
        raise _fail(
            ErrorCode.ADAPTER_CONFIG_INVALID, f"{CONFIG_FILE} is not valid JSON: {exc}", exc.field
        ) from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise _fail(
            ErrorCode.ADAPTER_CONFIG_INVALID,
            f"{CONFIG_FILE} must declare peft_type LORA.",
            "peft_type",
        )
    _check_numbers(config)
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _fail(
            ErrorCode.ADAPTER_CONFIG_INVALID,
            "target_modules must be a non-empty list of module names (regex strings are "
            "not supported).",
            "target_modules",
        )
    for option, allowed in ENGINE_RUNS_ONLY.items():
        if option in config and not _one_of(config[option], allowed):
            raise _fail(
                ErrorCode.ADAPTER_CONFIG_INVALID,
                f"{option}={_shown(config[option])} is not supported: the engine would refuse "
                f"the adapter or run it otherwise than PEFT; supported: "
                f"{' or '.join(json.dumps(a) for a in allowed)}.",
                option,
            )
    if not _one_of(config.get("use_rslora", False), (False, True)):
        raise _fail(
            ErrorCode.ADAPTER_CONFIG_INVALID, "use_rslora must be true or false.", "use_rslora"
        )
    init = config.get("init_lora_weights", True)
    if not (
        _one_of(init, (False, True)) or (isinstance(init, str) and init.lower() in PLAIN_INITS)
    ):
        raise _fail(
            ErrorCode.ADAPTER_CONFIG_INVALID,
            f"init_lora_weights={_shown(init)} is not supported: it changes the base model's "
            f"weights when PEFT loads the adapter; supported: true, false, "
            f"{', '.join(sorted(PLAIN_INITS))}.",
            "init_lora_weights",
        )
    return config


def _check_numbers(config: dict[str, Any]) -> None:
    """``r``, ``lora_alpha`` (required: vLLM has no default) and ``lora_dropout`` in range;
    the parser already refused every non-finite number in the file."""
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(ErrorCode.ADAPTER_CONFIG_INVALID, "r must be a positive integer.", "r")
    alpha = config.get("lora_alpha")
    if not _is_number(alpha) or alpha <= 0:
        raise _fail(
            ErrorCode.ADAPTER_CONFIG_INVALID,
            f"lora_alpha must be a positive number (it is {_shown(alpha)}).",
            "lora_alpha",
        )
    dropout = config.get("lora_dropout", 0.0)
    if not _is_number(dropout) or not 0 <= dropout <= 1:
        raise _fail(
            ErrorCode.ADAPTER_CONFIG_INVALID,
            f"lora_dropout must be a number from 0 to 1 (it is {_shown(dropout)}).",
            "lora_dropout",
        )


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _one_of(value: object, allowed: tuple[object, ...]) -> bool:
    """``value`` equals one of ``allowed`` with the same JSON type (``0`` is not ``false``)."""
    return any(type(value) is type(option) and value == option for option in allowed)


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
        if info.dtype not in SCANNED_DTYPES:
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
    weights = directory / WEIGHTS_FILE
    try:
        header = read_header(weights)
        check_layout(header)
    except ValueError as exc:
        raise _fail(
            ErrorCode.ADAPTER_WEIGHTS_INVALID, f"{WEIGHTS_FILE} is not valid safetensors: {exc}"
        ) from exc
    _check_tensors(header.tensors, rank, set(config["target_modules"]), modules)
    non_finite = first_non_finite(weights, header)
    if non_finite is not None:
        raise _fail(
            ErrorCode.ADAPTER_WEIGHTS_INVALID,
            f"Tensor {non_finite!r} holds a NaN or an infinity; the adapter would generate "
            "garbage.",
        )
    return ValidAdapter(
        rank=rank,
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(sorted(config["target_modules"])),
    )
