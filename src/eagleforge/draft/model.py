"""The EAGLE-3 draft head: its architecture (derived from the target's config) and module.

Parameter names and shapes are exactly those SGLang's ``LlamaForCausalLMEagle3`` loads
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, buffers ``d2t``/``t2d``), so a state dict
of this module, minus ``embed_tokens``, is an SGLang checkpoint.

Shape suffixes: B batch, T sequence, H draft hidden, A = 3 * target hidden (aux features),
N query heads, K key/value heads, D head dim, V target vocab, W draft vocab; a leading 3 is
M-RoPE's (time, height, width) position components of a vision-language target.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagleforge.errors import ConfigError
from eagleforge.layers import RMSNorm, SwiGLU, init_trainable, rotate_half


class LayerChoices(Protocol):
    """What the ``draft`` config chooses of an EAGLE-3 draft's layer (``DraftConfig``)."""

    intermediate_size: int | None
    draft_vocab_size: int
    fc_norm: bool
    norm_before_fc: bool
    norm_output: bool
    norm_before_residual: bool


@dataclass
class DraftArchitecture:
    """Everything needed to build the draft module; written as the export's config.json."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # target vocab V
    draft_vocab_size: int  # W
    target_hidden_size: int
    # Target layers whose outputs feed fc, 0-based output-of-layer numbering (see DESIGN.md).
    aux_layer_ids: list[int]
    # Non-default RoPE scaling of the target ({"rope_type": ..., ...}); None = plain RoPE.
    # An ``mrope_section`` entry (Qwen2.5-VL: D/2 frequencies split over time, height and
    # width) makes it M-RoPE, which SGLang reads from the same field.
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    target_model_type: str = "llama"
    extra: dict[str, Any] = field(default_factory=dict)
    # EAGLE-3.1 norms (see DraftConfig); all false is the EAGLE-3 draft every older
    # checkpoint holds.
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    # Parallel drafting (vLLM's parallel_drafting, P-EAGLE): the token fed at the positions
    # still to be proposed, beside the learned ``mask_hidden`` features. None = a sequential
    # EAGLE-3 draft.
    mask_token_id: int | None = None

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        draft: LayerChoices,
        aux_layer_ids: list[int],
        mask_token_id: int | None = None,
    ) -> DraftArchitecture:
        """Derive the draft's shape from a transformers config of the target.

        The draft is always one dense Llama layer; targets that differ get the nearest such
        layer: a multimodal config's text part (Llama 4, Gemma 3), the dense MLP width of a
        MoE target where it has one (Llama 4's ``intermediate_size_mlp``), GQA with the value
        head size for multi-head latent attention (DeepSeek-V3), the full-attention RoPE of
        per-layer-type RoPE (Gemma 3), and SiLU whatever the target's activation.
        """
        if len(aux_layer_ids) != 3:
            raise ConfigError(
                f"an EAGLE-3 draft reads 3 target layers, model.aux_layer_ids has "
                f"{len(aux_layer_ids)} ({aux_layer_ids}); give 3 (or null for the default)."
            )
        text = (
            target_config.get_text_config()
            if hasattr(target_config, "get_text_config")
            else target_config
        )
        hidden = text.hidden_size
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        if getattr(text, "kv_lora_rank", None):  # MLA: no per-head K/V to mirror
            head_dim = getattr(text, "v_head_dim", None) or head_dim
            heads = hidden // head_dim
            kv_heads = 8 if heads % 8 == 0 else heads
        rope = dict(getattr(text, "rope_parameters", None) or {})
        if isinstance(rope.get("full_attention"), dict):  # RoPE per layer type (Gemma 3)
            rope = dict(rope["full_attention"])
        rope_theta = float(rope.pop("rope_theta", getattr(text, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        mrope = rope.get("mrope_section")
        if mrope is not None:  # M-RoPE (Qwen2.5-VL): the draft rotates as the target does
            rope["mrope_section"] = [int(n) for n in mrope]
        vocab = text.vocab_size
        mlp_width = getattr(text, "intermediate_size_mlp", None) or text.intermediate_size
        return cls(
            hidden_size=hidden,
            intermediate_size=draft.intermediate_size or mlp_width,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 4096)),
            vocab_size=vocab,
            draft_vocab_size=min(draft.draft_vocab_size, vocab),
            target_hidden_size=hidden,
            aux_layer_ids=list(aux_layer_ids),
            rope_scaling=None if rope_type == "default" and mrope is None else rope,
            hidden_act="silu",  # DraftMLP is SiLU-gated; the export must say what was trained
            target_model_type=getattr(text, "model_type", "llama"),
            fc_norm=draft.fc_norm,
            norm_before_fc=draft.norm_before_fc,
            norm_output=draft.norm_output,
            norm_before_residual=draft.norm_before_residual,
            mask_token_id=mask_token_id,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def mrope_section(self) -> list[int] | None:
        """Frequencies per (time, height, width) component under M-RoPE; None = plain RoPE."""
        section = (self.rope_scaling or {}).get("mrope_section")
        return None if section is None else [int(n) for n in section]


def rope_inv_freq(arch: DraftArchitecture) -> torch.Tensor:
    """Inverse RoPE frequencies [D/2], computed the way transformers computes the target's."""
    scaling = arch.rope_scaling or {}
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type in ("default", "mrope"):  # M-RoPE's frequencies are plain RoPE's
        exponents = torch.arange(0, arch.head_dim, 2, dtype=torch.float64) / arch.head_dim
        return (1.0 / (arch.rope_theta**exponents)).float()
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rope_parameters={**scaling, "rope_theta": arch.rope_theta},
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float()


class DraftAttention(nn.Module):
    """Attention whose q/k/v read the 2H-wide concat of normed embedding and hidden state."""

    def __init__(self, arch: DraftArchitecture) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        width = 2 * arch.hidden_size
        bias = arch.attention_bias
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=False)

    def project(
        self, x_BTX: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B,N,T,D], k and v [B,K,T,D], RoPE applied to q and k."""
        b, t, _ = x_BTX.shape
        q = self.q_proj(x_BTX).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTX).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTX).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos_BTD.unsqueeze(1), sin_BTD.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v


class DraftMLP(SwiGLU):
    def __init__(self, arch: DraftArchitecture) -> None:
        super().__init__(arch.hidden_size, arch.intermediate_size)


class DraftDecoderLayer(nn.Module):
    """SGLang's EAGLE-3 ``midlayer``: attention over concat(norm(embed), norm(h)), residual h."""

    def __init__(self, arch: DraftArchitecture, recompute_mlp: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = DraftAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = DraftMLP(arch)
        self.recompute_mlp = recompute_mlp

    def feed_forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        """Post-attention norm + MLP. With ``recompute_mlp`` and autograd recording, its
        [B, T, intermediate] activations are recomputed in backward rather than kept."""
        if self.recompute_mlp and torch.is_grad_enabled():
            return checkpoint(
                self._feed_forward, hidden_BTH, use_reentrant=False, preserve_rng_state=False
            )
        return self._feed_forward(hidden_BTH)

    def _feed_forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(hidden_BTH))


class Eagle3Draft(nn.Module):
    """Module tree and weights of the draft; the TTT unrolling lives in ``draft/ttt.py``."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(self, arch: DraftArchitecture, recompute_mlp: bool = False) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        aux_width = 3 * arch.target_hidden_size
        # EAGLE-3.1's norms of fc's input, named as vLLM and SGLang load them
        self.input_norm = RMSNorm(aux_width, arch.rms_norm_eps) if arch.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(arch.target_hidden_size, arch.rms_norm_eps) for _ in range(3))
            if arch.fc_norm
            else None
        )
        self.fc = nn.Linear(aux_width, arch.hidden_size, bias=False)
        self.midlayer = DraftDecoderLayer(arch, recompute_mlp)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.draft_vocab_size, bias=False)
        # target_id = draft_id + d2t[draft_id]; t2d[target_id] marks ids in the draft vocab.
        self.register_buffer("d2t", torch.zeros(arch.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(arch.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)

    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) for every trainable matrix, ones for norms (the frozen embedding is kept)."""
        init_trainable(self, std, generator)

    def init_logit_lens(self, final_norm_H: torch.Tensor, lm_head_VH: torch.Tensor) -> None:
        """Start as the target's logit lens at its last aux layer: ``fc`` passes that layer's
        state through, the layer adds nothing (``o_proj`` and ``down_proj`` zero, the rest as
        ``init_weights`` left it), and ``norm`` and ``lm_head`` are the target's
        (``init_target_head``). At position t the untrained draft then gives the target's lens
        prediction for x_{t+1}, the token it is fed, not x_{t+2}: what it starts from is the
        target's hidden and output space."""
        arch = self.arch
        hidden = arch.hidden_size
        if hidden != arch.target_hidden_size:
            raise ValueError("a logit-lens draft needs the target's hidden size")
        last = arch.aux_layer_ids.index(max(arch.aux_layer_ids))  # its block of fc's input
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, last * hidden : (last + 1) * hidden].copy_(torch.eye(hidden))
            self.midlayer.self_attn.o_proj.weight.zero_()
            self.midlayer.mlp.down_proj.weight.zero_()
        self.init_target_head(final_norm_H, lm_head_VH)

    def init_target_head(self, final_norm_H: torch.Tensor, lm_head_VH: torch.Tensor) -> None:
        """``norm`` and ``lm_head`` become the target's final norm and its lm_head rows of the
        draft vocabulary (``set_vocab_map`` first); the rest is left as it is."""
        if self.arch.hidden_size != self.arch.target_hidden_size:
            raise ValueError("the target's lm_head needs a draft of the target's hidden size")
        target_ids_W = self.draft_to_target_ids(torch.arange(self.arch.draft_vocab_size))
        # the draft vocabulary's rows only: never a float copy of the whole [V, H] lm_head
        rows_WH = lm_head_VH[target_ids_W.to(lm_head_VH.device)].float().cpu()
        with torch.no_grad():
            self.norm.weight.copy_(final_norm_H.float())
            self.lm_head.weight.copy_(rows_WH)

    def load_embedding(self, weight_VH: torch.Tensor) -> None:
        """Copy the target's input embedding (frozen during training)."""
        if tuple(weight_VH.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding has shape {tuple(weight_VH.shape)}, the draft expects "
                f"{tuple(self.embed_tokens.weight.shape)}"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight_VH)

    def set_vocab_map(self, d2t_W: torch.Tensor, t2d_V: torch.Tensor) -> None:
        self.d2t.copy_(d2t_W)
        self.t2d.copy_(t2d_V)

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def rope(
        self, position_ids_BT: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B,T,D] for the given absolute positions: [B, T], or M-RoPE's
        [3, B, T] (time, height, width), whose frequency sections each take one component."""
        freqs = position_ids_BT.float().unsqueeze(-1) * self.inv_freq
        if position_ids_BT.dim() == 3:
            section = self.arch.mrope_section
            if section is None or sum(section) != freqs.shape[-1]:
                raise ValueError(
                    f"[3, B, T] M-RoPE positions need rope_scaling.mrope_section summing to "
                    f"{freqs.shape[-1]} (head_dim / 2), got {section}"
                )
            # as the target (transformers' Qwen2.5-VL): section j of the frequencies rotates
            # by position component j
            freqs = torch.cat(
                [part[j % 3] for j, part in enumerate(freqs.split(section, dim=-1))], dim=-1
            )
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def fuse(self, aux_BTA: torch.Tensor) -> torch.Tensor:
        """The first step's hidden state [B,T,H] from the target's aux features: fc, after
        EAGLE-3.1's norm of its input where the draft has one."""
        aux_BTA = aux_BTA.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            aux_BTA = self.input_norm(aux_BTA)
        if self.fc_norm is not None:
            parts = aux_BTA.chunk(len(self.fc_norm), dim=-1)
            aux_BTA = torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(aux_BTA)

    def head_input(self, carried_BTH: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads from a step's carried hidden state: its final norm, which
        a ``norm_output`` draft has applied already."""
        return carried_BTH if self.arch.norm_output else self.norm(carried_BTH)

    def layer_qkv(
        self, input_ids_BT: torch.Tensor, hidden_BTH: torch.Tensor, position_ids_BT: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """First half of a draft-layer pass: q [B,N,T,D], k and v [B,K,T,D] with RoPE, from
        the tokens and the incoming hidden states (fc of the target features, or the previous
        pass's pre-norm output)."""
        layer = self.midlayer
        embeds_BTH = self.embed_tokens(input_ids_BT).to(hidden_BTH.dtype)
        x_BTX = torch.cat(
            [layer.input_layernorm(embeds_BTH), layer.hidden_norm(hidden_BTH)], dim=-1
        )
        cos, sin = self.rope(position_ids_BT, x_BTX.dtype)
        return layer.self_attn.project(x_BTX, cos, sin)

    def layer_output(self, hidden_BTH: torch.Tensor, attention_BTX: torch.Tensor) -> torch.Tensor:
        """Second half: o_proj of the attention output [B,T,N*D], residuals and the MLP; returns
        the hidden state carried to the next pass: the pre-norm output, or its final norm for
        a ``norm_output`` draft (``head_input`` + ``lm_head`` give its logits)."""
        layer = self.midlayer
        residual_BTH = (
            layer.hidden_norm(hidden_BTH) if self.arch.norm_before_residual else hidden_BTH
        )
        hidden_BTH = residual_BTH + layer.self_attn.o_proj(attention_BTX)
        hidden_BTH = hidden_BTH + layer.feed_forward(hidden_BTH)
        return self.norm(hidden_BTH) if self.arch.norm_output else hidden_BTH

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen embedding: what checkpoints and exports store."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}

    def replica(self) -> Self:
        """A draft of the same architecture on the same device (rank 0's whole copy of a
        sharded draft; its weights are loaded into it)."""
        return type(self)(self.arch).to(next(self.parameters()).device)
