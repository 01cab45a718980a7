"""The CUDA variable-length path of the sdpa/flash backends, checked on CPU.

The flash kernels themselves need a GPU (``tests/gpu``); here a reference kernel with the same
varlen contract (q [Z, N, D], k/v [Z, K, D], log-sum-exp [N, Z], causal within each sequence
of ``cu_seqlens``) stands in for them, so that the sequence boundaries, the layout conversions
and the log-sum-exp merge are all checked against eager attention: outputs and gradients at
real positions, with padding, packed documents and grouped-query heads.
"""

from __future__ import annotations

import pytest
import torch

from eagleforge.draft.attention import _merged, _VarlenFlashKernel, eager_ttt_attention

pytestmark = pytest.mark.unit


class ReferenceVarlenKernel(_VarlenFlashKernel):
    """Plain-math stand-in for the flash kernels, in the input dtype."""

    @staticmethod
    def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
        return dtype

    def _segments(self) -> list[tuple[int, int]]:
        bounds = self.cu_seqlens.tolist()
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    @staticmethod
    def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        length = q.shape[0]
        scores = torch.einsum("lnd,mnd->nlm", q, k) * q.shape[-1] ** -0.5
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        return scores.masked_fill(~causal, float("-inf"))

    def varlen_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = q.shape[1] // k.shape[1]
        out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0])
        for a, b in self._segments():
            kr, vr = (x[a:b].repeat_interleave(groups, dim=1) for x in (k, v))
            scores = self._scores(q[a:b], kr)
            lse[:, a:b] = torch.logsumexp(scores, dim=-1)
            out[a:b] = torch.einsum("nlm,mnd->lnd", torch.softmax(scores, dim=-1), vr)
        return out, lse

    def varlen_backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv_heads, groups = k.shape[1], q.shape[1] // k.shape[1]
        scale = q.shape[-1] ** -0.5
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b in self._segments():
            kr, vr = (x[a:b].repeat_interleave(groups, dim=1) for x in (k, v))
            g = grad_out[a:b]
            probs = torch.exp(self._scores(q[a:b], kr) - lse[:, a:b].unsqueeze(-1))
            delta = (g * out[a:b]).sum(-1).T.unsqueeze(-1)
            dscores = probs * (torch.einsum("lnd,mnd->nlm", g, vr) - delta)
            dq[a:b] = torch.einsum("nlm,mnd->lnd", dscores, kr) * scale
            dk[a:b] = (
                (torch.einsum("nlm,lnd->mnd", dscores, q[a:b]) * scale)
                .unflatten(1, (kv_heads, groups))
                .sum(2)
            )
            dv[a:b] = torch.einsum("nlm,lnd->mnd", probs, g).unflatten(1, (kv_heads, groups)).sum(2)
        return dq, dk, dv


def test_sequences_are_rows_documents_and_padded_tails() -> None:
    q = torch.zeros(2, 1, 6, 4)
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    rows = _VarlenFlashKernel(q, None, None, use_flash_attn=False)
    assert rows.cu_seqlens.tolist() == [0, 6, 12] and rows.max_len == 6
    padded = _VarlenFlashKernel(q, valid, None, use_flash_attn=False)
    assert padded.cu_seqlens.tolist() == [0, 6, 10, 12]
    packed = _VarlenFlashKernel(q, valid, documents, use_flash_attn=False)
    assert packed.cu_seqlens.tolist() == [0, 2, 5, 6, 7, 10, 12] and packed.max_len == 3
    assert packed.cu_seqlens.dtype == torch.int32


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
@pytest.mark.parametrize("layout", ["rows", "padded", "packed"])
def test_varlen_merge_matches_eager(steps: int, heads: int, kv_heads: int, layout: str) -> None:
    generator = torch.Generator().manual_seed(steps + heads + kv_heads)
    batch, seq, dim = 2, 11, 8
    valid = torch.ones(batch, seq, dtype=torch.bool)
    documents = None
    if layout != "rows":
        valid[1, 7:] = False
    if layout == "packed":
        documents = torch.tensor([[0] * 3 + [1] * 4 + [2] * 4, [0] * 4 + [1] * 7])

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    q = leaf(batch, heads, seq, dim)
    keys = [leaf(batch, kv_heads, seq, dim) for _ in range(steps)]
    values = [leaf(batch, kv_heads, seq, dim) for _ in range(steps)]
    upstream = torch.randn(batch, seq, heads * dim, generator=generator, dtype=torch.float64)
    mask = valid.unsqueeze(-1)
    results = []
    for run in ("eager", "varlen"):
        for t in (q, *keys, *values):
            t.grad = None
        padding = None if layout == "rows" else valid
        if run == "eager":
            out = eager_ttt_attention(q, keys, values, padding, documents)
        else:
            kernel = ReferenceVarlenKernel(q, padding, documents, use_flash_attn=False)
            out = _merged(kernel, q, keys, values)
        (out * upstream * mask).sum().backward()
        results.append((out.detach() * mask, [t.grad.clone() for t in (q, *keys, *values)]))
    (eager_out, eager_grads), (varlen_out, varlen_grads) = results
    # the merge itself runs in fp32
    torch.testing.assert_close(varlen_out, eager_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(varlen_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
