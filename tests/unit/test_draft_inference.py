"""At inference the draft computes what the training-time test trains: its KV-cached prefill
and chain steps give the TTT's step-i outputs at the last committed position."""

from __future__ import annotations

import pytest
import torch

from eagleforge.batch import shift_left
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.ttt import draft_step
from eagleforge.speculative.runners import DraftRunner
from helpers.drafts import EAGLE31_VARIANTS, tiny_draft

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("variant", list(EAGLE31_VARIANTS))
@pytest.mark.parametrize("committed", [1, 5, 9])
def test_cached_chain_equals_the_training_time_test(committed: int, variant: str) -> None:
    draft = tiny_draft(seed=4, **EAGLE31_VARIANTS[variant]).eval()
    generator = torch.Generator().manual_seed(committed)
    seq, steps = 12, 3
    ids = torch.randint(0, draft.arch.vocab_size, (1, seq), generator=generator)
    aux = torch.randn(1, seq, 3 * draft.arch.target_hidden_size, generator=generator)
    with torch.no_grad():
        # the TTT, as in training: step i at position t reads x_{t+1+i}
        hidden = draft.fuse(aux)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        ttt_outputs = []
        positions = torch.arange(seq).unsqueeze(0)
        for step in range(steps):
            hidden = draft_step(
                draft, shift_left(ids, 1 + step), hidden, positions + step, None, None,
                keys, values, AttentionBackend.eager,
            )  # fmt: skip
            ttt_outputs.append(hidden[0, committed - 1])

        # inference: prefill positions 0..L-1, then feed the true next tokens as a chain
        runner = DraftRunner(draft)
        out = runner.extend(ids[0, 1 : committed + 1], aux[0, :committed], torch.arange(committed))
        torch.testing.assert_close(out[-1], ttt_outputs[0])
        hidden_in, extra = out[-1], None
        for depth in range(1, steps):
            token = ids[0, committed + depth : committed + depth + 1]
            mask = torch.ones(1, depth, dtype=torch.bool)
            node_out, k, v = runner.attend(
                token, hidden_in[None], torch.tensor([committed - 1 + depth]), extra, mask
            )
            torch.testing.assert_close(node_out[0], ttt_outputs[depth])
            extra = (
                (k, v)
                if extra is None
                else (torch.cat([extra[0], k], 2), torch.cat([extra[1], v], 2))
            )
            hidden_in = node_out[0]


def test_commits_in_pieces_equal_one_prefill_across_buffer_growth() -> None:
    """The draft's KV cache is a buffer that doubles when full (256 positions first): commits
    in pieces that cross its growth give what one prefill of them all gives."""
    draft = tiny_draft(seed=2).eval()
    generator = torch.Generator().manual_seed(0)
    seq = 600
    ids = torch.randint(0, draft.arch.vocab_size, (seq,), generator=generator)
    aux = torch.randn(seq, 3 * draft.arch.target_hidden_size, generator=generator)
    with torch.no_grad():
        whole = DraftRunner(draft).extend(ids, aux, torch.arange(seq))
        runner = DraftRunner(draft)
        pieces, start = [], 0
        for size in (200, 90, 1, 3, 250, 56):  # grows at 256 and at 512
            end = start + size
            pieces.append(runner.extend(ids[start:end], aux[start:end], torch.arange(start, end)))
            start = end
    assert start == seq and runner.cached == seq
    torch.testing.assert_close(torch.cat(pieces), whole)
