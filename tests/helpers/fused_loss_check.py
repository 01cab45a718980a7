"""The Triton loss kernels against the torch path, under Triton's interpreter, in a process
of their own: ``TRITON_INTERPRET`` is read when triton is first imported, which in a test
worker another test (torch.compile's inductor) may have done already.

    TRITON_INTERPRET=1 python -m helpers.fused_loss_check   # one JSON line: case -> "ok" or why
"""

from __future__ import annotations

import json
import os
import sys

import torch

from eagleforge.draft.loss import TRITON_KINDS, LossConfig, LossKernel, LossKind, chunked_loss

GROUPS = 3
# fp32: the kernels' arithmetic is the reference's; fp16: logits and gradient in half precision
# (bf16 itself on CUDA: numpy, under the interpreter, has none)
TOLERANCES = {torch.float32: (2e-5, 2e-6), torch.float16: (2e-2, 2e-3)}


def inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Peaked teacher rows with exact zeros, read through repeating indices; two equal
    lm_head rows (equal logits at 3 and width - 1: the argmax keeps the first)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 24, generator=generator).to(dtype)
    weight = torch.randn(width, 24, generator=generator) / 4
    weight[width - 1] = weight[3]
    weight = weight.to(dtype)
    teacher = torch.softmax(3 * torch.randn(rows + 5, width, generator=generator), dim=-1)
    teacher[torch.rand(teacher.shape, generator=generator) < 0.2] = 0.0
    teacher /= teacher.sum(-1, keepdim=True)
    teacher_rows = torch.randint(0, rows + 5, (rows,), generator=generator)
    scale = torch.rand(rows, generator=generator)
    group = torch.randint(0, GROUPS, (rows,), generator=generator)
    return hidden, weight, teacher, teacher_rows, scale, group


def run(kernel: LossKernel, kind: LossKind, data: tuple[torch.Tensor, ...], chunk: int | None):  # type: ignore[no-untyped-def]
    hidden, weight, teacher, rows, scale, group = (t.clone() for t in data)
    hidden.requires_grad_()
    weight.requires_grad_()
    config = LossConfig(kind=kind, kernel=kernel, kl_scale=0.9, kl_decay=3.0, kl_tv_eta=2.0)
    out = chunked_loss(hidden, weight, teacher, rows, scale, chunk, config, group, GROUPS)
    (out.weighted * 0.5).backward()
    return out, hidden.grad, weight.grad


def compare(kind: str, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCES[dtype]
    # 300 columns: three blocks of 128 (BLOCK_W below), the last ragged; chunks of 7 rows
    data = inputs(rows=23, width=300, dtype=dtype)
    ours, grad_h, grad_w = run(LossKernel.triton, LossKind(kind), data, chunk=7)
    ref, ref_h, ref_w = run(LossKernel.torch, LossKind(kind), data, chunk=7)
    for name, got, want in (
        ("loss_n", ours.loss_n, ref.loss_n),
        ("alpha_n", ours.alpha_n, ref.alpha_n),
        ("weighted", ours.weighted, ref.weighted),
        ("hidden gradient", grad_h, ref_h),
        ("lm_head gradient", grad_w, ref_w),
    ):
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=name)
    assert torch.equal(ours.argmax_n, ref.argmax_n), "argmax"
    assert grad_h.dtype == dtype and grad_w.dtype == dtype, "gradient dtypes"


def first_of_equal_maxima() -> None:
    """Two equal largest logits in different blocks of the row: the first index, as torch's."""
    width = 600
    hidden = torch.ones(2, 4)
    weight = torch.zeros(width, 4)
    weight[[5, 520]] = 1.0
    teacher = torch.full((2, width), 1 / width)
    config = LossConfig(kernel=LossKernel.triton)
    out = chunked_loss(hidden, weight, teacher, torch.arange(2), loss=config)
    assert out.argmax_n.tolist() == [5, 5], out.argmax_n.tolist()


def without_scale_and_empty() -> None:
    hidden, weight, teacher, rows, _, _ = inputs(rows=9, width=40, dtype=torch.float32)
    config = LossConfig(kernel=LossKernel.triton)
    ours = chunked_loss(hidden, weight, teacher, rows, loss=config)
    ref = chunked_loss(hidden, weight, teacher, rows, loss=LossConfig(kernel=LossKernel.torch))
    torch.testing.assert_close(ours.loss_n, ref.loss_n, rtol=2e-5, atol=2e-6)
    assert float(ours.weighted) == 0.0
    empty = chunked_loss(hidden[:0], weight, teacher, rows[:0], torch.ones(0), loss=config)
    assert empty.loss_n.shape == (0,) and float(empty.weighted) == 0.0


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: the kernels run on CPU tensors only interpreted")
        return 2
    import eagleforge.draft.fused_loss as fused

    fused.BLOCK_W = 128  # rows of several blocks, the last ragged
    cases = {
        f"{kind}-{str(dtype).removeprefix('torch.')}": (compare, kind, dtype)
        for kind in sorted(k.value for k in TRITON_KINDS)
        for dtype in TOLERANCES
    }
    cases["first_of_equal_maxima"] = (first_of_equal_maxima,)
    cases["without_scale_and_empty"] = (without_scale_and_empty,)
    results = {}
    for name, (fn, *args) in cases.items():
        try:
            fn(*args)
            results[name] = "ok"
        except AssertionError as error:
            results[name] = str(error) or repr(error)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
