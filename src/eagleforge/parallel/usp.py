"""USP sequence parallelism of the draft's TTT (offline training): Ulysses heads x ring chunks.

The ``sp = sp_ulysses x sp_ring`` ranks of one sample hold the same offline batch and split its
sequence into sp contiguous chunks; the rank at mesh coordinates (ring r, ulysses u) owns
chunk ``r * sp_ulysses + u``, so each ulysses group owns one contiguous *ring chunk*.
``shard_sequence`` cuts a rank's chunk out of the full batch, plus the look-ahead (halo) the
TTT shifts read, and ``ttt_forward(..., attention=USPBackend(sp, k))`` computes the chunk's
loss sums: summed over the sp ranks they are the single-process ones. This module gives the
draft that attention as a value (the draft imports nothing of it). Each TTT step's attention

1. trades the sequence split for a head split inside the ulysses group (one all-to-all of
   q, k and v): each rank then holds its whole ring chunk for N / sp_ulysses query heads;
2. attends to the step-0 keys of its own and every earlier ring chunk by ring attention: key
   and value chunks travel around the ring group point to point, partial results merge
   exactly by log-sum-exp, later chunks are skipped (causal); in backward the key and value
   gradients travel on around the ring back to their owners;
3. adds the diagonal keys of steps 1..i (same positions, so local) by the log-sum-exp merge
   the sdpa backend uses (``draft/attention.py``);
4. trades the head split of the output back for the sequence split (one all-to-all).

A rank holds one ring chunk of keys at a time, never the whole sequence's; each (query chunk,
key chunk) block materialises its [L, L] scores in plain torch, so it runs on any device.
Every step's keys cross the all-to-all once (``USPAttention`` keeps them in the head split).

Run the tests with ``pytest tests/dist/test_usp.py`` (gloo ranks on CPU).

Shape suffixes: B batch, T sequence, C this rank's chunk, L ring chunk (sp_ulysses * C),
S keys of one ring chunk, N query heads, K kv heads, G query heads per kv head, D head dim,
U sp_ulysses, R sp_ring, F metadata fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from eagleforge.batch import TTTBatch
from eagleforge.draft.attention import MergedTTTAttention, grouped_heads
from eagleforge.errors import ConfigError
from eagleforge.parallel.dist import World


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place among the sp ranks that share one sample. The default is one process."""

    ulysses_size: int = 1
    ulysses_rank: int = 0
    ring_size: int = 1
    ring_rank: int = 0
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None

    @classmethod
    def from_world(cls, world: World) -> SequenceParallel:
        """The mesh axes ``ulysses`` and ``ring`` of a run's world."""
        if not world.distributed:
            return cls()
        return cls(
            ulysses_size=world.dims.ulysses,
            ulysses_rank=world.coordinate("ulysses"),
            ring_size=world.dims.ring,
            ring_rank=world.coordinate("ring"),
            ulysses_group=world.group("ulysses"),
            ring_group=world.group("ring"),
        )

    @property
    def size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def chunk_index(self) -> int:
        """Which of the sp contiguous chunks of the sequence this rank owns."""
        return self.ring_rank * self.ulysses_size + self.ulysses_rank

    def chunk_length(self, seq_len: int) -> int:
        """Positions per chunk: the sequence is padded to a multiple of sp."""
        return math.ceil(seq_len / self.size)


def halo_length(ttt_length: int) -> int:
    """Positions past a chunk that its TTT reads: step k-1 at t reads x_{t+k}, the loss x_{t+k+1}."""
    return ttt_length + 1


def check_heads(num_heads: int, num_kv_heads: int, ulysses_size: int) -> None:
    """ConfigError unless the draft's heads can be split over ``parallel.sp_ulysses`` ranks."""
    if num_heads % ulysses_size:
        raise ConfigError(
            f"parallel.sp_ulysses={ulysses_size} must divide the draft's {num_heads} attention "
            "heads; choose a divisor and put the remaining sequence parallelism in "
            "parallel.sp_ring."
        )
    if num_kv_heads % ulysses_size and ulysses_size % num_kv_heads:
        raise ConfigError(
            f"parallel.sp_ulysses={ulysses_size} and the draft's {num_kv_heads} key/value heads "
            "must divide one another; choose another parallel.sp_ulysses and put the rest in "
            "parallel.sp_ring."
        )


def shard_sequence(batch: TTTBatch, sp: SequenceParallel, ttt_length: int) -> TTTBatch:
    """This rank's chunk of a full batch that every sp rank holds, for ``ttt_forward`` with the
    usp backend: C = ceil(T / sp) positions plus a halo of ``ttt_length + 1`` look-ahead
    positions that only the shifts read. Past the end of the sequence (the last chunk's
    padding, the last halo) positions are padding. Positions are global (RoPE)."""
    if batch.halo:
        raise ValueError("shard_sequence takes a full batch, this one is a chunk already")
    seq = batch.input_ids_BT.shape[1]
    chunk = sp.chunk_length(seq)
    start = sp.chunk_index * chunk
    end = start + chunk + halo_length(ttt_length)
    positions_BT = batch.position_ids_BT
    if positions_BT is None:
        positions_BT = torch.arange(seq, device=batch.input_ids_BT.device).expand_as(
            batch.input_ids_BT
        )

    def cut(x: torch.Tensor) -> torch.Tensor:
        """x[:, start:end], zero (False) past the end of the sequence."""
        out = x.new_zeros(x.shape[0], end - start, *x.shape[2:])
        stop = min(end, seq)
        if stop > start:
            out[:, : stop - start] = x[:, start:stop]
        return out

    teacher = batch.teacher
    return dataclasses.replace(
        batch,
        input_ids_BT=cut(batch.input_ids_BT),
        valid_BT=cut(batch.valid_BT),
        loss_mask_BT=cut(batch.loss_mask_BT),
        aux_BTA=cut(batch.aux_BTA),
        teacher=dataclasses.replace(
            teacher,
            probs_BTW=cut(teacher.probs_BTW),
            target_ids_BT=cut(teacher.target_ids_BT),
            in_draft_BT=cut(teacher.in_draft_BT),
        ),
        document_ids_BT=None if batch.document_ids_BT is None else cut(batch.document_ids_BT),
        position_ids_BT=cut(positions_BT),
        halo=halo_length(ttt_length),
    )


# --- Ulysses: sequence split <-> head split inside the ulysses group -------------------------


def _all_to_all(
    sp: SequenceParallel, xs: Sequence[torch.Tensor], to_heads: bool
) -> list[torch.Tensor]:
    """[B, H_i, C, D] (chunk, all heads) <-> [B, H_i / U, L, D] (ring chunk, a U-th of the
    heads) for every x, in one all-to-all. Block u of the send buffer goes to ulysses rank u."""
    size = sp.ulysses_size
    if to_heads:  # block u: heads u*H/U.. of this chunk
        blocks = [x.unflatten(1, (size, x.shape[1] // size)).movedim(1, 0) for x in xs]
    else:  # block u: chunk u of the ring chunk, for this rank's heads
        blocks = [x.unflatten(2, (size, x.shape[2] // size)).movedim(2, 0) for x in xs]
    send_UBHCD = torch.cat(blocks, dim=2).contiguous()
    recv_UBHCD = torch.empty_like(send_UBHCD)
    dist.all_to_all_single(recv_UBHCD, send_UBHCD, group=sp.ulysses_group)
    received = recv_UBHCD.split([b.shape[2] for b in blocks], dim=2)
    if to_heads:  # received block u: chunk u of the ring chunk
        return [r.movedim(0, 2).flatten(2, 3).contiguous() for r in received]
    return [r.movedim(0, 1).flatten(1, 2).contiguous() for r in received]


class _UlyssesAllToAll(torch.autograd.Function):
    """``_all_to_all`` with its inverse as backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, sp: SequenceParallel, to_heads: bool, *xs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.sp, ctx.to_heads = sp, to_heads
        return tuple(_all_to_all(sp, xs, to_heads))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return None, None, *_all_to_all(ctx.sp, grads, not ctx.to_heads)


def _ulysses(
    sp: SequenceParallel, xs: Sequence[torch.Tensor], to_heads: bool
) -> list[torch.Tensor]:
    if sp.ulysses_size == 1:
        return list(xs)
    return list(_UlyssesAllToAll.apply(sp, to_heads, *xs))


def _kv_for_ulysses(x_BKCD: torch.Tensor, ulysses_size: int) -> torch.Tensor:
    """With fewer kv heads than ulysses ranks, each kv head is repeated for the ranks whose
    query heads read it (autograd sums the copies' gradients)."""
    kv_heads = x_BKCD.shape[1]
    if kv_heads % ulysses_size == 0:
        return x_BKCD
    return x_BKCD.repeat_interleave(ulysses_size // kv_heads, dim=1)


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """[size, *x.shape]: x of every rank of the group, in group-rank order (no autograd)."""
    if size == 1:
        return x.unsqueeze(0)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


# --- Ring attention over the step-0 keys -----------------------------------------------------


class _Transfer:
    """A ring pass in flight: ``wait()`` gives the tensor received from the previous rank."""

    def __init__(self, works: list[Any], received: torch.Tensor) -> None:
        self.works, self.received = works, received

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class _RingKernel:
    """Step-0 attention of this rank's ring chunk of queries over the step-0 keys of its own
    and every earlier ring chunk, in the kernel interface of ``MergedTTTAttention``: forward
    gives the output and log-sum-exp, backward takes the *merged* output and log-sum-exp.

    ``valid_RBL`` and ``document_ids_RBL`` (or None) describe every ring chunk's positions.
    At turn j of the ring a rank holds ring chunk ``own - j`` (mod R) and sends it on to the
    next rank; chunks after its own are skipped (causal).
    """

    def __init__(
        self,
        sp: SequenceParallel,
        valid_RBL: torch.Tensor,
        document_ids_RBL: torch.Tensor | None,
    ) -> None:
        self.sp = sp
        self.valid_RBL = valid_RBL
        self.document_ids_RBL = document_ids_RBL

    def forward(
        self, q_BNLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size, own = self.sp.ring_size, self.sp.ring_rank
        with torch.autocast(q_BNLD.device.type, enabled=False):
            q_BKGLD = grouped_heads(q_BNLD.float(), k_BKLD.shape[1])
            out_BKGLD = torch.zeros_like(q_BKGLD)
            lse_BKGL = torch.full(q_BKGLD.shape[:-1], float("-inf"), device=q_BNLD.device)
            kv_2BKSD = torch.stack([k_BKLD, v_BKLD])
            for turn in range(size):
                key_chunk = (own - turn) % size
                sending = self._send_on(kv_2BKSD, tag=0) if turn < size - 1 else None
                if key_chunk <= own:
                    scores = self._scores(q_BKGLD, kv_2BKSD[0].float(), key_chunk)
                    block_lse_BKGL = torch.logsumexp(scores, dim=-1)
                    probs = torch.exp(scores - _finite(block_lse_BKGL).unsqueeze(-1))
                    block_out_BKGLD = probs @ kv_2BKSD[1].float().unsqueeze(2)
                    out_BKGLD, lse_BKGL = _merge(
                        out_BKGLD, lse_BKGL, block_out_BKGLD, block_lse_BKGL
                    )
                if sending is not None:
                    kv_2BKSD = sending.wait()
        return out_BKGLD.flatten(1, 2).to(q_BNLD.dtype), lse_BKGL.flatten(1, 2)

    def backward(
        self,
        grad_out_BNLD: torch.Tensor,
        q_BNLD: torch.Tensor,
        k_BKLD: torch.Tensor,
        v_BKLD: torch.Tensor,
        out_BNLD: torch.Tensor,
        lse_BNL: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        size, own = self.sp.ring_size, self.sp.ring_rank
        kv_heads = k_BKLD.shape[1]
        scale = q_BNLD.shape[-1] ** -0.5
        with torch.autocast(q_BNLD.device.type, enabled=False):
            q_BKGLD = grouped_heads(q_BNLD.float(), kv_heads)
            grad_BKGLD = grouped_heads(grad_out_BNLD.float(), kv_heads)
            lse_BKGL = _finite(grouped_heads(lse_BNL.float(), kv_heads))
            delta_BKGL = (grad_BKGLD * grouped_heads(out_BNLD.float(), kv_heads)).sum(-1)
            dq_BKGLD = torch.zeros_like(q_BKGLD)
            kv_2BKSD = torch.stack([k_BKLD, v_BKLD])
            dkv_2BKSD = torch.zeros(kv_2BKSD.shape, device=q_BNLD.device)
            for turn in range(size):
                key_chunk = (own - turn) % size
                sending = self._send_on(kv_2BKSD, tag=0) if turn < size - 1 else None
                if key_chunk <= own:
                    k_BKSD, v_BKSD = kv_2BKSD[0].float(), kv_2BKSD[1].float()
                    scores = self._scores(q_BKGLD, k_BKSD, key_chunk)
                    probs = torch.exp(scores - lse_BKGL.unsqueeze(-1))
                    dprobs = grad_BKGLD @ v_BKSD.unsqueeze(2).transpose(-1, -2)
                    dscores = probs * (dprobs - delta_BKGL.unsqueeze(-1)) * scale
                    dq_BKGLD += dscores @ k_BKSD.unsqueeze(2)
                    dkv_2BKSD[0] += (dscores.transpose(-1, -2) @ q_BKGLD).sum(2)
                    dkv_2BKSD[1] += (probs.transpose(-1, -2) @ grad_BKGLD).sum(2)
                if size > 1:
                    # A chunk's gradients travel with it, sent on once this rank's share is
                    # added; the last turn's pass brings this rank's own chunk's home.
                    dkv_2BKSD = self._send_on(dkv_2BKSD, tag=1).wait()
                if sending is not None:
                    kv_2BKSD = sending.wait()
        return (
            dq_BKGLD.flatten(1, 2).to(q_BNLD.dtype),
            dkv_2BKSD[0].to(k_BKLD.dtype),
            dkv_2BKSD[1].to(v_BKLD.dtype),
        )

    def _mask(self, key_chunk: int) -> torch.Tensor:
        """Bool [B, 1, 1, L, S]: which keys of ring chunk ``key_chunk`` each query may see."""
        own = self.sp.ring_rank
        query_valid_BL = self.valid_RBL[own]
        allowed_BLS = self.valid_RBL[key_chunk].unsqueeze(1).expand(-1, query_valid_BL.shape[1], -1)
        if key_chunk == own:
            allowed_BLS = allowed_BLS.tril()
        if self.document_ids_RBL is not None:
            query_document_BL1 = self.document_ids_RBL[own].unsqueeze(2)
            key_document_B1S = self.document_ids_RBL[key_chunk].unsqueeze(1)
            same_document = query_document_BL1 == key_document_B1S
            allowed_BLS = allowed_BLS & (same_document | ~query_valid_BL.unsqueeze(2))
        return allowed_BLS[:, None, None]

    def _scores(self, q_BKGLD: torch.Tensor, k_BKSD: torch.Tensor, key_chunk: int) -> torch.Tensor:
        """Masked scaled scores [B, K, G, L, S] (fp32) of the queries against one key chunk."""
        scores = (q_BKGLD @ k_BKSD.unsqueeze(2).transpose(-1, -2)) * q_BKGLD.shape[-1] ** -0.5
        return scores.masked_fill(~self._mask(key_chunk), float("-inf"))

    def _send_on(self, x: torch.Tensor, tag: int) -> _Transfer:
        """Start sending x to the next ring rank and receiving the previous rank's."""
        received = torch.empty_like(x)
        size, rank, group = self.sp.ring_size, self.sp.ring_rank, self.sp.ring_group
        ops = [
            dist.P2POp(dist.isend, x, group=group, group_peer=(rank + 1) % size, tag=tag),
            dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % size, tag=tag),
        ]
        return _Transfer(dist.batch_isend_irecv(ops), received)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """-inf (no key seen) -> 0, so that exp(score - lse) is 0 rather than nan for such rows."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-attention results over two disjoint key sets -> the result over their union."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = (torch.exp(x - _finite(lse)).unsqueeze(-1) for x in (lse_a, lse_b))
    return out_a * weight_a + out_b * weight_b, lse


# --- The backend -----------------------------------------------------------------------------


class USPAttention:
    """The usp backend for one TTT unroll (one ``ttt_forward``), called like the other backends
    with this rank's chunk of every tensor. It keeps every step's keys and values in the head
    split, so each crosses the all-to-all once; build a new one for every unroll."""

    def __init__(self, sp: SequenceParallel) -> None:
        self.sp = sp
        self.keys_BKLD: list[torch.Tensor] = []
        self.values_BKLD: list[torch.Tensor] = []
        self.kernel: _RingKernel | None = None

    def __call__(
        self,
        q_BNCD: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        valid_BC: torch.Tensor | None,
        document_ids_BC: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the newest step's queries -> [B, C, N*D], as ``eager_ttt_attention``
        computes it on the whole sequence, restricted to this rank's chunk."""
        batch, num_heads, chunk, head_dim = q_BNCD.shape
        sp = self.sp
        check_heads(num_heads, keys[0].shape[1], sp.ulysses_size)
        if self.kernel is None:
            self.kernel = self._ring_kernel(valid_BC, document_ids_BC, batch, chunk, q_BNCD.device)
        seen = len(self.keys_BKLD)
        new_keys = [_kv_for_ulysses(k, sp.ulysses_size) for k in keys[seen:]]
        new_values = [_kv_for_ulysses(v, sp.ulysses_size) for v in values[seen:]]
        q_BNLD, *new_kv = _ulysses(sp, [q_BNCD, *new_keys, *new_values], to_heads=True)
        self.keys_BKLD += new_kv[: len(new_keys)]
        self.values_BKLD += new_kv[len(new_keys) :]
        out_BNLD = MergedTTTAttention.apply(
            self.kernel,
            q_BNLD,
            self.keys_BKLD[0],
            self.values_BKLD[0],
            *self.keys_BKLD[1:],
            *self.values_BKLD[1:],
        )
        (out_BNCD,) = _ulysses(sp, [out_BNLD], to_heads=False)
        return out_BNCD.transpose(1, 2).reshape(batch, chunk, num_heads * head_dim)

    def _ring_kernel(
        self,
        valid_BC: torch.Tensor | None,
        document_ids_BC: torch.Tensor | None,
        batch: int,
        chunk: int,
        device: torch.device,
    ) -> _RingKernel:
        """Gather every chunk's validity and documents (a few ints per position) once."""
        sp = self.sp
        if valid_BC is None:
            valid_BC = torch.ones(batch, chunk, dtype=torch.bool, device=device)
        fields = [valid_BC.long()]
        if document_ids_BC is not None:
            fields.append(document_ids_BC.long())
        chunk_BCF = torch.stack(fields, dim=-1)
        ulysses_UBCF = _all_gather(chunk_BCF, sp.ulysses_group, sp.ulysses_size)
        ring_chunk_BLF = ulysses_UBCF.movedim(0, 1).flatten(1, 2)
        ring_RBLF = _all_gather(ring_chunk_BLF, sp.ring_group, sp.ring_size)
        return _RingKernel(
            sp,
            ring_RBLF[..., 0].bool(),
            ring_RBLF[..., 1] if document_ids_BC is not None else None,
        )


def usp_ttt_attention(
    q_BNCD: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid_BC: torch.Tensor | None,
    document_ids_BC: torch.Tensor | None,
    sp: SequenceParallel,
) -> torch.Tensor:
    """``eager_ttt_attention``'s result for this rank's chunk, from this rank's chunk of every
    tensor (``keys[j]``/``values[j]`` are step j's [B, K, C, D], RoPE at global positions)."""
    return USPAttention(sp)(q_BNCD, keys, values, valid_BC, document_ids_BC)


@dataclass(frozen=True)
class USPBackend:
    """The draft's attention under ``draft.attention=usp``, given to ``ttt_forward`` (and
    ``TTTModule``) as a value: a fresh ``USPAttention`` for every unroll over these ranks."""

    sp: SequenceParallel
    ttt_length: int

    @property
    def halo(self) -> int:
        """Look-ahead positions each chunk carries (``shard_sequence``); none in one process."""
        return halo_length(self.ttt_length) if self.sp.size > 1 else 0

    def __call__(self) -> USPAttention:
        return USPAttention(self.sp)
