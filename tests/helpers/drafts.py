"""Drafts without training: a tiny hand-sized one (H=16, 2 heads, 1 kv head, V=50, W=20) and
random batches for it (the TTT, checkpoint and export tests), a tiny DFlash one for the same
12-wide target, and a random draft for a real target (the decoding tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from eagleforge.batch import Teacher, TTTBatch
from eagleforge.draft.config import DraftConfig
from eagleforge.draft.dflash import DFlashArchitecture, DFlashDraft
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.targets.hf import HFTarget

# EAGLE-3.1's switches, one at a time and together (fc_norm and norm_before_fc exclude each other)
EAGLE31_VARIANTS = {
    "eagle3": {},
    "fc_norm": {"fc_norm": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_output": {"norm_output": True},
    "norm_before_residual": {"norm_before_residual": True},
    "all": {"fc_norm": True, "norm_output": True, "norm_before_residual": True},
}


def tiny_arch(**switches: bool) -> DraftArchitecture:
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
        **switches,
    )


def tiny_draft(seed: int = 0, **switches: bool) -> Eagle3Draft:
    """Random weights (std 0.3), a random embedding and a random sorted draft vocabulary;
    EAGLE-3.1's ``switches`` add norms whose weights are random too (never the ones a
    skipped norm would pass for)."""
    arch = tiny_arch(**switches)
    generator = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(arch)
    draft.init_weights(0.3, generator)
    if switches:
        with torch.no_grad():
            for name, param in draft.named_parameters():
                if "norm" in name and param.ndim == 1:
                    param.add_(0.3 * torch.randn(param.shape, generator=generator))
    draft.load_embedding(torch.randn(arch.vocab_size, arch.hidden_size, generator=generator))
    kept = torch.sort(
        torch.randperm(arch.vocab_size, generator=generator)[: arch.draft_vocab_size]
    ).values
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_map(kept - torch.arange(arch.draft_vocab_size), t2d)
    return draft


def tiny_dflash(seed: int = 0, **fields: object) -> DFlashDraft:
    """A one-layer DFlash draft (blocks of 4, mask token 5) for ``tiny_target_gguf``'s target,
    its weights random."""
    arch = DFlashArchitecture(**{
        "hidden_size": 12, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "vocab_size": 50, "target_hidden_size": 12, "num_target_layers": 5,
        "aux_layer_ids": [1, 2, 3], "block_size": 4, "mask_token_id": 5, **fields,
    })  # type: ignore[arg-type]  # fmt: skip
    draft = DFlashDraft(arch)
    draft.init_weights(0.2, torch.Generator().manual_seed(seed))
    with torch.no_grad():  # norms away from ones, so a misplaced one shows
        for name, param in draft.named_parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed + len(name)))
    return draft


def tiny_target_gguf(path: Path, hidden_size: int = 12, layers: int = 5, vocab: int = 50) -> Path:
    """The metadata of a GGUF target ``tiny_arch``'s draft fits (llama, 5 layers, hidden 12,
    a 50-token BPE vocabulary), no weights: what a GGUF draft export reads from its target."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", layers)
    writer.add_uint32("llama.embedding_length", hidden_size)
    writer.add_uint32("llama.vocab_size", vocab)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    writer.add_array("tokenizer.ggml.token_type", [1] * vocab)
    writer.add_array("tokenizer.ggml.merges", ["t 1"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_batch(
    arch: DraftArchitecture,
    seed: int,
    padded_row: int,
    real_length: int,
    supervised_share: float = 1.0,
) -> TTTBatch:
    """A random [2, 12] TTTBatch for ``arch`` whose row ``padded_row`` ends after ``real_length``."""
    generator = torch.Generator().manual_seed(seed)
    batch, seq = 2, 12
    valid = torch.ones(batch, seq, dtype=torch.bool)
    valid[padded_row, real_length:] = False
    return TTTBatch(
        input_ids_BT=torch.randint(0, arch.vocab_size, (batch, seq), generator=generator),
        valid_BT=valid,
        loss_mask_BT=torch.rand(batch, seq, generator=generator) < supervised_share,
        aux_BTA=torch.randn(batch, seq, 3 * arch.target_hidden_size, generator=generator),
        teacher=Teacher(
            probs_BTW=torch.softmax(
                torch.randn(batch, seq, arch.draft_vocab_size, generator=generator), -1
            ),
            target_ids_BT=torch.randint(0, arch.vocab_size, (batch, seq), generator=generator),
            in_draft_BT=torch.ones(batch, seq, dtype=torch.bool),
        ),
    )


def random_draft(target: HFTarget, draft_vocab: int, std: float, seed: int) -> Eagle3Draft:
    """An untrained draft for a real ``target``, over its first ``draft_vocab`` ids."""
    arch = DraftArchitecture.from_target(
        target.config, DraftConfig(draft_vocab_size=draft_vocab), target.aux_layer_ids
    )
    draft = Eagle3Draft(arch)
    draft.init_weights(std, torch.Generator().manual_seed(seed))
    draft.load_embedding(target.input_embedding().detach())
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    draft.set_vocab_map(torch.zeros(draft_vocab, dtype=torch.long), t2d)
    return draft.eval()


def lens_draft(target: HFTarget, draft_vocab: int, seed: int, **switches: bool) -> Eagle3Draft:
    """An untrained draft for a real ``target`` that starts as its logit lens
    (``draft.init=logit_lens``), so that some proposals are accepted; EAGLE-3.1's
    ``switches`` add norms with random weights (an engine that skipped one would propose
    other tokens)."""
    arch = DraftArchitecture.from_target(
        target.config, DraftConfig(draft_vocab_size=draft_vocab, **switches), target.aux_layer_ids
    )
    generator = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(arch)
    draft.init_weights(0.02, generator)
    draft.load_embedding(target.input_embedding().detach())
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[:draft_vocab] = True
    draft.set_vocab_map(torch.zeros(draft_vocab, dtype=torch.long), t2d)
    norm = target.final_norm_weight()
    assert norm is not None
    draft.init_logit_lens(norm.detach(), target.lm_head_weight().detach())
    with torch.no_grad():
        for module in (draft.input_norm, *(draft.fc_norm or [])):
            if module is not None:
                module.weight.mul_(1 + 0.2 * torch.randn(module.weight.shape, generator=generator))
    return draft.eval()
