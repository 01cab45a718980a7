"""The producers of the target's hidden states (target=vllm): one or more vLLM engines behind
one pool that hands each prompt to a live one.

A prompt's capture is a job, and ``ProducerPool.submit`` returns its future, set exactly once.
Each producer has ``requests_per_producer`` workers taking jobs from one queue, so a faster
producer takes more of them. A producer that stops answering (its process died, its connection
is refused or reset) puts the job it held back at the head of the queue, where the live ones
take it, and is brought back (``Producer.recover``: an engine eagleforge started is started
again, a server at a URL is waited for) within ``target.producers.recover_timeout_s``; one
not back by then is given up, and when every producer is given up the jobs left fail with one
error naming them. An error of the job itself (the engine refused the prompt, a capture of
other tokens, another layer set) fails that job only: the run stops on it, in one line.

    pool = ProducerPool(producers, requests_per_producer=64, recover_timeout_s=900, convert=f)
    result = pool.submit(ids).result()        # f(the [T, L, H] the engine captured)
    pool.records()                            # who produced what, for the run's record

Shape suffixes: T tokens, L captured layers, H hidden.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from eagleforge.engine.server import EngineError
from eagleforge.errors import EagleForgeError, InputsStopped

log = logging.getLogger(__name__)


class ProducerDown(EagleForgeError):
    """The producer stopped answering; the job it held goes to another."""


class Producer(Protocol):
    """One source of captures: a vLLM engine eagleforge started, or a server at a URL."""

    name: str  # how the record and the errors call it ("engine 0", "http://10.0.0.2:8000")

    def capture(self, ids: list[int]) -> torch.Tensor:
        """[T, L, H] of the prompt ``ids``; ProducerDown where the producer stopped answering."""
        ...

    def recover(self, deadline: float) -> None:
        """Bring the producer back by ``deadline`` (time.monotonic()); ProducerDown if not."""
        ...

    def close(self) -> None:
        """Stop what this producer runs (an engine eagleforge started) and remove its files."""
        ...


@dataclass
class ProducerRecord:
    """What one producer did for the run: the record ``producers.json`` keeps."""

    name: str
    samples: int = 0  # captures it delivered
    tokens: int = 0
    recoveries: int = 0  # times it stopped answering and came back
    handed_on: int = 0  # jobs it held when it stopped, taken by a live producer
    given_up: str | None = None  # why it was given up, when it was


@dataclass
class _Job:
    ids: list[int]
    future: Future[Any]


class ProducerPool:
    """Jobs to producers, failing over (see the module docstring)."""

    def __init__(
        self,
        producers: Sequence[Producer],
        requests_per_producer: int,
        recover_timeout_s: float,
        convert: Callable[[torch.Tensor], Any] = lambda states: states,
    ) -> None:
        self.producers = list(producers)
        self.recover_timeout_s, self.convert = recover_timeout_s, convert
        self._jobs: deque[_Job] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._down = [False] * len(self.producers)  # recovering or given up
        self._records = [ProducerRecord(p.name) for p in self.producers]
        # started producer by producer in turn: idle workers take jobs in the order they began
        # to wait, so the producers share even a few jobs, instead of the first taking them all
        self._workers = [
            threading.Thread(target=self._work, args=(i,), daemon=True, name=f"{p.name} {w}")
            for w in range(requests_per_producer)
            for i, p in enumerate(self.producers)
        ]
        for worker in self._workers:
            worker.start()

    def submit(self, ids: list[int]) -> Future[Any]:
        """The future of ``ids``'s capture (``convert`` of its [T, L, H]); cancelling it before
        a producer takes it leaves it undone."""
        job = _Job(list(ids), Future())
        with self._ready:
            if self._closed:
                raise EngineError("the producer pool is closed")
            if self._all_given_up():
                job.future.set_exception(self._given_up_error())
                return job.future
            self._jobs.append(job)
            self._ready.notify()
        return job.future

    def records(self) -> list[dict[str, Any]]:
        """Every producer's record so far, in the order they were given."""
        with self._ready:
            return [asdict(record) for record in self._records]

    def close(self) -> None:
        """Stop the workers and the producers; jobs not done yet fail (nothing waits on them)."""
        with self._ready:
            self._closed = True
            left, self._jobs = list(self._jobs), deque()
            self._ready.notify_all()
        for job in left:
            job.future.cancel()
        for producer in self.producers:
            producer.close()

    def _work(self, index: int) -> None:
        producer, record = self.producers[index], self._records[index]
        while True:
            with self._ready:
                while not self._closed and (self._down[index] or not self._jobs):
                    self._ready.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
            if job.future.cancelled():
                continue
            try:
                result = self.convert(producer.capture(job.ids))
            except ProducerDown as e:
                with self._ready:
                    if self._closed:  # its producer was stopped by close(): nobody takes it on
                        _settle(job.future, error=EngineError(f"{producer.name} was stopped"))
                        return
                    self._jobs.appendleft(job)
                    record.handed_on += 1
                    first = not self._down[index]  # this worker brings it back
                    self._down[index] = True
                    self._ready.notify_all()
                if first:
                    self._recover(index, e)
                continue
            except BaseException as e:  # the job's own error: the run stops on it
                _settle(job.future, error=e)
                continue
            with self._ready:
                record.samples += 1
                record.tokens += len(job.ids)
            _settle(job.future, result=result)

    def _recover(self, index: int, error: ProducerDown) -> None:
        producer, record = self.producers[index], self._records[index]
        log.warning(
            "%s stopped answering (%s); its work goes to the other producers while it is "
            "brought back (target.producers.recover_timeout_s=%g)",
            producer.name, error, self.recover_timeout_s,
        )  # fmt: skip
        try:
            producer.recover(time.monotonic() + self.recover_timeout_s)
        except Exception as e:  # noqa: BLE001 - ProducerDown, or a bug: given up either way
            if self._closed:
                return  # the run is ending: stopped while it was being brought back
            if not isinstance(e, ProducerDown):
                log.exception("bringing %s back failed", producer.name)
            with self._ready:
                record.given_up = str(e)
                failed = self._all_given_up() and not self._closed
                left = list(self._jobs) if failed else []
                if failed:
                    self._jobs.clear()
                self._ready.notify_all()
            log.error("%s given up: %s", producer.name, e)
            for job in left:
                _settle(job.future, error=self._given_up_error())
            return
        with self._ready:
            record.recoveries += 1
            self._down[index] = False
            self._ready.notify_all()
        log.warning("%s is back and takes work again", producer.name)

    def _all_given_up(self) -> bool:
        return all(record.given_up is not None for record in self._records)

    def _given_up_error(self) -> EngineError:
        why = "; ".join(f"{r.name}: {r.given_up}" for r in self._records)
        return ProducersGivenUp(
            f"every producer of the target's states stopped and did not come back within "
            f"target.producers.recover_timeout_s={self.recover_timeout_s:g} s ({why}); the "
            "checkpoints written so far are kept: run the same command again to resume."
        )


class ProducersGivenUp(EngineError, InputsStopped):
    """Every producer stopped and did not come back in time: the run saves and stops."""


def _settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Gives ``future`` its result or error, unless whoever waited on it cancelled it meanwhile
    (a run that stops cancels what it no longer waits for, captures in flight included)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled while its capture ran
        pass
