"""Measure a draft's real acceptance length by speculative decoding with the HF target.

    python -m eagleforge.evaluate +model=smollm2 eval.draft=outputs/runs/RUN/checkpoints/step_00000100
    python -m eagleforge.evaluate +model=smollm2 eval.draft=outputs/runs/RUN/checkpoints \\
        eval.topk=4 eval.total_draft_tokens=16 eval.temperature=0.7
    python -m eagleforge.evaluate +model=qwen2_5_vl eval.draft=DRAFT eval.prompts=/data/vlm.jsonl
    python -m eagleforge.evaluate +model=smollm2 eval.draft=DRAFT eval.prompts=[mtbench,gsm8k]
    python -m eagleforge.evaluate +model=smollm2 eval.draft=DRAFT eval.engine=[hf,vllm] \
        model.dtype=float32 eval.sweep=[1/1/2,3/1/4]

``eval.engine=vllm`` has the real vLLM engine (its own environment, ``make vllm``) serve the
target with the draft, exported to vLLM's format first; ``eval.engine=llamacpp`` has llama.cpp's
``llama-server`` (``make llamacpp``) serve the target's GGUF file with the draft exported as a
GGUF; ``[hf,vllm,llamacpp]`` decodes the same prompts with eagleforge's decoder and with each
engine and puts them in one table (docs/serving.md). The engines are judges (``judges.py``).

A vision-language target (``data.is_vlm``) reads prompts with images (docs/vlm.md) and decodes
with its M-RoPE positions.

Prints a table per draft and prompt set (τ, acceptance by position, tokens/s against the
target alone, the speedup, and whether greedy outputs equal the target's), writes
``summary.json`` and ``outputs.jsonl`` under the run directory, and logs everything, with
plots, to the tracker. Several prompt sets (``eval.prompts=[mtbench,gsm8k,humaneval]``) also
give one table and one plot across them. SIGTERM or Ctrl-C ends an evaluation in one line, its
MLflow run marked KILLED.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from eagleforge.config import (
    EagleForgeConfig,
    check_cli_overrides,
    conf_dir,
    register_configs,
    to_typed,
)
from eagleforge.draft.family import AnyDraft
from eagleforge.errors import (
    ConfigError,
    exit_on_user_error,
    stop_on_signals,
    stopped_in_one_line,
)
from eagleforge.export import export
from eagleforge.families import family_of
from eagleforge.formats.directory import load_checked_draft, read_architecture
from eagleforge.judges import Judge, build_judge
from eagleforge.parallel import resolve_device
from eagleforge.preflight import check_inputs, check_outputs
from eagleforge.progress import Progress, quiet_library_bars
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import (
    DecodeResult,
    SpeculativeDecoder,
    answer_end_ids,
    eos_ids,
)
from eagleforge.speculative.engine_judge import (
    EngineRun,
    run_engine,
    summarise_engine,
)
from eagleforge.speculative.prompts import (
    PromptRenderer,
    PromptSet,
    load_prompt_set,
    load_prompt_sets,
)
from eagleforge.speculative.report import (
    Summary,
    TurnRecord,
    plot_acceptance,
    plot_tau_by_set,
    plot_tau_by_step,
    sets_table,
    summarise,
    table,
    write_outputs,
    write_sets_table,
)
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.registry import build_hf_target
from eagleforge.targets.source import (
    generation_eos_ids,
    load_processor,
    load_tokenizer,
    resolve_model_dir,
)
from eagleforge.tracking import Tracker, TrackerKind, build_tracker, ended_on_error, flatten

log = logging.getLogger("eagleforge.evaluate")

# (prompt set, prompt id, prompt tokens) -> the target alone's decoding and transformers'
# generate's; keyed by the tokens too, since a later turn's prompt holds the earlier answers
Baselines = dict[tuple[str, str, tuple[int, ...]], tuple[DecodeResult, DecodeResult | None]]


def draft_dirs(path: str) -> list[tuple[int, Path]]:
    """(training step or 0, directory) of every draft at ``path``: one draft directory, or
    the step_* checkpoints in it (or in its checkpoints/), oldest first."""
    root = Path(path)
    if (root / "config.json").is_file():
        return [(_step(root), root)]
    found = sorted(root.glob("step_*/config.json")) or sorted(
        root.glob("checkpoints/step_*/config.json")
    )
    if not found:
        raise ConfigError(
            f"eval.draft={path}: no draft there. Give a training checkpoint or an exported "
            "SGLang directory (config.json + model.safetensors), or a directory of step_* "
            "checkpoints."
        )
    return sorted((_step(p.parent), p.parent) for p in found)


def _step(path: Path) -> int:
    match = re.fullmatch(r"step_(\d+)", path.name)
    return int(match.group(1)) if match else 0


def load_draft(path: Path, target: HFTarget, device: torch.device) -> AnyDraft:
    """A draft from its directory (any family, any format), with what it takes of the target;
    ConfigError when it was trained for another target."""
    layers = int(target.config.get_text_config().num_hidden_layers)
    arch, tensors = load_checked_draft(path, layers)
    check_draft_target(path, target, arch.vocab_size, arch.target_hidden_size)
    check_draft_taps(path, target, arch.aux_layer_ids)
    return family_of(arch).load(arch, tensors, target, path, device)


def check_draft_target(path: Path, target: HFTarget, vocab_size: int, hidden_size: int) -> None:
    """ConfigError when the draft at ``path`` was trained for a target of another vocabulary
    or hidden size than ``target``."""
    text = target.config.get_text_config()
    if vocab_size != text.vocab_size or hidden_size != text.hidden_size:
        raise ConfigError(
            f"{path}: this draft was trained for a target with vocab {vocab_size} and hidden "
            f"size {hidden_size}, but +model gives vocab {text.vocab_size} and hidden size "
            f"{text.hidden_size}; choose the draft's target model."
        )


def check_draft_taps(path: Path, target: HFTarget, layer_ids: list[int]) -> None:
    """ConfigError when the draft reads other target layers than the drafts evaluated with it
    (the target captures one set of layers)."""
    if list(layer_ids) != list(target.aux_layer_ids):
        raise ConfigError(
            f"{path}: the draft reads target layers {list(layer_ids)}, the other drafts "
            f"evaluated with it read {list(target.aux_layer_ids)}; evaluate them separately."
        )


def evaluate_draft(
    config: EagleForgeConfig,
    decoder: SpeculativeDecoder,
    renderer: PromptRenderer,
    name: str,
    device: torch.device,
    prompts: PromptSet | None = None,
    label: str | None = None,
    baselines: Baselines | None = None,
) -> tuple[Summary, list[TurnRecord]]:
    """Decode every prompt of ``prompts`` (default: the first set of eval.prompts) with the
    draft and, with eval.baseline, with the target alone (and eval.hf_generate, with
    transformers' generate). ``label`` names the progress bar. ``baselines`` keeps the
    target-alone decodings for the next setting of a greedy sweep: they are the same."""
    cfg = config.eval
    if prompts is None:
        texts = cfg.prompt_sets()
        prompts = load_prompt_set(texts[0], cfg.multi_turn, cfg.max_prompts, config.data.is_vlm)
    tokenizer = renderer.tokenizer
    records: list[TurnRecord] = []
    # a CPU evaluation runs for minutes: show prompts done and the speculative tokens/s
    desc = f"evaluate {label or Path(name).name}"
    # closed however decoding ends: a stopped evaluation's last line is its own message
    with Progress(len(prompts.items), desc, "prompt") as bar:
        new_tokens, seconds = 0, 0.0
        for index, item in enumerate(prompts.items):
            messages: list[dict[str, Any]] = list(item.context)
            for turn in range(len(item.turns)):
                messages.append(item.message(turn))
                prompt_ids, images = renderer(messages, f"{item.where} (turn {turn})")
                seed = config.seed * 100_003 + index * 101 + turn
                generator = torch.Generator(device).manual_seed(seed)
                speculative = decoder.generate(prompt_ids, generator, images)
                key = (prompts.name, item.id, tuple(prompt_ids))
                baseline: DecodeResult | None
                reference: DecodeResult | None
                if baselines is not None and key in baselines:
                    baseline, reference = baselines[key]
                elif cfg.baseline:
                    generator = torch.Generator(device).manual_seed(seed)
                    baseline = decoder.generate_target_only(prompt_ids, generator, images)
                    reference = None
                    if cfg.hf_generate and images is None:
                        reference = decoder.generate_hf(prompt_ids)
                    if baselines is not None:
                        baselines[key] = baseline, reference
                else:
                    baseline = reference = None
                records.append(
                    TurnRecord(item.id, turn, len(prompt_ids), speculative, baseline, reference)
                )
                answer = tokenizer.decode(speculative.output_ids, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": answer})
                new_tokens += len(speculative.output_ids)
                seconds += speculative.seconds
            bar.set_postfix(tok_s=f"{new_tokens / max(seconds, 1e-9):.1f}", refresh=False)
            bar.update()
    greedy = cfg.temperature == 0
    settings = decoder.settings
    summary = summarise(
        name, records, settings.num_draft_tokens, greedy, prompts.name, prompts.source,
        settings.label, str(target_dtype(config)).removeprefix("torch."),
    )  # fmt: skip
    return summary, records


def evaluate_sets(
    config: EagleForgeConfig,
    decoder: SpeculativeDecoder,
    renderer: PromptRenderer,
    draft: Path,
    step: int,
    sets: list[PromptSet],
    device: torch.device,
    tracker: Tracker,
    baselines: Baselines | None = None,
    sweep: bool = False,
) -> list[Summary]:
    """One draft, decoded one way, on every prompt set: a table, files and metrics per set.
    One set writes eval/<draft>/ and logs eval/tau ...; several write eval/<draft>/<set>/ and
    log eval/<set>/tau ...; in a sweep (eval.sweep) both end in the setting, e.g. 3-1-4/."""
    summaries = []
    several = len(sets) > 1
    setting = decoder.settings.label.replace("/", "-")
    for prompt_set in sets:
        parts = [prompt_set.name] * several + [setting] * sweep
        label = " ".join([draft.name, *parts])
        summary, records = evaluate_draft(
            config, decoder, renderer, str(draft), device, prompt_set, label, baselines
        )
        print(table(summary), flush=True)
        if summary.greedy_matches_target is False:
            print(inexact_note(config), flush=True)
        out = Path(config.output_dir, "eval", draft.name, *parts)
        write_outputs(summary, records, out)
        plot_acceptance(summary, out / "acceptance.png")
        scope = "/".join(["eval", *parts])
        metrics = {
            f"{scope}/tau": summary.tau,
            f"{scope}/tokens_per_s": summary.tokens_per_s,
            **{
                f"{scope}/accept_pos_{j + 1}": r
                for j, r in enumerate(summary.acceptance_by_position)
            },
        }
        if summary.speedup is not None:
            metrics[f"{scope}/speedup"] = summary.speedup
        tracker.log_metrics(metrics, step=step)
        tracker.log_artifact(out)  # summary.json, outputs.jsonl, acceptance.png
        summaries.append(summary)
    return summaries


def report_sets(summaries: list[Summary], eval_dir: Path, tracker: Tracker) -> None:
    """The table across prompt sets (printed, summary.csv and summary.md) and τ by set
    (tau_by_set.png), logged as artifacts."""
    print(sets_table(summaries), flush=True)
    for path in write_sets_table(summaries, eval_dir):
        tracker.log_artifact(path)
    tracker.log_artifact(plot_tau_by_set(summaries, eval_dir / "tau_by_set.png"))


def target_dtype(config: EagleForgeConfig) -> torch.dtype:
    """model.dtype resolved for this machine (``auto``: bf16 on CUDA and on a CPU with native
    bf16, else fp32: eagleforge.precision)."""
    return config.model.dtype.torch_dtype(resolve_device(config.parallel))


def inexact_note(config: EagleForgeConfig) -> str:
    """Why greedy speculative outputs may differ from the target alone's (only in bf16/fp16)."""
    dtype = target_dtype(config)
    if dtype == torch.float32:
        return (
            "greedy outputs differ from the target alone's in float32, where they must not: "
            "outputs.jsonl holds both; please report it."
        )
    name = str(dtype).removeprefix("torch.")
    return (
        f"greedy outputs differ from the target alone's in {name}, as expected: a forward over "
        "several tokens rounds differently from one-token steps, so near-tied greedy choices "
        "part ways (docs/quality.md#lossless-in-bf16); model.dtype=float32 decodes exactly."
    )


def export_for_engine(judge: Judge, draft: Path, out: Path) -> Path:
    """The draft in the judge's format, written, read back and checked."""
    if out.exists():  # an earlier evaluation into this run directory
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return export(judge.export_config(draft, out))


def evaluate_with_engine(
    judge: Judge,
    config: EagleForgeConfig,
    drafts: list[tuple[int, Path]],
    settings: list[DecodeSettings],
    sets: list[PromptSet],
    renderer: PromptRenderer,
    eos: set[int],
    tracker: Tracker,
) -> list[Summary]:
    """Every draft and chain setting served by the judge's engine, against the engine serving
    the target alone (decoded once per prompt set, before the drafts: the same for every
    setting)."""
    ecfg, output_dir = config.eval, Path(config.output_dir)
    logs = output_dir / judge.name
    # baselines are greedy-only reusable; sampled ones still show the target-alone speed
    reference = settings[0]
    baselines: dict[str, EngineRun] = {}
    summaries: list[Summary] = []
    with stop_on_signals():
        if ecfg.baseline:
            name = f"{judge.title} (target alone)"
            with judge.server(logs / "target.log", name) as server:
                for prompt_set in sets:
                    baselines[prompt_set.name] = run_engine(
                        server.client(), prompt_set, renderer, reference, eos,
                        ecfg.engine_batch, speculative=False,
                    )  # fmt: skip
        for step, path in drafts:
            exported = export_for_engine(judge, path, logs / "drafts" / path.name)
            for setting in settings:
                label = setting.label.replace("/", "-")
                with judge.server(
                    logs / f"{path.name}-{label}.log", f"{judge.title} ({path.name}, {setting.label})",
                    draft=exported, setting=setting,
                ) as server:  # fmt: skip
                    for prompt_set in sets:
                        run = run_engine(
                            server.client(), prompt_set, renderer, setting, eos,
                            ecfg.engine_batch, speculative=True,
                        )  # fmt: skip
                        summary = summarise_engine(
                            str(path), prompt_set, setting, run,
                            baselines.get(prompt_set.name), ecfg.engine_batch, judge.dtype,
                            engine=judge.name,
                        )  # fmt: skip
                        report_engine_summary(summary, output_dir, step, tracker, len(sets) > 1)
                        summaries.append(summary)
    return summaries


def report_engine_summary(
    summary: Summary, output_dir: Path, step: int, tracker: Tracker, several_sets: bool
) -> None:
    """The table of one engine's measurement, its summary.json under
    eval/<draft>/<engine>/<setting>/(<set>/), and its metrics eval/<engine>/[<set>/]<setting>/..."""
    print(table(summary), flush=True)
    setting = summary.setting.replace("/", "-")
    parts = [summary.prompt_set] * several_sets + [setting]
    out = Path(output_dir, "eval", Path(summary.draft).name, summary.engine, *parts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    plot_acceptance(summary, out / "acceptance.png")
    scope = "/".join(["eval", summary.engine, *parts])
    metrics = {
        f"{scope}/tau": summary.tau,
        f"{scope}/tokens_per_s": summary.tokens_per_s,
        **{f"{scope}/accept_pos_{j + 1}": r for j, r in enumerate(summary.acceptance_by_position)},
    }
    for name, value in (("speedup", summary.speedup), ("batch_speedup", summary.batch_speedup)):
        if value is not None:
            metrics[f"{scope}/{name}"] = value
    tracker.log_metrics(metrics, step=step)
    tracker.log_artifact(out)


def run(cfg: DictConfig) -> list[Summary]:
    config = to_typed(cfg)
    if not config.eval.draft:
        raise ConfigError("eval.draft is not set: give a checkpoint or draft directory.")
    device = resolve_device(config.parallel)
    torch.manual_seed(config.seed)
    drafts = draft_dirs(config.eval.draft)
    check_inputs(config, data=False, prompts=True, tracking=True)
    check_outputs(config, {"output_dir": config.output_dir}, output_root=True, tracking=True)
    ecfg = config.eval
    engines = ecfg.engines()
    settings = ecfg.decode_settings()
    # each engine's server is found before any model loads: a missing one costs a line
    judges = [build_judge(name, config) for name in engines if name != "hf"]
    engine_settings = {judge.name: judge.runnable(settings) for judge in judges}
    # every prompt set is read before the model loads: a set the hub cannot give costs a line
    sets = load_prompt_sets(
        ecfg.prompt_sets(), ecfg.multi_turn, ecfg.max_prompts, config.data.is_vlm
    )
    arch = read_architecture(drafts[0][1])
    taps = arch.aux_layer_ids
    model_dir = resolve_model_dir(config.model, config.resolved_cache_dir())
    data = config.data
    if data.is_vlm:  # prompts with images, rendered and processed as training does
        processor = load_processor(config.model, model_dir, data.min_pixels, data.max_pixels)
        renderer = PromptRenderer(None, processor, data.min_pixels, data.max_pixels)
    else:
        renderer = PromptRenderer(load_tokenizer(config.model, model_dir))
    output_dir = Path(config.output_dir)
    tracker = build_tracker(
        config.tracker,
        config.output_root,
        run_name=f"eval-{output_dir.name}",
        output_dir=output_dir,
    )
    with ended_on_error(tracker):  # Ctrl-C, SIGTERM, a failure: the run is not left RUNNING
        container = OmegaConf.to_container(cfg, resolve=True)
        tracker.log_config(flatten(container), OmegaConf.to_yaml(cfg))  # type: ignore[arg-type]
        summaries: list[Summary] = []
        tau_by_step: dict[str, list[tuple[int, float]]] = {}
        sweep = len(settings) > 1
        if "hf" in engines:
            target = build_hf_target(
                config.model, config.target, model_dir, device, aux_layer_ids=taps
            )
            eos = eos_ids(renderer.tokenizer, target)
            # greedy decoding by the target alone is the same for every setting: decoded once
            baselines: Baselines | None = {} if ecfg.temperature == 0 else None
            for step, path in drafts:
                draft = load_draft(path, target, device)
                family = family_of(draft.arch)
                for setting in settings:
                    decoder = family.decoder(target, draft, setting, eos)
                    for summary in evaluate_sets(
                        config, decoder, renderer, path, step, sets, device, tracker, baselines,
                        sweep,
                    ):  # fmt: skip
                        series = summary.prompt_set
                        if sweep:
                            series += f" {summary.setting}"
                        tau_by_step.setdefault(series, []).append((step, summary.tau))
                        summaries.append(summary)
            del target, draft  # the HF target's memory is free before the engines start
        else:
            # the same ids eos_ids reads from a loaded model, from its generation_config.json
            generated = generation_eos_ids(model_dir, config.model.revision)
            eos = answer_end_ids(renderer.tokenizer, generated)
        for judge in judges:
            summaries += evaluate_with_engine(
                judge, config, drafts, engine_settings[judge.name], sets, renderer, eos, tracker
            )
        eval_dir = output_dir / "eval"
        if len(drafts) > 1 and "hf" in engines:
            tracker.log_artifact(plot_tau_by_step(tau_by_step, eval_dir / "tau_by_step.png"))
        if len(sets) > 1 or sweep or len(engines) > 1:
            # one row per draft, set and setting, the engines of each side by side
            order = {name: i for i, name in enumerate(engines)}
            summaries.sort(key=lambda s: (s.draft, s.prompt_set, s.setting, order[s.engine]))
            report_sets(summaries, eval_dir, tracker)
        tracker.close()
    log.info("evaluation written to %s", eval_dir)
    return summaries


def stop_line(cfg: DictConfig, how: str) -> str:
    """What a stopped evaluation prints: that it did not finish, where its MLflow run and its
    finished results are, and what to run to go on (evaluate does not resume: it starts over)."""
    kind = OmegaConf.select(cfg, "tracker.kind", default=None)
    mlflow = getattr(kind, "value", kind) == TrackerKind.mlflow.value
    marked = "; its MLflow run is marked KILLED" if mlflow else ""
    return (
        f"{how}: the evaluation stopped before its end{marked}, and what it finished is in "
        f"{OmegaConf.select(cfg, 'output_dir', default='its run directory')}/eval; run the same "
        "command again to evaluate from the start."
    )


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
@exit_on_user_error
def _hydra_main(cfg: DictConfig) -> None:
    """One evaluation; SIGTERM (SLURM's preemption, scancel), SIGHUP or Ctrl-C -- during its
    last MLflow write too -- ends it in one line, its MLflow run marked KILLED, with status
    128 + the signal."""
    with stopped_in_one_line(functools.partial(stop_line, cfg)):
        run(cfg)


def main() -> None:
    quiet_library_bars()
    register_configs()
    check_cli_overrides()
    _hydra_main()


if __name__ == "__main__":
    main()
