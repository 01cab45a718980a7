"""Look at the training data exactly as the draft will see it.

    python -m eagleforge.inspect_data +model=smollm2 data=chitchat inspect.num_samples=3

Prints the preprocessing counts (rows, kept, skipped by reason, tokens, supervised tokens), a
histogram of sample lengths, and renders samples with the supervised tokens marked. Bad input
under ``data.on_error=raise`` exits with status 2 and the named error.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from eagleforge.config import conf_dir, register_configs, to_typed
from eagleforge.data.dataset import build_datasets
from eagleforge.data.inspection import (
    ANSI_RESET,
    ANSI_SUPERVISED,
    PLAIN_CLOSE,
    PLAIN_OPEN,
    marked_sample,
    report_lines,
)
from eagleforge.errors import exit_on_user_error
from eagleforge.target.source import load_tokenizer, resolve_model_dir


def inspect(cfg: DictConfig) -> None:
    config = to_typed(cfg)
    cache_dir = config.resolved_cache_dir()
    tokenizer = load_tokenizer(config.model, resolve_model_dir(config.model, cache_dir))
    data = build_datasets(config.data, tokenizer, cache_dir, config.seed)
    color = config.inspect.color if config.inspect.color is not None else sys.stdout.isatty()
    print(f"data={config.data.name} template={config.data.template} model={config.model.name}")
    print("\n".join(report_lines(data.report, data.train, config.inspect.num_buckets)))
    legend = (
        f"{ANSI_SUPERVISED}supervised{ANSI_RESET}"
        if color
        else f"{PLAIN_OPEN}supervised{PLAIN_CLOSE}"
    )
    for index in range(min(config.inspect.num_samples, len(data.train))):
        ids, mask = data.train[index]
        print(f"\n--- sample {index}: {len(ids)} tokens, {sum(mask)} supervised ({legend}) ---")
        print(marked_sample(ids, mask, tokenizer, color))


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="no_run_dir")
@exit_on_user_error
def _hydra_main(cfg: DictConfig) -> None:
    inspect(cfg)


def main() -> None:
    register_configs()
    _hydra_main()


if __name__ == "__main__":
    main()
