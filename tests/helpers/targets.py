"""A small-vocabulary random Llama target (8 ids): small enough to enumerate every continuation
of a few tokens, so a sampled decoding can be compared with the exact distribution."""

from __future__ import annotations

import torch

from eagleforge.targets.hf import HFTarget


def small_vocab_target(vocab: int = 8) -> HFTarget:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        initializer_range=0.4, tie_word_embeddings=False,
    )  # fmt: skip
    return HFTarget(LlamaForCausalLM(config).float())
