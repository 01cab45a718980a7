"""The DFlash draft (draft/dflash.py): what a block sees and predicts in training, its loss
against plain autograd, that training's logits are the decoder's draft pass, and its directory
as vLLM loads it (formats/dflash.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eagleforge.batch import BlockBatch
from eagleforge.draft.dflash import (
    DFlashArchitecture,
    DFlashConfig,
    DFlashDraft,
    anchor_candidates,
    block_forward,
    block_layout,
    block_loss_scales,
    block_weights,
    chunked_cross_entropy,
    default_gamma,
    mask_token_for,
    select_anchors,
    spread_layer_ids,
)
from eagleforge.errors import ConfigError
from eagleforge.formats.dflash import check_dflash, read_dflash, write_dflash
from eagleforge.speculative.block_decoder import BlockContext

pytestmark = pytest.mark.unit

MASK = 5


def tiny_arch(**changes: object) -> DFlashArchitecture:
    fields: dict[str, object] = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, vocab_size=40, target_hidden_size=32,
        num_target_layers=6, aux_layer_ids=[1, 2, 3], block_size=4, mask_token_id=MASK,
    )  # fmt: skip
    fields.update(changes)
    return DFlashArchitecture(**fields)  # type: ignore[arg-type]


def tiny_draft(seed: int = 0, **changes: object) -> DFlashDraft:
    arch = tiny_arch(**changes)
    draft = DFlashDraft(arch)
    generator = torch.Generator().manual_seed(seed)
    draft.init_weights(0.2, generator)
    embed = torch.randn(arch.vocab_size, arch.hidden_size, generator=generator)
    draft.set_target_weights(
        embed, torch.randn(arch.vocab_size, arch.hidden_size, generator=generator)
    )
    return draft


def batch_of(
    ids: list[list[int]], supervised_from: int = 0, documents: list[list[int]] | None = None
) -> BlockBatch:
    input_ids = torch.tensor(ids)
    loss_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    loss_mask[:, supervised_from:] = True
    generator = torch.Generator().manual_seed(1)
    return BlockBatch(
        input_ids_BT=input_ids,
        valid_BT=torch.ones_like(input_ids, dtype=torch.bool),
        loss_mask_BT=loss_mask,
        aux_BTA=torch.randn(*input_ids.shape, 3 * 32, generator=generator),
        document_ids_BT=None if documents is None else torch.tensor(documents),
    )


def test_a_block_sees_the_context_before_its_anchor_and_its_own_block_only() -> None:
    batch = batch_of([list(range(10, 22))])
    batch.anchors_BN = torch.tensor([[3, 7]])
    layout = block_layout(batch, block_size=4, mask_token_id=MASK)
    assert layout.tokens_BQ.tolist() == [[13, MASK, MASK, MASK, 17, MASK, MASK, MASK]]
    assert layout.positions_BQ.tolist() == [[3, 4, 5, 6, 7, 8, 9, 10]]
    mask = layout.mask_BQS[0]  # [Q, T + Q]
    context, own = mask[:, :12], mask[:, 12:]
    assert context[:4].sum(1).tolist() == [3] * 4 and bool(context[:4, :3].all())
    assert context[4:].sum(1).tolist() == [7] * 4 and bool(context[4:, :7].all())
    assert bool(own[:4, :4].all()) and not bool(own[:4, 4:].any())  # never the other block
    assert bool(own[4:, 4:].all()) and not bool(own[4:, :4].any())
    # slot k predicts the token at anchor + k; slot 0 is not a prediction
    assert layout.labels_BQ.tolist() == [[0, 14, 15, 16, 0, 18, 19, 20]]
    assert layout.counted_BQ.tolist() == [[False, True, True, True] * 2]


def test_blocks_count_only_supervised_tokens_of_their_document() -> None:
    documents = [[0] * 6 + [1] * 6]
    batch = batch_of([list(range(10, 22))], supervised_from=2, documents=documents)
    batch.anchors_BN = torch.tensor([[4, 10, -1]])
    layout = block_layout(batch, block_size=4, mask_token_id=MASK)
    counted = layout.counted_BQ[0].view(3, 4).tolist()
    assert counted[0] == [False, True, False, False]  # 6 and 7 belong to the next document
    assert counted[1] == [False, True, False, False]  # past the row's end
    assert counted[2] == [False] * 4  # no anchor
    context = layout.mask_BQS[0, 4:8, :12]  # the block at 10 sees 6..9 only, its document
    assert context.sum(1).tolist() == [4] * 4 and bool(context[:, 6:10].all())
    assert bool(layout.mask_BQS[0, 8:].sum(1).eq(4).all())  # an unused block sees itself


def test_anchors_are_supervised_tokens_followed_by_one() -> None:
    batch = batch_of([list(range(10, 22))], supervised_from=5)
    candidates = anchor_candidates(batch)
    assert candidates[0].nonzero().squeeze(1).tolist() == list(range(5, 11))
    anchors = select_anchors(candidates, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (1, 4) and anchors[0].tolist() == sorted(anchors[0].tolist())
    assert set(anchors[0].tolist()) <= set(range(5, 11))
    everything = select_anchors(candidates, 50)
    assert everything[0].tolist() == list(range(5, 11))


def test_chunked_cross_entropy_matches_autograd() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    head = torch.randn(50, 16, generator=generator)
    labels = torch.randint(0, 50, (37,), generator=generator)
    rows = chunked_cross_entropy(hidden, head, labels, chunk_size=8)
    weights = torch.rand(37, generator=generator)
    (rows.loss_n * weights).sum().backward()
    chunked_grad = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ head.T
    plain = F.cross_entropy(logits, labels, reduction="none")
    (plain * weights).sum().backward()
    torch.testing.assert_close(rows.loss_n, plain.detach())
    torch.testing.assert_close(chunked_grad, hidden.grad)
    torch.testing.assert_close(
        rows.label_prob_n, logits.softmax(-1).gather(1, labels[:, None])[:, 0].detach()
    )
    assert rows.argmax_n.tolist() == logits.argmax(-1).tolist()


def test_the_loss_is_the_weight_normalised_mean_of_the_slots() -> None:
    assert [default_gamma(b) for b in (16, 10, 8, 4)] == [7.0, 5.0, 4.0, 4.0]
    weights = block_weights(4, gamma=2.0)
    torch.testing.assert_close(weights, torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 2.0))
    draft = tiny_draft()
    batch = batch_of([list(range(10, 30))] * 2)
    batch.anchors_BN = torch.tensor([[2, 9, 15], [0, 4, 17]])
    counts = block_forward(draft, batch).num_counted_k
    scales = block_loss_scales(counts, weights)
    stats = block_forward(draft, batch, scales)
    # Σ_k w_k Σ_slot ce / Σ_k w_k N_k, the reference's normalisation
    expected = (weights * stats.loss_sum_k).sum() / (weights * counts).sum()
    torch.testing.assert_close(stats.loss, expected)
    assert counts.tolist() == [6, 6, 5]  # the block at 17 runs past the row at slot 3


def test_training_logits_equal_the_decoders_draft_pass() -> None:
    """One anchor's block in training is exactly the decoder's round at that position."""
    draft = tiny_draft(seed=3).eval()
    ids = list(range(10, 30))
    batch = batch_of([ids])
    anchor = 11
    batch.anchors_BN = torch.tensor([[anchor]])
    layout = block_layout(batch, draft.arch.block_size, MASK)
    positions = torch.arange(len(ids))[None]
    with torch.no_grad():
        context = draft.context_keys_values(draft.context(batch.aux_BTA), positions)
        hidden = draft.blocks(context, layout.tokens_BQ, layout.positions_BQ, layout.mask_BQS)
        trained = draft.logits(hidden[0, 1:])
    decoder = BlockContext(draft)
    decoder.extend(batch.aux_BTA[0, :anchor], torch.arange(anchor))
    drafted = decoder.propose(ids[anchor], anchor, draft.arch.block_size - 1)
    torch.testing.assert_close(drafted, trained, rtol=1e-5, atol=1e-5)


def test_mask_token_must_be_named_and_never_a_real_special_token() -> None:
    class Tokenizer:
        pad_token_id, bos_token_id, eos_token_id = 2, 1, 2

    assert mask_token_for(16, Tokenizer()) == 16
    with pytest.raises(ConfigError, match="draft.dflash.mask_token_id"):
        mask_token_for(None, Tokenizer())
    with pytest.raises(ConfigError, match="pad token"):
        mask_token_for(2, Tokenizer())
    with pytest.raises(ConfigError, match="block_size"):
        DFlashConfig(block_size=1)
    assert spread_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the reference's Qwen3-8B taps


def test_the_directory_is_what_vllm_loads(tmp_path: Path) -> None:
    draft = tiny_draft()
    out = write_dflash(draft.arch, draft.state_dict(), tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["head_dim"] == 8 and "auto_map" not in config
    assert config["dflash_config"] == {
        "mask_token_id": MASK,
        "target_layer_ids": [1, 2, 3],
        "block_size": 4,
    }
    assert config["block_size"] == 4 and config["num_target_layers"] == 6
    assert config["layer_types"] == ["full_attention"] * 2
    assert check_dflash(out, target_num_layers=6) == []
    arch, tensors = read_dflash(out)
    assert arch == draft.arch
    assert set(tensors) == set(draft.state_dict())
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_norm.weight",
    } <= set(tensors)
    assert not any(k.startswith(("embed", "lm_head")) for k in tensors)


def test_check_names_what_vllm_would_load_wrongly(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    draft = tiny_draft()
    out = write_dflash(draft.arch, draft.state_dict(), tmp_path / "d")
    assert any("outside the target's 0..2" in p for p in check_dflash(out, target_num_layers=3))
    config = json.loads((out / "config.json").read_text())
    # without the target, the draft's own num_target_layers bounds the taps, as SGLang checks
    config["num_target_layers"] = 3
    config["layer_types"] = ["full_attention", "causal"]
    del config["head_dim"]
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["mask_hidden"] = torch.zeros(32)
    tensors["lm_head.weight"] = torch.zeros(40, 32)
    tensors["fc.weight"] = torch.zeros(32, 64)
    tensors["layers.0.self_attn.qkv.weight"] = tensors.pop("layers.0.self_attn.q_proj.weight")
    save_file(tensors, str(out / "model.safetensors"))
    problems = " | ".join(check_dflash(out))
    for expected in (
        "'head_dim'",
        "auto_map",
        "mask_hidden",
        "lm_head.weight is in",
        "fc.weight has shape",
        "outside the target's 0..2",
        "layer_types must list 2 layer types",
        "tensors no engine loads: layers.0.self_attn.qkv.weight",
        "no layers.0.self_attn.q_proj.weight",
    ):
        assert expected in problems
    config["target_hidden_size"] = 48  # SGLang's fc is [hidden, taps x hidden]
    (out / "config.json").write_text(json.dumps(config))
    assert "SGLang sizes fc by hidden_size" in " | ".join(check_dflash(out))


def test_the_speculators_layout_reads_back_as_vllm_reads_it(tmp_path: Path) -> None:
    from eagleforge.formats.dflash import as_engine_config, dflash_config
    from eagleforge.formats.directory import read_draft, write_draft
    from eagleforge.formats.kinds import DraftFormat, Verifier

    draft = tiny_draft()
    verifier = Verifier("HuggingFaceTB/SmolLM2-135M-Instruct", ["LlamaForCausalLM"])
    out = write_draft(
        draft.arch, draft.state_dict(), tmp_path / "s", DraftFormat.speculators, verifier
    )
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [2, 3, 4]  # input of layer
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    # what vLLM's speculators reader builds is the vLLM layout's config
    engine = as_engine_config(config)
    for key, value in dflash_config(draft.arch, torch.float32).items():
        if key not in ("eagleforge",):
            assert engine[key] == value, key
    assert check_dflash(out, target_num_layers=6) == []
    fmt, arch, tensors = read_draft(out)
    assert (
        fmt == DraftFormat.speculators
        and arch == draft.arch
        and set(tensors) == set(draft.state_dict())
    )
    del config["speculators_config"]["verifier"]
    (out / "config.json").write_text(json.dumps(config))
    assert any("verifier.name_or_path" in p for p in check_dflash(out))


def test_evaluate_loads_a_dflash_draft_only_for_its_target(tmp_path: Path) -> None:
    from eagleforge.evaluate import load_draft
    from eagleforge.targets.hf import HFTarget
    from helpers.targets import small_vocab_target

    draft = tiny_draft()
    out = write_dflash(draft.arch, draft.state_dict(), tmp_path / "d")
    with pytest.raises(ConfigError, match="trained for a target with vocab 40 and hidden size 32"):
        load_draft(out, small_vocab_target(vocab=8), torch.device("cpu"))
    other_taps = HFTarget(small_vocab_target(vocab=40).model, aux_layer_ids=[0, 1, 2])
    with pytest.raises(ConfigError, match=r"reads target layers \[1, 2, 3\], the other drafts"):
        load_draft(out, other_taps, torch.device("cpu"))
    target = HFTarget(small_vocab_target(vocab=40).model, aux_layer_ids=[1, 2, 3])
    loaded = load_draft(out, target, torch.device("cpu"))
    assert isinstance(loaded, DFlashDraft) and not loaded.training
    torch.testing.assert_close(loaded.fc.weight, draft.fc.weight)
    # the engine's lm_head is the target's, not one of its own
    assert torch.equal(loaded.lm_head_VH, target.lm_head_weight())
