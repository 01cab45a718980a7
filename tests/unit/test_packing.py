"""Packed rows (several documents per row) give the same TTT loss, counts and gradients as the
same documents unpacked: attention, the shift and the TTT diagonal never cross a boundary."""

from __future__ import annotations

import pytest
import torch

from eagleforge.batch import Teacher, TTTBatch
from eagleforge.draft.attention import AttentionBackend, ttt_attention_mask
from eagleforge.draft.ttt import count_positions, loss_scales, step_weights, ttt_forward
from helpers.drafts import tiny_draft

pytestmark = pytest.mark.unit
STEPS = 3


def _documents(lengths: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    arch = tiny_draft().arch
    docs = []
    for length in lengths:
        docs.append(
            {
                "ids": torch.randint(0, arch.vocab_size, (length,), generator=generator),
                "loss_mask": torch.rand(length, generator=generator) > 0.2,
                "aux": torch.randn(length, 3 * arch.target_hidden_size, generator=generator),
                "probs": torch.softmax(
                    torch.randn(length, arch.draft_vocab_size, generator=generator), -1
                ),
                "targets": torch.randint(0, arch.vocab_size, (length,), generator=generator),
            }
        )
    return docs


def _unpacked(docs: list[dict[str, torch.Tensor]]) -> TTTBatch:
    seq = max(len(d["ids"]) for d in docs)

    def pad(key: str, value: float | int | bool = 0) -> torch.Tensor:
        rows = []
        for d in docs:
            t = d[key]
            filler = torch.full((seq - len(t), *t.shape[1:]), value, dtype=t.dtype)
            rows.append(torch.cat([t, filler]))
        return torch.stack(rows)

    valid = torch.stack([torch.arange(seq) < len(d["ids"]) for d in docs])
    return TTTBatch(
        pad("ids"), valid, pad("loss_mask", False), pad("aux"),
        Teacher(pad("probs"), pad("targets"), torch.ones_like(valid)),
    )  # fmt: skip


def _packed(docs: list[dict[str, torch.Tensor]]) -> TTTBatch:
    def cat(key: str) -> torch.Tensor:
        return torch.cat([d[key] for d in docs]).unsqueeze(0)

    document_ids = torch.cat(
        [torch.full((len(d["ids"]),), i) for i, d in enumerate(docs)]
    ).unsqueeze(0)
    positions = torch.cat([torch.arange(len(d["ids"])) for d in docs]).unsqueeze(0)
    valid = torch.ones_like(document_ids, dtype=torch.bool)
    return TTTBatch(
        cat("ids"), valid, cat("loss_mask"), cat("aux"),
        Teacher(cat("probs"), cat("targets"), torch.ones_like(valid)),
        document_ids_BT=document_ids, position_ids_BT=positions,
    )  # fmt: skip


def _run(batch: TTTBatch, attention: AttentionBackend):  # type: ignore[no-untyped-def]
    draft = tiny_draft(seed=3)
    scale_k = loss_scales(count_positions(batch, STEPS), step_weights(STEPS, 0.8))
    stats = ttt_forward(draft, batch, STEPS, scale_k, attention=attention)
    stats.loss.backward()
    grads = {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}
    return stats, grads


@pytest.mark.parametrize("attention", [AttentionBackend.eager, AttentionBackend.sdpa])
def test_packed_equals_unpacked(attention: AttentionBackend) -> None:
    docs = _documents([7, 5, 6])
    unpacked, unpacked_grads = _run(_unpacked(docs), attention)
    packed, packed_grads = _run(_packed(docs), attention)
    assert torch.equal(packed.num_counted_k, unpacked.num_counted_k)
    assert int(packed.num_counted_k[0]) > 0
    assert torch.equal(packed.num_correct_k, unpacked.num_correct_k)
    torch.testing.assert_close(packed.loss_sum_k, unpacked.loss_sum_k, rtol=1e-5, atol=1e-5)
    for name, grad in unpacked_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packing_without_document_ids_would_differ() -> None:
    """The guard: the same packed row without document ids (attention and shift crossing
    boundaries) gives a different loss, so the equality above is not an accident."""
    docs = _documents([7, 5, 6])
    packed = _packed(docs)
    crossing = TTTBatch(
        packed.input_ids_BT, packed.valid_BT, packed.loss_mask_BT, packed.aux_BTA, packed.teacher
    )
    with torch.no_grad():
        a = ttt_forward(tiny_draft(seed=3), packed, STEPS)
        b = ttt_forward(tiny_draft(seed=3), crossing, STEPS)
    assert not torch.allclose(a.loss_sum_k, b.loss_sum_k)


def test_mask_blocks_other_documents() -> None:
    valid = torch.ones(1, 4, dtype=torch.bool)
    documents = torch.tensor([[0, 0, 1, 1]])
    mask = ttt_attention_mask(valid, 2, documents)[0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [0, 0, 1, 0, 0, 0, 1, 0],
        [0, 0, 1, 1, 0, 0, 0, 1],
    ]
