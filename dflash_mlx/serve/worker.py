"""The engine thread: jobs from a bounded FIFO, decoded in batches or one at a time.

The HTTP side puts a Job in a bounded queue (full: the caller answers 429) and
reads the job's events.  BatchWorker decodes up to `max_batch` jobs together
(api.BatchGenerator): a job joins between steps, and leaves when it finishes or
its `cancelled` is set (a client gone), freeing its row for the next.  Worker runs
`stream_generate` for one job at a time (the pipeline-parallel mode, --max-batch 1).
"""

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from ..api import BatchGenerator, stream_generate

DONE = object()


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    options: dict  # temp, top_p, top_k, seed, block_size, stop
    events: "queue.Queue" = field(default_factory=queue.Queue)  # GenerationResponse | Exception | DONE
    cancelled: threading.Event = field(default_factory=threading.Event)


class QueueFull(Exception):
    pass


class _Engine:
    """The queue and thread every worker has; `_run` is what the thread does."""

    running = 0  # jobs being decoded

    def __init__(self, model, tokenizer, max_queue: int = 16, on_finish=None):
        self.model, self.tokenizer = model, tokenizer
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=max_queue)
        self._stopping = False
        self.on_finish = on_finish  # called with the last GenerationResponse of each finished job
        self._thread = threading.Thread(target=self._thread_main, name="dflash-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return self.jobs.qsize() + self.running

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> Job:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.jobs.maxsize} requests are already waiting; retry later") from None
        return job

    def stop(self) -> None:
        """Finish the current cycle and end (waiting jobs are dropped); safe to call twice."""
        self._stopping = True
        try:
            self.jobs.put_nowait(None)  # wakes an idle engine thread
        except queue.Full:
            pass
        self._thread.join(timeout=30)

    def _finished(self, job: Job, last, cancelled: bool) -> None:
        job.events.put(DONE)
        if self.on_finish is not None and last is not None:
            self.on_finish(last, cancelled=cancelled)

    def _thread_main(self) -> None:
        try:
            self._run()
        finally:
            # MLX keeps streams per thread; a thread that ran compiled functions and leaves
            # its streams behind aborts the process at exit ("terminate called without an
            # active exception", MLX 0.32)
            mx.clear_streams()

    def _run(self) -> None:
        raise NotImplementedError


class Worker(_Engine):
    """One job at a time."""

    def _run(self) -> None:
        while not self._stopping and (job := self.jobs.get()) is not None:
            if job.cancelled.is_set() or self._stopping:
                continue
            self.running = 1
            try:
                self._serve(job)
            finally:
                self.running = 0

    def _serve(self, job: Job) -> None:
        last: Any = None
        cancelled = False
        try:
            steps = stream_generate(self.model, self.tokenizer, job.prompt, job.max_tokens, **job.options)
            for last in steps:
                job.events.put(last)
                if job.cancelled.is_set() or self._stopping:
                    cancelled = last.finish_reason is None
                    steps.close()
                    break
        except Exception as e:  # handed to the HTTP side, which answers 4xx/5xx
            job.events.put(e)
            job.events.put(DONE)
            return
        self._finished(job, last, cancelled)


class BatchWorker(_Engine):
    """Up to `max_batch` jobs decoded together; `on_step(size, width)` after each batch step."""

    def __init__(self, model, tokenizer, max_queue: int = 16, on_finish=None, max_batch: int = 8,
                 prompt_cache=None, on_step=None, max_batch_tokens: Optional[int] = None):
        self.max_batch, self.prompt_cache, self.on_step = max_batch, prompt_cache, on_step
        self.active: dict[int, tuple[Job, Any]] = {}  # uid -> (job, its last response)
        self.batch = BatchGenerator(model, tokenizer, max_batch, prompt_cache, max_batch_tokens)
        super().__init__(model, tokenizer, max_queue, on_finish)

    @property
    def running(self) -> int:
        return len(self.active)

    def _run(self) -> None:
        while not self._stopping:
            if not self._admit():
                return
            self._drop_cancelled()
            if not self.active:
                continue
            try:
                responses = self.batch.next()
            except Exception as e:  # a failed step fails the jobs in it; the engine goes on
                self._fail_all(e)
                continue
            if self.on_step is not None and self.batch.last_step is not None:
                self.on_step(self.batch.last_step.size, self.batch.last_step.width)
            for uid, response in responses:
                job, _ = self.active[uid]
                job.events.put(response)
                self.active[uid] = (job, response)
                if response.finish_reason:
                    del self.active[uid]
                    self._finished(job, response, cancelled=False)

    def _admit(self) -> bool:
        """Take waiting jobs while there is room (blocking when idle); False when stopping."""
        while len(self.active) < self.max_batch:
            try:
                job = self.jobs.get(block=not self.active)
            except queue.Empty:
                return True
            if job is None or self._stopping:
                return False
            if job.cancelled.is_set():
                continue
            options = {k: v for k, v in job.options.items() if k != "prompt_cache"}  # the batch has its own
            try:
                uid = self.batch.insert(job.prompt, job.max_tokens, **options)
            except Exception as e:
                job.events.put(e)
                job.events.put(DONE)
                continue
            self.active[uid] = (job, None)
        return True

    def _drop_cancelled(self) -> None:
        for uid, (job, last) in list(self.active.items()):
            if job.cancelled.is_set():
                self.batch.remove(uid)
                del self.active[uid]
                self._finished(job, last, cancelled=True)

    def _fail_all(self, error: Exception) -> None:
        for uid, (job, _) in self.active.items():
            self.batch.remove(uid)
            job.events.put(error)
            job.events.put(DONE)
        self.active = {}
