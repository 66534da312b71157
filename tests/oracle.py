"""The correctness oracle: greedy decoding with transformers + PEFT on the same files."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


class PeftOracle:
    """Reference tokens for (adapter or base, prompt, n tokens), computed once each."""

    def __init__(self, fixtures_dir: Path) -> None:
        self._base_dir = fixtures_dir / "base"
        self._adapters_dir = fixtures_dir / "adapters"
        self._tokenizer = AutoTokenizer.from_pretrained(self._base_dir)
        self.tokens = cache(self._tokens)

    def _model(self, adapter: str | Path | None) -> torch.nn.Module:
        base = AutoModelForCausalLM.from_pretrained(self._base_dir, dtype=torch.float32)
        if adapter is None:
            return base.eval()
        path = adapter if isinstance(adapter, Path) else self._adapters_dir / adapter
        return PeftModel.from_pretrained(base, path).eval()

    def _tokens(self, adapter: str | Path | None, prompt: str, max_tokens: int) -> tuple[int, ...]:
        """Greedy tokens of ``adapter`` (a fixture name or a directory; ``None``: base)."""
        model = self._model(adapter)
        # Match jobs sent with ignore_eos: never stop on EOS, never suppress it either.
        model.generation_config.eos_token_id = None
        ids = self._tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self._tokenizer.pad_token_id,
            )
        return tuple(out[0, ids.shape[1] :].tolist())

    def decode(self, tokens: tuple[int, ...] | list[int]) -> str:
        """The text of ``tokens`` as the engine detokenizes it: special tokens dropped, and
        an incomplete UTF-8 character at the end (byte-level BPE) held back, not replaced."""
        text: str = self._tokenizer.decode(list(tokens), skip_special_tokens=True)
        return text.rstrip("\ufffd")

    def encode(self, text: str) -> list[int]:
        """``text``'s tokens without special tokens added (as a rendered chat prompt)."""
        ids: list[int] = self._tokenizer(text, add_special_tokens=False).input_ids
        return ids
