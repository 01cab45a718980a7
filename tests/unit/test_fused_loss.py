"""``loss.kernel=triton``'s two kernels, run by Triton's interpreter on CPU tensors, equal the
torch chunked path (the reference, tests/unit/test_losses.py) in loss, α, argmax and
gradients, for every kind they compute; ``loss.kernel`` resolves and refuses as documented.
(bf16 on CUDA: tests/gpu/test_fused_loss_cuda.py.)"""

from __future__ import annotations

import importlib
import platform
import sys
from collections.abc import Iterator

import pytest
import torch

from eagleforge.draft.loss import (
    TRITON_KINDS,
    LossConfig,
    LossKernel,
    LossKind,
    chunked_loss,
)
from eagleforge.errors import ConfigError

pytestmark = pytest.mark.unit

GROUPS = 3
# make test installs triton where its wheels exist (the dev extra): there it must run
TRITON_WHEELS = sys.platform == "linux" and platform.machine() == "x86_64"


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernels rebuilt under TRITON_INTERPRET=1 (read when ``triton.jit`` wraps them)."""
    if not TRITON_WHEELS:
        pytest.importorskip("triton", reason="triton has no wheel for this platform")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import eagleforge.draft.fused_loss as fused

    importlib.reload(fused)
    monkeypatch.setattr(fused, "BLOCK_W", 128)  # rows of several blocks, the last ragged
    yield
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(fused)


def _inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """As test_losses's: peaked teacher rows with exact zeros, read through repeating indices;
    ties in the logits (two equal lm_head rows) to check the argmax keeps the first."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 24, generator=generator).to(dtype)
    weight = torch.randn(width, 24, generator=generator) / 4
    weight[width - 1] = weight[3]  # equal logits at 3 and width - 1
    weight = weight.to(dtype)
    teacher = torch.softmax(3 * torch.randn(rows + 5, width, generator=generator), dim=-1)
    teacher[torch.rand(teacher.shape, generator=generator) < 0.2] = 0.0
    teacher /= teacher.sum(-1, keepdim=True)
    teacher_rows = torch.randint(0, rows + 5, (rows,), generator=generator)
    scale = torch.rand(rows, generator=generator)
    group = torch.randint(0, GROUPS, (rows,), generator=generator)
    return hidden, weight, teacher, teacher_rows, scale, group


def _run(kernel: LossKernel, kind: LossKind, inputs: tuple[torch.Tensor, ...], chunk: int | None):
    hidden, weight, teacher, rows, scale, group = (t.clone() for t in inputs)
    hidden.requires_grad_()
    weight.requires_grad_()
    config = LossConfig(kind=kind, kernel=kernel, kl_scale=0.9, kl_decay=3.0, kl_tv_eta=2.0)
    out = chunked_loss(hidden, weight, teacher, rows, scale, chunk, config, group, GROUPS)
    (out.weighted * 0.5).backward()
    return out, hidden.grad, weight.grad


# fp32: the kernels' arithmetic is the reference's; fp16: logits and gradient in half precision
# (bf16 itself on CUDA: numpy, under the interpreter, has none)
@pytest.mark.parametrize(
    ("dtype", "rtol", "atol"), [(torch.float32, 2e-5, 2e-6), (torch.float16, 2e-2, 2e-3)]
)
@pytest.mark.parametrize("kind", sorted(TRITON_KINDS))
def test_triton_kernels_equal_the_torch_path(
    interpreted: None, kind: str, dtype: torch.dtype, rtol: float, atol: float
) -> None:
    # 300 columns: three blocks of 128, the last ragged; chunks of 7 rows, the last ragged
    inputs = _inputs(rows=23, width=300, dtype=dtype)
    ours, grad_h, grad_w = _run(LossKernel.triton, LossKind(kind), inputs, chunk=7)
    ref, ref_h, ref_w = _run(LossKernel.torch, LossKind(kind), inputs, chunk=7)
    torch.testing.assert_close(ours.loss_n, ref.loss_n.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(ours.alpha_n, ref.alpha_n.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(ours.weighted, ref.weighted.float(), rtol=rtol, atol=atol)
    assert torch.equal(ours.argmax_n, ref.argmax_n)
    torch.testing.assert_close(grad_h.float(), ref_h.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(grad_w.float(), ref_w.float(), rtol=rtol, atol=atol)
    assert grad_h.dtype == dtype and grad_w.dtype == dtype


def test_argmax_keeps_the_first_of_equal_logits(interpreted: None) -> None:
    """Two equal largest logits, in different blocks of the row: the first index, as torch's."""
    width = 600
    hidden = torch.ones(2, 4)
    weight = torch.zeros(width, 4)
    weight[[5, 520]] = 1.0
    teacher = torch.full((2, width), 1 / width)
    out = chunked_loss(
        hidden, weight, teacher, torch.arange(2), loss=LossConfig(kernel=LossKernel.triton)
    )
    assert out.argmax_n.tolist() == [5, 5]


def test_without_scale_no_gradient_and_an_empty_call(interpreted: None) -> None:
    hidden, weight, teacher, rows, _, _ = _inputs(rows=9, width=40, dtype=torch.float32)
    config = LossConfig(kernel=LossKernel.triton)
    ours = chunked_loss(hidden, weight, teacher, rows, loss=config)
    ref = chunked_loss(hidden, weight, teacher, rows, loss=LossConfig(kernel=LossKernel.torch))
    torch.testing.assert_close(ours.loss_n, ref.loss_n, rtol=2e-5, atol=2e-6)
    assert float(ours.weighted) == 0.0
    empty = chunked_loss(hidden[:0], weight, teacher, rows[:0], torch.ones(0), loss=config)
    assert empty.loss_n.shape == (0,) and float(empty.weighted) == 0.0


def test_the_kernel_resolves_by_device_kind_and_package(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert LossConfig().kernel_for(cpu) == LossKernel.torch
    assert LossConfig(kernel=LossKernel.torch).kernel_for(cuda) == LossKernel.torch
    with pytest.raises(
        ConfigError, match=r"loss.kernel=triton: it runs on CUDA.*loss.kernel=torch"
    ):
        LossConfig(kernel=LossKernel.triton).kernel_for(cpu)
    reverse = LossConfig(kind=LossKind.reverse_kl)
    assert reverse.kernel_for(cuda) == LossKernel.torch  # auto: the torch path for that kind
    with pytest.raises(ConfigError, match="loss.kind=reverse_kl has no Triton kernel"):
        LossConfig(kind=LossKind.reverse_kl, kernel=LossKernel.triton).kernel_for(cuda)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert LossConfig().kernel_for(cuda) == LossKernel.torch
    with pytest.raises(ConfigError, match="the triton package is not installed"):
        LossConfig(kernel=LossKernel.triton).kernel_for(cuda)
    monkeypatch.undo()
    if importlib.util.find_spec("triton") is not None:
        assert LossConfig().kernel_for(cuda) == LossKernel.triton
    # the interpreter runs on CPU when asked for by name, never for auto
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert LossConfig().kernel_for(cpu) == LossKernel.torch
    assert LossConfig(kernel=LossKernel.triton).kernel_for(cpu) == LossKernel.triton
