"""Look at the training data exactly as the draft will see it.

    python -m eagleforge.inspect_data +model=smollm2 data=chitchat inspect.num_samples=3

Prints the preprocessing counts (rows, kept, skipped by reason, tokens, supervised tokens), a
histogram of sample lengths, and renders samples with the supervised tokens marked: every
conversation of the source (none is held out for eval; ``data.eval_path`` gets its counts).
Bad input under ``data.on_error=raise`` exits with status 2 and the named error.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from eagleforge.config import check_cli_overrides, conf_dir, register_configs, to_typed
from eagleforge.data.conversations import DataFormat
from eagleforge.data.inspection import (
    ANSI_RESET,
    ANSI_SUPERVISED,
    PLAIN_CLOSE,
    PLAIN_OPEN,
    marked_sample,
    report_lines,
)
from eagleforge.data.preprocess import preprocess_source
from eagleforge.errors import exit_on_user_error
from eagleforge.preflight import check_inputs, check_outputs
from eagleforge.targets.source import load_tokenizer, resolve_model_dir


def inspect(cfg: DictConfig) -> None:
    config = to_typed(cfg)
    check_inputs(config, need_weights=False)
    check_outputs(config)  # the cache: the tokenized data is kept there
    cache_dir = config.resolved_cache_dir()
    tokenizer = load_tokenizer(config.model, resolve_model_dir(config.model, cache_dir))
    data = config.data
    # every conversation of the source: nothing is held out for eval here
    dataset, report, _ = preprocess_source(
        data, data.format, data.sources(), tokenizer, cache_dir, data.max_num_samples
    )
    color = config.inspect.color if config.inspect.color is not None else sys.stdout.isatty()
    print(f"data={data.name} template={data.template} model={config.model.name}")
    print("\n".join(report_lines(report, dataset, config.inspect.num_buckets)))
    if data.eval_path:
        _, eval_report, _ = preprocess_source(
            data, DataFormat.auto, [data.eval_path], tokenizer, cache_dir, None
        )
        print(f"eval_path {data.eval_path}: {eval_report.summary()}")
    legend = (
        f"{ANSI_SUPERVISED}supervised{ANSI_RESET}"
        if color
        else f"{PLAIN_OPEN}supervised{PLAIN_CLOSE}"
    )
    for index in range(min(config.inspect.num_samples, len(dataset))):
        ids, mask = dataset[index]
        print(f"\n--- sample {index}: {len(ids)} tokens, {sum(mask)} supervised ({legend}) ---")
        print(marked_sample(ids, mask, tokenizer, color))


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="no_run_dir")
@exit_on_user_error
def _hydra_main(cfg: DictConfig) -> None:
    inspect(cfg)


def main() -> None:
    register_configs()
    check_cli_overrides()
    _hydra_main()


if __name__ == "__main__":
    main()
