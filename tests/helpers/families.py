"""What the contract tests need of each draft family beyond what its registry line gives: one
``FamilyCase`` per family of ``eagleforge.families.FAMILIES`` (``CASES``), and which judge of
``eagleforge.judges.JUDGES`` serves which family (``SERVES``).

The contract tests (tests/integration/test_family_contract.py, tests/engine/test_served_drafts.py)
are parametrised over the two registries and look a family's case up here; a family or judge
without its line here fails ``test_every_family_and_judge_has_its_line``, so a new one is tested
by adding one line to each registry, its own and this one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagleforge.draft.config import DraftConfig, DraftFamily
from eagleforge.draft.dflash import DFlashArchitecture, DFlashDraft
from eagleforge.draft.family import AnyDraft
from eagleforge.draft.model import DraftArchitecture
from eagleforge.draft.peagle import PEagleDraft
from eagleforge.families import Family
from eagleforge.precision import cpu_bf16
from eagleforge.targets.hf import HFTarget
from helpers.drafts import random_draft
from helpers.engine import shift_dflash_taps, shift_taps

# The mask token the tiny and SmolLM2 model files name (<empty_output>, unused by both)
MASK_TOKEN = 16


def random_eagle3(target: HFTarget, seed: int, std: float) -> AnyDraft:
    """An untrained EAGLE-3 draft for ``target`` over all but its last two ids."""
    return random_draft(target, target.config.vocab_size - 2, std, seed=seed)


def random_dflash(target: HFTarget, seed: int, std: float) -> AnyDraft:
    """An untrained one-layer DFlash draft (blocks of 4) for ``target``, its last id the mask."""
    text = target.config.get_text_config()
    arch = DFlashArchitecture(
        hidden_size=text.hidden_size, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=64, vocab_size=text.vocab_size,
        target_hidden_size=text.hidden_size, num_target_layers=text.num_hidden_layers,
        aux_layer_ids=list(target.aux_layer_ids), block_size=4,
        mask_token_id=text.vocab_size - 1,
    )  # fmt: skip
    draft = DFlashDraft(arch)
    draft.init_weights(std, torch.Generator().manual_seed(seed))
    draft.set_target_weights(target.input_embedding(), target.lm_head_weight())
    return draft


def random_peagle(target: HFTarget, seed: int, std: float) -> AnyDraft:
    """An untrained P-EAGLE draft for ``target`` over its whole vocabulary, its last id the
    mask."""
    text = target.config.get_text_config()
    arch = DraftArchitecture.from_target(
        target.config,
        DraftConfig(draft_vocab_size=text.vocab_size),
        target.aux_layer_ids,
        mask_token_id=text.vocab_size - 1,
    )
    draft = PEagleDraft(arch)
    draft.init_weights(std, torch.Generator().manual_seed(seed))
    draft.load_embedding(target.input_embedding().detach())
    draft.set_vocab_map(
        torch.zeros(text.vocab_size, dtype=torch.long),
        torch.ones(text.vocab_size, dtype=torch.bool),
    )
    return draft.eval()


def dflash_directory(checkpoint: Path) -> None:
    """A DFlash checkpoint is the directory vLLM loads, naming the model file's mask token."""
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == MASK_TOKEN


def peagle_directory(checkpoint: Path) -> None:
    """A P-EAGLE checkpoint is an EAGLE-3 directory that names its mask token (the model
    file's), with the placeholder features ``mask_hidden``."""
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["mask_token_id"] == MASK_TOKEN
    tensors = load_file(str(checkpoint / "model.safetensors"))
    assert tensors["mask_hidden"].shape == (1, 1, 3 * config["target_hidden_size"])


def eagle3_directory(checkpoint: Path) -> None:
    """An EAGLE-3 checkpoint is SGLang's directory, no mask token."""
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "mask_token_id" not in config


AUX_LOGGED = "Using auxiliary layers from speculative config: "


def taps_logged(engine: str, log: str, taps: list[int]) -> None:
    """vLLM logs the layers it taps, numbered by their input: eagleforge's ids + 1."""
    if engine == "vllm":
        assert f"{AUX_LOGGED}{tuple(i + 1 for i in taps)}" in log


def dflash_log(engine: str, log: str, taps: list[int]) -> None:
    if engine == "vllm":
        assert "dflash" in log.lower()
    else:  # llama.cpp read the block and the mask token from the GGUF
        assert "block_size=4, mask_token_id=16" in log


def peagle_log(engine: str, log: str, taps: list[int]) -> None:
    taps_logged(engine, log, taps)
    # vLLM read parallel_drafting (its own echo of the arguments) and loaded mask_hidden for
    # it (it warns and skips the tensor when drafting sequentially)
    assert "'parallel_drafting': True" in log and "not configured for parallel drafting" not in log


@dataclass(frozen=True)
class FamilyCase:
    """One family's line: its tiny shapes, its untrained draft for the decoding checks, and
    the draft engines accept, with the edit that moves its taps one layer up."""

    # a tiny run of the family: ``draft=<family>`` and the smallest shape that trains it
    tiny: tuple[str, ...]
    # the eval positions (acc_i) of that tiny run
    num_positions: int
    # the tensors that must move in training beyond fc.weight
    trained: tuple[str, ...]
    # what its checkpoint directory must hold
    checkpoint_check: Callable[[Path], None]
    # an untrained draft for a small-vocabulary target: (target, seed, std) -> draft
    random_draft: Callable[[HFTarget, int, float], AnyDraft]
    # its forwards a round of a chain of 3 (a block or parallel draft proposes in one)
    draft_forwards_per_round: int
    # a draft the engines accept, trained offline on the target's own answers
    served: tuple[str, ...]
    # the config.json edit that moves its taps one layer up (the negative control)
    shift_taps: Callable[[dict[str, Any]], None]
    # what an engine's log must show it read: (engine, its log, the taps the draft names)
    log_check: Callable[[str, str, list[int]], None] = taps_logged
    # judges whose tests of this family are slow (left out of `make test`)
    slow_in: tuple[str, ...] = field(default_factory=tuple)
    # whether its sampled-decoding check is slow (left out of `make test`)
    slow_sampling: bool = False


# what a draft that only needs training trains in: this CPU's faster precision, measured (bf16
# where it has bf16 units, fp32 where bf16 runs ~25x slower), not the suite's pinned auto
FAST_COMPUTE = f"trainer.compute_dtype={'bfloat16' if cpu_bf16().fast else 'float32'}"

CASES: dict[DraftFamily, FamilyCase] = {
    DraftFamily.eagle3: FamilyCase(
        tiny=("draft=eagle3", "draft.ttt_length=3"),
        num_positions=3,
        trained=(),
        checkpoint_check=eagle3_directory,
        random_draft=random_eagle3,
        draft_forwards_per_round=3,
        served=(
            "draft.ttt_length=3",
            "draft.norm_before_fc=true",
            "trainer.max_num_steps=160",
            FAST_COMPUTE,
        ),  # fmt: skip
        shift_taps=shift_taps,
        # a chain drafts token by token, 3 forwards a round x 1,500 decodes; the acceptance
        # rule keeps the target's distribution in tests/unit/test_speculative_sampling.py, and
        # a sampled tree goes through the whole decoder in tests/integration/test_evaluate.py
        slow_sampling=True,
        # vLLM judges an untrained EAGLE-3 draft in `make test` already
        # (tests/engine/test_vllm_engine.py); a trained one adds ~4 min of engine starts
        slow_in=("vllm",),
    ),
    DraftFamily.dflash: FamilyCase(
        tiny=(
            "draft=dflash",
            "draft.dflash.num_layers=2",
            "draft.dflash.block_size=4",
            "draft.dflash.num_anchors=6",
        ),  # fmt: skip
        num_positions=3,  # blocks of 4: three proposals
        trained=(),
        checkpoint_check=dflash_directory,
        random_draft=random_dflash,
        draft_forwards_per_round=1,
        served=(
            "draft=dflash",
            "draft.dflash.num_layers=1",
            "draft.dflash.block_size=4",
            "draft.dflash.num_anchors=16",
            "trainer.max_num_steps=160",
            FAST_COMPUTE,
        ),  # fmt: skip
        shift_taps=shift_dflash_taps,
        log_check=dflash_log,
        slow_in=("vllm",),
    ),
    DraftFamily.peagle: FamilyCase(
        tiny=("draft=peagle", "draft.peagle.num_depths=3"),
        num_positions=3,  # three depths
        trained=("mask_hidden",),  # the placeholder features train with the rest
        checkpoint_check=peagle_directory,
        random_draft=random_peagle,
        draft_forwards_per_round=1,
        served=(
            "draft=peagle",
            "draft.peagle.num_depths=3",
            "trainer.max_num_steps=120",
            "trainer.compute_dtype=float32",
        ),  # fmt: skip
        shift_taps=shift_taps,
        log_check=peagle_log,
        slow_in=("vllm",),
    ),
}


# which families each judge of ``eagleforge.judges.JUDGES`` serves
SERVES: dict[str, Callable[[Family], bool]] = {
    "vllm": lambda family: True,
    "llamacpp": lambda family: family.llamacpp_type is not None,
}


def serves(judge: str, family: Family) -> bool:
    """Whether ``judge`` (an ``eval.engine`` name) serves drafts of ``family``."""
    return SERVES[judge](family)
