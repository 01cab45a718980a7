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


def exact_marginals(target: HFTarget, prompt: list[int], temperature: float) -> list[torch.Tensor]:
    """P(t1), P(t2), P(t3) of the target's sampled continuation, by enumeration."""
    vocab = target.config.vocab_size

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = target.model(input_ids=prefixes).logits[:, -1].float()
        return torch.softmax(logits / temperature, dim=-1)

    base = torch.tensor([prompt])
    p1 = next_probs(base)[0]
    t1 = torch.arange(vocab).unsqueeze(1)
    p2_given = next_probs(torch.cat([base.expand(vocab, -1), t1], dim=1))  # [t1, t2]
    joint12 = p1.unsqueeze(1) * p2_given
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    p3_given = next_probs(torch.cat([base.expand(vocab * vocab, -1), pairs], dim=1))
    joint123 = joint12.reshape(-1, 1) * p3_given
    return [p1, joint12.sum(0), joint123.sum(0)]
