"""The contract every draft family keeps, tested once per family of the registry
(``eagleforge.families.FAMILIES``) on the tiny target: it trains and resumes bit for bit, its
checkpoint is the directory its engines load and ``export --check`` passes it, every format it
exports reads back as itself, and our decoder with its draft is lossless -- greedy output is
the target's, sampled output follows the target's distribution. What a family needs beyond its
registry line is its line in ``helpers.families.CASES``. The served half of the contract (each
engine that serves a family, lossless and accepting) is tests/engine/test_served_drafts.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config
from eagleforge.draft.config import DraftFamily
from eagleforge.export import ExportConfig, check_main, export
from eagleforge.families import FAMILIES, family_for, family_of
from eagleforge.formats.directory import read_draft
from eagleforge.formats.kinds import DraftFormat
from eagleforge.judges import JUDGES
from eagleforge.speculative.config import DecodeSettings
from eagleforge.train import run
from helpers.families import CASES, SERVES
from helpers.runs import start_from, tiny_run_overrides, weights
from helpers.targets import assert_samples_follow_the_target, small_vocab_target

pytestmark = pytest.mark.integration

FAMILY_NAMES = [family.value for family in FAMILIES]


def test_every_family_and_judge_has_its_line() -> None:
    assert set(CASES) == set(FAMILIES)
    assert set(SERVES) == set(JUDGES)


def overrides(tmp_path: Path, family: DraftFamily, name: str) -> list[str]:
    return tiny_run_overrides(
        tmp_path, *CASES[family].tiny, "data.max_tokens_per_batch=192",
        "trainer.max_num_steps=6", "trainer.grad_accum_steps=2", "trainer.save_every_n_steps=2",
        "optimizer.lr=1e-3", name=name,
    )  # fmt: skip


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_it_trains_resumes_bit_for_bit_and_exports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    family, case = family_for(DraftFamily(name)), CASES[DraftFamily(name)]
    full = run(compose_config(overrides(tmp_path, family.name, "full")))
    assert full.step == 6 and len(full.train_losses) == 6
    positions = {k for k in full.final_eval if k.startswith("eval/acc_")}
    assert positions == {f"eval/acc_{i}" for i in range(case.num_positions)}
    assert "eval/tau_sim" in full.final_eval
    assert family.positions in capsys.readouterr().out  # the table says what position i is

    step_2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    start_from(step_2, tmp_path / "resumed")
    resumed = run(compose_config(overrides(tmp_path, family.name, "resumed")))
    assert resumed.train_losses == full.train_losses[2:]  # the same batches, the same steps
    final_full, final_resumed = weights(full.checkpoint), weights(resumed.checkpoint)
    assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)
    assert resumed.final_eval == full.final_eval  # evaluation is fixed too
    for tensor in ("fc.weight", *case.trained):  # it trained
        assert not torch.equal(final_full[tensor], weights(step_2)[tensor]), tensor

    # the checkpoint is the family's directory, and export --check says so
    case.checkpoint_check(full.checkpoint)
    assert check_main(["--check", str(full.checkpoint), "--target-layers", "6"]) == 0
    assert f"ok ({family.title}" in capsys.readouterr().out
    # exported for vLLM (every family's engine) it reads back as the same draft
    _, arch, tensors = read_draft(full.checkpoint)
    out = export(ExportConfig(draft=str(full.checkpoint), format=DraftFormat.vllm,
                              output_dir=str(tmp_path / "exported")))  # fmt: skip
    assert not (out / "training_state.pt").exists()
    _, read_arch, read_tensors = read_draft(out)
    assert family_of(read_arch) is family and read_arch == arch
    assert read_tensors.keys() == tensors.keys()
    assert all(torch.equal(read_tensors[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_greedy_decoding_is_the_targets(name: str) -> None:
    """An untrained draft proposes garbage; greedy output must still be the target's, one
    target forward a round."""
    family, case = family_for(DraftFamily(name)), CASES[DraftFamily(name)]
    target = small_vocab_target(vocab=16)
    settings = DecodeSettings(20, 3, 1, 4, temperature=0.0)
    decoder = family.decoder(target, case.random_draft(target, 0, 0.5), settings, set())
    result = decoder.generate([1, 2, 3], torch.Generator().manual_seed(0))
    plain = decoder.generate_target_only([1, 2, 3], torch.Generator().manual_seed(0))
    assert result.output_ids == plain.output_ids and len(plain.output_ids) == 20
    assert result.target_forwards == 1 + len(result.accepted_lengths)
    assert result.draft_steps == case.draft_forwards_per_round * len(result.accepted_lengths)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name, marks=[pytest.mark.slow] if CASES[DraftFamily(name)].slow_sampling else []
        )
        for name in FAMILY_NAMES
    ],
)
def test_sampled_decoding_follows_the_targets_distribution(name: str) -> None:
    """Chains sampled at temperature 0.8 from a draft that disagrees with the target: each
    generated position's marginal matches the target's, and proposals are really accepted."""
    family, case = family_for(DraftFamily(name)), CASES[DraftFamily(name)]
    target = small_vocab_target()
    draft = case.random_draft(target, 7, 0.6)
    prompt, temperature = [1, 5, 2], 0.8
    decoder = family.decoder(target, draft, DecodeSettings(3, 3, 1, 4, temperature), set())
    assert_samples_follow_the_target(decoder, target, prompt, temperature, 1500)
