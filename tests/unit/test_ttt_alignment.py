"""The TTT shift/mask alignment (DESIGN.md, "Shift"): at step i, position t reads x_{t+1+i},
predicts x_{t+2+i}, is taught by the target's distribution at t+1+i, and counts iff
x_{t+2+i} exists, is supervised, and the target's argmax at t+1+i is a draft-vocab id."""

from __future__ import annotations

import math

import pytest
import torch

from eagleforge.batch import Teacher, TTTBatch, shift_left
from eagleforge.draft.model import Eagle3Draft
from eagleforge.draft.ttt import count_positions, counted_positions, draft_step, ttt_forward
from helpers.drafts import EAGLE31_VARIANTS, tiny_draft

pytestmark = pytest.mark.unit

# Two sequences of x_0..x_7 = 10..17; the second has length 6 (two right-padding slots).
INPUT_IDS = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17], [10, 11, 12, 13, 14, 15, 16, 17]])
VALID = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
# Row 1 marks its padding as supervised on purpose: `valid` alone must exclude it.
LOSS_MASK = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
IN_DRAFT = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1], [1, 0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)

# Worked out by hand: (i, t) counts iff t+2+i < length, loss_mask[t+2+i], in_draft[t+1+i].
EXPECTED_COUNTED = {
    0: [[0, 0, 1, 0, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]],
    1: [[0, 1, 0, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]],
    2: [[1, 0, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]],
}


def _spec_counted(loss_mask, valid, in_draft, step):  # type: ignore[no-untyped-def]
    """The DESIGN.md rule, one position at a time."""
    batch, seq = loss_mask.shape
    out = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        length = int(valid[b].sum())
        for t in range(seq):
            target = t + 2 + step
            out[b, t] = bool(target < length and loss_mask[b, target] and in_draft[b, t + 1 + step])
    return out


def random_teacher(batch: int, seq: int, width: int, in_draft: torch.Tensor, seed: int) -> Teacher:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(batch, seq, width, generator=generator) * 2, dim=-1)
    target_ids = torch.randint(0, 50, (batch, seq), generator=generator)
    return Teacher(probs_BTW=probs, target_ids_BT=target_ids, in_draft_BT=in_draft.clone())


def aligned_batch(seed: int = 1) -> TTTBatch:
    generator = torch.Generator().manual_seed(seed)
    batch, seq = INPUT_IDS.shape
    return TTTBatch(
        input_ids_BT=INPUT_IDS.clone(),
        valid_BT=VALID.clone(),
        loss_mask_BT=LOSS_MASK.clone(),
        aux_BTA=torch.randn(batch, seq, 3 * 12, generator=generator),
        teacher=random_teacher(batch, seq, 20, IN_DRAFT, seed + 1),
    )


def test_shift_left_moves_values_left_and_fills_zero() -> None:
    """out[:, t] = x[:, t+n]; the n last slots are 0 (False for bools); n >= T gives all zeros."""
    x = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    assert shift_left(x, 0).tolist() == [[10, 11, 12, 13, 14, 15, 16, 17]]
    assert shift_left(x, 1).tolist() == [[11, 12, 13, 14, 15, 16, 17, 0]]
    assert shift_left(x, 3).tolist() == [[13, 14, 15, 16, 17, 0, 0, 0]]
    assert shift_left(x, 8).tolist() == [[0] * 8]
    assert shift_left(x, 11).tolist() == [[0] * 8]
    flags = torch.tensor([[True, False, True, True]])
    shifted = shift_left(flags, 2)
    assert shifted.dtype == torch.bool
    assert shifted.tolist() == [[True, True, False, False]]
    assert x.tolist() == [[10, 11, 12, 13, 14, 15, 16, 17]]  # input untouched


@pytest.mark.parametrize("step", [0, 1, 2])
def test_counted_positions_hand_written(step: int) -> None:
    """counted_positions equals the literal matrix worked out by hand from the DESIGN.md rule."""
    got = counted_positions(LOSS_MASK, VALID, IN_DRAFT, step)
    assert got.dtype == torch.bool
    assert got.int().tolist() == EXPECTED_COUNTED[step]


def test_counted_positions_hand_matrix_agrees_with_rule() -> None:
    """The hand-written matrices themselves follow the per-position rule (guards the fixture)."""
    for step, expected in EXPECTED_COUNTED.items():
        assert _spec_counted(LOSS_MASK, VALID, IN_DRAFT, step).int().tolist() == expected


def test_counted_positions_random_masks_follow_rule() -> None:
    """On random right-padded masks, counted_positions matches the per-position rule at every step."""
    generator = torch.Generator().manual_seed(3)
    batch, seq = 4, 11
    lengths = torch.tensor([11, 7, 3, 1])
    valid = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
    loss_mask = torch.rand(batch, seq, generator=generator) < 0.6
    in_draft = torch.rand(batch, seq, generator=generator) < 0.7
    for step in range(6):
        expected = _spec_counted(loss_mask, valid, in_draft, step)
        assert torch.equal(counted_positions(loss_mask, valid, in_draft, step), expected), step


def test_count_positions_per_step() -> None:
    """count_positions sums counted positions per step: 2+3, 2+3, 2+2 for the hand-built batch."""
    batch = aligned_batch()
    assert count_positions(batch, 3).tolist() == [5, 5, 4]
    assert count_positions(batch, 1).tolist() == [5]


def _manual_step_hiddens(draft: Eagle3Draft, batch: TTTBatch, steps: int) -> list[torch.Tensor]:
    """Pre-norm hidden of each step, feeding x_{t+1+i} at RoPE position t+i, built explicitly."""
    ids = batch.input_ids_BT.tolist()
    bsz, seq = batch.input_ids_BT.shape
    hidden = draft.fc(batch.aux_BTA)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    out = []
    for step in range(steps):
        tokens = torch.tensor(
            [
                [ids[b][t + 1 + step] if t + 1 + step < seq else 0 for t in range(seq)]
                for b in range(bsz)
            ]
        )
        positions = torch.tensor([[t + step for t in range(seq)] for _ in range(bsz)])
        hidden = draft_step(draft, tokens, hidden, positions, batch.valid_BT, None, keys, values)
        out.append(hidden)
    return out


@torch.no_grad()
def test_ttt_forward_uses_teacher_row_t_plus_1_plus_i() -> None:
    """loss_sum, counts and correct counts per step equal an explicit loop over counted (i, t)
    that reads teacher.probs_BTW[b, t+1+i] and teacher.target_ids_BT[b, t+1+i]."""
    steps = 3
    draft = tiny_draft()
    batch = aligned_batch()
    hiddens = _manual_step_hiddens(draft, batch, steps)
    bsz, seq = batch.input_ids_BT.shape

    # Make every counted step-0 prediction correct: the teacher's argmax at row t+1 is the
    # draft's own step-0 prediction at t. An off-by-one teacher row breaks num_correct[0].
    target_ids = batch.teacher.target_ids_BT
    for b in range(bsz):
        for t in range(seq):
            if EXPECTED_COUNTED[0][b][t]:
                logits = draft.lm_head(draft.norm(hiddens[0][b, t]))
                target_ids[b, t + 1] = draft.draft_to_target_ids(logits.argmax())

    stats = ttt_forward(draft, batch, steps)

    for step in range(steps):
        loss, count, correct = 0.0, 0, 0
        for b in range(bsz):
            for t in range(seq):
                if not EXPECTED_COUNTED[step][b][t]:
                    continue
                row = t + 1 + step
                logits = draft.lm_head(draft.norm(hiddens[step][b, t])).double()
                log_probs = torch.log_softmax(logits, dim=-1)
                loss += float(-(batch.teacher.probs_BTW[b, row].double() * log_probs).sum())
                count += 1
                predicted = int(draft.draft_to_target_ids(logits.argmax()))
                correct += int(predicted == int(batch.teacher.target_ids_BT[b, row]))
        assert stats.loss_sum_k[step].item() == pytest.approx(loss, rel=1e-5), step
        assert int(stats.num_counted_k[step]) == count, step
        assert int(stats.num_correct_k[step]) == correct, step
    assert int(stats.num_correct_k[0]) == int(stats.num_counted_k[0]) == 5


@torch.no_grad()
def test_ttt_forward_ignores_teacher_outside_used_rows() -> None:
    """Changing the teacher at rows that no counted (i, t) reads (t+1+i) leaves the loss unchanged;
    changing a used row changes it."""
    steps = 3
    draft = tiny_draft()
    batch = aligned_batch()
    used = set()
    for step in range(steps):
        for b in range(2):
            for t in range(8):
                if EXPECTED_COUNTED[step][b][t]:
                    used.add((b, t + 1 + step))
    reference = ttt_forward(draft, batch, steps).loss_sum_k.clone()

    unused = [(b, r) for b in range(2) for r in range(8) if (b, r) not in used]
    assert unused
    for b, r in unused:
        batch.teacher.probs_BTW[b, r] = torch.roll(batch.teacher.probs_BTW[b, r], 3)
    assert torch.allclose(ttt_forward(draft, batch, steps).loss_sum_k, reference, rtol=1e-6)

    b, r = sorted(used)[0]
    batch.teacher.probs_BTW[b, r] = torch.roll(batch.teacher.probs_BTW[b, r], 3)
    assert not torch.allclose(ttt_forward(draft, batch, steps).loss_sum_k, reference, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# An independent reference of the whole unrolled TTT, with explicit per-query attention loops.


def _rope(vec: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """Llama (half-split) rotary embedding of one head vector at an absolute position."""
    dim = vec.numel()
    half = dim // 2
    out = torch.empty_like(vec)
    for j in range(half):
        angle = position * theta ** (-2.0 * j / dim)
        c, s = math.cos(angle), math.sin(angle)
        out[j] = vec[j] * c - vec[j + half] * s
        out[j + half] = vec[j + half] * c + vec[j] * s
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean() + eps) * weight


def _fused(draft: Eagle3Draft, aux: torch.Tensor) -> torch.Tensor:
    """fc of one position's aux features after EAGLE-3.1's norms, as vLLM's
    ``combine_hidden_states`` applies them: input_norm over all, then fc_norm per layer."""
    eps = draft.arch.rms_norm_eps
    if draft.input_norm is not None:
        aux = _rms(aux, draft.input_norm.weight, eps)
    if draft.fc_norm is not None:
        aux = torch.cat(
            [_rms(x, n.weight, eps) for n, x in zip(draft.fc_norm, aux.chunk(3), strict=True)]
        )
    return draft.fc(aux)


@torch.no_grad()
def _reference_loss_sums(draft: Eagle3Draft, batch: TTTBatch, steps: int) -> list[float]:
    arch = draft.arch
    layer = draft.midlayer
    attn = layer.self_attn
    n_heads, n_kv, hd = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    bsz, seq = batch.input_ids_BT.shape
    ids = batch.input_ids_BT.tolist()
    valid = batch.valid_BT.tolist()
    hidden = [[_fused(draft, batch.aux_BTA[b, t]) for t in range(seq)] for b in range(bsz)]
    keys: list[list[list[torch.Tensor]]] = []  # [step][b][t] -> [K, D]
    vals: list[list[list[torch.Tensor]]] = []
    sums = []
    for step in range(steps):
        qs = [[None] * seq for _ in range(bsz)]
        ks = [[None] * seq for _ in range(bsz)]
        vs = [[None] * seq for _ in range(bsz)]
        for b in range(bsz):
            for t in range(seq):
                token = ids[b][t + 1 + step] if t + 1 + step < seq else 0
                x = torch.cat(
                    [
                        layer.input_layernorm(draft.embed_tokens.weight[token]),
                        layer.hidden_norm(hidden[b][t]),
                    ]
                )
                q = attn.q_proj(x).view(n_heads, hd)
                k = attn.k_proj(x).view(n_kv, hd)
                qs[b][t] = torch.stack(
                    [_rope(q[n], t + step, arch.rope_theta) for n in range(n_heads)]
                )
                ks[b][t] = torch.stack(
                    [_rope(k[n], t + step, arch.rope_theta) for n in range(n_kv)]
                )
                vs[b][t] = attn.v_proj(x).view(n_kv, hd)
        keys.append(ks)
        vals.append(vs)
        new_hidden = [[None] * seq for _ in range(bsz)]
        for b in range(bsz):
            for t in range(seq):
                heads = []
                for n in range(n_heads):
                    kv = n // (n_heads // n_kv)
                    allowed = [(0, s) for s in range(t + 1) if valid[b][s]]
                    allowed += [(j, t) for j in range(1, step + 1)]
                    scores = torch.stack(
                        [qs[b][t][n] @ keys[j][b][s][kv] / math.sqrt(hd) for j, s in allowed]
                    )
                    weights = torch.softmax(scores, dim=0)
                    heads.append(
                        sum(
                            w * vals[j][b][s][kv]
                            for w, (j, s) in zip(weights, allowed, strict=True)
                        )
                    )
                residual = hidden[b][t]
                if arch.norm_before_residual:
                    residual = _rms(residual, layer.hidden_norm.weight, arch.rms_norm_eps)
                h = residual + attn.o_proj(torch.cat(heads))
                out = h + layer.mlp(layer.post_attention_layernorm(h))
                if arch.norm_output:  # the next step reads the final norm's output
                    out = _rms(out, draft.norm.weight, arch.rms_norm_eps)
                new_hidden[b][t] = out
        hidden = new_hidden
        total = 0.0
        length = [sum(row) for row in valid]
        for b in range(bsz):
            for t in range(seq):
                target = t + 2 + step
                if not (
                    target < length[b]
                    and batch.loss_mask_BT[b, target]
                    and batch.teacher.in_draft_BT[b, t + 1 + step]
                ):
                    continue
                normed = hidden[b][t] if arch.norm_output else draft.norm(hidden[b][t])
                log_probs = torch.log_softmax(draft.lm_head(normed).double(), -1)
                total += float(
                    -(batch.teacher.probs_BTW[b, t + 1 + step].double() * log_probs).sum()
                )
        sums.append(total)
    return sums


@torch.no_grad()
@pytest.mark.parametrize("variant", list(EAGLE31_VARIANTS))
def test_ttt_forward_matches_loop_reference(variant: str) -> None:
    """ttt_forward's per-step loss sums equal a from-scratch loop implementation of DESIGN.md
    (token x_{t+1+i}, RoPE position t+i, step-0 causal keys + diagonal keys, hidden carried on),
    with EAGLE-3.1's norms where vLLM's llama_eagle3 puts them."""
    steps = 3
    draft = tiny_draft(seed=5, **EAGLE31_VARIANTS[variant])
    batch = aligned_batch(seed=7)
    stats = ttt_forward(draft, batch, steps)
    expected = _reference_loss_sums(draft, batch, steps)
    assert stats.loss_sum_k.tolist() == pytest.approx(expected, rel=1e-4)
    assert all(value > 0 for value in expected)


def test_fed_loss_positions_count_the_token_after_each_supervised_one() -> None:
    """draft.loss_positions=fed (vLLM speculators' shift): the batch's loss mask marks each
    token after a supervised one in its document, so the first answer token is never a target
    and the token after the answer's last one is; the teacher is computed for those rows."""
    from eagleforge.targets.teacher import teacher_batch
    from helpers.targets import small_vocab_target

    target = small_vocab_target(vocab=8)
    ids = torch.tensor([[3, 1, 4, 1, 5, 2, 6, 5, 3, 7]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.tensor([[1] * 9 + [0]], dtype=torch.bool),
        "loss_mask": loss_mask,
        "document_ids": documents,
    }
    draft_ids, t2d = torch.arange(8), torch.ones(8, dtype=torch.bool)
    predicted = teacher_batch(target, batch, draft_ids, t2d, None)
    fed = teacher_batch(target, batch, draft_ids, t2d, None, count_after_supervised=True)
    assert predicted.loss_mask_BT.tolist() == loss_mask.tolist()
    # 4 follows the first answer; 8 would follow the second but starts document 2
    assert fed.loss_mask_BT.long().tolist() == [[0, 0, 0, 1, 1, 0, 0, 1, 0, 0]]
    full = teacher_batch(
        target, {**batch, "loss_mask": torch.ones_like(loss_mask)}, draft_ids, t2d, None
    )
    rows = shift_left(fed.loss_mask_BT, 1)
    torch.testing.assert_close(fed.teacher.probs_BTW[rows], full.teacher.probs_BTW[rows])
    assert not fed.teacher.in_draft_BT[~rows].any()
