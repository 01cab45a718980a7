"""Global token normalisation of the TTT loss (DESIGN.md, "Loss"): L = sum_i 0.8^i * L_i with
L_i summed over counted positions and divided by the counted positions of the whole step, so
padding and the split into micro-batches change neither the loss nor the gradients."""

from __future__ import annotations

import pytest
import torch

from eagleforge.batch import Teacher, TTTBatch
from eagleforge.draft.model import Eagle3Draft
from eagleforge.draft.ttt import (
    count_positions,
    loss_scales,
    simulated_acceptance_length,
    step_weights,
    ttt_forward,
)
from helpers.drafts import tiny_draft

pytestmark = pytest.mark.unit

STEPS = 3
V, W, HT = 50, 20, 12


def random_sequences(
    draft: Eagle3Draft, lengths: list[int], seed: int
) -> list[dict[str, torch.Tensor]]:
    """Per-sequence tensors (unpadded): ids, loss mask, aux states, teacher probs/targets."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        target_ids = torch.randint(0, V, (length,), generator=generator)
        loss_mask = torch.rand(length, generator=generator) < 0.7
        loss_mask[:2] = False  # a "prompt"
        out.append(
            {
                "ids": torch.randint(0, V, (length,), generator=generator),
                "loss_mask": loss_mask,
                "aux": torch.randn(length, 3 * HT, generator=generator),
                "probs": torch.softmax(torch.randn(length, W, generator=generator) * 2, dim=-1),
                "target_ids": target_ids,
                "in_draft": draft.t2d[target_ids],
            }
        )
    return out


def collate(
    sequences: list[dict[str, torch.Tensor]], pad_to: int | None = None, seed: int = 99
) -> TTTBatch:
    """Right-pad to the longest sequence (or ``pad_to``); padding slots hold random garbage,
    with loss_mask and in_draft set True there, so only ``valid`` keeps them out."""
    generator = torch.Generator().manual_seed(seed)
    seq = max(pad_to or 0, max(len(s["ids"]) for s in sequences))
    bsz = len(sequences)
    ids = torch.randint(0, V, (bsz, seq), generator=generator)
    valid = torch.zeros(bsz, seq, dtype=torch.bool)
    loss_mask = torch.ones(bsz, seq, dtype=torch.bool)
    aux = torch.randn(bsz, seq, 3 * HT, generator=generator)
    probs = torch.softmax(torch.randn(bsz, seq, W, generator=generator), dim=-1)
    target_ids = torch.randint(0, V, (bsz, seq), generator=generator)
    in_draft = torch.ones(bsz, seq, dtype=torch.bool)
    for row, s in enumerate(sequences):
        n = len(s["ids"])
        ids[row, :n] = s["ids"]
        valid[row, :n] = True
        loss_mask[row, :n] = s["loss_mask"]
        aux[row, :n] = s["aux"]
        probs[row, :n] = s["probs"]
        target_ids[row, :n] = s["target_ids"]
        in_draft[row, :n] = s["in_draft"]
    return TTTBatch(ids, valid, loss_mask, aux, Teacher(probs, target_ids, in_draft))


def loss_and_grads(
    draft: Eagle3Draft, micro_batches: list[TTTBatch]
) -> tuple[float, dict[str, torch.Tensor]]:
    """Accumulate the scaled loss over micro-batches with the step's global counts, as the trainer does."""
    draft.zero_grad(set_to_none=True)
    global_counts = sum(count_positions(mb, STEPS) for mb in micro_batches)
    weights = step_weights(STEPS, 0.8)
    total = 0.0
    for mb in micro_batches:
        loss = ttt_forward(draft, mb, STEPS, loss_scales(global_counts, weights)).loss
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    return total, grads


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_step_weights_are_powers_of_0_8() -> None:
    """step_weights(k, 0.8) = [0.8**0, ..., 0.8**(k-1)] in fp32."""
    weights = step_weights(5, 0.8)
    assert weights.dtype == torch.float32
    assert weights.tolist() == pytest.approx([1.0, 0.8, 0.64, 0.512, 0.4096])
    assert step_weights(1, 0.5).tolist() == [1.0]


def test_loss_scales_formula() -> None:
    """scale_i = w_i / N_i, with N_i = 0 treated as 1 (no NaN)."""
    got = loss_scales(torch.tensor([12, 8, 0]), step_weights(3, 0.8))
    assert got.tolist() == pytest.approx([1.0 / 12, 0.8 / 8, 0.64])


def test_extra_right_padding_changes_nothing() -> None:
    """The same sequences padded to 8 (their max) or to 13 give the same loss, counts and grads."""
    draft = tiny_draft()
    sequences = random_sequences(draft, [8, 5], seed=1)
    tight = collate(sequences)
    padded = collate(sequences, pad_to=13, seed=123)
    assert torch.equal(count_positions(tight, STEPS), count_positions(padded, STEPS))
    assert int(count_positions(tight, STEPS)[0]) > 0

    loss_tight, grads_tight = loss_and_grads(draft, [tight])
    loss_padded, grads_padded = loss_and_grads(draft, [padded])
    assert loss_padded == pytest.approx(loss_tight, rel=1e-5)
    assert_grads_close(grads_tight, grads_padded)

    stats_tight = ttt_forward(draft, tight, STEPS)
    stats_padded = ttt_forward(draft, padded, STEPS)
    assert torch.equal(stats_tight.num_correct_k, stats_padded.num_correct_k)
    torch.testing.assert_close(
        stats_tight.loss_sum_k, stats_padded.loss_sum_k, rtol=1e-5, atol=1e-6
    )


def test_micro_batch_split_matches_whole_batch() -> None:
    """Sequences of lengths 9, 4, 7 as one batch or as micro-batches [2, 1] (each padded to its
    own max) give the same summed loss and the same accumulated gradients."""
    draft = tiny_draft(seed=2)
    sequences = random_sequences(draft, [9, 4, 7], seed=3)
    whole = collate(sequences)
    split = [collate(sequences[:2], seed=5), collate(sequences[2:], seed=6)]
    assert torch.equal(
        sum(count_positions(mb, STEPS) for mb in split), count_positions(whole, STEPS)
    )

    loss_whole, grads_whole = loss_and_grads(draft, [whole])
    loss_split, grads_split = loss_and_grads(draft, split)
    assert loss_split == pytest.approx(loss_whole, rel=1e-5)
    assert_grads_close(grads_whole, grads_split)


def test_whole_batch_loss_is_per_token_mean() -> None:
    """The whole-batch loss equals sum_i 0.8^i * (mean soft CE over the counted positions of step i)."""
    draft = tiny_draft(seed=4)
    batch = collate(random_sequences(draft, [9, 4, 7], seed=8))
    stats = ttt_forward(draft, batch, STEPS)
    counts = count_positions(batch, STEPS)
    assert torch.equal(stats.num_counted_k, counts)
    expected = sum(0.8**i * stats.loss_sum_k[i].item() / counts[i].item() for i in range(STEPS))
    scaled = ttt_forward(draft, batch, STEPS, loss_scales(counts, step_weights(STEPS, 0.8)))
    assert scaled.loss.item() == pytest.approx(expected, rel=1e-6)


def test_per_sequence_normalisation_would_differ() -> None:
    """Guard: averaging each micro-batch by its own counts does NOT match the global loss here,
    so the micro-batch test above really checks global normalisation."""
    draft = tiny_draft(seed=2)
    sequences = random_sequences(draft, [9, 4, 7], seed=3)
    split = [collate(sequences[:2], seed=5), collate(sequences[2:], seed=6)]
    whole = collate(sequences)
    weights = step_weights(STEPS, 0.8)
    with torch.no_grad():
        whole_loss = ttt_forward(
            draft, whole, STEPS, loss_scales(count_positions(whole, STEPS), weights)
        ).loss
        local_mean = sum(
            ttt_forward(draft, mb, STEPS, loss_scales(count_positions(mb, STEPS), weights)).loss
            for mb in split
        ) / len(split)
    assert abs(local_mean.item() - whole_loss.item()) > 1e-3


def test_simulated_acceptance_length() -> None:
    """tau_sim = 1 + sum_j prod_{i<=j} acc_i."""
    assert simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([0.5, 0.5, 1.0]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert simulated_acceptance_length([1.0, 1.0]) == 3.0
    assert simulated_acceptance_length([0.0, 1.0]) == 1.0
