from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from lorafleet.fixtures import AdapterSpec


def test_adapters_cover_two_ranks_and_two_target_sets(specs: list[AdapterSpec]) -> None:
    assert len(specs) == 12
    assert {spec.rank for spec in specs} == {4, 8}
    assert len({spec.target_modules for spec in specs}) == 2
    assert len({spec.seed for spec in specs}) == 12


def test_adapter_files_are_peft_format_with_matching_shapes(
    fixtures_dir: Path, specs: list[AdapterSpec]
) -> None:
    base = json.loads((fixtures_dir / "base" / "config.json").read_text())
    for spec in specs:
        directory = fixtures_dir / "adapters" / spec.name
        config = json.loads((directory / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA"
        assert config["r"] == spec.rank
        assert sorted(config["target_modules"]) == sorted(spec.target_modules)
        with safe_open(directory / "adapter_model.safetensors", "pt") as weights:
            names = list(weights.keys())
            assert len(names) == 2 * len(spec.target_modules) * base["num_hidden_layers"]
            a = weights.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
            assert tuple(a.shape) == (spec.rank, base["hidden_size"])


def test_base_model_has_shapes_vllm_cpu_accepts(fixtures_dir: Path) -> None:
    config = json.loads((fixtures_dir / "base" / "config.json").read_text())
    assert config["head_dim"] == 64
    assert config["architectures"] == ["LlamaForCausalLM"]
    tokenizer = json.loads((fixtures_dir / "base" / "tokenizer_config.json").read_text())
    assert "chat_template" in tokenizer or (fixtures_dir / "base" / "chat_template.jinja").exists()
