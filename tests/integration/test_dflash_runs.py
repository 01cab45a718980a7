"""DFlash end to end on the tiny target: training (online and from a feature store) resumes
bit for bit, its checkpoint is the directory vLLM loads (export --check passes it, export
writes it), and our block decoder is lossless."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from eagleforge.draft.dflash import DFlashArchitecture, DFlashDraft
from eagleforge.export import ExportConfig, check_main, export
from eagleforge.formats.kinds import DraftFormat
from eagleforge.speculative.block_decoder import BlockDecoder
from eagleforge.speculative.config import DecodeSettings
from eagleforge.targets.hf import HFTarget
from eagleforge.train import run
from helpers.runs import start_from, tiny_run_overrides, weights
from helpers.targets import assert_samples_follow_the_target, small_vocab_target

pytestmark = pytest.mark.integration

DFLASH = (
    "draft=dflash", "draft.dflash.num_layers=2", "draft.dflash.block_size=4",
    "draft.dflash.num_anchors=6", "draft.dflash.mask_token_id=16",
)  # fmt: skip


def overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return tiny_run_overrides(
        tmp_path, *DFLASH, "data.max_tokens_per_batch=192", "trainer.max_num_steps=6",
        "trainer.grad_accum_steps=2", "trainer.save_every_n_steps=2", "optimizer.lr=1e-3",
        *extra, name=name,
    )  # fmt: skip


def test_dflash_trains_and_resumes_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = run(compose_config(overrides(tmp_path, "full")))
    assert full.step == 6 and len(full.train_losses) == 6
    assert set(full.final_eval) >= {"eval/acc_0", "eval/acc_2", "eval/tau_sim"}
    assert "eval/acc_3" not in full.final_eval  # block 4: three proposals
    assert "block slot (acc_0: slot 1)" in capsys.readouterr().out
    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    start_from(step_2, tmp_path / "resumed")
    resumed = run(compose_config(overrides(tmp_path, "resumed")))
    assert resumed.train_losses == full.train_losses[2:]  # the same anchors, the same steps
    final_full, final_resumed = weights(full.checkpoint), weights(resumed.checkpoint)
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
    assert not torch.equal(final_full["fc.weight"], weights(step_2)["fc.weight"])  # it trained
    assert resumed.final_eval == full.final_eval  # evaluation anchors are fixed

    # the checkpoint is the DFlash directory vLLM loads, and export --check says so
    config = json.loads((full.checkpoint / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == 16
    assert check_main(["--check", str(full.checkpoint), "--target-layers", "6"]) == 0
    assert "ok (DFlash" in capsys.readouterr().out
    out = export(ExportConfig(draft=str(full.checkpoint), format=DraftFormat.vllm,
                              output_dir=str(tmp_path / "exported")))  # fmt: skip
    assert not (out / "training_state.pt").exists()
    shutil.rmtree(out)


def random_dflash(target: HFTarget, seed: int, std: float) -> DFlashDraft:
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


def test_block_decoder_greedy_output_is_the_targets() -> None:
    """A random DFlash draft proposes garbage; greedy output must still be the target's."""
    target = small_vocab_target(vocab=16)
    decoder = BlockDecoder(
        target, random_dflash(target, 0, 0.5), DecodeSettings(20, 3, 1, 4, temperature=0.0), set()
    )
    result = decoder.generate([1, 2, 3], torch.Generator().manual_seed(0))
    plain = decoder.generate_target_only([1, 2, 3], torch.Generator().manual_seed(0))
    assert result.output_ids == plain.output_ids and len(plain.output_ids) == 20
    assert result.target_forwards == 1 + len(result.accepted_lengths)
    assert result.draft_steps == len(result.accepted_lengths)  # one draft forward a round


def test_block_decoder_sampled_output_follows_the_targets_distribution() -> None:
    """Sampled blocks at temperature 0.8 from a draft that disagrees with the target: each
    generated position's marginal matches the target's (chi-square over 8 tokens, 7 degrees of
    freedom; 35 is p < 1e-5)."""
    target = small_vocab_target()
    draft = random_dflash(target, 7, 0.6)
    prompt, temperature, runs = [1, 5, 2], 0.8, 1500
    decoder = BlockDecoder(target, draft, DecodeSettings(3, 3, 1, 4, temperature), set())
    assert_samples_follow_the_target(decoder, target, prompt, temperature, runs)
