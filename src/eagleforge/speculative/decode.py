"""Speculative decoding with an EAGLE-3 draft over an HF target, on one prompt at a time.

State between rounds: the committed tokens x_0 … x_L, where x_L is the target's latest token
(not yet run through the target); the target's KV cache and the draft's KV cache both cover
positions 0 … L-1. Draft position t is fed the token x_{t+1} and fc of the target's aux
features f_t -- exactly as in training -- and its output predicts x_{t+2}.

A round:
1. **Draft** from the draft output at L-1: a chain of ``num_draft_tokens`` (``topk`` = 1), or
   an EAGLE-2 tree: at each depth the ``topk`` best nodes so far (by cumulative draft
   log-probability) are expanded into ``topk`` children each, and the ``total_draft_tokens``
   best nodes overall are verified. A node at depth j is fed its token with the hidden output
   of its parent's pass, at RoPE position L-1+j, attending to the draft cache, its ancestors
   and itself -- the diagonal of the training-time test.
2. **Verify** x_L and all drafted nodes in one target forward (a tree attention mask when the
   tree branches), then walk down the tree: greedy (temperature 0) accepts the child equal to
   the target's argmax; sampling accepts by speculative rejection sampling -- a sampled chain
   token d with probability min(1, p(d)/q(d)), else a token from norm(max(p - q, 0)); tree
   children (deterministic proposals) one after another with probability r(c)/Σr on the
   residual r, which loses c's mass on rejection. Either way the output follows the target's
   distribution exactly. The round ends with one token from the target itself (the bonus).
3. **Commit**: both caches keep only the accepted path; the draft is extended over the new
   positions with their real target features.

τ counts the tokens a verification round commits (accepted drafts + the target's token).

Positions: the decoder counts tokens by index (0 = the prompt's first); ``RopePositions`` turns
indices into what the target and the draft rotate by. A text target rotates by the index
itself. A vision-language target (Qwen2-VL family, M-RoPE) prefills the prompt with its images
at the target's own 3-D positions (``get_rope_index``), and every later token -- committed or
drafted -- sits at index + delta on all three components, delta being the prompt's largest
position + 1 - its length, as Qwen2.5-VL's own generation continues after an image.
"""

from __future__ import annotations

import inspect
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from eagleforge.draft.model import Eagle3Draft
from eagleforge.errors import ConfigError
from eagleforge.targets.hf import HFTarget

# Shape suffixes: M new positions, S key positions, V target vocab, W draft vocab,
# H draft hidden, A aux width, K kv heads, D head dim. Positions are [M] (plain RoPE) or
# [3, M] (M-RoPE: time, height, width); the runners add the batch dimension the models take.


@dataclass
class EvalConfig:
    """The `eval` config section: options of ``python -m eagleforge.evaluate``."""

    # Draft to evaluate: a training checkpoint (…/checkpoints/step_N), an exported SGLang
    # draft directory, or a directory of checkpoints (each is evaluated; τ plotted by step).
    draft: str | None = None
    # Prompt set, or a list of them (each measured on its own, then one table across them): a
    # benchmark (mtbench, humaneval, gsm8k, math500; NAME:PATH reads a local copy of its rows),
    # mtbench_style (bundled, 40 prompts in 8 categories) or a jsonl path. str | list[str]:
    # typed Any because OmegaConf cannot type a union of a string and a list.
    prompts: Any = "mtbench"
    # Every user turn of a prompt (answered by the model in turn), not only the first.
    multi_turn: bool = False
    # At most this many prompts; null = all.
    max_prompts: int | None = None
    # Tokens generated per turn (fewer if the model ends its answer).
    max_new_tokens: int = 128
    # Draft tokens per round: the chain length, or the tree depth when topk > 1.
    num_draft_tokens: int = 5
    # Children per expanded node; > 1 drafts an EAGLE-2 tree.
    topk: int = 1
    # Tree nodes verified per round; null = num_draft_tokens * topk.
    total_draft_tokens: int | None = None
    # 0: greedy; > 0: sampling, verified by speculative rejection sampling.
    temperature: float = 0.0
    # Also decode with the target alone (speed baseline, and the lossless check when greedy).
    baseline: bool = True
    # Several decoding settings in one call, each "steps/topk/tokens" as SGLang's
    # --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens
    # (3/1/4: a chain of 3; 6/4/16: a tree of depth 6, 4 children a node, 15 drafts verified);
    # they replace num_draft_tokens, topk and total_draft_tokens, and one table compares them.
    # Greedy: the target alone is decoded once per prompt, whatever the number of settings.
    sweep: list[str] = field(default_factory=list)
    # Also time transformers' own generate on the same prompts (greedy text targets): the
    # target-alone loop's speed beside it.
    hf_generate: bool = False

    def __post_init__(self) -> None:
        self.prompt_sets()  # raises ConfigError for anything but a name or a list of names
        for name in ("max_new_tokens", "num_draft_tokens", "topk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"eval.{name} must be >= 1, got {getattr(self, name)}.")
        if self.total_draft_tokens is not None and self.total_draft_tokens < 1:
            raise ConfigError(
                f"eval.total_draft_tokens must be >= 1 or null, got {self.total_draft_tokens}."
            )
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0, got {self.temperature}.")
        self.decode_settings()  # raises ConfigError for a malformed sweep entry
        if self.hf_generate and self.temperature > 0:
            raise ConfigError(
                "eval.hf_generate times transformers' greedy generate; set eval.temperature=0."
            )

    def prompt_sets(self) -> list[str]:
        """``prompts`` as a list of entries (``eval.prompts=gsm8k`` and
        ``eval.prompts=[mtbench,gsm8k]`` alike)."""
        sets = [self.prompts] if isinstance(self.prompts, str) else self.prompts
        if (
            not isinstance(sets, list | tuple)
            or not sets
            or not all(isinstance(s, str) and s.strip() for s in sets)
        ):
            raise ConfigError(
                f"eval.prompts must be a prompt set or a list of them (e.g. mtbench, or "
                f"[mtbench,gsm8k,humaneval]), got {self.prompts!r}."
            )
        duplicates = sorted({s for s in sets if sets.count(s) > 1})
        if duplicates:
            raise ConfigError(f"eval.prompts names {', '.join(duplicates)} twice; list each once.")
        return list(sets)

    def decode_settings(self) -> list[DecodeSettings]:
        """The settings to decode with: each entry of ``sweep``, or the one of the fields."""
        if not self.sweep:
            return [self.settings()]
        settings = []
        for text in self.sweep:
            match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*/\s*(\d+)\s*", str(text))
            steps, topk, tokens = (int(g) for g in match.groups()) if match else (0, 0, 0)
            most = steps + 1 if topk == 1 else steps * topk + 1  # a chain verifies all
            if not (
                steps >= 1 and topk >= 1 and 2 <= tokens <= most and (topk > 1 or tokens == most)
            ):
                raise ConfigError(
                    f"eval.sweep entry {text!r}: expected steps/topk/tokens as SGLang counts "
                    "them (tokens include the verified root): a chain is steps/1/steps+1, e.g. 3/1/4; "
                    "a tree has 2 <= tokens <= steps*topk + 1, e.g. 6/4/16."
                )
            settings.append(replace(self.settings(), num_draft_tokens=steps, topk=topk,
                                    total_draft_tokens=tokens - 1))  # fmt: skip
        labels = [s.label for s in settings]
        if len(set(labels)) < len(labels):
            raise ConfigError(f"eval.sweep lists a setting twice: {self.sweep}.")
        return settings

    def settings(self) -> DecodeSettings:
        return DecodeSettings(
            max_new_tokens=self.max_new_tokens,
            num_draft_tokens=self.num_draft_tokens,
            topk=self.topk,
            total_draft_tokens=self.total_draft_tokens or self.num_draft_tokens * self.topk,
            temperature=self.temperature,
        )


@dataclass
class DecodeSettings:
    max_new_tokens: int
    num_draft_tokens: int  # chain length / tree depth
    topk: int  # 1: chain; > 1: tree
    total_draft_tokens: int  # nodes verified per round (tree); the chain verifies all
    temperature: float  # 0: greedy

    @property
    def label(self) -> str:
        """SGLang's steps/topk/tokens (tokens counting the verified root): 3/1/4 = chain 3."""
        return f"{self.num_draft_tokens}/{self.topk}/{self.total_draft_tokens + 1}"


@dataclass
class DecodeResult:
    """One prompt's decoding."""

    output_ids: list[int]
    seconds: float
    target_forwards: int  # including the prefill
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted per round
    # wall seconds by part of a round (speculative decoding only): "prefill" (target and draft
    # over the prompt), "draft" (drafting), "verify" (the target's forward over the drafts),
    # "commit" (acceptance, cache trimming, the draft extended over the accepted tokens)
    seconds_by_part: dict[str, float] = field(default_factory=dict)
    draft_steps: int = 0  # draft-layer passes while drafting (one per depth)


@dataclass
class PromptImages:
    """A vision-language prompt's images as the target's image processor gives them."""

    pixel_values: torch.Tensor  # [patches, C*t*p*p]: all images of the prompt, in order
    image_grid_thw: torch.Tensor  # [images, 3]: each image's (time, height, width) patches


@dataclass
class RopePositions:
    """Maps the decoder's token indices after the prompt to rotary positions: [M] (the index)
    for plain RoPE; [3, M] (index + ``delta`` on every component) for M-RoPE."""

    mrope: bool = False
    # M-RoPE: the prompt's largest position + 1 - its length (negative after an image, whose
    # tokens share positions); text after the prompt continues from there.
    delta: int = 0

    def __call__(self, index_M: torch.Tensor) -> torch.Tensor:
        positions_M = index_M + self.delta
        return positions_M.expand(3, -1) if self.mrope else positions_M


class TargetRunner:
    """The HF target with a KV cache and its aux-layer capture."""

    def __init__(self, target: HFTarget) -> None:
        self.target = target
        self.device = target.model.device
        self.cache: Any = None
        self.forwards = 0
        # transformers renamed ``past_key_values`` to ``cache`` during 5.x
        parameters = inspect.signature(target.model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.target.config)
        self.forwards = 0

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def prompt_positions(
        self, prompt_M: torch.Tensor, images: PromptImages | None
    ) -> tuple[torch.Tensor, RopePositions]:
        """The prompt's positions ([M], or [3, M] for an M-RoPE target) and the map of the
        indices after it."""
        if not self.target.is_vlm:
            if images is not None:
                raise ConfigError(
                    f"the prompt has images but the target {type(self.target.model).__name__} "
                    "has no vision tower; evaluate a vision-language model (data.is_vlm=true)."
                )
            rope = RopePositions()
            return rope(torch.arange(len(prompt_M), device=self.device)), rope
        grid = None if images is None else images.image_grid_thw.to(self.device)
        positions_3BT, deltas_B1 = self.target.rope_index(prompt_M[None], None, grid)
        return positions_3BT[:, 0], RopePositions(mrope=True, delta=int(deltas_B1[0, 0]))

    @torch.no_grad()
    def forward(
        self,
        tokens_M: torch.Tensor,
        positions: torch.Tensor,
        tree_mask_MM: torch.Tensor | None,
        images: PromptImages | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits [M, V] and aux features [M, A] of new tokens after the cached ones, at
        ``positions`` ([M] or [3, M]); ``tree_mask_MM`` (True = may attend) replaces the
        causal mask among the new tokens; ``images`` go with the prefill of their prompt."""
        mask = None
        if tree_mask_MM is not None:
            past = self.length
            prefix = torch.ones(len(tokens_M), past, dtype=torch.bool, device=self.device)
            mask = torch.cat([prefix, tree_mask_MM], dim=1)[None, None]
        vision: dict[str, torch.Tensor] = {}
        if images is not None:
            vision = {
                "pixel_values": images.pixel_values.to(self.device, self.target.model.dtype),
                "image_grid_thw": images.image_grid_thw.to(self.device),
            }
        out = self.target.model(
            input_ids=tokens_M[None],
            position_ids=positions[..., None, :],
            attention_mask=mask,
            use_cache=True,
            **{self.cache_argument: self.cache},
            **vision,
        )
        aux = self.target.take_aux()
        self.forwards += 1
        return out.logits[0].float(), aux[0]

    def keep(self, prefix: int, rows: list[int]) -> None:
        """Keep cache entries [0, prefix) and then the given rows of the block after them. Only
        those rows move (a tree's accepted path); the prefix is cut to, never copied."""
        end = prefix + len(rows)
        moved = rows != list(range(len(rows)))
        index = torch.tensor([prefix + r for r in rows], device=self.device)
        for layer in self.cache.layers:
            if moved:  # index_select copies the rows before they are written over
                layer.keys[..., prefix:end, :] = layer.keys.index_select(-2, index)
                layer.values[..., prefix:end, :] = layer.values.index_select(-2, index)
            layer.keys = layer.keys[..., :end, :]
            layer.values = layer.values[..., :end, :]


class DraftRunner:
    """The draft with its KV cache of committed positions (step-0 style: real features).

    The cache is a buffer that doubles when full, so committing tokens copies only them and a
    draft step reads the cache in place: no per-step work grows with the sequence but the
    attention itself."""

    def __init__(self, draft: Eagle3Draft) -> None:
        self.draft = draft.eval()
        self.buffer_k: torch.Tensor | None = None  # [1, K, capacity, D]
        self.buffer_v: torch.Tensor | None = None
        self.cached = 0  # committed positions in the buffers

    def reset(self) -> None:
        self.buffer_k = self.buffer_v = None
        self.cached = 0

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.buffer_k is None else self.buffer_k[:, :, : self.cached]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.buffer_v is None else self.buffer_v[:, :, : self.cached]

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write the keys and values of new positions after the cached ones (growing the
        buffer, doubling, when full) without committing them; returns their end."""
        count = k.shape[2]
        if self.buffer_k is None or self.buffer_v is None:
            shape = (*k.shape[:2], max(256, 2 * count), k.shape[3])
            self.buffer_k, self.buffer_v = k.new_empty(shape), v.new_empty(shape)
        end = self.cached + count
        if end > self.buffer_k.shape[2]:
            shape = (*self.buffer_k.shape[:2], max(256, 2 * end), self.buffer_k.shape[3])
            grown_k, grown_v = self.buffer_k.new_empty(shape), self.buffer_v.new_empty(shape)
            grown_k[:, :, : self.cached] = self.buffer_k[:, :, : self.cached]
            grown_v[:, :, : self.cached] = self.buffer_v[:, :, : self.cached]
            self.buffer_k, self.buffer_v = grown_k, grown_v
        self.buffer_k[:, :, self.cached : end] = k
        self.buffer_v[:, :, self.cached : end] = v
        return end

    def attend(
        self,
        tokens_M: torch.Tensor,
        hidden_MH: torch.Tensor,
        positions: torch.Tensor,
        extra: tuple[torch.Tensor, torch.Tensor] | None,
        mask_MS: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One draft-layer pass of M positions (``positions`` [M] or [3, M], as the target's)
        over the cache, the ``extra`` keys and their own keys, with ``mask_MS`` over (extra +
        own) keys; the cache is visible to all. Returns the pre-norm outputs [M, H] and the new
        keys and values."""
        q, k, v = self.draft.layer_qkv(tokens_M[None], hidden_MH[None], positions[..., None, :])
        new_k = k if extra is None else torch.cat([extra[0], k], dim=2)
        new_v = v if extra is None else torch.cat([extra[1], v], dim=2)
        if self.cached:  # the committed cache is visible to every query
            # with the drafted keys appended in the buffer's spare room: no copy of the cache
            end = self._write(new_k, new_v)
            assert self.buffer_k is not None and self.buffer_v is not None
            all_k, all_v = self.buffer_k[:, :, :end], self.buffer_v[:, :, :end]
        else:
            all_k, all_v = new_k, new_v
        mask = None  # a chain step sees everything: SDPA's unmasked kernel
        if not bool(mask_MS.all()):
            visible = torch.ones(len(tokens_M), self.cached, dtype=torch.bool, device=q.device)
            mask = torch.cat([visible, mask_MS], dim=1)[None, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, all_k, all_v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
        )
        out_MX = out.transpose(1, 2).flatten(2)
        return self.draft.layer_output(hidden_MH[None], out_MX)[0], k, v

    @torch.no_grad()
    def extend(
        self, tokens_M: torch.Tensor, features_MA: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Feed committed positions (token x_{t+1}, features f_t); returns outputs [M, H]."""
        hidden = self.draft.fc(features_MA.to(self.draft.fc.weight.dtype))
        causal = torch.ones(len(tokens_M), len(tokens_M), dtype=torch.bool).tril()
        out, k, v = self.attend(tokens_M, hidden, positions, None, causal.to(tokens_M.device))
        self.cached = self._write(k, v)  # committed
        return out

    def log_probs(self, hidden_MH: torch.Tensor, temperature: float) -> torch.Tensor:
        """Draft log-probabilities [M, W] (at ``temperature``; 1 when 0: greedy ranks)."""
        logits = self.draft.lm_head(self.draft.norm(hidden_MH)).float()
        return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)


@dataclass
class Node:
    """A drafted token: a child of the root (x_L) or of another node."""

    token: int  # target id
    parent: int  # index in the node list, -1 for the root
    depth: int  # 1 for children of the root
    score: float  # cumulative draft log-probability
    draft_probs_W: torch.Tensor | None = None  # the distribution it was sampled from (chain)
    draft_id: int = -1
    hidden_H: torch.Tensor | None = None  # output of feeding this node (predicts its children)


class SpeculativeDecoder:
    def __init__(
        self,
        target: HFTarget,
        draft: Eagle3Draft,
        settings: DecodeSettings,
        eos_ids: set[int],
    ) -> None:
        if target.is_vlm and draft.arch.mrope_section is None:
            raise ConfigError(
                "eval.draft: the draft has no rope_scaling.mrope_section but the target rotates "
                "by M-RoPE positions; evaluate a draft trained for this vision-language target."
            )
        self.target, self.draft = TargetRunner(target), DraftRunner(draft)
        self.settings, self.eos_ids = settings, eos_ids
        self.rope = RopePositions()  # the current prompt's, set by each prefill
        # target id of every draft id (the draft's vocab map, applied once)
        self.target_ids_W = draft.draft_to_target_ids(
            torch.arange(draft.arch.draft_vocab_size, device=draft.d2t.device)
        )

    # --- sampling helpers --------------------------------------------------------------------

    def _target_probs(self, logits_V: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits_V / self.settings.temperature, dim=-1)

    def _pick(self, logits_V: torch.Tensor, generator: torch.Generator) -> int:
        """The target's own token: argmax, or a sample at the temperature."""
        if self.settings.temperature == 0:
            return int(logits_V.argmax())
        return _sample(self._target_probs(logits_V), generator)

    # --- one prompt ----------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        generator: torch.Generator,
        images: PromptImages | None = None,
    ) -> DecodeResult:
        """Speculative decoding of one prompt (with its images, for a vision-language target)."""
        start = time.perf_counter()
        parts = dict.fromkeys(("prefill", "draft", "verify", "commit"), 0.0)
        device = self.target.device
        self.target.reset()
        self.draft.reset()
        prompt = torch.tensor(prompt_ids, device=device)
        # the draft rotates the prompt's positions as the target does (training's step 0)
        prompt_positions, self.rope = self.target.prompt_positions(prompt, images)
        logits, aux = self.target.forward(prompt, prompt_positions, None, images)
        token = self._pick(logits[-1], generator)
        output = [token]
        draft_tokens = torch.cat([prompt[1:], torch.tensor([token], device=device)])
        hidden = self.draft.extend(draft_tokens, aux, prompt_positions)
        root_hidden = hidden[-1]
        accepted_lengths: list[int] = []
        clock = time.perf_counter()
        parts["prefill"] = clock - start
        while not self._done(output):
            length = len(prompt) + len(output) - 1  # L: position of the latest token
            nodes = self._draft_tree(root_hidden, length, generator)
            clock = _lap(parts, "draft", clock)
            logits, aux = self._verify_forward(token, nodes, length)
            clock = _lap(parts, "verify", clock)
            accepted, bonus = self._walk(logits, nodes, generator)
            accepted_lengths.append(len(accepted))
            new_tokens = [nodes[i].token for i in accepted] + [bonus]
            self.target.keep(length, [0] + [i + 1 for i in accepted])
            positions = self.rope(torch.arange(length, length + len(new_tokens), device=device))
            aux = aux[[0] + [i + 1 for i in accepted]]
            hidden = self.draft.extend(torch.tensor(new_tokens, device=device), aux, positions)
            root_hidden, token = hidden[-1], bonus
            output.extend(new_tokens)
            clock = _lap(parts, "commit", clock)
        return DecodeResult(
            output_ids=self._trim(output),
            seconds=time.perf_counter() - start,
            target_forwards=self.target.forwards,
            accepted_lengths=accepted_lengths,
            seconds_by_part=parts,
            draft_steps=len(accepted_lengths) * self.settings.num_draft_tokens,
        )

    @torch.no_grad()
    def generate_target_only(
        self,
        prompt_ids: list[int],
        generator: torch.Generator,
        images: PromptImages | None = None,
    ) -> DecodeResult:
        """Plain decoding with the target and its KV cache: the baseline for speed and output."""
        start = time.perf_counter()
        device = self.target.device
        self.target.reset()
        tokens = torch.tensor(prompt_ids, device=device)
        positions, self.rope = self.target.prompt_positions(tokens, images)
        output: list[int] = []
        while not self._done(output):
            logits, _ = self.target.forward(tokens, positions, None, images)
            images = None  # the prefill put them in the cache
            token = self._pick(logits[-1], generator)
            output.append(token)
            tokens = torch.tensor([token], device=device)
            index = len(prompt_ids) + len(output) - 1
            positions = self.rope(torch.tensor([index], device=device))
        return DecodeResult(self._trim(output), time.perf_counter() - start, self.target.forwards)

    @torch.no_grad()
    def generate_hf(self, prompt_ids: list[int]) -> DecodeResult:
        """transformers' own greedy ``generate`` on the prompt, with the same budget and end
        tokens: the reference the target-alone loop is timed against (text targets)."""
        model = self.target.target.model
        input_ids = torch.tensor([prompt_ids], device=self.target.device)
        start = time.perf_counter()
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=self.settings.max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=sorted(self.eos_ids) or None,
            pad_token_id=min(self.eos_ids, default=0),
        )
        seconds = time.perf_counter() - start
        new_ids = self._trim(output[0, len(prompt_ids) :].tolist())
        return DecodeResult(new_ids, seconds, len(new_ids))

    def _done(self, output: list[int]) -> bool:
        return len(output) >= self.settings.max_new_tokens or any(t in self.eos_ids for t in output)

    def _trim(self, output: list[int]) -> list[int]:
        """At most max_new_tokens, ending at the first end-of-sequence token."""
        output = output[: self.settings.max_new_tokens]
        for i, t in enumerate(output):
            if t in self.eos_ids:
                return output[: i + 1]
        return output

    # --- drafting --------------------------------------------------------------------------------

    def _children(
        self,
        parent: int,
        parent_score: float,
        hidden_H: torch.Tensor,
        depth: int,
        generator: torch.Generator,
    ) -> list[Node]:
        s = self.settings
        log_q = self.draft.log_probs(hidden_H[None], s.temperature)[0]
        if s.temperature > 0 and s.topk == 1:
            probs = log_q.exp()
            draft_id = _sample(probs, generator)
            ids = [draft_id]
        else:
            probs = None
            ids = log_q.topk(min(s.topk, log_q.numel())).indices.tolist()
        return [
            Node(
                token=int(self.target_ids_W[i]),
                parent=parent,
                depth=depth,
                score=parent_score + float(log_q[i]),
                draft_probs_W=probs,
                draft_id=i,
            )
            for i in ids
        ]

    def _draft_tree(
        self, root_hidden: torch.Tensor, length: int, generator: torch.Generator
    ) -> list[Node]:
        """Draft nodes, parents before children (see the module docstring)."""
        s = self.settings
        nodes = self._children(-1, 0.0, root_hidden, 1, generator)
        frontier = list(range(len(nodes)))
        fed: list[int] = []  # nodes whose keys exist, in the order of ``keys``
        keys: tuple[torch.Tensor, torch.Tensor] | None = None
        for depth in range(2, s.num_draft_tokens + 1):
            tokens = torch.tensor([nodes[i].token for i in frontier], device=root_hidden.device)
            hidden_in = torch.stack(
                [
                    root_hidden if nodes[i].parent < 0 else _hidden(nodes[nodes[i].parent])
                    for i in frontier
                ]
            )
            positions = self.rope(torch.full_like(tokens, length - 1 + depth - 1))
            # each fed node sees its fed ancestors and itself
            mask = torch.zeros(len(frontier), len(fed) + len(frontier), dtype=torch.bool)
            for row, i in enumerate(frontier):
                mask[row, len(fed) + row] = True
                ancestor = nodes[i].parent
                while ancestor >= 0:
                    mask[row, fed.index(ancestor)] = True
                    ancestor = nodes[ancestor].parent
            out, k, v = self.draft.attend(
                tokens, hidden_in, positions, keys, mask.to(root_hidden.device)
            )
            keys = (
                (k, v) if keys is None else (torch.cat([keys[0], k], 2), torch.cat([keys[1], v], 2))
            )
            fed.extend(frontier)
            children: list[Node] = []
            for row, i in enumerate(frontier):
                nodes[i].hidden_H = out[row]
                children.extend(self._children(i, nodes[i].score, out[row], depth, generator))
            first = len(nodes)
            nodes.extend(children)
            best = sorted(range(first, len(nodes)), key=lambda j: -nodes[j].score)
            frontier = best[: s.topk]
        return self._select(nodes)

    def _select(self, nodes: list[Node]) -> list[Node]:
        """The best ``total_draft_tokens`` nodes, closed under ancestors, parents first."""
        if self.settings.topk == 1:
            return nodes
        order = sorted(range(len(nodes)), key=lambda j: (-nodes[j].score, nodes[j].depth))
        chosen: list[int] = []
        for j in order:
            if len(chosen) == self.settings.total_draft_tokens:
                break
            if nodes[j].parent < 0 or nodes[j].parent in chosen:
                chosen.append(j)
        chosen.sort(key=lambda j: (nodes[j].depth, j))
        renumber = {old: new for new, old in enumerate(chosen)}
        return [
            Node(
                token=nodes[j].token,
                parent=renumber.get(nodes[j].parent, -1),
                depth=nodes[j].depth,
                score=nodes[j].score,
            )
            for j in chosen
        ]

    # --- verification ----------------------------------------------------------------------------

    def _verify_forward(
        self, root_token: int, nodes: list[Node], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the root and the nodes: their logits and aux features."""
        device = self.target.device
        tokens = torch.tensor([root_token] + [n.token for n in nodes], device=device)
        positions = self.rope(
            torch.tensor([length] + [length + n.depth for n in nodes], device=device)
        )
        is_path = all(n.parent == i - 1 for i, n in enumerate(nodes))
        mask = None if is_path else _tree_mask(nodes).to(device)
        return self.target.forward(tokens, positions, mask)

    def _walk(
        self, logits: torch.Tensor, nodes: list[Node], generator: torch.Generator
    ) -> tuple[list[int], int]:
        """Down the verified tree from the root: the accepted node indices along one path and
        the target's bonus token."""
        accepted: list[int] = []
        row = 0  # verification row of the current node (0 = root)
        while True:
            children = sorted(
                (i for i, n in enumerate(nodes) if n.parent == row - 1),
                key=lambda i: -nodes[i].score,
            )
            chosen, bonus = self._accept(logits[row], [nodes[i] for i in children], generator)
            if chosen is None:
                break
            accepted.append(children[chosen])
            row = children[chosen] + 1
        return accepted, bonus

    def _accept(
        self, logits_V: torch.Tensor, children: list[Node], generator: torch.Generator
    ) -> tuple[int | None, int]:
        """Which child the target accepts (None: none), and otherwise the bonus token."""
        if self.settings.temperature == 0:
            best = int(logits_V.argmax())
            for c, child in enumerate(children):
                if child.token == best:
                    return c, -1
            return None, best
        p = self._target_probs(logits_V)
        q_W = children[0].draft_probs_W if len(children) == 1 else None
        if q_W is not None:  # a sampled chain token
            child = children[0]
            q = torch.zeros_like(p)
            q[self.target_ids_W.to(p.device)] = q_W.to(p.dtype)
            accepted, bonus = accept_sampled(p, q, child.token, generator)
            return (0 if accepted else None), bonus
        return accept_proposals(p, [c.token for c in children], generator)


def accept_sampled(
    p_V: torch.Tensor, q_V: torch.Tensor, token: int, generator: torch.Generator
) -> tuple[bool, int]:
    """Speculative rejection sampling of ``token`` drawn from q: accept with min(1, p/q);
    otherwise (False, a token from norm(max(p - q, 0))). The emitted token follows p."""
    if _uniform(generator) * float(q_V[token]) < float(p_V[token]):
        return True, -1
    residual = (p_V - q_V).clamp_(min=0)
    return False, _sample(residual if float(residual.sum()) > 0 else p_V, generator)


def accept_proposals(
    p_V: torch.Tensor, tokens: list[int], generator: torch.Generator
) -> tuple[int | None, int]:
    """Recursive rejection sampling of deterministic proposals (tree children, best first):
    accept each with probability r(t)/Σr on the residual r, which loses t's mass when t is
    rejected; if none is accepted, a token from the residual. The emitted token follows p."""
    residual = p_V.clone()
    for index, token in enumerate(tokens):
        if _uniform(generator) * float(residual.sum()) < float(residual[token]):
            return index, -1
        residual[token] = 0.0
    return None, _sample(residual, generator)


def eos_ids(tokenizer: Any, target: HFTarget) -> set[int]:
    """Token ids that end an answer: the tokenizer's and the generation config's."""
    ids = {tokenizer.eos_token_id}
    generation = getattr(target.model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {int(i) for i in ids if i is not None}


def _lap(parts: dict[str, float], part: str, since: float) -> float:
    """Add the time since ``since`` to ``parts[part]``; returns now."""
    now = time.perf_counter()
    parts[part] += now - since
    return now


def _hidden(node: Node) -> torch.Tensor:
    assert node.hidden_H is not None, "a parent is always fed before its children"
    return node.hidden_H


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, device=generator.device))


def _sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn with probability proportional to ``weights`` (need not sum to 1)."""
    weights = weights.float()
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator))


def _tree_mask(nodes: list[Node]) -> torch.Tensor:
    """[1+N, 1+N] bool: the root and each node see the root, their ancestors and themselves."""
    size = len(nodes) + 1
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[:, 0] = True
    for i, node in enumerate(nodes):
        mask[i + 1, i + 1] = True
        parent = node.parent
        while parent >= 0:
            mask[i + 1, parent + 1] = True
            parent = nodes[parent].parent
    return mask
