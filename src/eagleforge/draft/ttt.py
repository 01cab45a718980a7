"""The unrolled training-time test (TTT): k draft steps over a batch, and the loss.

At step i, draft position t reads the token x_{t+1+i} and the hidden state of step i-1 (at
step 0: fc of the target's aux features f_t), at RoPE position pos_t + i (every component of
a vision-language target's M-RoPE position), and predicts x_{t+2+i}; the teacher is the
target's distribution at position t+1+i. The loss at (i, t) counts iff x_{t+2+i} exists, is
supervised, and the target's argmax there is a draft-vocab id. The draft's lm_head and the
soft cross-entropy are computed only at counted positions.

Everything here is a function of tensors, testable alone.

Shape suffixes: B batch, T sequence, H draft hidden, A aux width (3 * target hidden),
W draft vocab, n counted positions, k TTT steps, 3 M-RoPE position components.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from eagleforge.batch import TTTBatch, shift_left
from eagleforge.draft.attention import (
    AttentionBackend,
    FastestAttention,
    FlexUnroll,
    eager_ttt_attention,
    flash_ttt_attention,
    flex_ttt_attention,
    sdpa_ttt_attention,
)
from eagleforge.draft.loss import LossConfig, chunked_loss
from eagleforge.draft.model import Eagle3Draft
from eagleforge.draft.training import PositionStats, TrainingModule

# (q, keys, values, valid_BT, document_ids_BT) -> [B, T, N*D], as ``eager_ttt_attention``.
AttentionFn = Callable[
    [
        torch.Tensor,
        list[torch.Tensor],
        list[torch.Tensor],
        torch.Tensor | None,
        torch.Tensor | None,
    ],
    torch.Tensor,
]


class UnrollAttention(Protocol):
    """An attention backend with state across the steps of one unroll, given to the TTT as a
    value: ``parallel/usp.py``'s sequence-parallel attention over this rank's chunk."""

    @property
    def halo(self) -> int:
        """Look-ahead positions a batch must carry past its chunk (``shard_sequence``), or 0."""
        ...

    def __call__(self) -> AttentionFn:
        """A fresh attention for one unroll."""
        ...


ATTENTION: dict[AttentionBackend, AttentionFn] = {
    AttentionBackend.auto: FastestAttention(),  # resolved to auto on a CPU only
    AttentionBackend.eager: eager_ttt_attention,
    AttentionBackend.sdpa: sdpa_ttt_attention,
    AttentionBackend.flex: flex_ttt_attention,
    AttentionBackend.flash: flash_ttt_attention,
}


def counted_positions(
    loss_mask_BT: torch.Tensor,
    valid_BT: torch.Tensor,
    in_draft_BT: torch.Tensor,
    step: int,
    document_ids_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [B, T]: positions t whose step-``step`` prediction of x_{t+2+step} enters the loss
    (in packed rows x_{t+2+step} must also belong to t's document)."""
    supervised = shift_left(loss_mask_BT.bool() & valid_BT.bool(), 2 + step)
    counted = supervised & shift_left(in_draft_BT.bool(), 1 + step)
    if document_ids_BT is not None:
        counted &= shift_left(document_ids_BT, 2 + step) == document_ids_BT
    return counted


def count_positions(batch: TTTBatch, ttt_length: int) -> torch.Tensor:
    """Counted positions per step [k] for one micro-batch (for global loss normalisation)."""
    return torch.stack(
        [
            counted_positions(
                batch.loss_mask_BT,
                batch.valid_BT,
                batch.teacher.in_draft_BT,
                i,
                batch.document_ids_BT,
            )[:, : batch.computed_length].sum()
            for i in range(ttt_length)
        ]
    )


def draft_step(
    draft: Eagle3Draft,
    input_ids_BT: torch.Tensor,
    hidden_BTH: torch.Tensor,
    position_ids_BT: torch.Tensor,
    valid_BT: torch.Tensor | None,
    document_ids_BT: torch.Tensor | None,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    attention: AttentionBackend | AttentionFn = AttentionBackend.eager,
    compile: bool = False,
) -> torch.Tensor:
    """One draft-layer pass of a TTT step; appends this step's keys/values; returns pre-norm [B,T,H].

    ``compile``: the layer's two dense regions (``compiled_layer``) run compiled, the
    attention between them as it is."""
    attend = ATTENTION[attention] if isinstance(attention, AttentionBackend) else attention
    layer_qkv, layer_output = compiled_layer() if compile else (_layer_qkv, _layer_output)
    q, k, v = layer_qkv(draft, input_ids_BT, hidden_BTH, position_ids_BT)
    keys.append(k)
    values.append(v)
    attention_BTX = attend(q, keys, values, valid_BT, document_ids_BT)
    return layer_output(draft, hidden_BTH, attention_BTX)  # type: ignore[no-any-return]


def _layer_qkv(
    draft: Eagle3Draft,
    input_ids_BT: torch.Tensor,
    hidden_BTH: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return draft.layer_qkv(input_ids_BT, hidden_BTH, positions)


def _layer_output(
    draft: Eagle3Draft, hidden_BTH: torch.Tensor, attention_BTX: torch.Tensor
) -> torch.Tensor:
    return draft.layer_output(hidden_BTH, attention_BTX)


@functools.cache
def compiled_layer() -> tuple[Any, Any]:
    """The draft layer's regions before and after attention (embedding, norms, q/k/v and RoPE;
    o_proj, residuals and MLP) through torch.compile, built once per process.

    Regional: every TTT step runs them at the same shapes, so one graph each serves all the
    steps of every batch of a sequence length (dynamic=None: after a second length, one graph
    with dynamic shapes). The attention between them keeps its own kernels -- flex its own
    compiled one (``FlexUnroll``) -- rather than a graph per step of growing keys.
    """
    return torch.compile(_layer_qkv), torch.compile(_layer_output)


def unroll_attention(backend: AttentionBackend, num_steps: int) -> AttentionFn:
    """The attention of one unroll of ``num_steps`` steps: flex lays every step's keys over
    the slots of all steps, so that one compiled kernel serves them (``FlexUnroll``)."""
    if backend == AttentionBackend.flex:
        return FlexUnroll(num_steps)
    return ATTENTION[backend]


def ttt_forward(
    draft: Eagle3Draft,
    batch: TTTBatch,
    ttt_length: int,
    loss_scale_k: torch.Tensor | None = None,
    attention: AttentionBackend | UnrollAttention = AttentionBackend.eager,
    compile: bool = False,
    loss_chunk_size: int | None = None,
    loss: LossConfig | None = None,
    later_inputs: LaterInputs | None = None,
) -> PositionStats:
    """Unroll ``ttt_length`` draft steps over the batch; per-step loss sums and counts.

    Step i at position t reads the token x_{t+i+1} and step i-1's output, at position t+i.
    With ``later_inputs`` every step after the first reads those inputs instead (the same at
    every position): a draft that proposes every depth in one forward from placeholders
    (vLLM's parallel drafting), trained on the same attention pattern and targets.

    ``loss_scale_k`` (see ``loss_scales``) multiplies each step's loss sum in the differentiable
    ``stats.loss``; without it (evaluation) no gradients are computed. ``loss`` picks the loss
    kind (default: kl, the soft cross-entropy).

    lk_lambda's KL weight comes from each step's mean α over *this call's* counted positions
    (this micro-batch, on this rank; under sequence parallelism this rank's chunk), as SpecForge
    takes it per micro-batch and data-parallel rank; the loss terms themselves keep the global
    normalisation of ``loss_scale_k``. So it is SpecForge's LK-λ exactly for one micro-batch on
    one rank, and otherwise a token-weighted sum of per-micro-batch LK-λ terms.

    ``attention`` is a backend of ``draft/attention.py`` or, for sequence parallelism, the
    ``USPBackend`` of ``parallel/usp.py``: the batch is then this rank's chunk
    (``shard_sequence``) and the stats are the chunk's. Every sp rank must run the unroll, and
    its backward, together.
    """
    input_ids, valid = batch.input_ids_BT, batch.valid_BT.bool()
    teacher = batch.teacher
    seq, span = input_ids.shape[1], batch.computed_length
    positions_BT = batch.position_ids_BT
    if positions_BT is None:
        positions_BT = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    positions_BT = positions_BT[:, :span]
    # [B, T] or M-RoPE's [3, B, T]: either way step i rotates by pos_t + i
    positions = positions_BT if batch.position_ids_3BT is None else batch.position_ids_3BT
    positions = positions[..., :span]
    documents_BT = None if batch.document_ids_BT is None else batch.document_ids_BT[:, :span]
    attention_valid = None if bool(valid[:, :span].all()) else valid[:, :span]  # None: no padding
    attend: AttentionBackend | AttentionFn
    if isinstance(attention, AttentionBackend):
        if attention not in ATTENTION:
            raise ValueError(
                f"attention={attention.value} needs its ranks: pass parallel.usp.USPBackend"
            )
        attend = unroll_attention(attention, ttt_length)
    else:
        if batch.halo < attention.halo:
            raise ValueError(
                "sequence-parallel attention over several ranks takes this rank's chunk of "
                "the batch: pass shard_sequence(batch, sp, ttt_length)"
            )
        attend = attention()
    hidden_BTH = draft.fuse(batch.aux_BTA[:, :span])
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    # Normed outputs at every step's counted positions, for one lm_head + loss call.
    normed_rows = []
    # Counted positions of every step, found once (one host sync, not one per step); nonzero
    # lists them step by step, so each step's rows are a contiguous slice.
    counted_kBT = torch.stack(
        [
            counted_positions(
                batch.loss_mask_BT, valid, teacher.in_draft_BT, step, batch.document_ids_BT
            )[:, :span]
            for step in range(ttt_length)
        ]
    )
    step_n, rows_n, cols_n = counted_kBT.nonzero(as_tuple=True)
    per_step_rows = counted_kBT.sum((1, 2)).tolist()
    fixed = None if later_inputs is None else later_inputs(input_ids.shape[0], span)
    for step, (rows, cols) in enumerate(
        zip(rows_n.split(per_step_rows), cols_n.split(per_step_rows), strict=True)
    ):
        ids_BT = shift_left(input_ids, 1 + step)[:, :span]
        if step and fixed is not None:
            ids_BT, hidden_BTH = fixed
        hidden_BTH = draft_step(
            draft,
            ids_BT,
            hidden_BTH,
            positions + step,
            attention_valid,
            documents_BT,
            keys,
            values,
            attend,
            compile,
        )
        normed_rows.append(draft.head_input(hidden_BTH[rows, cols]))
    teacher_n = rows_n * seq + cols_n + 1 + step_n  # rows of the teacher, halo included
    out = chunked_loss(
        torch.cat(normed_rows),
        draft.lm_head.weight,
        teacher.probs_BTW.flatten(0, 1),
        teacher_n,
        None if loss_scale_k is None else loss_scale_k.to(step_n.device)[step_n],
        loss_chunk_size,
        loss,
        step_n,
        ttt_length,
    )
    correct_n = (
        draft.draft_to_target_ids(out.argmax_n) == teacher.target_ids_BT.flatten()[teacher_n]
    )
    per_step = torch.zeros(ttt_length, dtype=torch.long, device=step_n.device)
    per_step_sum = torch.zeros(ttt_length, dtype=out.loss_n.dtype, device=step_n.device)
    return PositionStats(
        loss=out.weighted,
        loss_sum_k=per_step_sum.index_add(0, step_n, out.loss_n),
        num_counted_k=per_step.index_add(0, step_n, torch.ones_like(step_n)),
        num_correct_k=per_step.index_add(0, step_n, correct_n.long()),
        alpha_sum_k=per_step_sum.index_add(0, step_n, out.alpha_n),
    )


def step_weights(ttt_length: int, decay: float, device: torch.device | None = None) -> torch.Tensor:
    """Loss weight of each TTT step: decay ** i."""
    return decay ** torch.arange(ttt_length, dtype=torch.float32, device=device)


def loss_scales(global_counts_k: torch.Tensor, weights_k: torch.Tensor) -> torch.Tensor:
    """scale_i = w_i / N_i, with N_i the counted positions of the whole optimizer step.

    With these scales, ``ttt_forward(...).loss`` is Σ_i w_i · loss_sum_i / N_i; summing it over
    the micro-batches (and data-parallel ranks) of a step gives the global token-normalised
    loss, whatever the padding or the split into micro-batches.
    """
    return weights_k / global_counts_k.clamp(min=1).to(weights_k.dtype)


def simulated_acceptance_length(acc_k: list[float]) -> float:
    """τ_sim = 1 + Σ_j Π_{i<=j} acc_i (the 1 is the target's own token)."""
    tau, survive = 1.0, 1.0
    for acc in acc_k:
        survive *= acc
        tau += survive
    return tau


# (batch, length) -> the token ids [B, T] and hidden states [B, T, H] every step after the
# first reads (``ttt_forward``'s ``later_inputs``)
LaterInputs = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class TTTModule(TrainingModule):
    """The draft with the unrolled training-time test as its forward."""

    def __init__(
        self,
        draft: Eagle3Draft,
        ttt_length: int,
        attention: AttentionBackend | UnrollAttention,
        compile: bool = False,
        loss: LossConfig | None = None,
        **ttt_options: Any,
    ) -> None:
        super().__init__()
        self.draft = draft
        self.ttt_length, self.attention, self.use_compile = ttt_length, attention, compile
        self.num_positions = ttt_length  # the per-position metrics: one per TTT step
        self.loss = loss if loss is not None else LossConfig()
        self.ttt_options = ttt_options

    def forward(
        self, batch: TTTBatch, loss_scale_k: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # A tuple of tensors, not PositionStats: FSDP2 hooks the backward through the outputs it
        # can flatten.
        stats = ttt_forward(
            self.draft,
            batch,
            self.ttt_length,
            loss_scale_k,
            attention=self.attention,
            compile=self.use_compile,
            loss=self.loss,
            later_inputs=self.later_inputs(),
            **self.ttt_options,
        )
        return (
            stats.loss,
            stats.loss_sum_k,
            stats.num_counted_k,
            stats.num_correct_k,
            stats.alpha_sum_k,
        )

    def later_inputs(self) -> LaterInputs | None:
        """What every step after the first reads, where not the next token and the previous
        step's output (None: EAGLE-3's unrolled test)."""
        return None

    def count_positions(self, batch: TTTBatch) -> torch.Tensor:
        """Counted positions per step (the step's global normalisation sums them)."""
        return count_positions(batch, self.ttt_length)

    @staticmethod
    def loss_scales(global_counts_k: torch.Tensor, weights_k: torch.Tensor) -> torch.Tensor:
        return loss_scales(global_counts_k, weights_k)
