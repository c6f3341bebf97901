"""One engine, one request at a time: a FIFO of jobs served by a single thread.

The HTTP side puts a Job in a bounded queue (full: the caller answers 429) and
reads the job's events; the engine thread runs `stream_generate` for it and
checks `cancelled` after every decode cycle, so a client that goes away frees
the engine at the next cycle.  Requests never share caches: each decode builds
its own.
"""

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from ..api import stream_generate

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


class Worker:
    def __init__(self, model, tokenizer, max_queue: int = 16, on_finish=None):
        self.model, self.tokenizer = model, tokenizer
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=max_queue)
        self.busy = False
        self._stopping = False
        self.on_finish = on_finish  # called with the last GenerationResponse of each finished job
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return self.jobs.qsize() + int(self.busy)

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

    def _run(self) -> None:
        while not self._stopping and (job := self.jobs.get()) is not None:
            if job.cancelled.is_set() or self._stopping:
                continue
            self.busy = True
            try:
                self._serve(job)
            finally:
                self.busy = False

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
            return
        finally:
            job.events.put(DONE)
        if self.on_finish is not None and last is not None:
            self.on_finish(last, cancelled=cancelled)
