"""Speculative decoding's cost per round on the bundled SmolLM2-135M, against the target alone
and transformers' own ``generate``, on the same prompts and CPU threads.

    python benchmarks/decode.py --prompts 8 --max-new-tokens 64 --json
    python benchmarks/decode.py --draft outputs/runs/RUN/checkpoints/step_00000100 --json

Without ``--draft`` the draft is random (acceptance ~0): the costs per draft step, per
verification and per round do not depend on its weights, only τ does. Reported:

- target step: one cached decode step of the target alone (our loop; ``generate`` beside it);
- draft step: the time spent drafting per draft position (its lm_head, one layer pass), and
  its ratio to a target step -- what decides whether a τ pays off;
- a round split into draft / verify (the target's forward over the drafts) / commit
  (acceptance, cache trimming, the draft extended over accepted tokens);
- τ and the wall-clock speedup over the target alone.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.draft.config import DraftConfig
from eagleforge.draft.model import DraftArchitecture, Eagle3Draft
from eagleforge.speculative.config import DecodeSettings
from eagleforge.speculative.decoder import SpeculativeDecoder
from eagleforge.speculative.prompts import load_prompts, render_prompt
from eagleforge.targets.hf import HFTarget
from eagleforge.targets.registry import build_hf_target
from eagleforge.targets.source import load_tokenizer, resolve_model_dir


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default=None, help="a draft directory; default: random weights")
    p.add_argument("--draft-vocab", type=int, default=8192, help="random draft's vocab size")
    p.add_argument("--prompts", type=int, default=8, help="first N bundled MT-bench prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=3, help="chain length")
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--total-draft-tokens", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the target's dtype (model.dtype); the draft runs in float32")  # fmt: skip
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    return p.parse_args()


def build(args: argparse.Namespace) -> tuple[HFTarget, Eagle3Draft, object]:
    config = to_typed(
        compose_config(
            ["+model=smollm2", f"model.dtype={args.dtype}", "output_dir=.", "tracker=console"]
        )
    )
    model_dir = resolve_model_dir(config.model, config.resolved_cache_dir())
    tokenizer = load_tokenizer(config.model, model_dir)
    device = torch.device("cpu")
    if args.draft:
        from eagleforge.evaluate import load_draft
        from eagleforge.formats.directory import read_architecture

        arch = read_architecture(args.draft)
        target = build_hf_target(
            config.model, config.target, model_dir, device, aux_layer_ids=arch.aux_layer_ids
        )
        return target, load_draft(args.draft, target, device), tokenizer
    target = build_hf_target(config.model, config.target, model_dir, device)
    arch = DraftArchitecture.from_target(
        target.config, DraftConfig(draft_vocab_size=args.draft_vocab), target.aux_layer_ids
    )
    draft = Eagle3Draft(arch)
    draft.init_weights(0.02, torch.Generator().manual_seed(0))
    draft.load_embedding(target.input_embedding().detach().float())
    vocab = arch.vocab_size
    kept = torch.arange(args.draft_vocab) * (vocab // args.draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_map(kept - torch.arange(args.draft_vocab), t2d)
    return target, draft.eval(), tokenizer


def hf_generate_seconds(target: HFTarget, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers' own greedy ``generate`` over the prompts (same budget, EOS ignored)."""
    model = target.model
    total = 0.0
    for ids in prompts:
        input_ids = torch.tensor([ids])
        start = time.perf_counter()
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        total += time.perf_counter() - start
    return total


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, tokenizer = build(args)
    settings = DecodeSettings(
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        topk=args.topk,
        total_draft_tokens=args.total_draft_tokens,
        temperature=0.0,
    )
    # EOS is not an end here: every prompt decodes the same number of tokens in both loops
    decoder = SpeculativeDecoder(target, draft, settings, eos_ids=set())
    prompts = [
        render_prompt(tokenizer, [item.message(0)])
        for item in load_prompts("mtbench_style", False, args.prompts)
    ]
    generator = torch.Generator().manual_seed(0)
    decoder.generate(prompts[0], generator)  # warm-up (allocator, kernels)
    decoder.generate_target_only(prompts[0], generator)

    alone_s, alone_tokens, alone_forwards = 0.0, 0, 0
    spec_s, spec_tokens, rounds, accepted, draft_steps = 0.0, 0, 0, 0, 0
    parts = dict.fromkeys(("prefill", "draft", "verify", "commit"), 0.0)
    prefill_alone, same = 0.0, 0
    for ids in prompts:  # alternate the two loops prompt by prompt: same machine state
        base = decoder.generate_target_only(ids, generator)
        start = time.perf_counter()
        decoder.target.reset()
        decoder.target.forward(torch.tensor(ids), torch.arange(len(ids)), None)
        prefill_alone += time.perf_counter() - start
        alone_s += base.seconds
        alone_tokens += len(base.output_ids)
        alone_forwards += base.target_forwards
        spec = decoder.generate(ids, generator)
        # exact in fp32; in bf16 near-tied logits round differently in a one-token step and
        # in a verification forward, and the outputs may part (docs/quality.md)
        equal = spec.output_ids == base.output_ids
        assert equal or args.dtype != "float32", "speculative output differs from the target's"
        same += equal
        spec_s += spec.seconds
        spec_tokens += len(spec.output_ids)
        rounds += len(spec.accepted_lengths)
        accepted += sum(spec.accepted_lengths)
        draft_steps += spec.draft_steps
        for key, value in spec.seconds_by_part.items():
            parts[key] += value
    generate_s = hf_generate_seconds(target, prompts, args.max_new_tokens)

    # a target decode step: the target-alone loop without its prefill, per decoded token
    target_step_s = (alone_s - prefill_alone) / (alone_forwards - len(prompts))
    draft_step_s = parts["draft"] / draft_steps
    round_s = (parts["draft"] + parts["verify"] + parts["commit"]) / rounds
    tau = (accepted + rounds) / rounds
    result = {
        "benchmark": "decode",
        "draft": args.draft or f"random (vocab {args.draft_vocab})",
        "prompts": len(prompts),
        "new_tokens_per_prompt": args.max_new_tokens,
        "chain": args.num_draft_tokens if args.topk == 1 else None,
        "tree": None
        if args.topk == 1
        else [args.num_draft_tokens, args.topk, args.total_draft_tokens],
        "threads": torch.get_num_threads(),
        "target_dtype": args.dtype,
        "target_alone_tokens_per_s": alone_tokens / alone_s,
        "hf_generate_tokens_per_s": args.max_new_tokens * len(prompts) / generate_s,
        "speculative_tokens_per_s": spec_tokens / spec_s,
        "speedup": (spec_tokens / spec_s) / (alone_tokens / alone_s),
        "outputs_equal_target": same,
        "tau": tau,
        "target_step_ms": 1e3 * target_step_s,
        "draft_step_ms": 1e3 * draft_step_s,
        "draft_step_over_target_step": draft_step_s / target_step_s,
        "round_ms": 1e3 * round_s,
        "round_draft_ms": 1e3 * parts["draft"] / rounds,
        "round_verify_ms": 1e3 * parts["verify"] / rounds,
        "round_commit_ms": 1e3 * parts["commit"] / rounds,
        "verify_over_target_step": parts["verify"] / rounds / target_step_s,
    }
    rows = [
        ("target alone (our loop)", f"{result['target_alone_tokens_per_s']:.1f} tok/s"),
        ("transformers generate", f"{result['hf_generate_tokens_per_s']:.1f} tok/s"),
        ("speculative", f"{result['speculative_tokens_per_s']:.1f} tok/s"),
        ("speedup", f"{result['speedup']:.2f}x at tau {tau:.2f}"),
        ("outputs = target's", f"{same} of {len(prompts)}"),
        ("target decode step", f"{result['target_step_ms']:.2f} ms"),
        ("draft step", f"{result['draft_step_ms']:.2f} ms "
                       f"({result['draft_step_over_target_step']:.1%} of a target step)"),
        ("round: draft", f"{result['round_draft_ms']:.2f} ms"),
        ("round: verify", f"{result['round_verify_ms']:.2f} ms "
                          f"({result['verify_over_target_step']:.2f} target steps)"),
        ("round: commit", f"{result['round_commit_ms']:.2f} ms"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    print(f"decode: SmolLM2-135M ({args.dtype}), {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"{result['threads']} threads, draft {result['draft']}")  # fmt: skip
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
