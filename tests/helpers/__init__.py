"""Helpers the test tiers share, imported as ``from helpers.<module> import ...``
(``pythonpath = ["tests"]`` in pyproject puts them on the path):

- ``helpers.runs``: the Hydra overrides of a tiny training run (``tiny_run_overrides``, extras
  replace defaults by key), the FSDP and sequence-parallel variants, ``train_on_rank``,
  ``prepare_store`` and the checkpoint-weight comparisons.
- ``helpers.vlm``: the tiny Qwen2.5-VL's data file with generated images and its run overrides.
- ``helpers.ranks``: ``run_ranks`` spawns N gloo ranks with torchrun's environment;
  ``free_port``.
- ``helpers.drafts``: a tiny hand-sized draft with random batches, and a random draft for a
  real target.
- ``helpers.targets``: a small-vocabulary random Llama target.
- ``helpers.masks``: the supervised spans and runs the loss-mask tests compare.
- ``helpers.engine``: the engine tier's small vLLM settings, and what its tests of trained
  drafts share (the target's own answers as data, the fp32 evaluation on those prompts, a
  draft directory with its config.json edited).
- ``helpers.processes``: a pid that has exited, and the processes below a pid.
- ``helpers.slurm``: ``Cluster``, the SLURM cluster the slurm tier found or started.
"""
