"""The learning-rate schedule (linear warmup, then cosine to min_lr_ratio), the optimizer
config's validation, the four optimizer kinds (Muon's groups and its steps against torch's own
Muon and AdamW, also sharded) and fp32 master weights on the tiny draft."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from eagleforge.checkpoint import load_checkpoint, save_checkpoint
from eagleforge.config import compose_config, to_typed
from eagleforge.draft.attention import AttentionBackend
from eagleforge.draft.model import Eagle3Draft
from eagleforge.draft.ttt import TTTModule, count_positions, loss_scales, step_weights, ttt_forward
from eagleforge.errors import ConfigError
from eagleforge.muon import ADAMW, ALGORITHM, MUON, MuonConfig, MuonLrAdjust, split_for_muon
from eagleforge.optim import (
    ApolloConfig,
    ApolloScaleType,
    OptimizerConfig,
    OptimizerKind,
    Schedule,
    apply_master_dtype,
    build_optimizer,
    lr_multiplier,
    warmup_cosine,
)
from eagleforge.parallel import ParallelDims
from eagleforge.parallel.dist import World
from helpers.drafts import random_batch, tiny_draft

pytestmark = pytest.mark.unit


def test_linear_warmup_reaches_one() -> None:
    """With 10 warmup steps the multiplier is (step+1)/10: 0.1, 0.2, ..., 1.0 at step 9."""
    got = [warmup_cosine(step, 100, 10, 0.1) for step in range(10)]
    assert got == pytest.approx([(s + 1) / 10 for s in range(10)])


def test_cosine_decay_to_min_ratio() -> None:
    """After warmup: 1.0 at its start, (1+min)/2 half-way, min_ratio at total_steps and beyond."""
    total, warmup, floor = 100, 10, 0.1
    assert warmup_cosine(10, total, warmup, floor) == pytest.approx(1.0)
    assert warmup_cosine(55, total, warmup, floor) == pytest.approx(0.55)
    progress = (32 - warmup) / (total - warmup)
    expected = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    assert warmup_cosine(32, total, warmup, floor) == pytest.approx(expected)
    assert warmup_cosine(100, total, warmup, floor) == pytest.approx(floor)
    assert warmup_cosine(150, total, warmup, floor) == pytest.approx(floor)
    decay = [warmup_cosine(s, total, warmup, floor) for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(decay[:-1], decay[1:], strict=True))
    assert decay[-2] > floor


def test_no_warmup_and_zero_floor() -> None:
    """warmup_steps=0 starts at 1.0; min_ratio=0 decays to 0."""
    assert warmup_cosine(0, 20, 0, 0.0) == pytest.approx(1.0)
    assert warmup_cosine(10, 20, 0, 0.0) == pytest.approx(0.5)
    assert warmup_cosine(20, 20, 0, 0.0) == pytest.approx(0.0, abs=1e-12)


def test_build_optimizer_follows_schedule_and_skips_frozen() -> None:
    """build_optimizer optimises only trainable params; lr at step s is lr * warmup_cosine(s)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    cfg = OptimizerConfig(lr=1e-2, warmup_ratio=0.2, min_lr_ratio=0.1)
    optimizer, scheduler = build_optimizer(cfg, model, total_steps=10)
    params = optimizer.param_groups[0]["params"]
    assert len(params) == 3
    assert all(p is not model[0].weight for p in params)
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1e-2 * warmup_cosine(s, 10, 2, 0.1) for s in range(10)])
    assert lrs[:2] == pytest.approx([5e-3, 1e-2])


def test_a_linear_schedule_falls_in_a_straight_line_to_its_floor() -> None:
    """optimizer.schedule=linear (vLLM speculators'): after warmup the multiplier falls by the
    same amount every step, from 1 to min_lr_ratio at the run's last step."""
    got = [lr_multiplier(s, 12, 2, 0.1, Schedule.linear) for s in range(13)]
    assert got[:2] == pytest.approx([0.5, 1.0])
    assert got[2:] == pytest.approx([1.0 - 0.9 * k / 10 for k in range(11)])
    model = torch.nn.Linear(3, 1)
    cfg = OptimizerConfig(lr=1e-2, warmup_ratio=0.0, schedule=Schedule.linear)
    optimizer, scheduler = build_optimizer(cfg, model, total_steps=4)
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1e-2, 7.5e-3, 5e-3, 2.5e-3])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": -1}, "optimizer.lr"),
        ({"lr": 0.0}, "optimizer.lr"),
        ({"warmup_ratio": 1.0}, "optimizer.warmup_ratio"),
        ({"warmup_ratio": -0.1}, "optimizer.warmup_ratio"),
        ({"min_lr_ratio": 1.5}, "optimizer.min_lr_ratio"),
        ({"max_grad_norm": -1.0}, "optimizer.max_grad_norm"),
        ({"betas": [0.9]}, "optimizer.betas"),
        ({"betas": [0.9, 1.0]}, "optimizer.betas"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    """Invalid optimizer settings raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        OptimizerConfig(**kwargs)


def test_defaults_are_what_the_default_group_file_picks() -> None:
    """conf/optimizer/adamw.yaml (the default choice) sets every field to the dataclass
    default: a section built in code trains as a composed run does."""
    typed = to_typed(compose_config(["+model=tiny", "output_dir=/tmp/x"]))
    assert typed.optimizer == OptimizerConfig()


# --- optimizer kinds and fp32 master weights -------------------------------------------------


def _train(
    cfg: OptimizerConfig,
    num_steps: int = 8,
    attention: AttentionBackend = AttentionBackend.eager,
) -> tuple[list[float], Eagle3Draft, dict]:
    """A few full optimizer steps of the tiny draft on one fixed batch, with the schedule and
    clipping the trainer uses; the losses, the draft and its weights before training."""
    torch.manual_seed(0)
    draft = tiny_draft()
    apply_master_dtype(draft, cfg)
    before = {k: v.detach().clone() for k, v in draft.named_parameters() if v.requires_grad}
    batch = random_batch(draft.arch, seed=1, padded_row=1, real_length=9)
    optimizer, scheduler = build_optimizer(cfg, draft, total_steps=num_steps)
    params = [p for p in draft.parameters() if p.requires_grad]
    scale_k = loss_scales(count_positions(batch, 2), step_weights(2, 0.8, torch.device("cpu")))
    losses = []
    for _ in range(num_steps):
        optimizer.zero_grad(set_to_none=True)
        stats = ttt_forward(draft, batch, 2, scale_k, attention=attention)
        stats.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(float(stats.loss.detach()))
    return losses, draft, before


def _trainable_dtypes(draft: Eagle3Draft) -> set[torch.dtype]:
    return {p.dtype for p in draft.parameters() if p.requires_grad}


def _assert_trains(
    cfg: OptimizerConfig,
    dtype: torch.dtype,
    attention: AttentionBackend = AttentionBackend.eager,
) -> None:
    """Trainable weights stay in ``dtype``, all of them move, and the loss goes down."""
    losses, draft, before = _train(cfg, attention=attention)
    assert _trainable_dtypes(draft) == {dtype}
    assert draft.embed_tokens.weight.dtype == torch.float32  # frozen: left as it was
    for name, param in draft.named_parameters():
        if param.requires_grad:
            assert not torch.equal(param, before[name]), f"{name} was not updated"
    assert losses[-1] < losses[0], losses


def test_fp32_master_keeps_trainable_weights_fp32() -> None:
    """fp32_master (the default) stores and updates fp32 trainable weights."""
    cfg = OptimizerConfig(lr=1e-2, warmup_ratio=0.0)
    assert cfg.fp32_master
    _assert_trains(cfg, torch.float32)


@pytest.mark.parametrize("attention", [AttentionBackend.eager, AttentionBackend.sdpa])
def test_without_fp32_master_weights_and_state_are_bf16(attention: AttentionBackend) -> None:
    """fp32_master=false: the trainable weights (so their grads and AdamW moments) are bf16,
    updated in place; frozen embedding and buffers unchanged; training still works, also
    through the CPU flash kernel (sdpa, the CPU default) with no autocast."""
    cfg = OptimizerConfig(lr=1e-2, warmup_ratio=0.0, fp32_master=False)
    _assert_trains(cfg, torch.bfloat16, attention)
    _, draft, _ = _train(cfg, num_steps=1)
    assert draft.d2t.dtype == torch.long and draft.inv_freq.dtype == torch.float32


def test_apply_master_dtype_keeps_parameter_objects() -> None:
    """The cast is in place: the Parameters an optimizer or FSDP already holds stay valid."""
    draft = tiny_draft()
    params = [p for p in draft.parameters() if p.requires_grad]
    apply_master_dtype(draft, OptimizerConfig(fp32_master=False))
    after = [p for p in draft.parameters() if p.requires_grad]
    assert all(a is b for a, b in zip(params, after, strict=True))
    assert _trainable_dtypes(draft) == {torch.bfloat16}
    apply_master_dtype(draft, OptimizerConfig(fp32_master=True))
    assert _trainable_dtypes(draft) == {torch.float32}


def test_adamw_is_torch_adamw() -> None:
    optimizer, _ = build_optimizer(OptimizerConfig(betas=[0.8, 0.9]), tiny_draft(), 10)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)


@pytest.mark.parametrize("fp32_master", [True, False])
def test_adamw_8bit_trains_on_cpu(fp32_master: bool) -> None:
    """bitsandbytes' AdamW8bit on its CPU backend (checked with 0.50.2): 8-bit moments for the
    large matrices, and the tiny draft learns."""
    bnb = pytest.importorskip("bitsandbytes")
    cfg = OptimizerConfig(
        kind=OptimizerKind.adamw_8bit, lr=1e-2, warmup_ratio=0.0, fp32_master=fp32_master
    )
    _assert_trains(cfg, torch.float32 if fp32_master else torch.bfloat16)
    optimizer, _ = build_optimizer(cfg, tiny_draft(), 10)
    assert isinstance(optimizer, bnb.optim.AdamW8bit)


def test_adamw_8bit_uses_8bit_state_for_large_matrices() -> None:
    """Matrices of 4096+ elements (bitsandbytes' min_8bit_size) get uint8 moments."""
    pytest.importorskip("bitsandbytes")
    model = torch.nn.Linear(64, 64, bias=False)
    optimizer, _ = build_optimizer(OptimizerConfig(kind=OptimizerKind.adamw_8bit), model, 10)
    model(torch.randn(4, 64)).square().sum().backward()
    optimizer.step()
    assert optimizer.state[model.weight]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("scale_type", list(ApolloScaleType))
def test_apollo_trains_on_cpu(scale_type: ApolloScaleType) -> None:
    """apollo-torch's APOLLOAdamW: the matrices in a low-rank group with our options, the
    norms in a plain one; the tiny draft learns."""
    apollo_torch = pytest.importorskip("apollo_torch")
    cfg = OptimizerConfig(
        kind=OptimizerKind.apollo,
        lr=1e-2,
        warmup_ratio=0.0,
        apollo=ApolloConfig(rank=4, scale_type=scale_type, scale=1.0, update_proj_gap=3),
    )
    _assert_trains(cfg, torch.float32)
    draft = tiny_draft()
    optimizer, _ = build_optimizer(cfg, draft, 10)
    assert isinstance(optimizer, apollo_torch.APOLLOAdamW)
    plain, low_rank = optimizer.param_groups
    assert all(p.ndim == 1 for p in plain["params"])
    assert all(p.ndim == 2 for p in low_rank["params"])
    assert len(plain["params"]) + len(low_rank["params"]) == len(
        [p for p in draft.parameters() if p.requires_grad]
    )
    assert (low_rank["rank"], low_rank["scale_type"], low_rank["update_proj_gap"]) == (
        4,
        scale_type.value,
        3,
    )
    assert (low_rank["proj"], low_rank["proj_type"], low_rank["scale"]) == ("random", "std", 1.0)


@pytest.mark.parametrize(
    ("kind", "module"), [("adamw_8bit", "bitsandbytes"), ("apollo", "apollo_torch")]
)
def test_missing_package_names_the_extra(
    kind: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the library: one ConfigError naming the field and the extra to install."""
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    cfg = OptimizerConfig(kind=OptimizerKind(kind))
    with pytest.raises(ConfigError, match=rf"optimizer\.kind={kind}.*eagleforge\[optim\]"):
        build_optimizer(cfg, tiny_draft(), 10)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": 0}, "optimizer.apollo.rank"),
        ({"update_proj_gap": 0}, "optimizer.apollo.update_proj_gap"),
        ({"scale": 0.0}, "optimizer.apollo.scale"),
    ],
)
def test_apollo_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ApolloConfig(**kwargs)


@pytest.mark.parametrize("choice", ["adamw", "adamw_8bit", "apollo", "muon"])
def test_optimizer_group_files(choice: str) -> None:
    """Each conf/optimizer file picks its kind and keeps adamw.yaml's shared settings."""
    typed = to_typed(compose_config(["+model=tiny", f"optimizer={choice}", "output_dir=/tmp/x"]))
    assert typed.optimizer.kind == OptimizerKind(choice)
    assert typed.optimizer.fp32_master is True
    assert typed.optimizer.max_grad_norm == 0.5 and typed.optimizer.lr == 1e-4
    if choice == "apollo":
        assert typed.optimizer.apollo == ApolloConfig()
    if choice == "muon":  # the file's Muon settings are the dataclass defaults
        assert typed.optimizer.muon == MuonConfig()


@pytest.mark.parametrize("fp32_master", [True, False])
@pytest.mark.parametrize("kind", list(OptimizerKind))
def test_resume_continues_exactly(kind: OptimizerKind, fp32_master: bool, tmp_path: Path) -> None:
    """Every kind checkpoints through the trainer's checkpoint code (APOLLO's projectors as
    tensors, loadable with weights_only=True) and a resumed run takes the same steps as the
    uninterrupted one, past a fresh APOLLO projection (update_proj_gap=2)."""
    pytest.importorskip({"adamw_8bit": "bitsandbytes", "apollo": "apollo_torch"}.get(kind, "torch"))
    cfg = OptimizerConfig(
        kind=kind,
        lr=1e-2,
        warmup_ratio=0.0,
        fp32_master=fp32_master,
        apollo=ApolloConfig(rank=4, scale=1.0, update_proj_gap=2),
    )
    world = World(torch.device("cpu"), ParallelDims())
    batch = random_batch(tiny_draft().arch, seed=1, padded_row=1, real_length=9)
    scale_k = loss_scales(count_positions(batch, 2), step_weights(2, 0.8))

    def build() -> tuple[TTTModule, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        draft = tiny_draft()
        apply_master_dtype(draft, cfg)
        module = TTTModule(draft, 2, AttentionBackend.eager)
        return module, *build_optimizer(cfg, module, total_steps=20)

    def steps(module: TTTModule, optimizer: torch.optim.Optimizer, scheduler: Any, n: int) -> list:
        losses = []
        for _ in range(n):
            optimizer.zero_grad(set_to_none=True)
            loss = module.stats(batch, scale_k).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
        return losses

    module, optimizer, scheduler = build()
    steps(module, optimizer, scheduler, 3)
    path = save_checkpoint(
        tmp_path / "step_3", module, optimizer, scheduler, {"step": 3}, "a: 1\n", world
    )
    uninterrupted = steps(module, optimizer, scheduler, 4)
    module, optimizer, scheduler = build()
    load_checkpoint(path, module, optimizer, scheduler, world)
    assert steps(module, optimizer, scheduler, 4) == uninterrupted


@pytest.mark.parametrize("kind", [OptimizerKind.adamw_8bit, OptimizerKind.apollo])
def test_8bit_and_apollo_refuse_a_sharded_draft(kind: OptimizerKind, tmp_path: Path) -> None:
    """FSDP2 parameters are DTensors, which bitsandbytes and APOLLO cannot update: a ConfigError
    naming optimizer.kind before training (here a one-rank gloo group makes the DTensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Linear(8, 8)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ConfigError, match=rf"optimizer\.kind={kind.value} .*optimizer=adamw"):
            build_optimizer(OptimizerConfig(kind=kind), model, 10)
        optimizer, _ = build_optimizer(OptimizerConfig(), model, 10)  # adamw handles DTensors
        assert type(optimizer) is torch.optim.AdamW
    finally:
        dist.destroy_process_group()


# --- muon -------------------------------------------------------------------------------------

MATRICES = [
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
]
NORMS = [
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
]


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("lm_head", [False, True])
def test_muon_groups_matrices_and_the_rest(lm_head: bool) -> None:
    """Muon gets the trainable matrices (lm_head only with muon.lm_head), AdamW the norms (and
    lm_head); the frozen embedding neither. Names may carry the TTTModule's prefix."""
    cfg = MuonConfig(lm_head=lm_head)
    muon, adamw = split_for_muon(cfg, _trainable(tiny_draft()))
    assert list(muon) == MATRICES + (["lm_head.weight"] if lm_head else [])
    assert sorted(adamw) == sorted(NORMS + ([] if lm_head else ["lm_head.weight"]))
    module = TTTModule(tiny_draft(), 2, AttentionBackend.eager)
    optimizer, _ = build_optimizer(
        OptimizerConfig(kind=OptimizerKind.muon, muon=cfg), module, total_steps=10
    )
    names = {id(p): n for n, p in module.named_parameters()}
    by_algorithm = {
        group[ALGORITHM]: [names[id(p)].removeprefix("draft.") for p in group["params"]]
        for group in optimizer.param_groups
    }
    assert by_algorithm == {MUON: list(muon), ADAMW: list(adamw)}


def test_muon_leaves_vectors_shaped_as_matrices_and_embeddings_to_adamw() -> None:
    """A [1, N] or [N, 1] weight has nothing to orthogonalise; an embedding (trainable here) is
    a lookup table: both go to AdamW, as in speculators."""
    model = torch.nn.ModuleDict(
        {
            "row": torch.nn.Linear(4, 1),
            "embed_tokens": torch.nn.Embedding(10, 4),
            "proj": torch.nn.Linear(4, 3, bias=False),
        }
    )
    muon, adamw = split_for_muon(MuonConfig(lm_head=True), _trainable(model))
    assert list(muon) == ["proj.weight"]
    assert list(adamw) == ["row.weight", "row.bias", "embed_tokens.weight"]


def _set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


@pytest.mark.parametrize(
    ("adjust_lr_fn", "nesterov", "lm_head", "fp32_master"),
    [
        (MuonLrAdjust.match_rms_adamw, True, False, True),
        (MuonLrAdjust.original, False, True, True),
        (MuonLrAdjust.match_rms_adamw, True, True, False),
    ],
)
def test_muon_steps_are_torch_muon_and_adamw_on_the_same_groups(
    adjust_lr_fn: MuonLrAdjust, nesterov: bool, lm_head: bool, fp32_master: bool
) -> None:
    """Three steps of optimizer=muon leave bit for bit the weights that torch.optim.Muon (at
    lr * lr_ratio, with the muon options) and torch.optim.AdamW (the shared settings) leave when
    each updates its own group, both under the one schedule."""
    muon_cfg = MuonConfig(
        lr_ratio=5.0,
        weight_decay=0.05,
        momentum=0.9,
        nesterov=nesterov,
        ns_steps=4,
        adjust_lr_fn=adjust_lr_fn,
        lm_head=lm_head,
    )
    cfg = OptimizerConfig(
        kind=OptimizerKind.muon,
        lr=1e-2,
        betas=[0.8, 0.9],
        eps=1e-6,
        weight_decay=0.01,
        warmup_ratio=0.5,
        fp32_master=fp32_master,
        muon=muon_cfg,
    )
    ours, theirs = tiny_draft(), tiny_draft()
    apply_master_dtype(ours, cfg)
    apply_master_dtype(theirs, cfg)
    optimizer, scheduler = build_optimizer(cfg, ours, total_steps=4)
    muon_params, adamw_params = split_for_muon(muon_cfg, _trainable(theirs))
    reference = [
        torch.optim.Muon(
            list(muon_params.values()),
            lr=1e-2 * 5.0,
            weight_decay=0.05,
            momentum=0.9,
            nesterov=nesterov,
            ns_steps=4,
            adjust_lr_fn=adjust_lr_fn.value,
        ),
        torch.optim.AdamW(
            list(adamw_params.values()), lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01
        ),
    ]
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, 4, 2, 0.0))
        for opt in reference
    ]
    for seed in range(3):
        _set_grads([p for _, p in _trainable(ours)], seed)
        _set_grads([p for _, p in _trainable(theirs)], seed)
        optimizer.step()
        scheduler.step()
        for opt, schedule in zip(reference, schedules, strict=True):
            opt.step()
            schedule.step()
    expected = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, expected[name]), name
    assert optimizer.state[ours.fc.weight].keys() == {"momentum_buffer"}
    assert optimizer.state[ours.norm.weight].keys() == {"step", "exp_avg", "exp_avg_sq"}


def test_muon_schedule_scales_both_groups() -> None:
    """One LambdaLR: the Muon group's lr stays lr_ratio times the AdamW group's."""
    cfg = OptimizerConfig(kind=OptimizerKind.muon, lr=1e-3, warmup_ratio=0.2)
    optimizer, scheduler = build_optimizer(cfg, tiny_draft(), total_steps=10)
    muon, adamw = optimizer.param_groups
    for step in range(10):
        assert adamw["lr"] == pytest.approx(1e-3 * warmup_cosine(step, 10, 2, 0.0))
        assert muon["lr"] == pytest.approx(10 * adamw["lr"])
        optimizer.step()
        scheduler.step()


def test_muon_state_dict_round_trip() -> None:
    """state_dict (Muon's momentum buffers, AdamW's moments, each group's algorithm and options),
    saved and loaded with weights_only=True, loads into a fresh optimizer, which then takes the
    original's next step exactly."""
    cfg = OptimizerConfig(kind=OptimizerKind.muon, lr=1e-2, warmup_ratio=0.0)
    drafts = [tiny_draft(), tiny_draft()]
    optimizers = [build_optimizer(cfg, d, total_steps=10)[0] for d in drafts]
    for seed in range(2):
        _set_grads([p for _, p in _trainable(drafts[0])], seed)
        optimizers[0].step()
    blob = io.BytesIO()  # as in a checkpoint: a loaded state shares no tensor with the live one
    torch.save(optimizers[0].state_dict(), blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    assert [g[ALGORITHM] for g in saved["param_groups"]] == [MUON, ADAMW]
    drafts[1].load_state_dict(drafts[0].state_dict())
    optimizers[1].load_state_dict(saved)
    assert optimizers[1].param_groups[0]["ns_steps"] == 5
    for draft, optimizer in zip(drafts, optimizers, strict=True):
        _set_grads([p for _, p in _trainable(draft)], 7)
        optimizer.step()
    for (name, a), b in zip(drafts[0].named_parameters(), drafts[1].parameters(), strict=True):
        assert torch.equal(a, b), name


def test_muon_trains_the_tiny_draft() -> None:
    cfg = OptimizerConfig(kind=OptimizerKind.muon, lr=1e-2, warmup_ratio=0.0)
    _assert_trains(cfg, torch.float32)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr_ratio": 0.0}, "optimizer.muon.lr_ratio"),
        ({"weight_decay": -0.1}, "optimizer.muon.weight_decay"),
        ({"momentum": 1.0}, "optimizer.muon.momentum"),
        ({"momentum": -0.5}, "optimizer.muon.momentum"),
        ({"ns_steps": 0}, "optimizer.muon.ns_steps"),
        ({"ns_steps": 100}, "optimizer.muon.ns_steps"),
    ],
)
def test_muon_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        MuonConfig(**kwargs)


def test_muon_without_torch_muon_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older torch (before 2.9) has no torch.optim.Muon: a ConfigError, not an AttributeError."""
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match=r"optimizer\.kind=muon needs torch\.optim\.Muon"):
        build_optimizer(OptimizerConfig(kind=OptimizerKind.muon), tiny_draft(), 10)


def test_muon_sharded_step_is_torch_muon(tmp_path: Path) -> None:
    """The DTensor path (gather the update, torch's Newton-Schulz, keep this rank's rows) takes
    torch.optim.Muon's steps bit for bit: here on a one-rank gloo group (tests/dist checks two
    ranks against one process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        sharded = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 5))
        first, second = torch.nn.Linear(6, 8), torch.nn.Linear(8, 5)
        plain = torch.nn.Sequential(first, second)
        plain.load_state_dict(sharded.state_dict())
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        cfg = OptimizerConfig(kind=OptimizerKind.muon, lr=1e-2, warmup_ratio=0.0)
        optimizer, _ = build_optimizer(cfg, sharded, total_steps=10)
        assert all(isinstance(p, DTensor) for p in optimizer.param_groups[0]["params"])
        reference = [
            torch.optim.Muon(
                [first.weight, second.weight],
                lr=0.1,
                weight_decay=0.1,
                adjust_lr_fn="match_rms_adamw",
            ),
            torch.optim.AdamW(
                [first.bias, second.bias], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0
            ),
        ]
        for seed in range(3):
            for model in (sharded, plain):
                torch.manual_seed(seed)
                model(torch.randn(4, 6)).square().sum().backward()
            optimizer.step()
            for opt in reference:
                opt.step()
            optimizer.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
        for (name, a), b in zip(sharded.named_parameters(), plain.parameters(), strict=True):
            assert isinstance(a, DTensor) and torch.equal(a.full_tensor(), b), name
    finally:
        dist.destroy_process_group()
