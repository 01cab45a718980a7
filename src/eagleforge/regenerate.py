"""Rewrite a data set's assistant turns with the target model itself.

    python -m eagleforge.regenerate +model=llama3 data=sharegpt data.path=in.jsonl \
        regenerate.output=regen.jsonl regenerate.base_urls=[http://127.0.0.1:30000/v1]
    python -m eagleforge.regenerate +model=smollm2 data=chitchat regenerate.backend=hf \
        regenerate.output=regen.jsonl

Resumable: the same command after a kill continues where it stopped, under any
``regenerate.chunk_rows``; a change to the data, model or sampling is refused (see
``eagleforge.data.regenerate``).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from eagleforge.config import conf_dir, register_configs, to_typed
from eagleforge.data.regenerate import Backend, run
from eagleforge.errors import exit_on_user_error
from eagleforge.preflight import check_inputs


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="no_run_dir")
@exit_on_user_error
def _hydra_main(cfg: DictConfig) -> None:
    config = to_typed(cfg)
    # the server backend only talks to a server; the hf backend loads the target here; with
    # Magpie the target writes the prompts, and no data is read
    regen = config.regenerate
    check_inputs(config, model=regen.backend == Backend.hf, data=not regen.magpie.num_prompts)
    summary = run(config)
    print(
        f"{summary.written} conversations written to {config.regenerate.output} "
        f"({summary.rows_per_s:.2f} conversations/s; {summary.failed} failed, "
        f"{summary.skipped} source rows unreadable)",
        flush=True,
    )
    if summary.failed and not summary.written:
        sys.exit(1)


def main() -> None:
    register_configs()
    _hydra_main()


if __name__ == "__main__":
    main()
