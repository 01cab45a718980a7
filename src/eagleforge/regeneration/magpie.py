"""Magpie (Xu et al. 2024): the target writes the first user turns, which it then answers.

Each prompt is sampled from the chat template's user header (hf or vllm backend); the prompts are
saved before any is answered, so a resumed job answers the same ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from eagleforge.errors import ConfigError
from eagleforge.progress import Progress
from eagleforge.regeneration.config import MagpieConfig, RegenerateConfig
from eagleforge.regeneration.output import write_lines_atomically
from eagleforge.regeneration.rows import Generate, Row
from eagleforge.targets.hf import kv_cache_argument


class PromptSampler(Protocol):
    """A backend that can continue raw token ids (the hf and vllm backends)."""

    tokenizer: Any
    stop_ids: set[int]

    def sample_rows(self, prompt_ids: list[int], cfg: MagpieConfig) -> list[list[int]]: ...


@torch.no_grad()
def user_turns(backend: PromptSampler, count: int, cfg: MagpieConfig) -> list[str]:
    """``count`` distinct first user turns sampled from the chat template's user header
    (Magpie), in the order written; those the target does not end are dropped."""
    header = user_header(backend.tokenizer)
    ids = list(backend.tokenizer(header, add_special_tokens=False)["input_ids"])
    prompts: dict[str, None] = {}  # insertion-ordered set
    tries, calls = 0, 0
    bar = Progress(count, "magpie prompts", "prompt")
    while len(prompts) < count:
        # four tries a prompt, and four calls of the backend's width beyond that
        if calls and tries >= 4 * count + 4 * tries // calls:
            raise ConfigError(
                f"regenerate.magpie: the target wrote only {len(prompts)} distinct, ended "
                f"prompts in {tries} tries; raise regenerate.magpie.max_new_tokens or "
                "temperature, or ask for fewer."
            )
        rows = backend.sample_rows(ids, cfg)
        tries, calls = tries + len(rows), calls + 1
        for row in rows:
            end = first_stop(row, backend.stop_ids)
            text = "" if end is None else backend.tokenizer.decode(row[:end]).strip()
            if text and text not in prompts and len(prompts) < count:
                prompts[text] = None
                bar.update()
    bar.close()
    return list(prompts)


@torch.no_grad()
def sample_continuations(
    model: Any, ids_BT: torch.Tensor, cfg: MagpieConfig, stop_ids: set[int]
) -> torch.Tensor:
    """[B, ≤ max_new_tokens] tokens continuing the unpadded rows ``ids_BT``, by nucleus
    sampling from the global generator; stops once every row holds a stop token (what a row
    writes after its first one is noise, cut by the caller)."""
    from transformers import DynamicCache

    stop_tokens = torch.tensor(sorted(stop_ids), device=ids_BT.device)
    cache = {kv_cache_argument(model): DynamicCache(config=model.config)}
    logits_BV = model(input_ids=ids_BT, use_cache=True, **cache).logits[:, -1]
    ended_B = torch.zeros(len(ids_BT), dtype=torch.bool, device=ids_BT.device)
    tokens: list[torch.Tensor] = []
    for _ in range(cfg.max_new_tokens):
        token_B = nucleus_sample(logits_BV, cfg.temperature, cfg.top_p, cfg.top_k)
        tokens.append(token_B)
        ended_B |= torch.isin(token_B, stop_tokens)
        if bool(ended_B.all()):
            break
        logits_BV = model(input_ids=token_B[:, None], use_cache=True, **cache).logits[:, -1]
    return torch.stack(tokens, dim=1)


def first_stop(row: list[int], stop_ids: set[int]) -> int | None:
    """Tokens before the row's first stop token (None: the row never ended)."""
    return next((i for i, t in enumerate(row) if t in stop_ids), None)


def nucleus_sample(
    logits_BV: torch.Tensor, temperature: float, top_p: float, top_k: int
) -> torch.Tensor:
    """One token per row: from the smallest set of most likely tokens holding ``top_p`` of
    the probability at ``temperature``, at most ``top_k`` of them (0 = no limit). Only the top
    ``top_k`` are ever sorted: transformers' top-p sorts the whole vocabulary of every row at
    every step, which on a CPU costs more than the forward of a small target (49k-token vocab,
    batch 128)."""
    logits_BV = logits_BV.float() / temperature
    vocab = logits_BV.shape[-1]
    top_BK = logits_BV.topk(min(top_k, vocab) if top_k else vocab, dim=-1)
    probs_BK = (top_BK.values - logits_BV.logsumexp(dim=-1, keepdim=True)).exp()
    # keep a candidate while the mass before it is below top_p (the most likely one always)
    before_BK = probs_BK.cumsum(dim=-1) - probs_BK
    probs_BK = probs_BK.masked_fill(before_BK >= top_p, 0.0)
    pick_B = torch.multinomial(probs_BK, 1)
    return top_BK.indices.gather(-1, pick_B)[:, 0]


def user_header(tokenizer: Any) -> str:
    """The chat template's text before a first user message's content (with the template's
    default system prompt, if it has one): where the target, continuing, writes a prompt."""
    mark = "\x00magpie\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    if text.count(mark) != 1:
        raise ConfigError(
            "regenerate.magpie: the tokenizer's chat template does not render a user message "
            "verbatim, so its user header cannot be found; this model needs prompts from data."
        )
    return str(text[: text.index(mark)])


# the turn regenerate_rows writes after each Magpie prompt (read, never changed)
ASSISTANT_TO_WRITE = {"role": "assistant", "content": ""}


def magpie_rows(
    path: Path, cfg: RegenerateConfig, backend: Callable[[], Generate]
) -> tuple[list[Row], list[str]]:
    """The rows to answer and the held-out prompts of a Magpie job: read from ``path`` when an
    earlier call wrote them, else written by the target and saved there first."""
    magpie = cfg.magpie
    wanted = magpie.num_prompts + magpie.held_out
    if path.exists():
        prompts = [json.loads(line) for line in path.read_text().splitlines()]
        if len(prompts) != wanted:
            raise ConfigError(
                f"regenerate.magpie asks for {magpie.num_prompts} + {magpie.held_out} held-out "
                f"prompts but {path} holds the {len(prompts)} an earlier call wrote: rerun with "
                f"those numbers to resume, or remove {path.parent} to start over."
            )
    else:
        generate = backend()
        assert hasattr(generate, "sample_rows")  # RegenerateConfig refuses backend=server
        prompts = user_turns(generate, wanted, magpie)  # type: ignore[arg-type]
        write_lines_atomically(path, [json.dumps(p) for p in prompts])
    rows = [
        Row(i, f"magpie-{i:06d}", [{"role": "user", "content": p}, ASSISTANT_TO_WRITE])
        for i, p in enumerate(prompts[: magpie.num_prompts])
    ]
    return rows, prompts[magpie.num_prompts :]
