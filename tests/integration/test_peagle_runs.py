"""P-EAGLE end to end on the tiny target: it trains and resumes bit for bit, its checkpoint is
the directory vLLM serves with parallel_drafting, our one-forward decoder is lossless (greedy
and sampled), and what it proposes at slot d is exactly what training taught depth d."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagleforge.config import compose_config
from eagleforge.draft.config import DraftConfig
from eagleforge.draft.model import DraftArchitecture
from eagleforge.draft.peagle import PEagleDraft
from eagleforge.draft.ttt import draft_step
from eagleforge.export import check_main
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.parallel_decoder import ParallelDecoder
from eagleforge.speculative.runners import DraftRunner
from eagleforge.targets.hf import HFTarget
from eagleforge.train import run
from helpers.runs import start_from, tiny_run_overrides, weights
from helpers.targets import assert_samples_follow_the_target, small_vocab_target

pytestmark = pytest.mark.integration

PEAGLE = ("draft=peagle", "draft.peagle.num_depths=3")


def overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return tiny_run_overrides(
        tmp_path, *PEAGLE, "data.max_tokens_per_batch=192", "trainer.max_num_steps=6",
        "trainer.grad_accum_steps=2", "trainer.save_every_n_steps=2", "optimizer.lr=1e-3",
        *extra, name=name,
    )  # fmt: skip


def test_peagle_trains_and_resumes_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = run(compose_config(overrides(tmp_path, "full")))
    assert full.step == 6 and len(full.train_losses) == 6
    assert set(full.final_eval) >= {"eval/acc_0", "eval/acc_2", "eval/tau_sim"}
    assert "eval/acc_3" not in full.final_eval  # three depths
    assert "depth (acc_0: the bonus slot)" in capsys.readouterr().out
    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    start_from(step_2, tmp_path / "resumed")
    resumed = run(compose_config(overrides(tmp_path, "resumed")))
    assert resumed.train_losses == full.train_losses[2:]
    final_full, final_resumed = weights(full.checkpoint), weights(resumed.checkpoint)
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
    # the placeholder features train with the rest
    assert not torch.equal(final_full["mask_hidden"], weights(step_2)["mask_hidden"])

    # the checkpoint is an EAGLE-3 directory that names its mask token, with mask_hidden
    config = json.loads((full.checkpoint / "config.json").read_text())
    assert config["mask_token_id"] == 16  # model.mask_token_id of the tiny model's file
    tensors = load_file(str(full.checkpoint / "model.safetensors"))
    assert tensors["mask_hidden"].shape == (1, 1, 3 * config["target_hidden_size"])
    assert check_main(["--check", str(full.checkpoint), "--target-layers", "6"]) == 0
    assert "ok (P-EAGLE, sglang format)" in capsys.readouterr().out


def random_peagle(target: HFTarget, seed: int, std: float) -> PEagleDraft:
    """An untrained P-EAGLE draft for ``target`` over its whole vocabulary."""
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


def test_parallel_decoder_greedy_output_is_the_targets() -> None:
    """A random draft proposes garbage; greedy output must still be the target's, with one
    draft forward and one target forward a round."""
    target = small_vocab_target(vocab=16)
    settings = DecodeSettings(20, 3, 1, 4, temperature=0.0)
    decoder = ParallelDecoder(target, random_peagle(target, 0, 0.5), settings, set())
    result = decoder.generate([1, 2, 3], torch.Generator().manual_seed(0))
    plain = decoder.generate_target_only([1, 2, 3], torch.Generator().manual_seed(0))
    assert result.output_ids == plain.output_ids and len(plain.output_ids) == 20
    assert result.target_forwards == 1 + len(result.accepted_lengths)
    assert result.draft_steps == len(result.accepted_lengths)


def test_parallel_decoder_sampled_output_follows_the_targets_distribution() -> None:
    target = small_vocab_target()
    draft = random_peagle(target, 7, 0.6)
    prompt, temperature = [1, 5, 2], 0.8
    decoder = ParallelDecoder(target, draft, DecodeSettings(3, 3, 1, 4, temperature), set())
    assert_samples_follow_the_target(decoder, target, prompt, temperature, 1500)


def test_slot_d_proposes_what_training_taught_depth_d() -> None:
    """Training's depth d at position t (the unrolled test, its later steps reading the
    placeholders) equals the decoder's slot d after the pairs 0..t, as vLLM runs it: one
    causal forward over the committed pairs and the placeholder slots."""
    target = small_vocab_target(vocab=16)
    draft = random_peagle(target, 3, 0.5)
    generator = torch.Generator().manual_seed(5)
    length, depths, a = 9, 3, 3 * draft.arch.target_hidden_size
    ids_T = torch.randint(0, 15, (length + depths,), generator=generator)
    aux_TA = torch.randn(length, a, generator=generator)
    positions = torch.arange(length)[None]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    with torch.no_grad():
        hidden = draft.fuse(aux_TA[None])
        trained = [draft_step(draft, ids_T[None, 1 : length + 1], hidden, positions, None, None,
                              keys, values)]  # fmt: skip
        mask_ids, mask_hidden = draft.placeholders(1, length)
        for depth in range(1, depths):
            trained.append(draft_step(draft, mask_ids, mask_hidden, positions + depth, None, None,
                                      keys, values))  # fmt: skip
        for t in (0, 4, length - 1):
            runner = DraftRunner(draft)
            slot_ids, slot_hidden = draft.placeholders(1, depths - 1)
            tokens = torch.cat([ids_T[1 : t + 2], slot_ids[0]])
            hidden_MH = torch.cat([draft.fuse(aux_TA[: t + 1]), slot_hidden[0]])
            count = len(tokens)
            causal = torch.ones(count, count, dtype=torch.bool).tril()
            out, _, _ = runner.attend(tokens, hidden_MH, torch.arange(count), None, causal)
            for depth in range(depths):
                # fp32: the same sums in another order (a wrong view differs by O(1))
                torch.testing.assert_close(
                    out[t + depth], trained[depth][0, t], rtol=1e-4, atol=1e-4
                )
