"""Every loss kind of the chunked path equals its plain autograd computation over the full
[n, W] softmax; LK-α and LK-λ equal SpecForge's formulas; the `loss` config group composes."""

from __future__ import annotations

import math
import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from eagleforge.config import compose_config, to_typed
from eagleforge.draft.loss import (
    LOSS_BUFFERS,
    NEG_LOG_ALPHA_EPS,
    REVERSE_KL_MIN_PROB,
    LossConfig,
    LossKind,
    chunked_loss,
    loss_chunk_rows,
    soft_cross_entropy,
)
from eagleforge.draft.ttt import (
    PositionStats,
    count_positions,
    loss_scales,
    step_weights,
    ttt_forward,
)
from eagleforge.errors import ConfigError
from eagleforge.trainer import StepSums
from helpers.drafts import random_batch, tiny_arch, tiny_draft

pytestmark = pytest.mark.unit

GROUPS = 3
BASE = ["+model=tiny", "data=chitchat", "output_dir=/tmp/unused"]


def _inputs(
    rows: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [rows, 16], weight [20, 16], a teacher table [rows + 5, 20] read through shuffled,
    repeating row indices, a scale and a group (TTT step) per row. Teacher rows are peaked
    softmaxes, some entries exactly 0 (as where the target's fp32 softmax underflows)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 16, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(20, 16, generator=generator, dtype=torch.float64).requires_grad_()
    teacher = torch.softmax(
        2 * torch.randn(rows + 5, 20, generator=generator, dtype=torch.float64), dim=-1
    )
    teacher[torch.rand(teacher.shape, generator=generator) < 0.2] = 0.0
    teacher /= teacher.sum(-1, keepdim=True)
    teacher_rows = torch.randint(0, rows + 5, (rows,), generator=generator)
    scale = torch.rand(rows, generator=generator, dtype=torch.float64)
    group = torch.randint(0, GROUPS, (rows,), generator=generator)
    return hidden, weight, teacher, teacher_rows, scale, group


def _plain(
    config: LossConfig, logits: torch.Tensor, p: torch.Tensor, group: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and α from the whole [n, W] softmax, differentiated by autograd."""
    logq = torch.log_softmax(logits, dim=-1)
    q = logq.exp()
    alpha = torch.minimum(p, q).sum(-1)
    ce = -(p * logq).sum(-1)
    kind = config.kind
    if kind == LossKind.kl:
        loss = ce
    elif kind == LossKind.tv:
        loss = 1 - alpha
    elif kind == LossKind.neg_log_alpha:
        loss = -alpha.clamp_min(NEG_LOG_ALPHA_EPS).log()
    elif kind == LossKind.lk_alpha:
        positive = alpha > 0
        loss = torch.where(positive, -torch.where(positive, alpha, 1.0).log(), 0.0)
    elif kind == LossKind.kl_tv:
        lam = torch.exp(-config.kl_tv_eta * alpha.detach())
        kl = (torch.special.xlogy(p, p) - p * logq).sum(-1)
        loss = lam * kl + (1 - lam) * (1 - alpha)
    elif kind == LossKind.jsd:
        m = (p + q) / 2
        loss = 0.5 * (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(-1) + 0.5 * (
            q * (logq - m.log())
        ).sum(-1)
    elif kind == LossKind.reverse_kl:
        loss = (q * (logq - p.clamp_min(REVERSE_KL_MIN_PROB).log())).sum(-1)
    elif kind == LossKind.lk_lambda:
        count = torch.zeros(GROUPS, dtype=p.dtype).index_add_(0, group, torch.ones_like(alpha))
        mean = torch.zeros(GROUPS, dtype=p.dtype).index_add_(0, group, alpha.detach()) / count
        w = (config.kl_scale * torch.exp(-config.kl_decay * mean))[group]
        loss = w * ce + (1 - w) * (1 - alpha)
    else:
        raise AssertionError(kind)
    return loss, alpha


CONFIGS = [
    LossConfig(kind=kind, kl_scale=0.9, kl_decay=3.0, kl_tv_eta=2.0)
    if kind in (LossKind.lk_lambda, LossKind.kl_tv)
    else LossConfig(kind=kind)
    for kind in LossKind
]


def _check_against_plain(
    config: LossConfig,
    chunk_size: int | None,
    inputs: tuple[torch.Tensor, ...],
) -> None:
    hidden, weight, teacher, rows, scale, group = inputs
    out = chunked_loss(hidden, weight, teacher, rows, scale, chunk_size, config, group, GROUPS)
    (out.weighted * 0.3).backward()
    grads = hidden.grad.clone(), weight.grad.clone()  # type: ignore[union-attr]
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    plain_loss_n, plain_alpha_n = _plain(config, logits, teacher[rows], group)
    plain_weighted = (plain_loss_n * scale).sum()
    (plain_weighted * 0.3).backward()
    torch.testing.assert_close(out.weighted, plain_weighted.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out.loss_n, plain_loss_n.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out.alpha_n, plain_alpha_n.detach(), rtol=1e-9, atol=1e-12)
    assert torch.equal(out.argmax_n, logits.argmax(-1))
    assert not (out.loss_n.requires_grad or out.alpha_n.requires_grad)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.kind.value)
def test_value_alpha_and_gradients_match_plain(config: LossConfig, chunk_size: int | None) -> None:
    """Chunks of 1, 7 and 64 rows (and the memory-sized default) over 37 rows in 3 groups."""
    _check_against_plain(config, chunk_size, _inputs(37))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.kind.value)
def test_unnormalised_and_empty_teacher_rows_match_plain(config: LossConfig) -> None:
    """Rows whose teacher mass is not 1 -- all zero (α = 0), halved -- keep exact values and
    gradients, with the documented readings of log 0 (lk_alpha: no loss; neg_log_alpha: the
    floor; reverse_kl: the smallest normal fp32)."""
    hidden, weight, teacher, _, scale, group = _inputs(6, seed=1)
    teacher = teacher.clone()
    teacher[2] = 0.0
    teacher[3] *= 0.5
    _check_against_plain(config, 4, (hidden, weight, teacher, torch.arange(6), scale, group))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.kind.value)
def test_no_grad_gives_values_and_empty_rows_give_zero(config: LossConfig) -> None:
    hidden, weight, teacher, rows, scale, group = _inputs(9, seed=2)
    with torch.no_grad():
        out = chunked_loss(hidden, weight, teacher, rows, None, 4, config, group, GROUPS)
        plain_loss_n, plain_alpha_n = _plain(config, hidden @ weight.T, teacher[rows], group)
    torch.testing.assert_close(out.loss_n, plain_loss_n)
    torch.testing.assert_close(out.alpha_n, plain_alpha_n)
    assert float(out.weighted) == 0.0 and not out.weighted.requires_grad
    empty = chunked_loss(hidden[:0], weight, teacher, rows[:0], scale[:0], 4, config, group[:0])
    empty.weighted.backward()
    assert empty.loss_n.numel() == empty.alpha_n.numel() == 0
    assert weight.grad is not None and float(weight.grad.abs().sum()) == 0.0


def test_kl_is_soft_cross_entropy() -> None:
    """The default kind is the soft cross-entropy, through the same code as before the other
    kinds existed (tests/integration/test_golden_trace.py pins its numbers)."""
    hidden, weight, teacher, rows, scale, _ = _inputs(11, seed=3)
    out = chunked_loss(hidden, weight, teacher, rows, scale, 4)
    weighted, loss_n, argmax_n = soft_cross_entropy(hidden, weight, teacher, rows, scale, 4)
    assert torch.equal(out.weighted, weighted) and torch.equal(out.loss_n, loss_n)
    assert torch.equal(out.argmax_n, argmax_n)
    assert loss_chunk_rows(LossKind.kl, 128256) == 256
    assert loss_chunk_rows(LossKind.kl, 8000) == 524


class _LiveBytes(TorchDispatchMode):
    """Tracks the bytes of tensor storages created under it and still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.nbytes: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, pointer: int) -> None:
        self.refs[pointer] -= 1
        if not self.refs[pointer]:
            self.live -= self.nbytes.pop(pointer)
            del self.refs[pointer]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in self.refs:
                self.refs[pointer] = 0
                self.nbytes[pointer] = tensor.untyped_storage().nbytes()
                self.live += self.nbytes[pointer]
                self.peak = max(self.peak, self.live)
            self.refs[pointer] += 1
            weakref.finalize(tensor, self._release, pointer)
        return out


@pytest.mark.parametrize("kind", list(LossKind))
def test_every_kind_peaks_below_kl_chunk_bytes(kind: LossKind) -> None:
    """Over 4 chunks of a [128, 2000] problem, with each kind's rows per chunk scaled as
    ``loss_chunk_rows`` does, no kind holds more [rows, W] bytes at once than kl's chunk (2
    buffers and α's 1/8). The [W, H] and [n, H] gradients, the same for all, are not counted."""
    width, hidden_size, rows, kl_chunk = 2000, 8, 128, 32
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=generator).requires_grad_()
    weight = torch.randn(width, hidden_size, generator=generator).requires_grad_()
    teacher = torch.softmax(torch.randn(rows, width, generator=generator), -1)
    chunk = int(kl_chunk * LOSS_BUFFERS[LossKind.kl] / LOSS_BUFFERS[kind])
    scale, group = torch.rand(rows, generator=generator), torch.zeros(rows, dtype=torch.long)
    with _LiveBytes() as memory:
        chunked_loss(
            hidden, weight, teacher, torch.arange(rows), scale, chunk, LossConfig(kind=kind), group
        )
    gradients = (width + rows) * hidden_size * 4
    kl_chunk_bytes = LOSS_BUFFERS[LossKind.kl] * kl_chunk * width * 4
    assert memory.peak - gradients <= kl_chunk_bytes * 1.02


# --- SpecForge side by side ------------------------------------------------------------------


def _specforge_step_loss(
    logits_BTW: torch.Tensor,
    target_p_BTW: torch.Tensor,
    mask_BT: torch.Tensor,
    kind: LossKind,
    kl_scale: float,
    kl_decay: float,
) -> torch.Tensor:
    """One TTT step's loss as SpecForge computes it (specforge/core/lk_loss.py and
    algorithms/eagle3/model.py), restated as plain autograd: its KL loss is the masked soft
    cross-entropy averaged over all B·T positions; α per position is Σ min(p, softmax(z));
    the step's acceptance rate and log-acceptance rate are masked means over the positions."""
    mask = mask_BT.to(logits_BTW.dtype)
    log_q = torch.log_softmax(logits_BTW, dim=-1)
    kl_loss = -(mask[..., None] * target_p_BTW * log_q).sum(-1).mean()
    acc_BT = torch.minimum(target_p_BTW, log_q.exp()).sum(-1)
    denominator = mask.sum().clamp_min(1e-8)
    acceptance = (acc_BT * mask).sum() / denominator
    safe_log = torch.where(acc_BT > 0, torch.where(acc_BT > 0, acc_BT, 1.0).log(), 0.0)
    log_acceptance = (safe_log * mask).sum() / denominator
    if kind == LossKind.lk_alpha:
        return -log_acceptance
    weight = kl_scale * torch.exp(-kl_decay * acceptance.detach())
    return weight * kl_loss + (1 - weight) * (1 - acceptance)


@pytest.mark.parametrize(
    ("kind", "all_counted"),
    [(LossKind.lk_alpha, False), (LossKind.lk_alpha, True), (LossKind.lk_lambda, True)],
)
def test_lk_losses_match_specforge(kind: LossKind, all_counted: bool) -> None:
    """Three TTT steps over a [2, 5] batch, step weights 0.8^i: SpecForge's Σ_i 0.8^i · L_i and
    its gradients equal ours with scale = 0.8^i / N_i and each step's rows as one group.

    lk_lambda only with every position counted: SpecForge divides its KL term by B·T, we by the
    counted positions N_i (as the kl kind does), which agree exactly when N_i = B·T."""
    generator = torch.Generator().manual_seed(5)
    steps, batch, seq, width = 3, 2, 5, 20
    hidden_kBTH = torch.randn(steps, batch, seq, 16, generator=generator, dtype=torch.float64)
    hidden_kBTH.requires_grad_()
    weight = torch.randn(width, 16, generator=generator, dtype=torch.float64).requires_grad_()
    target_kBTW = torch.softmax(
        2 * torch.randn(steps, batch, seq, width, generator=generator, dtype=torch.float64), -1
    )
    mask_kBT = torch.rand(steps, batch, seq, generator=generator) < 0.6
    if all_counted:
        mask_kBT[:] = True
    mask_kBT[:, 0, 0] = True  # every step counts something

    reference = sum(
        0.8**i
        * _specforge_step_loss(
            hidden_kBTH[i] @ weight.T, target_kBTW[i], mask_kBT[i], kind, 0.9, 3.0
        )
        for i in range(steps)
    )
    assert isinstance(reference, torch.Tensor)
    reference.backward()
    expected = hidden_kBTH.grad.clone(), weight.grad.clone()  # type: ignore[union-attr]
    hidden_kBTH.grad = weight.grad = None

    step_n = mask_kBT.nonzero()[:, 0]
    weights_k = torch.tensor([0.8**i for i in range(steps)], dtype=torch.float64)
    scale_k = loss_scales(mask_kBT.sum((1, 2)), weights_k)
    config = LossConfig(kind=kind, kl_scale=0.9, kl_decay=3.0)
    ours = chunked_loss(
        hidden_kBTH[mask_kBT],
        weight,
        target_kBTW.flatten(0, 2),
        mask_kBT.flatten().nonzero().squeeze(1),
        scale_k[step_n],
        4,
        config,
        step_n,
        steps,
    )
    ours.weighted.backward()
    torch.testing.assert_close(ours.weighted, reference.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hidden_kBTH.grad, expected[0], rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(weight.grad, expected[1], rtol=1e-8, atol=1e-12)


# --- through the TTT -----------------------------------------------------------------------


def test_ttt_forward_takes_the_loss_and_reports_alpha() -> None:
    """ttt_forward trains with the configured kind: its loss is Σ_i scale_i · loss_sum_i; the
    evaluation call (no scales) gives the same per-step sums; Σ α per step is the same
    whatever the kind, between 0 and the counted positions, and kl's default is unchanged."""
    draft = tiny_draft(seed=4)
    batch = random_batch(tiny_arch(), seed=8, padded_row=1, real_length=9, supervised_share=0.8)
    counts = count_positions(batch, GROUPS)
    scale_k = loss_scales(counts, step_weights(GROUPS, 0.8))
    default = ttt_forward(draft, batch, GROUPS, scale_k)
    alpha_sum_k = default.alpha_sum_k
    assert bool(((alpha_sum_k > 0) & (alpha_sum_k <= counts)).all())
    for config in CONFIGS:
        train = ttt_forward(draft, batch, GROUPS, scale_k, loss=config)
        with torch.no_grad():
            evaluation = ttt_forward(draft, batch, GROUPS, loss=config)
        torch.testing.assert_close(train.loss.detach(), (scale_k * train.loss_sum_k).sum())
        torch.testing.assert_close(evaluation.loss_sum_k, train.loss_sum_k)
        torch.testing.assert_close(train.alpha_sum_k, alpha_sum_k)
        if config.kind == LossKind.kl:
            assert torch.equal(train.loss, default.loss)


def test_alpha_is_logged_next_to_acc() -> None:
    """train/alpha_i and eval/alpha_i are Σ α over the counted positions of step i."""
    sums = StepSums.zeros(2)
    stats = PositionStats(
        loss=torch.zeros(()),
        loss_sum_k=torch.ones(2),
        num_counted_k=torch.tensor([4, 2]),
        num_correct_k=torch.tensor([2, 1]),
        alpha_sum_k=torch.tensor([3.0, 0.5]),
    )
    sums.add(stats, 9)
    metrics = sums.metrics("eval", torch.ones(2))
    assert metrics["eval/alpha_0"] == 0.75 and metrics["eval/alpha_1"] == 0.25
    assert metrics["eval/acc_0"] == 0.5


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(LossKind))
def test_each_loss_file_composes(kind: LossKind) -> None:
    typed = to_typed(compose_config([*BASE, f"loss={kind.value}"]))
    assert typed.loss.kind == kind


def test_default_loss_is_kl_and_fields_override() -> None:
    assert to_typed(compose_config(BASE)).loss == LossConfig()
    typed = to_typed(compose_config([*BASE, "loss=lk_lambda", "loss.kl_decay=3"]))
    assert typed.loss.kind == LossKind.lk_lambda and typed.loss.kl_decay == 3.0


@pytest.mark.parametrize(
    "override",
    ["loss.kl_decay=-1", "loss.kl_scale=1.5", "loss.kl_scale=-0.1", "loss.kl_tv_eta=-2"],
)
def test_invalid_loss_parameters_name_the_field(override: str) -> None:
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        to_typed(compose_config([*BASE, "loss=lk_lambda", override]))


def test_nan_parameter_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"loss\.kl_decay"):
        LossConfig(kind=LossKind.lk_lambda, kl_decay=math.nan)
