"""eagleforge's drafts in the real vLLM engine on this CPU: a checkpoint served as it is taps
the layers it was trained on, vLLM's counters are read, regenerate writes rows through the
engine, and `evaluate eval.engine=[hf,vllm]` decodes losslessly in fp32 in both engines."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.engine.server import VLLMServer
from eagleforge.formats.directory import read_architecture
from helpers.engine import ENGINE, ENGINE_OVERRIDES
from helpers.runs import weights

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def served_checkpoint(
    engine_env: Path,
    smollm2_dir: Path,
    smollm2_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VLLMServer]:
    """vLLM serving SmolLM2 with the checkpoint directory itself as its EAGLE-3 draft."""
    log = tmp_path_factory.mktemp("engine") / "vllm.log"
    spec = {"method": "eagle3", "model": str(smollm2_checkpoint), "num_speculative_tokens": 3}
    with VLLMServer(ENGINE, smollm2_dir, log, "float32", speculative=spec) as server:
        yield server


def test_a_checkpoint_served_as_it_is_taps_its_trained_layers(
    served_checkpoint: VLLMServer, smollm2_checkpoint: Path
) -> None:
    """vLLM numbers aux layers by their input: it must log eagleforge's ids + 1."""
    trained = read_architecture(smollm2_checkpoint).aux_layer_ids
    logged = re.findall(
        r"Using auxiliary layers from speculative config: \(([\d, ]+)\)",
        served_checkpoint.log_path.read_text(),
    )
    assert logged, "vLLM did not log the layers it taps"
    assert [int(i) for i in logged[-1].split(",")] == [i + 1 for i in trained]


def test_the_engines_counters_are_read(served_checkpoint: VLLMServer, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    client = served_checkpoint.client()
    before = client.spec_counters()
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True
    )
    done = client.complete(list(prompt), max_tokens=16)
    after = client.spec_counters() - before
    assert 1 <= len(done.token_ids) <= 16
    assert after.drafts >= 1 and after.draft_tokens == 3 * after.drafts
    assert len(after.accepted_per_position) == 3
    assert 1.0 <= after.mean_acceptance_length <= 4.0


def test_regenerate_writes_rows_through_the_engine(
    served_checkpoint: VLLMServer, tmp_path: Path
) -> None:
    from eagleforge.regenerate import run

    fixture = Path(__file__).parents[1] / "fixtures" / "openai_small.jsonl"
    output = tmp_path / "regen.jsonl"
    config = to_typed(compose_config([
        "+model=smollm2", "data=jsonl", f"data.path={fixture}", "regenerate.backend=vllm",
        f"vllm.url={served_checkpoint.url}", f"regenerate.output={output}",
        "regenerate.max_rows=3", "regenerate.max_new_tokens=16", f"output_dir={tmp_path}",
    ]))  # fmt: skip
    summary = run(config)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert summary.written == 3 and summary.failed == 0 and len(rows) == 3
    assert all(
        r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in rows
    )
    settings = json.loads(output.with_name("regen.jsonl.settings.json").read_text())
    assert settings["backend"] == "vllm" and settings["model"] == "vllm:target"


def test_evaluate_judges_the_draft_in_both_engines_losslessly(
    engine_env: Path, smollm2_checkpoint: Path, tmp_path: Path
) -> None:
    """One evaluation, both engines: vLLM serves the exported draft (fp32) and its greedy
    outputs equal its own without speculation, one at a time and batched."""
    from eagleforge.evaluate import run

    summaries = run(compose_config([
        "+model=smollm2", "model.dtype=float32", f"eval.draft={smollm2_checkpoint}",
        "eval.engine=[hf,vllm]", "eval.prompts=mtbench_style", "eval.max_prompts=3",
        "eval.max_new_tokens=24", "eval.num_draft_tokens=3", "eval.engine_batch=3",
        "tracker=console", f"output_root={tmp_path}", f"output_dir={tmp_path / 'eval'}",
        *ENGINE_OVERRIDES,
    ]))  # fmt: skip
    assert [s.engine for s in summaries] == ["hf", "vllm"]
    hf, vllm = summaries
    assert hf.greedy_matches_target is True and vllm.greedy_matches_target is True
    assert vllm.batch_outputs_equal == 3 and vllm.batch_size == 3
    assert vllm.rounds > 0 and len(vllm.acceptance_by_position) == 3
    assert vllm.speedup is not None and vllm.batch_speedup is not None
    table = (tmp_path / "eval" / "eval" / "summary.md").read_text()
    assert "| hf " in table and "| vllm " in table
    exported = tmp_path / "eval" / "vllm" / "drafts" / smollm2_checkpoint.name
    assert json.loads((exported / "config.json").read_text())["architectures"] == [
        "Eagle3LlamaForCausalLM"
    ]
    log = (tmp_path / "eval" / "vllm" / f"{smollm2_checkpoint.name}-3-1-4.log").read_text()
    trained = read_architecture(smollm2_checkpoint).aux_layer_ids
    assert f"Using auxiliary layers from speculative config: {tuple(i + 1 for i in trained)}" in log


@pytest.mark.parametrize(
    "switches",
    [
        pytest.param(
            {"fc_norm": True, "norm_output": True, "norm_before_residual": True},
            id="fc_norm",
            marks=pytest.mark.slow,
        ),
        pytest.param({"norm_before_fc": True}, id="norm_before_fc", marks=pytest.mark.slow),
    ],
)
def test_an_eagle31_draft_decodes_in_vllm_as_in_our_decoder(
    engine_env: Path, smollm2_dir: Path, tmp_path: Path, switches: dict[str, bool]
) -> None:
    """An EAGLE-3.1 draft (its norms with random weights, over the target's logit lens, so
    that proposals are accepted) is served by vLLM losslessly in fp32, and vLLM accepts at
    every position what eagleforge's decoder accepts: an engine that skipped or misplaced a
    norm would propose other tokens."""
    from eagleforge.evaluate import run
    from eagleforge.formats.eagle3 import export_sglang
    from eagleforge.targets.config import TargetConfig
    from eagleforge.targets.hf import HFTarget
    from helpers.drafts import lens_draft

    target = HFTarget.from_pretrained(
        smollm2_dir, TargetConfig(), torch.float32, torch.device("cpu")
    )
    draft = lens_draft(target, 8192, seed=0, **switches)
    path = export_sglang(draft, tmp_path / "step_00000000")
    summaries = run(compose_config([
        "+model=smollm2", "model.dtype=float32", f"eval.draft={path}", "eval.engine=[hf,vllm]",
        "eval.prompts=mtbench_style", "eval.max_prompts=3", "eval.max_new_tokens=32",
        "eval.num_draft_tokens=3", "eval.engine_batch=1", "tracker=console",
        f"output_root={tmp_path}", f"output_dir={tmp_path / 'eval'}", *ENGINE_OVERRIDES,
    ]))  # fmt: skip
    hf, vllm = summaries
    assert hf.greedy_matches_target is True and vllm.greedy_matches_target is True
    assert hf.acceptance_by_position[0] > 0, "the lens draft must have proposals accepted"
    assert vllm.acceptance_by_position == pytest.approx(hf.acceptance_by_position, abs=0.02)
    exported = json.loads(
        (tmp_path / "eval" / "vllm" / "drafts" / path.name / "config.json").read_text()
    )
    assert all(exported[k] is v for k, v in switches.items())


def test_capture_through_vllm_matches_the_hf_capture(engine_env: Path, tmp_path: Path) -> None:
    """`prepare` with target=vllm writes the store target=hf writes: the same samples, aux and
    final states within 1e-4 relative in fp32; a few offline steps on each lose within 1%."""
    from eagleforge.data.features import FeatureDataset
    from helpers.runs import prepare_store, tiny_run_overrides, train_on_rank

    data = ("+model=smollm2", "model.dtype=float32", "data=chitchat", "data.max_num_samples=24",
            "data.num_eval_samples=2", "data.max_length=96", "prepare.samples_per_shard=8",
            "prepare.batch_size=8")  # fmt: skip
    stores = {
        backend: prepare_store(tmp_path / backend, *data, f"target={backend}", *ENGINE_OVERRIDES)
        for backend in ("hf", "vllm")
    }
    assert (tmp_path / "vllm" / "features" / "vllm.log").is_file()  # the engine logged there
    hf, vllm = (FeatureDataset(stores[b] / "train") for b in ("hf", "vllm"))
    assert len(hf) == len(vllm) > 0
    manifests = [
        json.loads((stores[b] / "train" / "manifest.json").read_text()) for b in ("hf", "vllm")
    ]
    # the same data, target, layers and dtype; only the record of who captured it differs
    assert [m.pop("captured_by") for m in manifests] == ["hf", "vllm"]
    assert {k: v for k, v in manifests[0].items() if k != "sha256"} == {
        k: v for k, v in manifests[1].items() if k != "sha256"
    }
    for i in range(len(hf)):
        (ids, mask, aux, final), (ids_v, mask_v, aux_v, final_v) = hf[i], vllm[i]
        assert (ids, mask) == (ids_v, mask_v)
        for ours, theirs in ((aux, aux_v), (final, final_v)):
            relative = (ours - theirs).norm(dim=-1) / ours.norm(dim=-1)
            assert float(relative.max()) < 1e-4
    runs = {
        backend: train_on_rank(0, tiny_run_overrides(
            tmp_path / f"train-{backend}", *data, f"data.features={stores[backend]}",
            "trainer.max_num_steps=3", "draft.ttt_length=2",
        ))
        for backend in ("hf", "vllm")
    }  # fmt: skip
    losses = {backend: run[0] for backend, run in runs.items()}
    # the same vocabulary map from either store
    maps = [weights(runs[b][2]) for b in ("hf", "vllm")]
    assert torch.equal(maps[0]["d2t"], maps[1]["d2t"]) and torch.equal(
        maps[0]["t2d"], maps[1]["t2d"]
    )
    # fp32 states within 5.3e-6 relative of each other move a 3-step loss by far less than
    # 1e-3: a capture that misplaced a layer, a position or the final norm moves it by 10-100%
    assert losses["vllm"] == pytest.approx(losses["hf"], rel=1e-3)


def test_training_streams_from_engines_one_of_which_is_killed_and_resumes(
    engine_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """target=vllm online streams from two engines (docs/streaming.md). Engine 1 is killed
    (SIGKILL, its process group) at its 3rd capture: its prompts go to engine 0, the run goes
    on while engine 1 is started again, and every sample is captured once (producers.json). The 4 steps' losses are within
    1% of the hf target's on the same rows; a run resumed from step 2 on one engine goes on
    from the data position with steps 3-4 within 1e-3 (vLLM batches concurrent prompts as they
    come, so captures agree in fp32 to rounding, not bit for bit); no engine process is left."""
    import os
    import signal
    from collections import Counter
    from concurrent.futures import Future

    from eagleforge.targets.vllm import StartedEngine, VLLMTarget
    from helpers.runs import start_from, tiny_run_overrides, train_on_rank

    data = ("+model=smollm2", "model.dtype=float32", "data=chitchat", "data.max_num_samples=24",
            "data.num_eval_samples=2", "data.max_length=96", "data.packing=false",
            "trainer.max_num_steps=4", "draft.ttt_length=2", "trainer.eval_at_start=false",
            "trainer.batch_size=4", "trainer.save_every_n_steps=2")  # fmt: skip
    capture, calls = StartedEngine.capture, {"engine 1": 0}
    delivered: list[tuple[int, ...]] = []  # the prompts whose states came back

    def killing(self: StartedEngine, ids: list[int]) -> torch.Tensor:
        if self.name in calls:
            calls[self.name] += 1
            if calls[self.name] == 3 and self.server.proc is not None:
                os.killpg(self.server.proc.pid, signal.SIGKILL)
        states = capture(self, ids)
        delivered.append(tuple(ids))
        return states

    submit, asked = VLLMTarget.submit, []  # the prompts the run's batches asked for

    def asking(self: VLLMTarget, ids: list[int]) -> Future[tuple[torch.Tensor, torch.Tensor]]:
        asked.append(tuple(ids))
        return submit(self, ids)

    monkeypatch.setattr(StartedEngine, "capture", killing)
    monkeypatch.setattr(VLLMTarget, "submit", asking)
    runs = {name: tmp_path / name for name in ("hf", "vllm", "resumed")}
    hf = train_on_rank(0, tiny_run_overrides(runs["hf"], *data, "target=hf"))[0]
    vllm = train_on_rank(0, tiny_run_overrides(
        runs["vllm"], *data, "target=vllm", *ENGINE_OVERRIDES, "target.producers.engines=2"
    ))[0]  # fmt: skip
    assert vllm == pytest.approx(hf, rel=0.01) and len(vllm) == 4
    [part] = json.loads((runs["vllm"] / "run" / "producers.json").read_text())
    producers = {p["name"]: p for p in part["producers"]}
    # engine 1 stopped with prompts in flight, which engine 0 took; it was being started again
    # (or was back) when the run ended
    assert producers["engine 1"]["handed_on"] >= 1 and producers["engine 1"]["given_up"] is None
    # each prompt of the 4 steps and the final eval captured once, and recorded
    assert Counter(delivered) == Counter(asked) and len(asked) >= 4 * 3
    assert sum(p["samples"] for p in producers.values()) == len(delivered)
    start_from(runs["vllm"] / "run" / "checkpoints" / "step_00000002", runs["resumed"] / "run")
    monkeypatch.setattr(StartedEngine, "capture", capture)
    resumed = train_on_rank(
        0, tiny_run_overrides(runs["resumed"], *data, "target=vllm", *ENGINE_OVERRIDES)
    )[0]
    assert resumed == pytest.approx(vllm[2:], rel=1e-3)
    logs = [runs["vllm"] / "run" / "vllm.log", runs["vllm"] / "run" / "vllm-1.log",
            runs["resumed"] / "run" / "vllm.log"]  # fmt: skip
    assert "extract_hidden_states" in logs[0].read_text()
    ports = [port for log in logs for port in re.findall(r"--port (\d+)", log.read_text())]
    assert len(ports) == 4  # engine 1 started twice (stopped by the run's end, or back)
    assert (
        not [  # no process of those engines is left
            proc
            for proc in Path("/proc").glob("[0-9]*/cmdline")
            for port in ports
            if f"--port\0{port}\0".encode() in _read(proc)
        ]
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a process that ended meanwhile
        return b""


@pytest.mark.slow
def test_capture_through_vllm_in_bf16_is_within_bf16_rounding(
    engine_env: Path, tmp_path: Path
) -> None:
    """In bf16 (`make quality`'s capture) the two captures differ by rounding: vLLM's bf16
    states are no farther from transformers' bf16 states than those are from transformers'
    fp32 states (the rounding that bf16 itself costs), position by position, aux and final
    alike; and 3 offline steps on vLLM's bf16 store lose no farther from the steps on
    transformers' bf16 store than those are from the steps on its fp32 store. (vLLM's bf16
    kernels -- oneDNN matmuls, its own attention and RMSNorm -- round in another order than
    transformers' eager bf16, so the two bf16 stores are not bitwise equal; in fp32 they agree
    within 5.3e-6, see test_capture_through_vllm_matches_the_hf_capture.)"""
    from eagleforge.data.features import FeatureDataset
    from helpers.runs import prepare_store, tiny_run_overrides, train_on_rank

    data = ("+model=smollm2", "data=chitchat", "data.max_num_samples=24", "data.num_eval_samples=2",
            "data.max_length=96", "prepare.samples_per_shard=8", "prepare.batch_size=8")  # fmt: skip
    runs = {"hf32": ("target=hf", "model.dtype=float32"), "hf16": ("target=hf", "model.dtype=bfloat16"),
            "vllm16": ("target=vllm", "model.dtype=bfloat16", *ENGINE_OVERRIDES)}  # fmt: skip
    paths = {name: prepare_store(tmp_path / name, *data, *extra) for name, extra in runs.items()}
    stores = {name: FeatureDataset(path / "train") for name, path in paths.items()}
    assert len(stores["hf32"]) == len(stores["hf16"]) == len(stores["vllm16"]) > 0
    for i in range(len(stores["hf32"])):
        ref, hf, vllm = (stores[name][i] for name in ("hf32", "hf16", "vllm16"))
        assert ref[0] == hf[0] == vllm[0]  # the same tokens
        for k in (2, 3):  # aux, final
            exact = ref[k].float()
            bf16_cost = (hf[k].float() - exact).norm(dim=-1) / exact.norm(dim=-1)
            between = (vllm[k].float() - hf[k].float()).norm(dim=-1) / exact.norm(dim=-1)
            assert float(between.mean()) <= 2 * float(bf16_cost.mean()) + 1e-3
            assert float(between.max()) <= 2 * float(bf16_cost.max()) + 1e-3
    losses = {
        name: train_on_rank(0, tiny_run_overrides(
            tmp_path / f"train-{name}", *data, *extra[1:2], f"data.features={paths[name]}",
            "trainer.max_num_steps=3", "draft.ttt_length=2",
        ))[0]
        for name, extra in runs.items()
    }  # fmt: skip
    for step, (ref, hf, vllm) in enumerate(zip(*losses.values(), strict=True)):
        # a loss averages the rounding of thousands of positions: 2e-3 relative is bf16's
        # one-value rounding (8 bits of mantissa), the floor where the two fp32-bf16 gaps
        # happen to be smaller
        assert abs(vllm - hf) <= 2 * abs(hf - ref) + 2e-3 * abs(hf), (step, losses)
