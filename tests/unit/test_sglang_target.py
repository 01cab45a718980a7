"""The SGLang target backend without SGLang (CPU): its config composes and is checked, the
module imports, building it says how to install SGLang, and its pure parts (padded rows <->
SGLang's flat token layout, layer ids, ServerArgs from target.sglang, rank planning, the
unsharded vocab matrices) give the right values. SGLang itself runs in tests/gpu."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from transformers import LlamaConfig

from eagleforge.config import compose_config, to_typed
from eagleforge.errors import ConfigError
from eagleforge.layers import RMSNorm
from eagleforge.targets.config import SGLangConfig, TargetBackendKind, TargetConfig
from eagleforge.targets.registry import build_target
from eagleforge.targets.sglang import SGLangTarget
from eagleforge.targets.sglang_launch import (
    INSTALL_HINT,
    SGLangRanks,
    nccl_environment,
    plan_ranks,
    server_args_fields,
    server_args_kwargs,
)
from eagleforge.targets.sglang_layout import (
    RowLayout,
    aux_in_our_order,
    rows_to_sequences,
    sequences_to_rows,
    sglang_aux_layer_ids,
    sglang_snapshot_layers,
    vocab_matrix_from_shards,
)
from eagleforge.targets.source import ModelConfig, default_aux_layer_ids

pytestmark = pytest.mark.unit

BASE = ["+model=tiny", "data=chitchat", "output_dir=/tmp/unused", "target=sglang"]


# --- config ---------------------------------------------------------------------------------------


def test_target_sglang_composes_with_its_options() -> None:
    typed = to_typed(compose_config(BASE))
    assert typed.target.backend == TargetBackendKind.sglang
    assert typed.target.sglang == SGLangConfig()  # conf/target/sglang.yaml = the schema defaults
    assert not typed.target.supports_packing()
    options = [
        *BASE,
        "target.sglang.attention_backend=fa3",
        "target.sglang.mem_fraction_static=0.7",
        "target.sglang.cuda_graph=true",
        "target.sglang.max_total_tokens=65536",
        "+target.sglang.extra.kv_cache_dtype=fp8_e5m2",
    ]
    sglang = to_typed(compose_config(options)).target.sglang
    assert (sglang.attention_backend, sglang.mem_fraction_static) == ("fa3", 0.7)
    assert (sglang.cuda_graph, sglang.max_total_tokens) == (True, 65536)
    assert sglang.extra == {"kv_cache_dtype": "fp8_e5m2"}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("target.sglang.mem_fraction_static=1.5", "target.sglang.mem_fraction_static"),
        ("target.sglang.mem_fraction_static=0", "target.sglang.mem_fraction_static"),
        ("target.sglang.ep_size=0", "target.sglang.ep_size"),
        ("target.sglang.context_length=0", "target.sglang.context_length"),
        ("target.sglang.max_total_tokens=-1", "target.sglang.max_total_tokens"),
        ("target.sglang.max_running_requests=0", "target.sglang.max_running_requests"),
        (
            "target.sglang.piecewise_cuda_graph_max_tokens=0",
            "target.sglang.piecewise_cuda_graph_max_tokens",
        ),
        ("target.sglang.dp_lm_head=true", "target.sglang.dp_lm_head"),
        ("target.sglang.attention_backend=''", "target.sglang.attention_backend"),
    ],
)
def test_option_checks_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        to_typed(compose_config([*BASE, override]))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["parallel.device=cpu"], r"target\.backend=sglang runs on CUDA only"),
        (["data.packing=true"], r"data\.packing=true"),
        (["trainer.eval_tau_every_n_steps=5"], r"trainer\.eval_tau_every_n_steps"),
    ],
)
def test_what_sglang_cannot_run_fails_at_compose_time(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        to_typed(compose_config([*BASE, *overrides]))


def test_offline_training_does_not_load_the_target_so_sglang_checks_do_not_apply() -> None:
    typed = to_typed(compose_config([*BASE, "parallel.device=cpu", "data.features=/tmp/f"]))
    assert typed.target.backend == TargetBackendKind.sglang


# --- import and build without SGLang ---------------------------------------------------------------


def test_module_imports_without_importing_sglang() -> None:
    import eagleforge.targets.sglang as module

    assert module.SGLangTarget is SGLangTarget
    if "sglang" not in sys.modules:  # nothing above pulled it in
        assert not any(name.startswith("sglang.") for name in sys.modules)


def _sglang_target_cfg() -> TargetConfig:
    return TargetConfig(backend=TargetBackendKind.sglang)


def test_building_without_sglang_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` fails, installed or not
    model_cfg = ModelConfig(name="t", path=str(tmp_path))
    with pytest.raises(ConfigError) as info:
        build_target(model_cfg, _sglang_target_cfg(), tmp_path, torch.device("cuda"))
    assert INSTALL_HINT in str(info.value)
    assert "pip install 'eagleforge[sglang]'" in str(info.value)


def test_building_on_cpu_is_a_config_error_before_importing_sglang(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_cfg = ModelConfig(name="t", path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"target\.backend=sglang runs on CUDA only"):
        build_target(model_cfg, _sglang_target_cfg(), tmp_path, torch.device("cpu"))


# --- layer ids --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [7, 28, 30, 32, 36, 80])
def test_default_layers_are_what_sglang_captures_by_default(num_layers: int) -> None:
    ours = default_aux_layer_ids(num_layers)
    theirs = sglang_aux_layer_ids(ours, num_layers)
    assert theirs == ours  # both number the output of a layer, 0-based
    # SGLang's own EAGLE-3 default (set_eagle3_layers_to_capture(None)) snapshots the inputs of
    # layers [2, N//2, N-3]: the same three hidden states as our default
    assert sglang_snapshot_layers(theirs) == [2, num_layers // 2, num_layers - 3]


def test_sglang_layer_ids_for_explicit_ids() -> None:
    assert sglang_aux_layer_ids([0, 5, 28], 30) == [0, 5, 28]
    assert sglang_snapshot_layers([0, 5, 28]) == [1, 6, 29]


def test_repeated_layers_are_config_errors() -> None:
    # a repeated layer would be captured once by SGLang
    with pytest.raises(ConfigError, match=r"model\.aux_layer_ids \[1, 2, 2\] repeats a layer"):
        sglang_aux_layer_ids([1, 2, 2], 6)


def test_aux_blocks_follow_our_id_order() -> None:
    # SGLang's output: the states of layers 1, 14, 26 (layer order), width 2 each
    sglang_NA = torch.tensor([[1.0, 1.0, 14.0, 14.0, 26.0, 26.0]])
    assert torch.equal(aux_in_our_order(sglang_NA, [1, 14, 26]), sglang_NA)
    reordered = aux_in_our_order(sglang_NA, [26, 1, 14])
    assert torch.equal(reordered, torch.tensor([[26.0, 26.0, 1.0, 1.0, 14.0, 14.0]]))


@pytest.mark.parametrize("bad", [29, -1, 40])
def test_layers_sglang_cannot_capture_are_config_errors(bad: int) -> None:
    with pytest.raises(ConfigError, match=r"model\.aux_layer_ids .*0\.\.28"):
        sglang_aux_layer_ids([1, 14, bad], 30)


# --- padded rows <-> flat layout --------------------------------------------------------------------


def test_rows_become_one_sequence_each_without_padding() -> None:
    ids_BT = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [0, 0, 0, 0], [1, 2, 3, 4]])
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    sequences, layout = rows_to_sequences(ids_BT, mask_BT)
    assert sequences == [[5, 6, 7], [8], [1, 2, 3, 4]]  # the padding-only row sends nothing
    assert layout == RowLayout(lengths=[3, 1, 0, 4], seq_len=4)
    assert layout.num_tokens == 8


@pytest.mark.parametrize(
    "mask", [[[0, 1, 1], [1, 1, 1]], [[1, 0, 1], [1, 1, 1]]], ids=["left-padded", "hole"]
)
def test_rows_that_are_not_right_padded_are_refused(mask: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="right-padded"):
        rows_to_sequences(torch.ones(2, 3, dtype=torch.long), torch.tensor(mask))


def test_flat_results_go_back_to_their_rows_with_zeros_in_padding() -> None:
    layout = RowLayout(lengths=[3, 1, 0], seq_len=4)
    flat_NX = torch.arange(1, 9, dtype=torch.float32).view(4, 2)  # tokens 0..3, width 2
    rows_BTX = sequences_to_rows(flat_NX, layout)
    expected = torch.zeros(3, 4, 2)
    expected[0, :3] = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    expected[1, 0] = torch.tensor([7.0, 8.0])
    assert torch.equal(rows_BTX, expected)


def test_round_trip_through_the_flat_layout_keeps_every_real_token() -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = [7, 1, 5, 0, 9]
    seq = 9
    mask_BT = torch.arange(seq) < torch.tensor(lengths).unsqueeze(1)
    ids_BT = torch.randint(3, 500, (len(lengths), seq), generator=generator) * mask_BT
    hidden_BTH = torch.randn(len(lengths), seq, 6, generator=generator)
    sequences, layout = rows_to_sequences(ids_BT, mask_BT)
    # SGLang's flat order: the requests' tokens back to back
    flat_ids = torch.tensor([t for s in sequences for t in s])
    assert torch.equal(flat_ids, ids_BT[mask_BT])
    back_BTH = sequences_to_rows(hidden_BTH[mask_BT], layout)
    assert torch.equal(back_BTH, hidden_BTH * mask_BT.unsqueeze(-1))


def test_a_token_count_mismatch_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="3 token rows for a batch of 4"):
        sequences_to_rows(torch.zeros(3, 2), RowLayout(lengths=[4], seq_len=4))


# --- vocab matrices ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_shards_concatenate_and_drop_the_padding_rows(tp: int) -> None:
    vocab, padded = 100, 128  # SGLang pads the vocab to a multiple of 64 x tp
    full_VH = torch.randn(padded, 4)
    shards = list(full_VH.chunk(tp))
    assert torch.equal(vocab_matrix_from_shards(shards, vocab), full_VH[:vocab])


def test_too_few_vocab_rows_are_an_error() -> None:
    with pytest.raises(RuntimeError, match="fewer than the target's vocab_size 100"):
        vocab_matrix_from_shards([torch.zeros(64, 4)], 100)


# --- ServerArgs -------------------------------------------------------------------------------------


def _kwargs(cfg: SGLangConfig, **extra_args):  # type: ignore[no-untyped-def]
    return server_args_kwargs(cfg, "/models/t", torch.bfloat16, 2, [1, 14, 26], **extra_args)


def test_server_args_from_the_default_options() -> None:
    kwargs = _kwargs(SGLangConfig())
    assert kwargs["model_path"] == kwargs["tokenizer_path"] == "/models/t"
    assert (kwargs["dtype"], kwargs["tp_size"], kwargs["pp_size"]) == ("bfloat16", 2, 1)
    assert kwargs["attention_backend"] == "flashinfer"
    assert kwargs["mem_fraction_static"] == 0.4
    assert kwargs["disable_cuda_graph"] is True
    assert "cuda_graph_backend_prefill" not in kwargs
    # SGLang's capture-only EAGLE-3 mode with our layer ids
    assert kwargs["enable_return_aux_hidden_states"] is True
    assert kwargs["speculative_algorithm"] == "EAGLE3"
    assert kwargs["return_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert kwargs["skip_tokenizer_init"] is True and kwargs["disable_radix_cache"] is True
    assert kwargs["context_length"] is None and kwargs["max_total_tokens"] is None


@pytest.mark.parametrize(("piecewise", "backend"), [(False, "full"), (True, "breakable")])
def test_cuda_graphs_are_prefill_graphs(piecewise: bool, backend: str) -> None:
    cfg = SGLangConfig(
        cuda_graph=not piecewise,
        piecewise_cuda_graph=piecewise,
        piecewise_cuda_graph_max_tokens=2048,
    )
    kwargs = _kwargs(cfg)
    assert "disable_cuda_graph" not in kwargs
    assert kwargs["disable_decode_cuda_graph"] is True
    assert kwargs["cuda_graph_backend_prefill"] == backend
    assert kwargs["cuda_graph_max_seq_len_prefill"] == 2048


def test_options_map_onto_their_server_args() -> None:
    cfg = SGLangConfig(
        attention_backend="fa3",
        mem_fraction_static=0.55,
        context_length=8192,
        torch_compile=True,
        nccl_nvls=True,
        symm_mem=True,
        dp_attention=True,
        dp_lm_head=True,
        ep_size=2,
        max_running_requests=64,
        max_total_tokens=131072,
    )
    kwargs = _kwargs(cfg, trust_remote_code=True, revision="abc")
    assert {k: kwargs[k] for k in cfg_fields_to_server_args()} == {
        "attention_backend": "fa3",
        "mem_fraction_static": 0.55,
        "context_length": 8192,
        "enable_torch_compile": True,
        "enable_nccl_nvls": True,
        "enable_symm_mem": True,
        "enable_dp_attention": True,
        "enable_dp_lm_head": True,
        "ep_size": 2,
        "max_running_requests": 64,
        "max_total_tokens": 131072,
        "trust_remote_code": True,
        "revision": "abc",
    }


def cfg_fields_to_server_args() -> list[str]:
    return [
        "attention_backend",
        "mem_fraction_static",
        "context_length",
        "enable_torch_compile",
        "enable_nccl_nvls",
        "enable_symm_mem",
        "enable_dp_attention",
        "enable_dp_lm_head",
        "ep_size",
        "max_running_requests",
        "max_total_tokens",
        "trust_remote_code",
        "revision",
    ]


KNOWN = {"kv_cache_dtype", "chunked_prefill_size", "log_level", "tp_size", "model_path"}


def test_extra_keys_pass_through_when_sglang_knows_them() -> None:
    cfg = SGLangConfig(extra={"kv_cache_dtype": "fp8_e5m2", "log_level": "info"})
    kwargs = _kwargs(cfg, known_fields=KNOWN)
    assert kwargs["kv_cache_dtype"] == "fp8_e5m2"
    assert kwargs["log_level"] == "info"  # our default, which extra may change


def test_unknown_extra_keys_name_the_key() -> None:
    cfg = SGLangConfig(extra={"kv_cache_dtype": "fp8_e5m2", "not_a_field": 1})
    with pytest.raises(ConfigError, match=r"target\.sglang\.extra\.not_a_field is not a field"):
        _kwargs(cfg, known_fields=KNOWN)


@pytest.mark.parametrize(
    ("key", "owner"),
    [
        ("tp_size", r"parallel\.tp"),
        ("model_path", r"model\.path"),
        ("ep_size", r"target\.sglang\.ep_size"),
    ],
)
def test_extra_keys_set_by_other_fields_are_refused(key: str, owner: str) -> None:
    with pytest.raises(ConfigError, match=rf"target\.sglang\.extra\.{key} is set by {owner}"):
        _kwargs(SGLangConfig(extra={key: 4}), known_fields=KNOWN)


def test_dtypes_sglang_does_not_run_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"model\.dtype"):
        server_args_kwargs(SGLangConfig(), "/m", torch.float64, 1, [1, 2, 3])


def test_server_args_fields_of_a_struct_or_a_dataclass() -> None:
    @dataclasses.dataclass
    class OldServerArgs:  # sglang < 0.5: a dataclass
        model_path: str = ""
        tp_size: int = 1

    class NewServerArgs:  # sglang 0.5.x: a msgspec Struct lists its fields here
        __struct_fields__ = ("model_path", "tp_size", "kv_cache_dtype")

    assert server_args_fields(OldServerArgs) == {"model_path", "tp_size"}
    assert server_args_fields(NewServerArgs) == {"model_path", "tp_size", "kv_cache_dtype"}


def test_nccl_environment_follows_the_collective_options() -> None:
    assert nccl_environment(SGLangConfig()) == {}
    assert nccl_environment(SGLangConfig(nccl_nvls=True)) == {"NCCL_NVLS_ENABLE": "1"}
    assert nccl_environment(SGLangConfig(symm_mem=True)) == {
        "NCCL_NVLS_ENABLE": "1",
        "NCCL_CUMEM_ENABLE": "1",
    }


# --- ranks ------------------------------------------------------------------------------------------


def test_a_single_process_gets_its_own_sglang_world() -> None:
    assert plan_ranks(None, False, 1, 0) == SGLangRanks(1, 0, adopt_world=False)


def test_a_world_that_is_the_tp_axis_is_adopted() -> None:
    assert plan_ranks([0, 1], True, 2, 1) == SGLangRanks(2, 1, adopt_world=True)
    assert plan_ranks([0, 1, 2, 3], True, 4, 2) == SGLangRanks(4, 2, adopt_world=True)
    assert plan_ranks(None, True, 1, 0) == SGLangRanks(1, 0, adopt_world=True)


@pytest.mark.parametrize(
    ("tp_ranks", "world", "rank"), [([0, 1], 4, 0), ([2, 3], 4, 3), (None, 2, 1)]
)
def test_data_parallel_ranks_beside_the_tp_axis_are_refused(
    tp_ranks: list[int] | None, world: int, rank: int
) -> None:
    with pytest.raises(ConfigError, match=r"tp axis\s+must span all of it"):
        plan_ranks(tp_ranks, True, world, rank)


def test_tensor_parallelism_without_a_process_group_is_refused() -> None:
    with pytest.raises(ConfigError, match="torchrun"):
        plan_ranks([0, 1], False, 1, 0)


# --- the backend object around a runner --------------------------------------------------------------


class _Runner:
    """A ModelRunner stand-in: only the loaded model's vocab layers (real torch modules, the
    way SGLang's unsharded VocabParallelEmbedding holds them: padded rows at the end)."""

    def __init__(self, tied: bool) -> None:
        self.model = torch.nn.Module()
        self.model.model = torch.nn.Module()
        self.model.model.embed_tokens = torch.nn.Embedding(128, 8)  # vocab 100, padded to 128
        self.model.lm_head = self.model.model.embed_tokens if tied else torch.nn.Embedding(128, 8)
        self.model.model.norm = RMSNorm(8, 1e-6)
        self.max_total_num_tokens = 16
        self.model_config = type("SGLangModelConfig", (), {"context_len": 6})()


def _target(tied: bool) -> SGLangTarget:
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=8,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return SGLangTarget(_Runner(tied), config, [1, 2, 3])


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_and_lm_head_are_whole_vocab_matrices(tied: bool) -> None:
    target = _target(tied)
    runner = target.runner
    assert target.input_embedding().shape == (100, 8)
    assert torch.equal(target.input_embedding(), runner.model.model.embed_tokens.weight[:100])
    assert torch.equal(target.lm_head_weight(), runner.model.lm_head.weight[:100])
    assert (target.lm_head_weight() is target.input_embedding()) == tied
    assert target.final_norm_weight() is runner.model.model.norm.weight  # draft.init=logit_lens


def test_packed_rows_and_shifted_positions_are_refused() -> None:
    target = _target(tied=True)
    ids_BT, mask_BT = torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ConfigError, match=r"packed rows \(document_ids\)"):
        target.forward(ids_BT, mask_BT, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match="position ids"):
        target.forward(ids_BT, mask_BT, None, torch.tensor([[0, 1, 0, 1]]))


def test_a_batch_larger_than_the_kv_pool_names_the_options() -> None:
    target = _target(tied=True)
    ids_BT, mask_BT = torch.ones(3, 6, dtype=torch.long), torch.ones(3, 6, dtype=torch.bool)
    with pytest.raises(ConfigError, match=r"18 tokens does not fit SGLang's KV pool of 16"):
        target.forward(ids_BT, mask_BT)


def test_a_row_longer_than_sglangs_context_names_the_options() -> None:
    target = _target(tied=True)
    ids_BT, mask_BT = torch.ones(1, 7, dtype=torch.long), torch.ones(1, 7, dtype=torch.bool)
    with pytest.raises(ConfigError, match=r"7 tokens is longer than SGLang's context length 6"):
        target.forward(ids_BT, mask_BT)


def test_padding_only_batches_need_no_sglang_forward() -> None:
    target = _target(tied=True)
    out = target.forward(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool))
    assert out.aux_BTA.shape == (2, 3, 24) and out.final_hidden_BTH.shape == (2, 3, 8)
    assert not out.aux_BTA.any() and not out.final_hidden_BTH.any()
