"""DFlash: a block draft that proposes a whole block of tokens in one forward (arXiv 2602.06036).

The draft is a few Qwen3-style decoder layers (per-head q/k norms, SwiGLU, a final norm) with
no embedding or lm_head of its own: it reads the target's, frozen. The target's tapped hidden
states (``aux_layer_ids``, output-of-layer numbering) are fused by ``fc`` and
``hidden_norm`` into one context state per position, and every layer projects that context
with its own ``k_proj``/``v_proj`` (``k_norm`` and RoPE on the keys, no input norm) and puts it
in front of the block's keys and values. Queries come only from the block.

A block at position p is ``[x_p, MASK x (B-1)]`` at positions p .. p+B-1: it sees the context
of every position before p, and itself bidirectionally; slot k predicts the token at p+k
(slot 0, the token itself, is not a prediction). That is how vLLM serves it (its DFlash
proposer's query is the bonus token and B-1 mask tokens after the context of the verified
tokens), how our decoder drafts (``speculative/block_decoder.py``) and how training runs: up to
``num_anchors`` anchors per sequence, each a supervised token followed by a supervised token,
each anchor's block attending to the context strictly before it and never to another block.

The loss is cross-entropy over the target's whole vocabulary at each counted slot, slot k
weighted by exp(-(k-1)/gamma) and normalised by the weights (``block_loss_scales``), computed
in chunks of rows so no [rows, V] logits are kept for backward.

Shape suffixes: B batch, T sequence, C context positions, Q block queries (anchors x block
size), S = C + Q keys, N query heads, K key/value heads, D head dim, H hidden, A fc input
(taps x target hidden), V target vocab, n counted slots, k block slots 1 .. B-1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagleforge.batch import BlockBatch, rows_per_chunk
from eagleforge.draft.training import PositionStats, TrainingModule
from eagleforge.errors import ConfigError
from eagleforge.layers import RMSNorm, SwiGLU, init_trainable, rotate_half

# The DFlash paper's loss decay gamma by block size (16, 10, 8); other sizes take the nearest
# size at or below theirs.
_GAMMA_BY_BLOCK_SIZE = ((16, 7.0), (10, 5.0), (8, 4.0))


def default_gamma(block_size: int) -> float:
    """The paper's gamma for ``block_size`` (7 / 5 / 4 for 16 / 10 / 8; 4 below 8)."""
    for size, gamma in _GAMMA_BY_BLOCK_SIZE:
        if block_size >= size:
            return gamma
    return 4.0


def spread_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The reference's default taps: ``num_taps`` output-of-layer ids spread evenly over
    1 .. num_target_layers-3 (one tap: the middle layer)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_taps - 1)) for i in range(num_taps)]


@dataclass
class DFlashConfig:
    """``draft.dflash``: the shape and training of a DFlash draft (with ``draft.family=dflash``).

    The taps are the run's aux layers (``model.aux_layer_ids``: the layers the target backend
    and the feature store capture), so a store prepared for EAGLE-3 trains DFlash as it is.
    """

    # Decoder layers of the draft (the published recipe's 5; 1-2 train on a CPU). These three
    # are the published shape; draft=dflash takes a model file's model.draft_defaults.dflash
    # instead, where it gives them (the shape that fits a small target).
    num_layers: int = 5
    # Tokens per block B: one verified token and B-1 proposals (vLLM's
    # num_speculative_tokens = B-1, SGLang's speculative-num-draft-tokens = B).
    block_size: int = 16
    # Blocks trained per sequence, at most (anchors drawn among supervised positions).
    num_anchors: int = 512
    # gamma of the slot weights exp(-(k-1)/gamma); null = the paper's for the block size.
    loss_decay: float | None = None
    # The token id of the masked slots: a real row of the target's embedding that is never
    # pad or eos (SmolLM2: 16, <empty_output>, unused in chat); null = the tokenizer's
    # mask_token_id, which most chat tokenizers do not have.
    mask_token_id: int | None = None
    # MLP width of each layer; null = the target's intermediate_size.
    intermediate_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_anchors"):
            if getattr(self, name) < 1:
                raise ConfigError(f"draft.dflash.{name} must be >= 1, got {getattr(self, name)}.")
        if self.block_size < 2:
            raise ConfigError(
                f"draft.dflash.block_size must be >= 2 (a token and a proposal), got "
                f"{self.block_size}."
            )
        if self.loss_decay is not None and self.loss_decay <= 0:
            raise ConfigError(f"draft.dflash.loss_decay must be > 0, got {self.loss_decay}.")

    @property
    def gamma(self) -> float:
        return self.loss_decay if self.loss_decay is not None else default_gamma(self.block_size)


@dataclass
class DFlashArchitecture:
    """Everything that builds a DFlash draft; written into its config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    target_hidden_size: int
    num_target_layers: int
    # Tapped target layers, output-of-layer numbering (vLLM reads them +1).
    aux_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    target_model_type: str = "llama"

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        cfg: DFlashConfig,
        target_layer_ids: list[int],
        mask_token_id: int,
    ) -> DFlashArchitecture:
        """The draft for a target: its hidden size, heads, head size and RoPE (the draft
        embeds with the target's embedding and decodes with its lm_head)."""
        text = (
            target_config.get_text_config()
            if hasattr(target_config, "get_text_config")
            else target_config
        )
        heads = text.num_attention_heads
        rope = dict(getattr(text, "rope_parameters", None) or {})
        rope_theta = float(rope.pop("rope_theta", getattr(text, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default" or "mrope_section" in rope:
            raise ConfigError(
                f"draft.family=dflash: the target's RoPE is {rope_type} "
                f"{'(M-RoPE)' if 'mrope_section' in rope else ''}; DFlash drafts are trained "
                "here for plain-RoPE text targets only."
            )
        if not 0 <= mask_token_id < text.vocab_size:
            raise ConfigError(
                f"draft.dflash.mask_token_id={mask_token_id} is not a row of the target's "
                f"embedding (0..{text.vocab_size - 1}); choose an unused special token."
            )
        return cls(
            hidden_size=text.hidden_size,
            intermediate_size=cfg.intermediate_size or text.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
            vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
            num_target_layers=text.num_hidden_layers,
            aux_layer_ids=list(target_layer_ids),
            block_size=cfg.block_size,
            mask_token_id=mask_token_id,
            target_model_type=getattr(text, "model_type", "llama"),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DFlashAttention(nn.Module):
    """Qwen3 attention: RMSNorm per head on q and k before RoPE."""

    def __init__(self, arch: DFlashArchitecture) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        self.head_dim = arch.head_dim
        hidden, bias = arch.hidden_size, arch.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)

    def keys_values(
        self, x_BTH: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k (normed, rotated) and v [B, K, T, D] of ``x``: the block's after the input norm,
        the context's straight from ``hidden_norm``."""
        b, t, _ = x_BTH.shape
        k = self.k_norm(self.k_proj(x_BTH).view(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_BTH).view(b, t, self.num_kv_heads, self.head_dim)
        return _rotate(k.transpose(1, 2), cos_BTD, sin_BTD), v.transpose(1, 2)

    def queries(
        self, x_BQH: torch.Tensor, cos_BQD: torch.Tensor, sin_BQD: torch.Tensor
    ) -> torch.Tensor:
        b, q, _ = x_BQH.shape
        queries = self.q_norm(self.q_proj(x_BQH).view(b, q, self.num_heads, self.head_dim))
        return _rotate(queries.transpose(1, 2), cos_BQD, sin_BQD)


def _rotate(x_BNTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD.unsqueeze(1), sin_BTD.unsqueeze(1)
    return x_BNTD * cos + rotate_half(x_BNTD) * sin


class DFlashLayer(nn.Module):
    def __init__(self, arch: DFlashArchitecture) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = DFlashAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SwiGLU(arch.hidden_size, arch.intermediate_size)


class DFlashDraft(nn.Module):
    """The draft's trained tensors (``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``: the
    names vLLM loads) and the target's embedding and lm_head as frozen, unsaved buffers."""

    embed_VH: torch.Tensor
    lm_head_VH: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(self, arch: DFlashArchitecture) -> None:
        super().__init__()
        self.arch = arch
        taps = len(arch.aux_layer_ids)
        self.fc = nn.Linear(taps * arch.target_hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # set_target_weights gives them: until then, nothing of the target's size
        self.register_buffer("embed_VH", torch.empty(0), persistent=False)
        self.register_buffer("lm_head_VH", torch.empty(0), persistent=False)
        exponents = torch.arange(0, arch.head_dim, 2, dtype=torch.float64) / arch.head_dim
        inv_freq = (1.0 / (arch.rope_theta**exponents)).float()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def decoder_layers(self) -> list[DFlashLayer]:
        return [layer for layer in self.layers if isinstance(layer, DFlashLayer)]

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) for every matrix, ones for the norms, zero biases."""
        init_trainable(self, std, generator)

    def set_target_weights(self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor) -> None:
        """The target's input embedding and lm_head, which the draft reads and never trains,
        kept in the target's dtype (the logits are computed in it, as the target computes its
        own: on a CPU a bf16 lm_head is read in a sixth of the fp32 time); one tensor when the
        target ties them."""
        device = self.inv_freq.device
        expected = (self.arch.vocab_size, self.arch.hidden_size)
        for name, weight in (("embedding", embed_VH), ("lm_head", lm_head_VH)):
            if tuple(weight.shape) != expected:
                raise ValueError(
                    f"the target's {name} has shape {tuple(weight.shape)}, the draft expects "
                    f"{expected}"
                )
        embed = embed_VH.detach().to(device)
        tied = lm_head_VH.data_ptr() == embed_VH.data_ptr()
        self.embed_VH = embed
        self.lm_head_VH = embed if tied else lm_head_VH.detach().to(device)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def context(self, aux_BCA: torch.Tensor) -> torch.Tensor:
        """The fused context state [B, C, H] of the target's taps: hidden_norm(fc(taps))."""
        return self.hidden_norm(self.fc(aux_BCA.to(self.fc.weight.dtype)))

    def context_keys_values(
        self, context_BCH: torch.Tensor, positions_BC: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values [B, K, C, D] of the context (what vLLM writes into the
        draft's cache before the block runs)."""
        cos, sin = self.rope(positions_BC, context_BCH.dtype)
        return [layer.self_attn.keys_values(context_BCH, cos, sin) for layer in self.decoder_layers]

    def blocks(
        self,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        tokens_BQ: torch.Tensor,
        positions_BQ: torch.Tensor,
        mask_BQS: torch.Tensor,
    ) -> torch.Tensor:
        """The final-normed hidden states [B, Q, H] of the block queries: each layer attends
        from the block to the context's keys and the block's own (``mask_BQS``, True = may
        attend, over context then block keys)."""
        dtype = self.fc.weight.dtype
        hidden_BQH = F.embedding(tokens_BQ, self.embed_VH).to(dtype)
        cos, sin = self.rope(positions_BQ, dtype)
        mask_B1QS = mask_BQS.unsqueeze(1)
        for layer, (context_k, context_v) in zip(self.decoder_layers, context_kv, strict=True):
            attn = layer.self_attn
            x_BQH = layer.input_layernorm(hidden_BQH)
            k, v = attn.keys_values(x_BQH, cos, sin)
            q = attn.queries(x_BQH, cos, sin)
            # one dtype for all three: under autocast the norms' fp32 gains and the bf16
            # projections meet here
            keys = torch.cat([context_k, k], dim=2).to(q.dtype)
            values = torch.cat([context_v.to(v.dtype), v], dim=2).to(q.dtype)
            out = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=mask_B1QS,
                enable_gqa=attn.num_heads != attn.num_kv_heads,
            )
            out_BQX = out.transpose(1, 2).reshape(*tokens_BQ.shape, -1)
            hidden_BQH = hidden_BQH + attn.o_proj(out_BQX)
            hidden_BQH = hidden_BQH + layer.mlp(layer.post_attention_layernorm(hidden_BQH))
        return self.norm(hidden_BQH)

    def logits(self, hidden_nH: torch.Tensor) -> torch.Tensor:
        """The target's lm_head over draft states: fp32 logits [n, V]."""
        return F.linear(hidden_nH.to(self.lm_head_VH.dtype), self.lm_head_VH).float()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())

    def replica(self) -> DFlashDraft:
        """A draft of the same architecture on the same device, seeing the same target
        embedding and lm_head (rank 0's whole copy of a sharded draft)."""
        copy = DFlashDraft(self.arch).to(next(self.parameters()).device)
        copy.set_target_weights(self.embed_VH, self.lm_head_VH)
        return copy


# --- training -------------------------------------------------------------------------------


def anchor_candidates(batch: BlockBatch) -> torch.Tensor:
    """Bool [B, T]: positions a block may start at -- a supervised token followed by a
    supervised token of the same document."""
    supervised = batch.loss_mask_BT.bool() & batch.valid_BT.bool()
    candidates = torch.zeros_like(supervised)
    candidates[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    if batch.document_ids_BT is not None:
        documents = batch.document_ids_BT
        candidates[:, :-1] &= documents[:, :-1] == documents[:, 1:]
    return candidates


def select_anchors(
    candidates_BT: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to ``num_anchors`` candidate positions per row, drawn without replacement and sorted;
    long [B, num_anchors'], -1 where a row has fewer (``num_anchors'`` = the most any row got)."""
    rows = []
    for candidates_T in candidates_BT.cpu():
        found = candidates_T.nonzero().squeeze(1)
        order = torch.randperm(len(found), generator=generator)[:num_anchors]
        rows.append(found[order].sort().values)
    width = max(1, max(len(r) for r in rows))
    anchors_BN = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        anchors_BN[i, : len(r)] = r
    return anchors_BN.to(candidates_BT.device)


@dataclass
class BlockLayout:
    """Where every block query of a batch sits, what it sees and what it predicts."""

    tokens_BQ: torch.Tensor  # x_anchor at slot 0, the mask token elsewhere
    positions_BQ: torch.Tensor  # RoPE positions: the anchor's + slot
    mask_BQS: torch.Tensor  # True = may attend; keys are the T context positions, then Q
    labels_BQ: torch.Tensor  # the token at anchor + slot (0 where there is none)
    counted_BQ: torch.Tensor  # slot >= 1 with a supervised label in the anchor's document
    slot_BQ: torch.Tensor  # 0 .. B-1


def block_layout(batch: BlockBatch, block_size: int, mask_token_id: int) -> BlockLayout:
    """The blocks of ``batch.anchors_BN``: block j of a row is its anchor's token and
    ``block_size - 1`` mask tokens; each query attends to the context before the anchor (real
    tokens of the anchor's document) and to its own block, never another block."""
    input_ids, anchors = batch.input_ids_BT, batch.anchors_BN
    if anchors is None:
        raise ValueError("a block batch needs its anchors (select_anchors)")
    device = input_ids.device
    rows, seq = input_ids.shape
    num_blocks = anchors.shape[1]
    slot_Q = torch.arange(block_size, device=device).repeat(num_blocks)
    block_Q = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    used_BQ = (anchors >= 0).repeat_interleave(block_size, dim=1)
    anchor_BQ = anchors.clamp(min=0).repeat_interleave(block_size, dim=1)
    target_BQ = anchor_BQ + slot_Q  # the position slot k stands for
    inside_BQ = target_BQ < seq
    target_at_BQ = target_BQ.clamp(max=seq - 1)

    positions_BT = batch.position_ids_BT
    if positions_BT is None:
        positions_BT = torch.arange(seq, device=device).expand(rows, seq)
    positions_BQ = positions_BT.gather(1, anchor_BQ) + slot_Q
    tokens_BQ = torch.where(slot_Q == 0, input_ids.gather(1, anchor_BQ), mask_token_id)

    valid_BT = batch.valid_BT.bool()
    key_T = torch.arange(seq, device=device)
    context_BQT = (key_T < anchor_BQ.unsqueeze(2)) & valid_BT.unsqueeze(1) & used_BQ.unsqueeze(2)
    same_document_BQ = torch.ones_like(used_BQ)
    if batch.document_ids_BT is not None:
        documents = batch.document_ids_BT
        anchor_doc_BQ = documents.gather(1, anchor_BQ)
        context_BQT &= documents.unsqueeze(1) == anchor_doc_BQ.unsqueeze(2)
        same_document_BQ = documents.gather(1, target_at_BQ) == anchor_doc_BQ
    own_block_QQ = block_Q.unsqueeze(1) == block_Q.unsqueeze(0)
    mask_BQS = torch.cat([context_BQT, own_block_QQ.expand(rows, -1, -1)], dim=2)

    supervised_BT = batch.loss_mask_BT.bool() & valid_BT
    counted_BQ = (
        used_BQ
        & (slot_Q > 0)
        & inside_BQ
        & supervised_BT.gather(1, target_at_BQ)
        & same_document_BQ
    )
    labels_BQ = torch.where(counted_BQ, input_ids.gather(1, target_at_BQ), 0)
    return BlockLayout(
        tokens_BQ, positions_BQ, mask_BQS, labels_BQ, counted_BQ, slot_Q.expand(rows, -1)
    )


def block_weights(
    block_size: int, gamma: float, device: torch.device | None = None
) -> torch.Tensor:
    """Loss weight of slots 1 .. B-1: exp(-(k-1)/gamma)."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def block_loss_scales(global_counts_k: torch.Tensor, weights_k: torch.Tensor) -> torch.Tensor:
    """scale_k = w_k / Σ_j w_j N_j: the loss is the weight-normalised mean of the counted
    slots' cross-entropy over the whole optimizer step (every micro-batch and rank)."""
    total = (weights_k * global_counts_k.to(weights_k.dtype)).sum().clamp(min=1e-12)
    return weights_k / total


@dataclass
class BlockRows:
    """Per counted slot: its cross-entropy, its label's draft probability and its argmax."""

    loss_n: torch.Tensor  # differentiable
    label_prob_n: torch.Tensor
    argmax_n: torch.Tensor


def chunked_cross_entropy(
    hidden_nH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_n: torch.Tensor,
    chunk_size: int | None = None,
) -> BlockRows:
    """Cross-entropy of the draft's logits over the whole vocabulary, ``chunk_size`` rows at a
    time (default: 32 MiB of fp32 logits); each chunk's logits are recomputed in backward,
    never kept."""
    if chunk_size is None:
        chunk_size = rows_per_chunk(lm_head_VH.shape[0])
    losses, probs, argmaxes = [], [], []
    for start in range(0, len(labels_n), chunk_size):
        rows, labels = hidden_nH[start : start + chunk_size], labels_n[start : start + chunk_size]
        if torch.is_grad_enabled() and rows.requires_grad:
            loss = checkpoint(_row_losses, rows, lm_head_VH, labels, use_reentrant=False)
        else:
            loss = _row_losses(rows, lm_head_VH, labels)
        with torch.no_grad():
            logits = F.linear(rows.to(lm_head_VH.dtype), lm_head_VH).float()
            probs.append(logits.softmax(-1).gather(1, labels[:, None]).squeeze(1))
            argmaxes.append(logits.argmax(-1))
        losses.append(loss)
    if not losses:
        empty = hidden_nH.new_zeros(0, dtype=torch.float32)
        return BlockRows(empty, empty, labels_n.new_zeros(0))
    return BlockRows(torch.cat(losses), torch.cat(probs), torch.cat(argmaxes))


def _row_losses(
    rows_nH: torch.Tensor, lm_head_VH: torch.Tensor, labels_n: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(rows_nH.to(lm_head_VH.dtype), lm_head_VH).float()
    return F.cross_entropy(logits, labels_n, reduction="none")


def block_forward(
    draft: DFlashDraft,
    batch: BlockBatch,
    loss_scale_k: torch.Tensor | None = None,
    loss_chunk_size: int | None = None,
) -> PositionStats:
    """One forward over every block of the batch; per-slot loss sums and counts. Slot k's
    acceptance α is the draft's probability of the label (the target's greedy token in
    regenerated data): Σ_v min(p_v, q_v) against a one-hot target."""
    arch = draft.arch
    layout = block_layout(batch, arch.block_size, arch.mask_token_id)
    seq = batch.input_ids_BT.shape[1]
    positions_BT = batch.position_ids_BT
    if positions_BT is None:
        positions_BT = torch.arange(seq, device=batch.input_ids_BT.device).expand_as(
            batch.input_ids_BT
        )
    context_kv = draft.context_keys_values(draft.context(batch.aux_BTA), positions_BT)
    hidden_BQH = draft.blocks(context_kv, layout.tokens_BQ, layout.positions_BQ, layout.mask_BQS)
    counted = layout.counted_BQ
    slot_n = layout.slot_BQ[counted] - 1
    rows = chunked_cross_entropy(
        hidden_BQH[counted], draft.lm_head_VH, layout.labels_BQ[counted], loss_chunk_size
    )
    k = arch.block_size - 1
    per_slot = torch.zeros(k, dtype=torch.float32, device=slot_n.device)
    counts = torch.zeros(k, dtype=torch.long, device=slot_n.device)
    if loss_scale_k is None:  # evaluation: nothing to differentiate
        loss = torch.zeros((), device=slot_n.device)
    else:
        loss = (rows.loss_n * loss_scale_k.to(slot_n.device)[slot_n]).sum()
    correct = (rows.argmax_n == layout.labels_BQ[counted]).long()
    return PositionStats(
        loss=loss,
        loss_sum_k=per_slot.index_add(0, slot_n, rows.loss_n.detach()),
        num_counted_k=counts.index_add(0, slot_n, torch.ones_like(slot_n)),
        num_correct_k=counts.index_add(0, slot_n, correct),
        alpha_sum_k=per_slot.index_add(0, slot_n, rows.label_prob_n),
    )


def count_block_positions(batch: BlockBatch, block_size: int) -> torch.Tensor:
    """Counted slots per block position [B-1] for one micro-batch (global normalisation)."""
    layout = block_layout(batch, block_size, mask_token_id=0)
    slot_n = layout.slot_BQ[layout.counted_BQ] - 1
    counts = torch.zeros(block_size - 1, dtype=torch.long, device=slot_n.device)
    return counts.index_add(0, slot_n, torch.ones_like(slot_n))


class BlockModule(TrainingModule):
    """The DFlash draft with the block forward as its forward: what the trainer runs, as
    ``draft.ttt.TTTModule`` for EAGLE-3 (``num_positions`` are the block's slots 1 .. B-1)."""

    def __init__(self, draft: DFlashDraft, loss_chunk_size: int | None = None) -> None:
        super().__init__()
        self.draft = draft
        self.num_positions = draft.arch.block_size - 1
        self.loss_chunk_size = loss_chunk_size

    def forward(
        self, batch: BlockBatch, loss_scale_k: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        stats = block_forward(self.draft, batch, loss_scale_k, self.loss_chunk_size)
        return (
            stats.loss,
            stats.loss_sum_k,
            stats.num_counted_k,
            stats.num_correct_k,
            stats.alpha_sum_k,
        )

    def count_positions(self, batch: BlockBatch) -> torch.Tensor:
        return count_block_positions(batch, self.draft.arch.block_size)

    @staticmethod
    def loss_scales(global_counts_k: torch.Tensor, weights_k: torch.Tensor) -> torch.Tensor:
        return block_loss_scales(global_counts_k, weights_k)


def mask_token_for(
    configured: int | None, tokenizer: Any, setting: str = "draft.dflash.mask_token_id"
) -> int:
    """``draft.dflash.mask_token_id`` (else ``model.mask_token_id``), else the tokenizer's mask
    token; ConfigError without one,
    or when it is the pad, bos or eos token."""
    mask = configured if configured is not None else getattr(tokenizer, "mask_token_id", None)
    if mask is None:
        raise ConfigError(
            f"{setting.split('.')[1]} drafts need a mask token, the token id of the slots still "
            "to propose: a real but unused row of the target's embedding (an unused special "
            "token, e.g. 16 <empty_output> for SmolLM2); this tokenizer has none. Set "
            f"model.mask_token_id in the model's file (or {setting} for this draft alone)."
        )
    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("pad", "bos", "eos")}
    for name, token in special.items():
        if token is not None and int(token) == int(mask):
            raise ConfigError(
                f"{setting}={mask} is the tokenizer's {name} token; choose an "
                "unused special token (a mask must never be read as a real token)."
            )
    return int(mask)


def check_block_fits(arch: DFlashArchitecture, max_length: int) -> None:
    """ConfigError unless a block fits the sequences and the positions the draft rotates."""
    if arch.block_size > arch.max_position_embeddings:
        raise ConfigError(
            f"draft.dflash.block_size={arch.block_size} exceeds the target's "
            f"max_position_embeddings {arch.max_position_embeddings}."
        )
    if max_length < arch.block_size:
        raise ConfigError(
            f"data.max_length={max_length} is shorter than one block "
            f"(draft.dflash.block_size={arch.block_size})."
        )
