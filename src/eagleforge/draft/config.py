"""The ``draft`` config section: which family is trained and its settings. The fields every
family shares, EAGLE-3's (flat under ``draft.*``: it was the first family, and P-EAGLE reads
them too) and each other family's own section (``draft.dflash.*``). Which fields a family reads
is the family's to say (``eagleforge.families``): a setting the chosen family never reads is
refused at compose time."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from eagleforge.draft.attention import FLASH_CUDA_ONLY, AttentionBackend
from eagleforge.draft.dflash import DFlashConfig
from eagleforge.draft.peagle import PEagleConfig
from eagleforge.errors import ConfigError


class DraftFamily(str, Enum):
    """Which draft is trained (``draft=eagle3|dflash|peagle``)."""

    eagle3 = "eagle3"  # one layer, unrolled training-time test (this module, draft/ttt.py)
    dflash = "dflash"  # a block per forward, the target's states as keys (draft/dflash.py)
    peagle = "peagle"  # EAGLE-3 proposing all k tokens in one forward (draft/peagle.py)


class DraftInit(str, Enum):
    """How the draft's trainable weights start (see ``Eagle3Draft.init_logit_lens``)."""

    random = "random"  # normal(0, init_std), as EAGLE-3 and SpecForge do
    logit_lens = "logit_lens"  # the target's final norm and lm_head over its last aux layer
    # the target's final norm and lm_head rows, the rest random (vLLM speculators' start)
    target_head = "target_head"


class LossPositions(str, Enum):
    """Which predictions of the unrolled test enter the loss (``DraftConfig.loss_positions``)."""

    # the prediction of x_j counts when x_j is supervised (EAGLE-3, SpecForge)
    predicted = "predicted"
    # it counts when the token fed just before it, x_{j-1}, is supervised (vLLM speculators):
    # the first answer token is never a target, the token after the answer's last one is
    fed = "fed"


@dataclass
class DraftConfig:
    """The `draft` config section: what the user chooses about the draft head."""

    # eagle3 (the fields below) | dflash (``dflash``'s fields; docs/dflash.md) | peagle (the
    # fields below but ttt_length, step_weight_decay and norm_output, and ``peagle``'s;
    # docs/peagle.md).
    family: DraftFamily = DraftFamily.eagle3
    # A DFlash draft's shape and training, read when family=dflash.
    dflash: DFlashConfig = field(default_factory=DFlashConfig)
    # A P-EAGLE draft's parallel depths, read when family=peagle (with EAGLE-3's layer fields).
    peagle: PEagleConfig = field(default_factory=PEagleConfig)

    # Draft vocabulary size W (tokens the draft can propose); clipped to the target vocab.
    draft_vocab_size: int = 32000
    # Number of unrolled training-time-test steps k (tokens predicted ahead per position).
    ttt_length: int = 7
    # Weight of TTT step i in the loss is step_weight_decay ** i.
    step_weight_decay: float = 0.8
    # predicted | fed: a prediction counts when the token it predicts is supervised, or when
    # the token fed before it is (see LossPositions).
    loss_positions: LossPositions = LossPositions.predicted
    # TTT attention: auto (sdpa) | eager | sdpa | flash (CUDA) | flex (CUDA)
    # | usp (sequence parallel over parallel.sp_ulysses x sp_ring ranks, offline).
    attention: AttentionBackend = AttentionBackend.auto
    # torch.compile the draft layer's regions before and after attention, once for every TTT
    # step (the first step is slower while it compiles; docs/performance.md#torchcompile).
    compile: bool = False
    # MLP width of the draft layer; null = the target's intermediate_size.
    intermediate_size: int | None = None
    # Std of the normal init of trainable weights (fc, attention, mlp, lm_head).
    init_std: float = 0.02
    # random | logit_lens: start in the target's output space: fc passes the last aux layer's
    # state, the draft layer adds nothing yet, norm and lm_head are the target's (the untrained
    # draft repeats the target's lens prediction at the previous position; training moves it on)
    # | target_head: norm and lm_head are the target's, the rest random.
    # With model.draft_init, that draft's weights are the start instead.
    init: DraftInit = DraftInit.random
    # Recompute each TTT step's MLP in backward instead of keeping its [T, intermediate]
    # activations: about 3% more step FLOPs for about 4 fewer such tensors per step.
    recompute_mlp: bool = True
    # EAGLE-3.1 (arXiv 2605.09992), exactly as vLLM's and SGLang's llama_eagle3 run them:
    # one RMSNorm per aux layer's state before fc (tensors fc_norm.{0,1,2}.weight).
    fc_norm: bool = False
    # One RMSNorm over the concatenated aux states before fc (tensor input_norm.weight, 3x the
    # target hidden wide; speculators' gpt-oss style); excludes fc_norm.
    norm_before_fc: bool = False
    # The hidden state carried to the next draft step is the final norm's output, not its
    # input (the lm_head reads the same normed state either way).
    norm_output: bool = False
    # The decoder layer's residual is hidden_norm(h) rather than h. vLLM honours it; SGLang's
    # llama_eagle3 always adds the raw h, so `export --check` refuses it for SGLang.
    norm_before_residual: bool = False

    def changed_fields(self) -> dict[str, str]:
        """Every field set away from its default, as ``draft.<field>`` (a family section's as
        ``draft.<section>.<field>``) -> the value as typed; the family itself left out."""
        changed = {}
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), getattr(DraftConfig(), f.name)
            if f.name == "family" or value == default:
                continue
            if dataclasses.is_dataclass(value):
                changed.update(
                    {
                        f"draft.{f.name}.{g.name}": config_text(getattr(value, g.name))
                        for g in dataclasses.fields(value)
                        if getattr(value, g.name) != getattr(default, g.name)
                    }
                )
            else:
                changed[f"draft.{f.name}"] = config_text(value)
        return changed

    def attention_for(self, device: torch.device) -> AttentionBackend:
        """The backend to run on ``device``; ConfigError where the chosen one cannot run."""
        if self.attention == AttentionBackend.auto:
            # CUDA: sdpa since the H200 check of 2026-12-04 (its outputs and gradients equal
            # eager's, tests/gpu; O(k·T) memory where eager's is O(k·T²)). A CPU: the faster
            # of sdpa and eager for each kind of call, measured (attention.FastestAttention)
            return AttentionBackend.sdpa if device.type == "cuda" else AttentionBackend.auto
        if self.attention == AttentionBackend.flash:
            if device.type != "cuda":
                raise ConfigError(FLASH_CUDA_ONLY)
            if importlib.util.find_spec("flash_attn") is None:
                raise ConfigError(
                    "draft.attention=flash needs the flash-attn package: "
                    "pip install 'eagleforge[flash]' (or choose draft.attention=sdpa)."
                )
        if self.attention == AttentionBackend.flex and device.type != "cuda":
            raise ConfigError(
                "draft.attention=flex trains on CUDA only (its CPU backward does not exist); "
                "use draft.attention=sdpa or auto on CPU."
            )
        return self.attention

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1:
            raise ConfigError(f"draft.draft_vocab_size must be >= 1, got {self.draft_vocab_size}.")
        if self.ttt_length < 1:
            raise ConfigError(f"draft.ttt_length must be >= 1, got {self.ttt_length}.")
        if not 0.0 < self.step_weight_decay <= 1.0:
            raise ConfigError(
                f"draft.step_weight_decay must be in (0, 1], got {self.step_weight_decay}."
            )
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError(
                "draft.fc_norm and draft.norm_before_fc are two ways to normalise fc's input "
                "(one norm per aux layer, or one over their concatenation); set one of them."
            )
        if self.compile and self.attention == AttentionBackend.usp:
            raise ConfigError(
                "draft.compile=true does not combine with draft.attention=usp (its collectives "
                "run outside torch.compile); set draft.compile=false."
            )


def config_text(value: Any) -> str:
    """A config value as typed on the command line (an Enum by its value)."""
    return str(value.value) if isinstance(value, Enum) else str(value)
