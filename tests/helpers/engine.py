"""The engine tier's vLLM settings: small and quick to start -- eager (no torch.compile
warm-up, ~35 s instead of ~70-135 s on 2 cores), 1 GiB of KV cache, 1,024-token sequences.

And what the tests of trained drafts served by vLLM share: ``the_targets_answers`` (data a
draft learns its target from in a minute), ``evaluate_on_smollm2`` (the evaluation of a draft
on the first of those prompts, in fp32, in the engines named) and ``edited_copy`` (a draft
directory with its config.json changed, for the negative controls, and ``shift_taps`` /
``shift_dflash_taps``, the edits that move an EAGLE-3 or DFlash checkpoint's taps one layer
up).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagleforge.config import compose_config
from eagleforge.engine.config import VLLMConfig

ENGINE = VLLMConfig(enforce_eager=True, kv_cache_space_gib=1.0, max_model_len=1024)
ENGINE_OVERRIDES = [
    "vllm.enforce_eager=true",
    "vllm.kv_cache_space_gib=1",
    "vllm.max_model_len=1024",
]

PROMPTS = "mtbench_style"
NUM_PROMPTS = 6


def evaluate_on_smollm2(draft: Path, out: Path, engines: str, *extra: str) -> list:  # type: ignore[type-arg]
    """The draft at ``draft`` evaluated in ``engines`` (``[hf,vllm]``) on the first prompts,
    fp32, chains of 3, one request at a time; the summaries, hf's first."""
    from eagleforge.evaluate import run

    return run(compose_config([
        "+model=smollm2", "model.dtype=float32", f"eval.draft={draft}", f"eval.engine={engines}",
        f"eval.prompts={PROMPTS}", f"eval.max_prompts={NUM_PROMPTS}", "eval.max_new_tokens=48",
        "eval.num_draft_tokens=3", "eval.engine_batch=1", "tracker=console",
        f"output_root={out}", f"output_dir={out / 'eval'}", *ENGINE_OVERRIDES, *extra,
    ]))  # fmt: skip


def the_targets_answers(smollm2_dir: Path, path: Path) -> Path:
    """The target's own greedy answers (fp32, 64 tokens) to the first prompts it will be
    served on, as chat data: what a draft that has learned its target proposes, learned in a
    minute instead of the hours real data needs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagleforge.speculative.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    rows = []
    for prompt in load_prompts(PROMPTS, multi_turn=False, limit=NUM_PROMPTS):
        messages = [{"role": "user", "content": prompt.turns[0]}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, do_sample=False)
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        rows.append({"messages": [*messages, {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def edited_copy(draft: Path, root: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the draft directory under ``root`` (same name) with ``edit`` applied to its
    config.json; the training checkpoint's digests are dropped, as they no longer hold."""
    copy = root / draft.name
    shutil.copytree(draft, copy)
    (copy / "checksums.json").unlink(missing_ok=True)
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def shift_taps(config: dict[str, Any]) -> None:
    """An EAGLE-3 checkpoint's config.json told to tap the layers one above, in both numberings
    it states (SGLang's in eagle_config, vLLM's at the top level), so that it stays consistent
    and exports as such."""
    for where in (config["eagle_config"], config):
        where["eagle_aux_hidden_state_layer_ids"] = [
            i + 1 for i in where["eagle_aux_hidden_state_layer_ids"]
        ]


def shift_dflash_taps(config: dict[str, Any]) -> None:
    """A DFlash checkpoint's config.json told to tap the layers one above."""
    taps = config["dflash_config"]["target_layer_ids"]
    config["dflash_config"]["target_layer_ids"] = [i + 1 for i in taps]
