"""One model's queue: sentences from every waiting request go to the engine together, one call per batch."""

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..translators import Decoding


class QueueFull(Exception):
    """The model's queue holds max_queue_sentences: the request is refused (503), not queued."""


@dataclass
class Job:
    sentences: list[str]
    tokens: int
    decoding: Decoding
    future: asyncio.Future
    queued: float = field(default_factory=time.perf_counter)


class Batcher:
    """Requests wait in one queue. As soon as an engine thread is free, the batcher takes every request waiting, up
    to max_batch_tokens source tokens (and, with max_delay_ms, whatever else arrives that long after the first), and
    makes one engine call per kind of decoding among them, in that thread: the event loop keeps answering. While the
    engines are busy the queue fills, so batches grow with the load and a lone request never waits for company.
    Each request gets its own results, in order; a call that fails is retried request by request, so one request's
    bad sentence fails only that request."""

    def __init__(self, translate: Callable, max_batch_tokens: int, max_delay_ms: float, max_queue_sentences: int,
                 on_batch: Callable[[int, float], None], workers: int = 1):  # fmt: skip
        """translate(sentences, decoding) -> each sentence's [(score, text), ...], called from `workers` threads at
        once; on_batch(sentences, seconds) after each engine call (metrics)."""
        self.translate, self.workers = translate, workers
        self.max_batch_tokens, self.max_delay = max_batch_tokens, max_delay_ms / 1000
        self.max_queue_sentences, self.on_batch = max_queue_sentences, on_batch
        self.pending: deque[Job] = deque()
        self.arrived = asyncio.Event()
        self.waiting = 0  # sentences queued or being translated
        self.engine = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engine")
        self.task: asyncio.Task | None = None
        self.calls: set[asyncio.Task] = set()  # batches in the engine threads

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.engine.shutdown(wait=False, cancel_futures=True)

    async def submit(self, sentences: list[str], decoding: Decoding,
                     tokens: int) -> tuple[list[list[tuple[float, str]]], float]:  # fmt: skip
        """Each sentence's hypotheses, and the seconds from queueing to results. `tokens`: the sentences' source
        tokens, as the caller counted them."""
        if self.waiting + len(sentences) > self.max_queue_sentences:
            raise QueueFull(f"{self.waiting} sentences are waiting (max_queue_sentences={self.max_queue_sentences})")
        job = Job(sentences, tokens, decoding, asyncio.get_running_loop().create_future())
        self.waiting += len(sentences)
        try:
            self.pending.append(job)
            self.arrived.set()
            return await job.future, time.perf_counter() - job.queued
        finally:
            self.waiting -= len(sentences)

    async def run(self) -> None:
        loop, free = asyncio.get_running_loop(), asyncio.Semaphore(self.workers)
        while True:
            await free.acquire()  # requests queue up while every engine thread is busy
            while not self.pending:
                self.arrived.clear()
                await self.arrived.wait()
            if self.max_delay:
                await self.gather_until(loop.time() + self.max_delay - (time.perf_counter() - self.pending[0].queued))
            batch = [self.pending.popleft()]
            tokens = batch[0].tokens
            while self.pending and tokens + self.pending[0].tokens <= self.max_batch_tokens:
                tokens += self.pending[0].tokens
                batch.append(self.pending.popleft())
            call = loop.create_task(self.dispatch(batch, loop))
            self.calls.add(call)
            call.add_done_callback(lambda done: (self.calls.discard(done), free.release()))

    async def gather_until(self, deadline: float) -> None:
        """Wait for more requests until `deadline` (the loop's clock) or until a batch's worth of tokens waits."""
        loop = asyncio.get_running_loop()
        while sum(job.tokens for job in self.pending) < self.max_batch_tokens and (left := deadline - loop.time()) > 0:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on, another class in 3.10
                return

    async def dispatch(self, batch: list[Job], loop) -> None:
        try:
            for decoding in dict.fromkeys(job.decoding for job in batch):
                await self.call([job for job in batch if job.decoding == decoding], decoding, loop)
        finally:  # whatever happened, no request taken off the queue is left waiting
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(RuntimeError("the engine call was interrupted"))

    async def call(self, jobs: list[Job], decoding: Decoding, loop) -> None:
        jobs = [job for job in jobs if not job.future.done()]  # a client that went away cancelled its future
        if not jobs:
            return
        sentences = [s for job in jobs for s in job.sentences]
        start = time.perf_counter()
        try:
            found = await loop.run_in_executor(self.engine, self.translate, sentences, decoding)
        except Exception as error:
            if len(jobs) == 1:
                if not jobs[0].future.done():
                    jobs[0].future.set_exception(error)
                return
            for job in jobs:  # one at a time: only the request that fails gets the error
                await self.call([job], decoding, loop)
            return
        self.on_batch(len(sentences), time.perf_counter() - start)
        done = 0
        for job in jobs:
            if not job.future.done():
                job.future.set_result(found[done : done + len(job.sentences)])
            done += len(job.sentences)
