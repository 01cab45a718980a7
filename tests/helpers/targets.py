"""A small-vocabulary random Llama target (8 ids): small enough to enumerate every continuation
of a few tokens, so a sampled decoding can be compared with the exact distribution."""

from __future__ import annotations

import torch

from eagleforge.speculative.decoder import SpeculativeDecoder
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


def assert_samples_follow_the_target(
    decoder: SpeculativeDecoder,
    target: HFTarget,
    prompt: list[int],
    temperature: float,
    runs: int = 1500,
) -> None:
    """Decode ``prompt`` ``runs`` times at ``temperature``: the draft's proposals must really be
    accepted, and each of the first 3 generated positions' marginals must match the target's
    (chi-square over 8 tokens, 7 degrees of freedom; 35 is p < 1e-5)."""
    counts = torch.zeros(3, target.config.vocab_size)
    generator = torch.Generator().manual_seed(11)
    accepted = 0
    for _ in range(runs):
        result = decoder.generate(prompt, generator)
        accepted += sum(result.accepted_lengths)
        for position, token in enumerate(result.output_ids[:3]):
            counts[position, token] += 1
    assert accepted > runs // 4  # the draft's proposals are really being accepted
    for position, expected in enumerate(exact_marginals(target, prompt, temperature)):
        chi2 = float((((counts[position] - runs * expected) ** 2) / (runs * expected)).sum())
        assert chi2 < 35.0, (position, chi2, counts[position] / runs, expected)
