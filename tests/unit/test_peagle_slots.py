"""What P-EAGLE's decoder proposes at slot d is exactly what training taught depth d: the
unrolled test, its later steps reading the placeholders, against the one causal forward over
the committed pairs and the placeholder slots that vLLM and our parallel decoder run. (The
family's contract -- training, resume, directory, lossless decoding, serving -- is tested with
every family's: tests/integration/test_family_contract.py, tests/engine/test_served_drafts.py.)"""

from __future__ import annotations

import pytest
import torch

from eagleforge.draft.peagle import PEagleDraft
from eagleforge.draft.ttt import draft_step
from eagleforge.speculative.runners import DraftRunner
from helpers.families import random_peagle
from helpers.targets import small_vocab_target

pytestmark = pytest.mark.unit


def test_slot_d_proposes_what_training_taught_depth_d() -> None:
    """Training's depth d at position t (the unrolled test, its later steps reading the
    placeholders) equals the decoder's slot d after the pairs 0..t, as vLLM runs it: one
    causal forward over the committed pairs and the placeholder slots."""
    target = small_vocab_target(vocab=16)
    draft = random_peagle(target, 3, 0.5)
    assert isinstance(draft, PEagleDraft)
    generator = torch.Generator().manual_seed(5)
    length, depths, a = 9, 3, 3 * draft.arch.target_hidden_size
    ids_T = torch.randint(0, 15, (length + depths,), generator=generator)
    aux_TA = torch.randn(length, a, generator=generator)
    positions = torch.arange(length)[None]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    with torch.no_grad():
        hidden = draft.fuse(aux_TA[None])
        trained = [draft_step(draft, ids_T[None, 1 : length + 1], hidden, positions, None, None,
                              keys, values)]  # fmt: skip
        mask_ids, mask_hidden = draft.placeholders(1, length)
        for depth in range(1, depths):
            trained.append(draft_step(draft, mask_ids, mask_hidden, positions + depth, None, None,
                                      keys, values))  # fmt: skip
        for t in (0, 4, length - 1):
            runner = DraftRunner(draft)
            slot_ids, slot_hidden = draft.placeholders(1, depths - 1)
            tokens = torch.cat([ids_T[1 : t + 2], slot_ids[0]])
            hidden_MH = torch.cat([draft.fuse(aux_TA[: t + 1]), slot_hidden[0]])
            count = len(tokens)
            causal = torch.ones(count, count, dtype=torch.bool).tril()
            out, _, _ = runner.attend(tokens, hidden_MH, torch.arange(count), None, causal)
            for depth in range(depths):
                # fp32: the same sums in another order (a wrong view differs by O(1))
                torch.testing.assert_close(
                    out[t + depth], trained[depth][0, t], rtol=1e-4, atol=1e-4
                )
