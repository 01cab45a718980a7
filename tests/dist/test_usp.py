"""USP sequence parallelism (parallel/usp.py) on gloo ranks: each rank's chunk of the attention
and of the TTT equals the single-process computation restricted to that chunk, gradients
included, for Ulysses only, ring only and both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.ranks import run_ranks

from eagleforge.draft.attention import eager_ttt_attention
from eagleforge.draft.model import DraftArchitecture
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.config import DraftConfig
from eagleforge.draft.ttt import count_positions, loss_scales, step_weights, ttt_forward
from eagleforge.batch import Teacher, TTTBatch
from eagleforge.errors import ConfigError
from eagleforge.parallel import ParallelConfig
from eagleforge.parallel.dist import World, init_distributed
from eagleforge.parallel.usp import (
    SequenceParallel,
    USPBackend,
    check_heads,
    shard_sequence,
    usp_ttt_attention,
)

from helpers.drafts import tiny_arch, tiny_draft

pytestmark = pytest.mark.dist

ULYSSES = {"sp_ulysses": 2}
RING = {"sp_ring": 2}
BOTH = {"sp_ulysses": 2, "sp_ring": 2}
TTT_LENGTH = 3


# --- Attention ---------------------------------------------------------------------------------

# Row 1 is padded after 8 of 12 positions; packed: row 0 holds three documents, row 1 two.
VALID = torch.tensor([[True] * 12, [True] * 8 + [False] * 4])
DOCUMENTS = torch.tensor([[0] * 3 + [1] * 5 + [2] * 4, [0] * 5 + [1] * 3 + [2] * 4])


def _attention_matches_eager(sp: SequenceParallel) -> None:
    seq = VALID.shape[1]
    chunk = sp.chunk_length(seq)
    assert chunk * sp.size == seq
    here = slice(sp.chunk_index * chunk, (sp.chunk_index + 1) * chunk)
    for num_heads, num_kv_heads in [(2, 1), (4, 2), (4, 1)]:
        for documents in (None, DOCUMENTS):
            generator = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
            q = torch.randn(2, num_heads, seq, 8, generator=generator)
            keys = [torch.randn(2, num_kv_heads, seq, 8, generator=generator) for _ in range(3)]
            values = [torch.randn(2, num_kv_heads, seq, 8, generator=generator) for _ in range(3)]
            grad_out = torch.randn(2, seq, num_heads * 8, generator=generator)
            tensors = [q, *keys, *values]
            for x in tensors:
                x.requires_grad_()
            expected = eager_ttt_attention(q, keys, values, VALID, documents)
            expected.backward(grad_out)

            chunks = [x.detach()[:, :, here].requires_grad_() for x in tensors]
            got = usp_ttt_attention(
                chunks[0],
                chunks[1:4],
                chunks[4:],
                VALID[:, here],
                None if documents is None else documents[:, here],
                sp,
            )
            got.backward(grad_out[:, here])
            torch.testing.assert_close(got, expected[:, here], rtol=1e-4, atol=1e-5)
            for x, part in zip(tensors, chunks, strict=True):
                assert x.grad is not None and part.grad is not None
                torch.testing.assert_close(part.grad, x.grad[:, :, here], rtol=1e-4, atol=1e-5)


def test_configs_that_cannot_work_name_the_field() -> None:
    with pytest.raises(ConfigError, match="parallel.sp_ulysses=4 must divide the draft's 6"):
        check_heads(6, 2, 4)
    with pytest.raises(ConfigError, match="6 key/value heads"):
        check_heads(12, 6, 4)
    check_heads(4, 1, 2)
    with pytest.raises(ConfigError, match="draft.compile=true does not combine"):
        DraftConfig(attention=AttentionBackend.usp, compile=True)


# --- The unrolled TTT --------------------------------------------------------------------------


def _batch(
    arch: DraftArchitecture,
    seed: int,
    lengths: list[int],
    seq: int,
    documents: list[list[int]] | None = None,
    supervised_until: int | None = None,
) -> TTTBatch:
    """Random right-padded rows of ``lengths``; ``documents``: each row's document lengths
    (packed, positions restart per document); ``supervised_until``: no loss after it."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    valid = torch.arange(seq) < torch.tensor(lengths).unsqueeze(1)
    loss_mask = torch.rand(batch, seq, generator=generator) < 0.8
    if supervised_until is not None:
        loss_mask[:, supervised_until:] = False
    document_ids = position_ids = None
    if documents is not None:
        document_ids = torch.stack(
            [
                torch.repeat_interleave(
                    torch.arange(len(docs) + 1), torch.tensor([*docs, seq - sum(docs)])
                )
                for docs in documents
            ]
        )
        position_ids = torch.stack(
            [torch.cat([torch.arange(n) for n in [*docs, seq - sum(docs)]]) for docs in documents]
        )
    kept = torch.nonzero(tiny_draft().t2d).squeeze(1)
    return TTTBatch(
        input_ids_BT=torch.randint(0, arch.vocab_size, (batch, seq), generator=generator),
        valid_BT=valid,
        loss_mask_BT=loss_mask,
        aux_BTA=torch.randn(batch, seq, 3 * arch.target_hidden_size, generator=generator),
        teacher=Teacher(
            probs_BTW=torch.softmax(
                2 * torch.randn(batch, seq, arch.draft_vocab_size, generator=generator), -1
            ),
            # draft-vocab ids, so that some predictions are correct
            target_ids_BT=kept[torch.randint(0, len(kept), (batch, seq), generator=generator)],
            in_draft_BT=torch.rand(batch, seq, generator=generator) < 0.9,
        ),
        document_ids_BT=document_ids,
        position_ids_BT=position_ids,
    )


def _ttt_matches_single_process(world: World) -> None:
    sp = SequenceParallel.from_world(world)
    arch = tiny_arch()
    batches = {
        # 11 positions: the last chunk is padded (2 and 4 ranks)
        "padded": _batch(arch, 1, [11, 7], 11),
        "packed": _batch(arch, 2, [13], 14, documents=[[5, 4, 4]]),
        # the later chunks count nothing, yet join every collective of forward and backward
        "early_loss_only": _batch(arch, 3, [12, 12], 12, supervised_until=5),
    }
    num_correct = 0
    for name, batch in batches.items():
        scale_k = loss_scales(count_positions(batch, TTT_LENGTH), step_weights(TTT_LENGTH, 0.8))
        whole, parted = tiny_draft(seed=4), tiny_draft(seed=4)
        expected = ttt_forward(whole, batch, TTT_LENGTH, scale_k, AttentionBackend.eager)
        expected.loss.backward()

        chunk = shard_sequence(batch, sp, TTT_LENGTH)
        stats = ttt_forward(parted, chunk, TTT_LENGTH, scale_k, USPBackend(sp, TTT_LENGTH))
        stats.loss.backward()
        if name == "early_loss_only" and sp.size > 1 and sp.chunk_index == sp.size - 1:
            assert int(stats.num_counted_k.sum()) == 0
        summed = [
            world.all_reduce_sum(x.detach().clone())
            for x in (
                stats.loss,
                stats.loss_sum_k,
                stats.num_counted_k,
                stats.num_correct_k,
                count_positions(chunk, TTT_LENGTH),
            )
        ]
        loss, loss_sum_k, counted_k, correct_k, chunk_counts_k = summed
        assert int(expected.num_counted_k.sum()) > 0, name
        num_correct += int(expected.num_correct_k.sum())
        torch.testing.assert_close(loss, expected.loss.detach(), msg=name)
        torch.testing.assert_close(loss_sum_k, expected.loss_sum_k, msg=name)
        assert counted_k.tolist() == expected.num_counted_k.tolist(), name
        assert correct_k.tolist() == expected.num_correct_k.tolist(), name
        assert chunk_counts_k.tolist() == count_positions(batch, TTT_LENGTH).tolist(), name
        for (param_name, param), reference in zip(
            parted.named_parameters(), whole.parameters(), strict=True
        ):
            if param.grad is None:
                assert reference.grad is None, param_name
                continue
            grad = world.all_reduce_sum(param.grad)
            torch.testing.assert_close(
                grad, reference.grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {param_name}"
            )
    assert num_correct > 0  # the correct counts were compared, not only zeros


def _usp_matches_one_process(rank: int, overrides: dict) -> None:
    world = init_distributed(ParallelConfig(device="cpu", **overrides))
    _attention_matches_eager(SequenceParallel.from_world(world))
    _ttt_matches_single_process(world)


@pytest.mark.parametrize(
    ("num_ranks", "overrides"),
    [(2, ULYSSES), (2, RING), (4, BOTH)],
    ids=["ulysses2", "ring2", "ulysses2xring2"],
)
def test_usp_matches_one_process(num_ranks: int, overrides: dict) -> None:
    """Attention: each rank's chunk of the output and of the q/k/v gradients equals eager
    attention on the whole sequence (padding, packed documents, GQA with kv heads split or
    repeated). TTT: per-step loss sums, counts, correct counts and the draft's gradients, summed
    over the ranks, equal single-process eager TTT (padding, a sequence length sp does not
    divide, a packed row, ranks that count nothing)."""
    run_ranks(_usp_matches_one_process, num_ranks, overrides)


def test_one_process_usp_is_eager() -> None:
    """Without other ranks (the default SequenceParallel) usp computes what eager does."""
    _attention_matches_eager(SequenceParallel())
    _ttt_matches_single_process(init_distributed(ParallelConfig(device="cpu")))
