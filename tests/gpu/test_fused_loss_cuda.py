"""``loss.kernel=triton`` on CUDA in bf16 equals the torch chunked path to bf16 tolerance in
loss and gradients, for every kind it computes, at a draft vocabulary of 32k (16 blocks a
row), and inside a whole TTT step (run with -m gpu)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from eagleforge.batch import Teacher, TTTBatch
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.loss import TRITON_KINDS, LossConfig, LossKernel, LossKind, chunked_loss
from eagleforge.draft.ttt import count_positions, loss_scales, step_weights, ttt_forward
from helpers.drafts import tiny_draft

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("kind", sorted(k.value for k in TRITON_KINDS))
def test_triton_equals_torch_in_bf16(kind: str) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, hidden_size, width = 3000, 256, 32000
    hidden = torch.randn(rows, hidden_size, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(width, hidden_size, device="cuda", generator=generator) / 8).bfloat16()
    teacher = torch.softmax(4 * torch.randn(rows, width, device="cuda", generator=generator), -1)
    teacher_rows = torch.randperm(rows, device="cuda", generator=generator)
    scale = torch.rand(rows, device="cuda", generator=generator) / rows
    group = torch.randint(0, 7, (rows,), device="cuda", generator=generator)
    results = {}
    for kernel in (LossKernel.triton, LossKernel.torch):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        config = LossConfig(kind=LossKind(kind), kernel=kernel)
        out = chunked_loss(h, w, teacher, teacher_rows, scale, None, config, group, 7)
        out.weighted.backward()
        results[kernel] = (out, h.grad, w.grad)
    ours, grad_h, grad_w = results[LossKernel.triton]
    ref, ref_h, ref_w = results[LossKernel.torch]
    assert _relative(ours.loss_n, ref.loss_n) < 1e-3
    assert _relative(ours.alpha_n, ref.alpha_n) < 1e-3
    # the argmax may differ only where bf16 logits tie or round differently: nearly never
    assert (ours.argmax_n == ref.argmax_n).float().mean() > 0.999
    assert _relative(grad_h, ref_h) < 2e-2
    assert _relative(grad_w, ref_w) < 2e-2


def _cuda_batch(vocab: int, width: int, aux: int) -> TTTBatch:
    generator = torch.Generator().manual_seed(1)
    batch, seq = 2, 64
    valid = torch.ones(batch, seq, dtype=torch.bool)
    valid[1, 50:] = False
    cpu = TTTBatch(
        input_ids_BT=torch.randint(0, vocab, (batch, seq), generator=generator),
        valid_BT=valid,
        loss_mask_BT=torch.rand(batch, seq, generator=generator) < 0.8,
        aux_BTA=torch.randn(batch, seq, aux, generator=generator),
        teacher=Teacher(
            probs_BTW=torch.softmax(torch.randn(batch, seq, width, generator=generator), -1),
            target_ids_BT=torch.randint(0, vocab, (batch, seq), generator=generator),
            in_draft_BT=torch.ones(batch, seq, dtype=torch.bool),
        ),
    )
    teacher = cpu.teacher
    return TTTBatch(
        cpu.input_ids_BT.cuda(), cpu.valid_BT.cuda(), cpu.loss_mask_BT.cuda(), cpu.aux_BTA.cuda(),
        Teacher(teacher.probs_BTW.cuda(), teacher.target_ids_BT.cuda(), teacher.in_draft_BT.cuda()),
    )  # fmt: skip


def test_a_ttt_step_with_the_triton_loss_equals_the_torch_loss() -> None:
    results = {}
    for kernel in (LossKernel.triton, LossKernel.torch):
        draft = tiny_draft(seed=0).cuda()
        arch = draft.arch
        batch = _cuda_batch(arch.vocab_size, arch.draft_vocab_size, 3 * arch.target_hidden_size)
        scale = loss_scales(count_positions(batch, 3), step_weights(3, 0.8, torch.device("cuda")))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            stats = ttt_forward(
                draft, batch, 3, scale, attention=AttentionBackend.sdpa,
                loss=LossConfig(kernel=kernel),
            )  # fmt: skip
        stats.loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        results[kernel] = (stats, grads)
    (ours, our_grads), (ref, ref_grads) = results[LossKernel.triton], results[LossKernel.torch]
    assert _relative(ours.loss_sum_k, ref.loss_sum_k) < 1e-2
    assert torch.equal(ours.num_counted_k, ref.num_counted_k)
    assert our_grads.keys() == ref_grads.keys() and ref_grads
    for name in ref_grads:
        assert _relative(our_grads[name], ref_grads[name]) < 3e-2, name
