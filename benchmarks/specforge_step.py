"""SpecForge's own EAGLE-3 training step at the shape of ``benchmarks/ttt_step.py``, to set
beside ours on the same GPU (scripts/gpu_check.py's ``bench-specforge`` part).

    pip install --no-deps specforge==0.2.0     # where it is not installed (its pins: torch 2.11)
    python benchmarks/specforge_step.py --hidden-size 4096 --intermediate-size 14336 \\
        --heads 32 --kv-heads 8 --vocab 128256 --draft-vocab 32000 --seq-len 2048 \\
        --ttt-length 7 --steps 10 --json

It builds SpecForge's Llama EAGLE-3 draft (``LlamaForCausalLMEagle3``, bf16, the embedding
frozen) with the same vocabulary map and inputs as ours -- one row of T tokens, its first
``--prompt-frac`` unsupervised, aux states [1, T, 3H], the target's final hidden state and a
frozen lm_head whose draft-vocab rows dominate -- and times the step its trainer runs on one
GPU: the target head over the row, ``OnlineEagle3Model``'s unrolled steps with its own loss
(a Triton kernel) and its attention backend (``--attention``, its default flex_attention),
Σ 0.8^i of the step losses, backward, and its ``BF16Optimizer`` (fp32 masters, clipping,
AdamW). Its FSDP wrapper, a no-op on one rank, is left out. SpecForge is imported only here,
only where installed; nothing of it is copied into eagleforge.

Prints a line and, with ``--json``, one JSON line: first_step_s (its torch.compile'd pieces
compile then) apart from median_step_s, tokens_per_s, peak_cuda_mib after the warm-up.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time
from typing import Any

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--intermediate-size", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up steps)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    p.add_argument("--prompt-frac", type=float, default=0.25, help="unsupervised share of the row")
    p.add_argument(
        "--attention",
        choices=["flex_attention", "sdpa", "fa"],
        default="flex_attention",
        help="SpecForge's attention backend (its default: flex_attention; fa needs flash-attn)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    return p.parse_args()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build SpecForge's draft and time its step; the figures as a dict."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.utils import padding
    from transformers import LlamaConfig

    torch.manual_seed(0)
    device, dtype = torch.device(args.device), torch.bfloat16
    h, t, vocab, width = args.hidden_size, args.seq_len, args.vocab, args.draft_vocab
    config = LlamaConfig(
        hidden_size=h, intermediate_size=args.intermediate_size, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=h // args.heads, vocab_size=vocab,
        draft_vocab_size=width, num_hidden_layers=1, max_position_embeddings=4 * t,
        rms_norm_eps=1e-6, hidden_act="silu", pad_token_id=0, tie_word_embeddings=False,
        architectures=["LlamaForCausalLMEagle3"],
    )  # fmt: skip
    # the same vocabulary map and inputs as benchmarks/ttt_step.py's
    draft_ids = torch.sort(torch.randperm(vocab)[:width]).values
    with device:
        draft = LlamaForCausalLMEagle3(config, attention_backend=args.attention)
    draft.t2d.zero_()
    draft.t2d[draft_ids.to(draft.t2d.device)] = True
    draft.d2t.copy_(draft_ids - torch.arange(width))
    draft.freeze_embedding()
    draft = draft.to(device=device, dtype=dtype)
    model = OnlineEagle3Model(
        draft_model=draft, length=args.ttt_length, attention_backend=args.attention
    ).to(device=device, dtype=dtype)
    optimizer = BF16Optimizer(
        model.draft_model, lr=1e-4, max_grad_norm=0.5, warmup_ratio=0.015,
        lr_scheduler="cosine", total_steps=1000,
    )  # fmt: skip
    lm_head = torch.randn(vocab, h) * 0.05
    lm_head[draft_ids] *= 4  # the target's argmax is nearly always a draft-vocab token
    target_head = torch.nn.Linear(h, vocab, bias=False, device=device, dtype=dtype)
    target_head.weight.data.copy_(lm_head)
    target_head.requires_grad_(False)
    input_ids = draft_ids[torch.randint(0, width, (1, t))].to(device)
    loss_mask = torch.ones(1, t, dtype=torch.long, device=device)
    loss_mask[:, : int(args.prompt_frac * t)] = 0
    attention_mask = torch.ones(1, t, dtype=torch.long, device=device)
    aux = torch.randn(1, t, 3 * h, device=device, dtype=dtype)
    final_hidden = torch.randn(1, t, h, device=device, dtype=dtype)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step() -> float:
        """Its trainer's step on one rank: the target head, the unroll, backward, optimizer."""
        start = time.perf_counter()
        target = target_head(padding(final_hidden, left=False))
        losses, *_ = model(
            input_ids=padding(input_ids, left=False), attention_mask=attention_mask,
            loss_mask=loss_mask[..., None], target=target, hidden_states=aux,
        )  # fmt: skip
        loss = sum(0.8**i * step_loss for i, step_loss in enumerate(losses))
        loss.backward()
        optimizer.step()
        synchronize()
        return time.perf_counter() - start

    warmup_s = [step() for _ in range(max(1, args.warmup))]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = statistics.median(step() for _ in range(args.steps))
    result: dict[str, Any] = {
        "bench": "specforge_step",
        "specforge": importlib.metadata.version("specforge"),
        "shape": f"h{h}-v{vocab}-dv{width}-t{t}",
        "attention": args.attention,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "first_step_s": round(warmup_s[0], 3),
        "median_step_s": round(seconds, 4),
        "tokens_per_s": round(t / seconds, 1),
    }
    if device.type == "cuda":
        result["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return result


def main() -> int:
    args = parse_args()
    if importlib.util.find_spec("specforge") is None:
        print("specforge is not installed: pip install --no-deps specforge==0.2.0")
        return 2
    if not args.device.startswith("cuda"):
        print("SpecForge's loss is a Triton kernel for CUDA: run with --device cuda")
        return 2
    result = measure(args)
    print(
        f"SpecForge {result['specforge']} {result['shape']} {args.attention}: "
        f"{result['median_step_s']} s a step, {result['tokens_per_s']} tokens/s, "
        f"peak {result.get('peak_cuda_mib')} MiB; first step {result['first_step_s']} s"
    )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
