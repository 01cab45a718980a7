"""Batches whose hidden states come from running producers as training goes, with no feature
store on disk (training with target=vllm; docs/streaming.md).

``FeatureStream`` goes through a ``BatchPlan`` -- the epoch's batches in their seeded order,
padded or packed, after those a resumed run has used -- and hands each batch's samples to
``submit`` (the target's producers) while at most ``queue_batches`` batches lie between the
producers and the trainer: theirs are the only states held in memory, however fast the
producers are. The trainer gets the batches in the planned order, every sample's states
once, and each batch as it would read from a feature store of the same data (``aux_hidden``,
``final_hidden``): the draft's training cannot tell a stream from a store.

    stream = FeatureStream(plan_batches(dataset, ...), target.submit, queue_batches=8)
    for batch in stream: ...
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from eagleforge.data.loader import BatchPlan

# A prompt's token ids -> the future of its aux [T, 3H] and final [T, H] states.
Submit = Callable[[list[int]], "Future[tuple[torch.Tensor, torch.Tensor]]"]


class FeatureStream:
    """The batches of ``plan`` with their samples' states from ``submit``, at most
    ``queue_batches`` batches ahead of the one the trainer holds."""

    def __init__(self, plan: BatchPlan, submit: Submit, queue_batches: int) -> None:
        self.plan, self.submit, self.queue_batches = plan, submit, queue_batches

    def __len__(self) -> int:
        return len(self.plan.batches)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        planned = iter(self.plan.batches)
        # the batches handed to the producers, oldest first: their samples and states' futures
        queued: deque[tuple[list[tuple[Any, ...]], list[Future[Any]]]] = deque()

        def refill() -> None:
            while len(queued) < self.queue_batches:
                indices = next(planned, None)
                if indices is None:
                    return
                samples = [self.plan.dataset[i] for i in indices]
                queued.append((samples, [self.submit(list(s[0])) for s in samples]))

        try:
            refill()
            while queued:
                samples, futures = queued[0]
                states = [future.result() for future in futures]
                queued.popleft()
                refill()  # the producers go on while this batch trains
                yield self.plan.collate(
                    [(ids, mask, aux, final)
                     for (ids, mask, *_), (aux, final) in zip(samples, states, strict=True)]
                )  # fmt: skip
        finally:  # an epoch left early (a stop, an error): nobody waits for the rest
            for _, futures in queued:
                for future in futures:
                    future.cancel()
