"""The producers of the target's states and the stream training reads them through
(targets/producers.py, data/stream.py), with producers in this process: every job is done
once whoever does it, a producer that stops hands its job on and comes back or is given up,
a job's own error stops only that job, and the stream keeps the planned order with at most
its queue of batches in memory."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from eagleforge.data.loader import BatchPlan, plan_batches
from eagleforge.data.stream import FeatureStream
from eagleforge.engine.server import EngineError
from eagleforge.errors import ConfigError
from eagleforge.targets.producers import ProducerDown, ProducerPool

pytestmark = pytest.mark.unit


def states_of(ids: list[int]) -> torch.Tensor:
    """What every producer here captures for ``ids``: [T, 1, 2]."""
    return torch.tensor([[[float(i), float(len(ids))]] for i in ids])


class Fake:
    """A producer that goes down at its ``down_at``-th capture (and at every capture while
    down), and comes back at ``recover`` unless ``stays_down``."""

    def __init__(self, name: str, down_at: int | None = None, stays_down: bool = False) -> None:
        self.name, self.down_at, self.stays_down = name, down_at, stays_down
        self.calls, self.down, self.closed = 0, False, False
        self.lock = threading.Lock()
        self.done: list[list[int]] = []

    def capture(self, ids: list[int]) -> torch.Tensor:
        with self.lock:
            self.calls += 1
            if self.down or self.calls == self.down_at:
                self.down = True
                raise ProducerDown("connection refused")
        if ids == [-1]:
            raise ConfigError("the engine refused this prompt")
        time.sleep(0.001)
        with self.lock:
            self.done.append(ids)
        return states_of(ids)

    def recover(self, deadline: float) -> None:
        if self.stays_down:
            raise ProducerDown("its /health did not answer again")
        self.down = False

    def close(self) -> None:
        self.closed = True


def prompts(n: int) -> list[list[int]]:
    return [[k, k + 1, k + 2][: 1 + k % 3] for k in range(n)]


def test_every_job_is_done_once_when_a_producer_stops_and_comes_back() -> None:
    a, b = Fake("a", down_at=3), Fake("b")
    pool = ProducerPool([a, b], requests_per_producer=2, recover_timeout_s=5)
    jobs = prompts(40)
    results = [pool.submit(ids) for ids in jobs]
    for ids, future in zip(jobs, results, strict=True):
        assert torch.equal(future.result(timeout=10), states_of(ids))
    # delivered once each: the job a held when it stopped was done by one producer, not two
    assert sorted(a.done + b.done) == sorted(jobs)
    records = {r["name"]: r for r in pool.records()}
    assert records["a"]["samples"] + records["b"]["samples"] == len(jobs)
    assert records["a"]["recoveries"] == 1 and records["a"]["handed_on"] >= 1
    assert records["a"]["given_up"] is None
    pool.close()
    assert a.closed and b.closed


def test_a_producer_given_up_leaves_its_work_to_the_others() -> None:
    a, b = Fake("a", down_at=1, stays_down=True), Fake("b")
    pool = ProducerPool([a, b], requests_per_producer=3, recover_timeout_s=5)
    jobs = prompts(20)
    assert [f.result(timeout=10).tolist() for f in [pool.submit(i) for i in jobs]] == [
        states_of(ids).tolist() for ids in jobs
    ]
    records = {r["name"]: r for r in pool.records()}
    assert records["a"]["samples"] == 0 and records["b"]["samples"] == len(jobs)
    assert records["a"]["given_up"] == "its /health did not answer again"
    pool.close()


def test_when_every_producer_is_given_up_the_jobs_fail_in_one_line() -> None:
    a, b = Fake("a", down_at=1, stays_down=True), Fake("b", down_at=1, stays_down=True)
    pool = ProducerPool([a, b], requests_per_producer=1, recover_timeout_s=7)
    futures = [pool.submit(ids) for ids in prompts(4)]
    for future in futures:
        with pytest.raises(EngineError) as error:
            future.result(timeout=10)
    message = str(error.value)
    assert "target.producers.recover_timeout_s=7 s (a: its /health" in message
    assert "b: its /health did not answer again" in message and "run the same command" in message
    with pytest.raises(EngineError):  # and so does every job after
        pool.submit([1]).result(timeout=10)
    pool.close()


def test_a_jobs_own_error_fails_that_job_alone() -> None:
    pool = ProducerPool([Fake("a")], requests_per_producer=2, recover_timeout_s=5)
    bad, good = pool.submit([-1]), pool.submit([5, 6])
    with pytest.raises(ConfigError, match="refused this prompt"):
        bad.result(timeout=10)
    assert torch.equal(good.result(timeout=10), states_of([5, 6]))
    assert pool.records()[0]["samples"] == 1
    pool.close()


class Gated(Fake):
    """A producer whose captures wait for ``gate``: requests in flight."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate, self.started = threading.Event(), threading.Event()

    def capture(self, ids: list[int]) -> torch.Tensor:
        self.started.set()
        self.gate.wait(timeout=10)
        if ids == [-1]:
            raise ConfigError("the engine refused this prompt")
        return states_of(ids)


@pytest.mark.parametrize("ids", [[1, 2], [-1]])
def test_a_capture_cancelled_in_flight_ends_quietly(
    ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that stops cancels the captures it no longer waits for, some already in a
    producer's hands: their results and errors go nowhere, with no error in the workers."""
    raised: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    producer = Gated("a")
    pool = ProducerPool([producer], requests_per_producer=1, recover_timeout_s=5)
    future = pool.submit(ids)
    assert producer.started.wait(timeout=10)
    assert future.cancel()
    producer.gate.set()
    after = pool.submit([3])  # the worker goes on
    assert torch.equal(after.result(timeout=10), states_of([3]))
    pool.close()
    assert raised == []


def test_results_are_converted_by_the_workers() -> None:
    pool = ProducerPool(
        [Fake("a")], requests_per_producer=1, recover_timeout_s=5, convert=lambda s: s.sum()
    )
    assert float(pool.submit([1, 2]).result(timeout=10)) == float(states_of([1, 2]).sum())
    pool.close()


class Samples(torch.utils.data.Dataset):
    """Token samples of lengths 2..5 (ids, loss mask), as a TokenizedDataset gives them."""

    def __init__(self, n: int) -> None:
        self.rows = [[100 + k] * (2 + k % 4) for k in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        return self.rows[index], [1] * len(self.rows[index])

    def lengths(self) -> list[int]:
        return [len(r) for r in self.rows]


class Counting:
    """A submit that answers at once and counts the batches' samples handed out."""

    def __init__(self) -> None:
        self.submitted = 0

    def __call__(self, ids: list[int]) -> Future[tuple[torch.Tensor, torch.Tensor]]:
        self.submitted += 1
        future: Future[tuple[torch.Tensor, torch.Tensor]] = Future()
        aux = torch.tensor(ids, dtype=torch.float32)[:, None].expand(-1, 3).clone()
        future.set_result((aux, aux[:, :1] * 2))
        return future


@pytest.mark.parametrize("packing", [False, True])
def test_the_stream_is_the_planned_batches_with_their_states(packing: bool) -> None:
    """In the planned order, each sample's states where a store's would be, for padded and
    packed batches alike; never more than the queue's batches handed out ahead."""
    dataset = Samples(23)
    plan = plan_batches(dataset, packing, 9, 4, 0, shuffle_seed=3, start=1)
    submit = Counting()
    stream = FeatureStream(plan, submit, queue_batches=2)
    assert len(stream) == len(plan.batches)
    seen = 0
    for k, batch in enumerate(stream):
        samples = sum(len(b) for b in plan.batches[: k + 1])
        ahead = sum(len(b) for b in plan.batches[k + 1 : k + 3])
        assert submit.submitted == samples + ahead  # the batch held, and 2 queued
        expected = plan.collate(
            [(*dataset[i], torch.tensor(dataset[i][0], dtype=torch.float32)[:, None]
              .expand(-1, 3), torch.tensor(dataset[i][0], dtype=torch.float32)[:, None] * 2)
             for i in plan.batches[k]]
        )  # fmt: skip
        assert batch.keys() == expected.keys()
        for key in batch:
            assert torch.equal(batch[key], expected[key]), key
        seen += 1
    assert seen == len(plan.batches)


def test_an_epoch_left_early_cancels_what_was_queued() -> None:
    futures: list[Future[tuple[torch.Tensor, torch.Tensor]]] = []

    def submit(ids: list[int]) -> Future[tuple[torch.Tensor, torch.Tensor]]:
        future: Future[tuple[torch.Tensor, torch.Tensor]] = Future()
        if not futures:
            future.set_result((torch.zeros(len(ids), 3), torch.zeros(len(ids), 1)))
        futures.append(future)
        return future

    plan = BatchPlan(
        Samples(8), [[i] for i in range(8)], plan_batches(Samples(8), False, 9, 1, 0).collate, 0
    )
    stream = iter(FeatureStream(plan, submit, queue_batches=3))
    next(stream)
    stream.close()  # type: ignore[attr-defined]
    assert len(futures) == 4 and all(f.cancelled() for f in futures[1:])
