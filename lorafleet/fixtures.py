"""Deterministic fixtures: a tiny Llama base model and LoRA adapters in PEFT format.

Everything is generated locally from fixed seeds (no hub downloads), with shapes vLLM-CPU
accepts: head_dim 64 (CPU attention refuses 16), float32, max_model_len 256.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BASE_SEED = 1234
VOCAB_SIZE = 512
MAX_POSITION_EMBEDDINGS = 256
LAYERS = 2
HIDDEN = 128
INTERMEDIATE = 256
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 64
# Larger than Llama's 0.02 so greedy logits have clear margins: near-ties would make the
# engine-vs-PEFT comparison flaky for reasons that have nothing to do with adapters.
INITIALIZER_RANGE = 0.2
LORA_INIT_STD = 0.2

ATTENTION_QV = ("q_proj", "v_proj")
ATTENTION_ALL = ("q_proj", "k_proj", "v_proj", "o_proj")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the server batches requests.
A tenant fine-tunes an adapter for invoices, another for contracts, a third for support tickets.
Extract the total amount, the due date and the vendor name from the following document.
Summarise the conversation in one sentence and list the action items with their owners.
Translate the paragraph into French, keeping the product names and the numbers unchanged.
Classify the sentiment of this review as positive, negative or neutral, and explain why.
The engine loads hot adapters into GPU slots, warm ones into CPU memory, cold ones from storage.
Queues fill and drain; workers scale with the depth of each tier and the age of the oldest job.
Digests prove which weights ran: a name must change whenever the weights change.
Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 and punctuation , . ; : ! ? ( ) [ ] { } " ' - _ / @ #
"""


@dataclass(frozen=True)
class AdapterSpec:
    """One generated adapter: its directory name, LoRA rank, alpha and target modules."""

    name: str
    seed: int
    rank: int
    alpha: int
    target_modules: tuple[str, ...]


def adapter_specs(count: int) -> list[AdapterSpec]:
    """Specs for ``count`` adapters cycling over two ranks and two target-module sets."""
    specs = []
    combos = [(8, ATTENTION_QV), (4, ATTENTION_ALL), (4, ATTENTION_QV), (8, ATTENTION_ALL)]
    for index in range(count):
        rank, targets = combos[index % len(combos)]
        label = "qv" if targets == ATTENTION_QV else "qkvo"
        specs.append(
            AdapterSpec(
                name=f"lora-{index:02d}-r{rank}-{label}",
                seed=10_000 + index,
                rank=rank,
                alpha=2 * rank,
                target_modules=targets,
            )
        )
    return specs


def write_tokenizer(out_dir: Path) -> int:
    """Train a byte-level BPE tokenizer on the embedded corpus; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.model_max_length = MAX_POSITION_EMBEDDINGS
    fast.save_pretrained(out_dir)
    return len(fast)


def write_base_model(out_dir: Path) -> None:
    """Write a tiny Llama (random weights from ``BASE_SEED``) plus tokenizer in HF format."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(BASE_SEED)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)


def write_adapter(out_dir: Path, spec: AdapterSpec, base_dir: Path) -> None:
    """Write one PEFT-format LoRA adapter (adapter_config.json + adapter_model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config["head_dim"]
    shapes = {
        "q_proj": (hidden, config["num_attention_heads"] * head_dim),
        "k_proj": (hidden, config["num_key_value_heads"] * head_dim),
        "v_proj": (hidden, config["num_key_value_heads"] * head_dim),
        "o_proj": (config["num_attention_heads"] * head_dim, hidden),
    }
    generator = torch.Generator().manual_seed(spec.seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in spec.target_modules:
            in_features, out_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            # PEFT initialises lora_B to zero (an identity adapter); random B makes each
            # adapter's output distinguishable from the base model and from the others.
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(spec.rank, in_features, generator=generator) * LORA_INIT_STD
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(out_features, spec.rank, generator=generator) * LORA_INIT_STD
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_dir),
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")


def write_fixtures(out: Path, adapters: int = 12) -> list[AdapterSpec]:
    """Write ``out/base`` and ``out/adapters/<name>``; idempotent for an existing complete tree."""
    base_dir = out / "base"
    if not (base_dir / "model.safetensors").exists():
        write_base_model(base_dir)
    specs = adapter_specs(adapters)
    for spec in specs:
        adapter_dir = out / "adapters" / spec.name
        if not (adapter_dir / "adapter_config.json").exists():
            write_adapter(adapter_dir, spec, base_dir)
    return specs
