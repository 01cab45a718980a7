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

``runners.py`` holds the target and the draft with their caches (and how token indices become
RoPE positions), ``tree.py`` the draft tree's nodes and masks, ``sampling.py`` the rejection
sampling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from eagleforge.draft.model import Eagle3Draft
from eagleforge.errors import ConfigError
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.runners import DraftRunner, PromptImages, RopePositions, TargetRunner
from eagleforge.speculative.sampling import accept_proposals, accept_sampled, sample_index
from eagleforge.speculative.tree import Node, drafting_mask, select_nodes, verification_mask
from eagleforge.targets.hf import HFTarget

# Shape suffixes: V target vocab, W draft vocab, H draft hidden.


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


class SpeculativeDecoder:
    """Decodes one prompt at a time speculatively (see the module docstring), or with the
    target alone as the baseline to compare with."""

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
        return sample_index(self._target_probs(logits_V), generator)

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
        # the round's draft input: EAGLE-3's draft output at L-1, DFlash's latest token
        token, root_hidden = self._prefill(prompt_ids, generator, images)
        output = [token]
        accepted_lengths: list[int] = []
        clock = time.perf_counter()
        parts["prefill"] = clock - start
        while not self._done(output):
            length = len(prompt_ids) + len(output) - 1  # L: position of the latest token
            nodes = self._draft_tree(root_hidden, length, generator)
            clock = _lap(parts, "draft", clock)
            logits, aux = self._verify_forward(token, nodes, length)
            clock = _lap(parts, "verify", clock)
            accepted, bonus = self._walk(logits, nodes, generator)
            accepted_lengths.append(len(accepted))
            new_tokens = [nodes[i].token for i in accepted] + [bonus]
            root_hidden = self._commit(length, new_tokens, [0] + [i + 1 for i in accepted], aux)
            token = bonus
            output.extend(new_tokens)
            clock = _lap(parts, "commit", clock)
        return DecodeResult(
            output_ids=self._trim(output),
            seconds=time.perf_counter() - start,
            target_forwards=self.target.forwards,
            accepted_lengths=accepted_lengths,
            seconds_by_part=parts,
            draft_steps=len(accepted_lengths) * self.draft_passes_per_round,
        )

    @property
    def draft_passes_per_round(self) -> int:
        """Draft-layer passes in a round: one per depth of the chain or tree."""
        return self.settings.num_draft_tokens

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

    def _prefill(
        self, prompt_ids: list[int], generator: torch.Generator, images: PromptImages | None
    ) -> tuple[int, torch.Tensor]:
        """Both caches over the prompt: the target's first token x_L and the draft's output at
        L-1 [H], which the first round drafts from."""
        device = self.target.device
        self.target.reset()
        self.draft.reset()
        prompt = torch.tensor(prompt_ids, device=device)
        # the draft rotates the prompt's positions as the target does (training's step 0)
        prompt_positions, self.rope = self.target.prompt_positions(prompt, images)
        logits, aux = self.target.forward(prompt, prompt_positions, None, images)
        token = self._pick(logits[-1], generator)
        draft_tokens = torch.cat([prompt[1:], torch.tensor([token], device=device)])
        return token, self._extend_draft(draft_tokens, aux, prompt_positions)

    def _commit(
        self, length: int, new_tokens: list[int], rows: list[int], aux: torch.Tensor
    ) -> torch.Tensor:
        """The accepted path: the target's cache keeps its first ``length`` positions and then
        the verification ``rows`` (the root and the accepted nodes); the draft is extended over
        ``new_tokens`` with those rows' aux features. Returns the draft's output at the last
        new token [H], which the next round drafts from."""
        device = self.target.device
        self.target.keep(length, rows)
        positions = self.rope(torch.arange(length, length + len(new_tokens), device=device))
        return self._extend_draft(torch.tensor(new_tokens, device=device), aux[rows], positions)

    def _extend_draft(
        self, tokens_M: torch.Tensor, aux_MA: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Commit M pairs (token x_{t+1}, the target's features at t) to the draft's cache;
        the draft's output at the last of them [H], which the next round drafts from."""
        return self.draft.extend(tokens_M, aux_MA, positions)[-1]

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
            draft_id = sample_index(probs, generator)
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
            mask = drafting_mask(nodes, frontier, fed)
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
        if s.topk == 1:
            return nodes
        return select_nodes(nodes, s.total_draft_tokens)

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
        mask = None if is_path else verification_mask(nodes).to(device)
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


def eos_ids(tokenizer: Any, target: HFTarget) -> set[int]:
    """Token ids that end an answer: the tokenizer's and the generation config's."""
    generation = getattr(target.model, "generation_config", None)
    return answer_end_ids(tokenizer, getattr(generation, "eos_token_id", None))


def answer_end_ids(tokenizer: Any, configured: Any) -> set[int]:
    """The tokenizer's eos and ``configured`` (a generation config's eos_token_id: an id, a
    list of them, or None): what ends an answer, for eagleforge's decoder and for vLLM alike."""
    ids = {tokenizer.eos_token_id}
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
