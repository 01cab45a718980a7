"""Speculative decoding with a vision-language target (a tiny random Qwen2.5-VL, built
offline) on prompts with generated images: greedy outputs equal transformers' own
``generate`` with the images, the draft rotates by the target's M-RoPE positions, and the
evaluate entry point measures τ on a VLM data file."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.draft.model import Eagle3Draft
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import SpeculativeDecoder, eos_ids
from eagleforge.speculative.prompts import PromptRenderer, load_prompts
from eagleforge.speculative.report import TurnRecord, summarise
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.registry import build_hf_target
from eagleforge.targets.source import load_processor, load_tokenizer, resolve_model_dir
from helpers.drafts import random_draft
from helpers.targets import small_vocab_target
from helpers.vlm import tiny_vl_run_overrides, write_data

pytestmark = pytest.mark.integration

MIN_PIXELS, MAX_PIXELS = 3136, 12544


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny Qwen2.5-VL with its weights redrawn at std 0.1 (as built, its greedy output
    is one token repeated, which no position error would change), its prompt renderer, and
    the prompts of the training-style data file (three with images, one without)."""
    root = tmp_path_factory.mktemp("vlm")
    config = to_typed(
        compose_config(["+model=tiny_vl", f"output_root={root}", f"output_dir={root / 'out'}"])
    )
    model_dir = resolve_model_dir(config.model, config.resolved_cache_dir())
    target = build_hf_target(config.model, config.target, model_dir, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in target.model.parameters():
            if weight.dim() >= 2:  # norms keep their ones
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    processor = load_processor(config.model, model_dir, MIN_PIXELS, MAX_PIXELS)
    data = write_data(root / "data")
    prompts = load_prompts(str(data), multi_turn=False, images_allowed=True)
    renderer = PromptRenderer(None, processor, MIN_PIXELS, MAX_PIXELS)
    return {"target": target, "processor": processor, "prompts": prompts, "renderer": renderer}


def reference_generate(target: HFTarget, ids: list[int], images: Any, new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of the rendered prompt with its images."""
    input_ids = torch.tensor([ids])
    kwargs: dict[str, torch.Tensor] = {}
    if images is not None:
        kwargs = {
            "pixel_values": images.pixel_values,
            "image_grid_thw": images.image_grid_thw,
            # what the processor returns and generate needs for M-RoPE positions
            "mm_token_type_ids": (input_ids == target.config.image_token_id).int(),
        }
    out = target.model.generate(input_ids, do_sample=False, max_new_tokens=new_tokens, **kwargs)
    return list(out[0, len(ids) :].tolist())


@pytest.mark.parametrize(("topk", "total"), [(1, 4), (3, 8)])
def test_greedy_output_equals_transformers_generate_with_images(
    vlm: dict[str, Any], topk: int, total: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, renderer = vlm["target"], vlm["renderer"]
    draft = random_draft(target, 2048, 0.02, seed=topk)
    assert draft.arch.mrope_section == [2, 3, 3]
    new_tokens = 12
    settings = DecodeSettings(new_tokens, 4, topk, total, temperature=0.0)
    decoder = SpeculativeDecoder(target, draft, settings, eos_ids(renderer.tokenizer, target))
    seen: list[torch.Tensor] = []
    rope = Eagle3Draft.rope

    def spy(self: Eagle3Draft, positions: torch.Tensor, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        seen.append(positions.clone())
        return rope(self, positions, dtype)

    monkeypatch.setattr(Eagle3Draft, "rope", spy)
    records, position_sensitive = [], False
    for item in vlm["prompts"]:
        ids, images = renderer([item.message(0)], item.where)
        assert (images is None) == (not item.images[0])
        seen.clear()
        result = decoder.generate(ids, torch.Generator().manual_seed(0), images)
        expected = reference_generate(target, ids, images, new_tokens)
        assert result.output_ids == expected, item.where
        plain = decoder.generate_target_only(ids, torch.Generator().manual_seed(0), images)
        assert plain.output_ids == expected
        records.append(TurnRecord(item.id, 0, len(ids), result, plain))
        # the draft's prefill rotates by the target's own positions, and everything after
        # by text positions continuing from the prompt's largest one, on all components
        prompt_3BT, _ = target.rope_index(
            torch.tensor([ids]), None, images and images.image_grid_thw
        )
        assert torch.equal(seen[0], prompt_3BT)
        later = torch.cat([p.flatten(1) for p in seen[1:]], dim=1)
        assert later.shape[0] == 3 and torch.equal(later[0], later[1])
        assert torch.equal(later[1], later[2])
        assert int(later.min()) == int(prompt_3BT.max()) + 1
        if images is not None:
            assert not torch.equal(prompt_3BT[1], prompt_3BT[2])  # a real 3-D prompt
            text_positions = target.model.generate(
                torch.tensor([ids]),
                pixel_values=images.pixel_values,
                image_grid_thw=images.image_grid_thw,
                do_sample=False,
                max_new_tokens=new_tokens,
            )[0, len(ids) :].tolist()
            position_sensitive |= text_positions != expected
    # 1-D positions would have decoded something else: the comparison sees position errors
    assert position_sensitive
    summary = summarise("random", records, settings.num_draft_tokens, greedy=True)
    assert summary.greedy_matches_target is True and summary.tau >= 1.0


def test_text_target_rotates_by_the_token_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """A text target and its draft get the plain [1, M] token indices they always got: the
    prompt's 0..L-1, then each verified or drafted token's index (tree drafting included)."""
    target = small_vocab_target()
    draft = random_draft(target, 6, 0.6, seed=7)
    target_positions: list[torch.Tensor] = []
    draft_positions: list[torch.Tensor] = []
    forward, rope = target.model.forward, Eagle3Draft.rope

    @functools.wraps(forward)  # keeps the signature the runner inspects
    def spy_forward(*args: Any, **kwargs: Any) -> Any:
        target_positions.append(kwargs["position_ids"].clone())
        return forward(*args, **kwargs)

    def spy_rope(self: Eagle3Draft, positions: torch.Tensor, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        draft_positions.append(positions.clone())
        return rope(self, positions, dtype)

    monkeypatch.setattr(target.model, "forward", spy_forward)
    monkeypatch.setattr(Eagle3Draft, "rope", spy_rope)
    decoder = SpeculativeDecoder(target, draft, DecodeSettings(8, 3, 2, 4, 0.0), set())
    result = decoder.generate([1, 5, 2], torch.Generator().manual_seed(0))
    assert torch.equal(target_positions[0], torch.arange(3)[None])
    assert torch.equal(draft_positions[0], torch.arange(3)[None])
    for positions in target_positions + draft_positions:
        assert positions.shape[0] == 1 and positions.dim() == 2
    # each verification starts at the latest committed token's index
    committed = 3
    for verify, accepted in zip(target_positions[1:], result.accepted_lengths, strict=True):
        assert int(verify[0, 0]) == committed and int(verify.max()) <= committed + 3
        committed += accepted + 1


def write_prompts(directory: Path) -> Path:
    """Two two-turn prompts: an image in the first turn (``turns`` with a row-level image),
    two images in the second turn (OpenAI messages)."""
    rows = [
        {"id": "a", "turns": ["Describe it.", "Once more."], "image": "img/2.png"},
        {
            "id": "b",
            "messages": [
                {"role": "user", "content": "Hello."},
                {"role": "user", "content": "And this?", "images": ["img/0.png", "img/1.png"]},
            ],
        },
    ]
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_evaluate_entry_point_on_a_vision_language_target(tmp_path: Path) -> None:
    """Evaluate multi-turn on prompts with images in the first and in the second turn; then
    train on the target's own answers to them (as `regenerate` would) and evaluate again, as
    a chain and as a tree: greedy outputs always equal the target's, and the trained draft's
    proposals are accepted."""
    from eagleforge.evaluate import run as evaluate
    from eagleforge.train import run as train

    data = write_data(tmp_path / "data")
    prompts = write_prompts(tmp_path / "data")
    common = [
        "+model=tiny_vl",
        "data=vlm",
        f"data.min_pixels={MIN_PIXELS}",
        f"data.max_pixels={MAX_PIXELS}",
        "tracker=console",
        f"output_root={tmp_path}",
    ]

    def train_draft(data_path: Path, steps: int, name: str) -> Path:
        overrides = tiny_vl_run_overrides(
            data_path,
            tmp_path,
            "data.num_eval_samples=0",
            f"trainer.max_num_steps={steps}",
            "trainer.eval_every_n_steps=0",
            "draft.ttt_length=3",
            "optimizer.lr=1e-2",
            name=name,
        )
        train(compose_config(overrides))
        return tmp_path / name / "checkpoints" / f"step_{steps:08d}"

    def evaluate_draft(draft: Path, name: str, *overrides: str) -> Any:
        (summary,) = evaluate(
            compose_config(
                [
                    *common,
                    f"eval.draft={draft}",
                    f"eval.prompts={prompts}",
                    "eval.multi_turn=true",
                    "eval.max_new_tokens=12",
                    "eval.num_draft_tokens=3",
                    *overrides,
                    f"output_dir={tmp_path / name}",
                ]
            )
        )
        assert summary.num_turns == 4 and summary.greedy_matches_target is True
        assert summary.tau >= 1.0
        return summary

    first = evaluate_draft(train_draft(data, 2, "first"), "first_eval")
    outputs = tmp_path / "first_eval" / "eval" / "step_00000002" / "outputs.jsonl"
    answers = {}
    for line in outputs.read_text().splitlines():
        row = json.loads(line)
        answers[row["prompt_id"], row["turn"]] = row["baseline_output_ids"]
    config = to_typed(compose_config([*common, f"output_dir={tmp_path}"]))
    model_dir = resolve_model_dir(config.model, config.resolved_cache_dir())
    tokenizer = load_tokenizer(config.model, model_dir)
    conversations = []
    for item in load_prompts(str(prompts), multi_turn=True, images_allowed=True):
        messages = []
        for turn in range(len(item.turns)):
            answer = tokenizer.decode(answers[item.id, turn], skip_special_tokens=True)
            messages += [item.message(turn), {"role": "assistant", "content": answer}]
        conversations.append({"messages": messages})
    regenerated = tmp_path / "data" / "answers.jsonl"
    regenerated.write_text("".join(json.dumps(row) + "\n" for row in conversations * 2))
    trained = train_draft(regenerated, 150, "trained")
    chain = evaluate_draft(trained, "chain_eval")
    tree = evaluate_draft(trained, "tree_eval", "eval.topk=2", "eval.total_draft_tokens=8")
    print(
        f"tiny Qwen2.5-VL τ: {first.tau:.3f} untrained; trained {chain.tau:.3f} chain, {tree.tau:.3f} tree"
    )
    # accepted drafts were committed at M-RoPE positions, also after images in a later turn
    assert chain.tau > 2.0 and tree.tau > 2.0
