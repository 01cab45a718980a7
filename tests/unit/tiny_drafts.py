"""A tiny hand-sized draft shared by the TTT unit tests (H=16, 2 heads, 1 kv head, V=50, W=20)."""

from __future__ import annotations

import torch

from eagleforge.draft.model import DraftArchitecture, Eagle3Draft


def tiny_arch() -> DraftArchitecture:
    return DraftArchitecture(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        vocab_size=50,
        draft_vocab_size=20,
        target_hidden_size=12,
        aux_layer_ids=[1, 2, 3],
    )


def tiny_draft(seed: int = 0) -> Eagle3Draft:
    """Random weights (std 0.3), a random embedding and a random sorted draft vocabulary."""
    arch = tiny_arch()
    generator = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(arch)
    draft.init_weights(0.3, generator)
    draft.load_embedding(torch.randn(arch.vocab_size, arch.hidden_size, generator=generator))
    kept = torch.sort(
        torch.randperm(arch.vocab_size, generator=generator)[: arch.draft_vocab_size]
    ).values
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_map(kept - torch.arange(arch.draft_vocab_size), t2d)
    return draft
