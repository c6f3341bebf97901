"""The engine thread: jobs from a bounded FIFO, handed to the decoder.

The HTTP side checks a request whole (serve/edge.py, decode/request.build_request), puts its Job
in a bounded queue (full: the caller answers 429) and reads the job's events.  The Worker hands
jobs to api.BatchGenerator between steps; a job leaves when it finishes or its `cancelled` is
set (a client gone).  `drain` ends it gracefully: no new jobs, the running ones finish (or are
cut at a deadline, ending as if at their max_tokens).

Which jobs decode, which wait, and what is prefilled while nothing waits (`prefill_when_idle`:
the conversations as their next requests will render them, while an agent runs its tools) is
the decoder's to decide (decode/decoder.py); the worker hands it jobs and offers as they come
and routes what comes out.
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from ..api import BatchGenerator
from ..decode.request import Request

DONE = object()
logger = logging.getLogger(__name__)


@dataclass
class Job:
    request: Request  # checked at the edge (decode/request.build_request)
    events: "queue.Queue" = field(default_factory=queue.Queue)  # GenerationResponse | Exception | DONE
    cancelled: threading.Event = field(default_factory=threading.Event)
    output: list[int] = field(default_factory=list)  # the tokens answered so far (the engine thread's)


class QueueFull(Exception):
    pass


class Draining(Exception):
    """The server is stopping: a job it will not start."""

    def __init__(self):
        super().__init__("the server is shutting down; send the request again once it is back")


def answer_error(job: Job, error: Exception) -> None:
    """`job` ended by `error`, its last event."""
    job.events.put(error)
    job.events.put(DONE)


class Worker:
    """Jobs handed to the decoder on the engine thread (`max_batch`, `max_batch_tokens`: the
    decoder's bounds; up to `max_queue` jobs may wait for it); `on_step(size, width, passes)`
    after each step, `on_finish(last response, cancelled)` when a job ends."""

    def __init__(
        self,
        model,
        tokenizer,
        max_queue: int = 16,
        *,
        max_batch: int = 8,
        max_batch_tokens: Optional[int] = None,
        prompt_cache=None,
        warm_up: bool = False,
        on_step=None,
        on_finish=None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_queue, self.on_step = max_queue, on_step
        self.active: dict[int, tuple[Job, Any]] = {}  # uid -> (job, its last response): running or waiting
        self.batch = BatchGenerator(model, tokenizer, max_batch, prompt_cache, max_batch_tokens)
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue()  # to the engine thread (None: a wake-up)
        self._offers: list[list[int]] = []  # prompts for idle prefills, to hand to the decoder
        self._stopping = False
        self._deadline: Optional[float] = None  # draining: when running jobs are cut
        self._closing = threading.Lock()
        self._closed = False  # the engine thread has ended: a job submitted now is refused
        self.on_finish = on_finish  # called with the last GenerationResponse of each finished job
        self.warm_up = warm_up  # a throw-away request first (jobs wait for it), on the engine thread
        self.warmed = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="dflash-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting or running."""
        return self._queued_jobs() + len(self.active)

    def _queued_jobs(self) -> int:
        """Jobs submitted and not yet handed to the decoder (wake-ups aside)."""
        with self.jobs.mutex:
            return sum(job is not None for job in self.jobs.queue)

    @property
    def waiting(self) -> int:
        """Jobs not yet prefilling, handed to the decoder or not: what max_queue bounds."""
        return self._queued_jobs() + len(self.batch.waiting)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def idle(self) -> bool:
        """Whether nothing is left to do: no job, no idle prefill running or offered."""
        with self._closing:
            offered = bool(self._offers)
        return not (offered or self._queued_jobs() or self.active or self.batch.busy)

    def submit(self, job: Job) -> Job:
        with self._closing:
            if self._closed or self._deadline is not None:
                raise Draining()
            if self.waiting >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting; retry later")
            self.jobs.put(job)
        return job

    def prefill_when_idle(self, prompt: list[int]) -> None:
        """Prefill `prompt` (a conversation as its next request will begin) into the prompt
        cache once no job waits (Decoder.prefill_when_idle)."""
        with self._closing:
            self._offers.append(prompt)
        self._wake()

    def stop(self) -> None:
        """Finish the current cycle and end (waiting jobs are dropped); safe to call twice."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout=30)

    def drain(self, seconds: float) -> None:
        """Start no more jobs (waiting ones get Draining), let the running ones finish for up to
        `seconds`, then end them as if they had reached their max_tokens; returns once the
        engine thread has ended."""
        self._deadline = time.monotonic() + seconds
        self._wake()
        self._thread.join(timeout=seconds + 30)

    def _wake(self) -> None:
        """An idle engine thread (blocked on the queue) looks again."""
        self.jobs.put(None)

    def _finished(self, job: Job, last, cancelled: bool) -> None:
        job.events.put(DONE)
        if self.on_finish is not None and last is not None:
            self.on_finish(last, cancelled=cancelled)

    def _thread_main(self) -> None:
        try:
            if self.warm_up:
                self.batch.warm_up()
            self.warmed.set()
            self._run()
        except BaseException:
            logger.exception("the engine thread stopped")
            raise
        finally:
            self.warmed.set()  # a failed warm-up: no one waits for ever (the engine has gone, jobs are refused)
            with self._closing:  # no job is left waiting for an engine that has gone
                self._closed = True
                self._fail_active(RuntimeError("the engine stopped before this request finished; send it again"))
                self._refuse_waiting()
            self.batch.close()
            # MLX keeps streams per thread; a thread that ran compiled functions and leaves
            # its streams behind aborts the process at exit ("terminate called without an
            # active exception", MLX 0.32)
            mx.clear_streams()

    def _run(self) -> None:
        while not self._stopping:
            if self._deadline is not None and self._drained():
                return
            if not self._take():
                return
            self._drop_cancelled()
            if not self.batch.busy:
                continue
            try:
                responses = self.batch.next()
            except Exception as error:  # not a request's own failure (those are in batch.failed): all fail
                logger.exception("a decode step failed outside any request; failing every running request")
                self._fail(set(self.active), error)
                continue
            if self.batch.failed:
                self._fail_requests(self.batch.failed)
            step = self.batch.last_step
            if self.on_step is not None and step is not None:
                self.on_step(step.size, step.width, step.passes)
            for uid, response in responses:
                job, _ = self.active[uid]
                job.output += response.tokens
                job.events.put(response)
                self.active[uid] = (job, response)
                if response.finish_reason:
                    del self.active[uid]
                    self._finished(job, response, cancelled=False)

    def _take(self) -> bool:
        """The offered prefills and the jobs submitted handed to the decoder (waiting for a job,
        or a wake-up, when it has nothing to do); False when stopping."""
        with self._closing:
            offers, self._offers = self._offers, []
        if self._deadline is None:
            for prompt in offers:
                self.batch.prefill_when_idle(prompt)
        while True:
            try:
                job = self.jobs.get(block=not self.batch.busy)
            except queue.Empty:
                break
            if self._stopping:
                return False
            if job is None:  # a wake-up: look at what there is to do
                if self.batch.busy:
                    continue
                break
            if job.cancelled.is_set():
                job.events.put(DONE)
                continue
            try:
                uid = self.batch.add(job.request)
            except Exception as e:  # not its values (checked at the edge): the engine's own failure
                answer_error(job, e)
                continue
            self.active[uid] = (job, None)
        return True

    def _drained(self) -> bool:
        """Draining: waiting jobs refused, running ones cut once the deadline is past; True when
        nothing runs any more."""
        self._refuse_waiting()
        if self.active and time.monotonic() >= self._deadline:
            for uid, (job, _) in list(self.active.items()):
                del self.active[uid]
                end = self.batch.cut(uid)
                if end is None:  # nothing out yet: refused as a waiting job is
                    answer_error(job, Draining())
                    continue
                job.events.put(end)
                self._finished(job, end, cancelled=False)
        return not self.active

    def _refuse_waiting(self) -> None:
        """Jobs not yet prefilling refused (the worker is draining or ending), offers forgotten."""
        self._offers.clear()
        for uid in self.batch.waiting:
            if uid in self.active:
                job, _ = self.active.pop(uid)
                self.batch.discard(uid)
                answer_error(job, Draining())
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                answer_error(job, Draining())

    def _drop_cancelled(self) -> None:
        for uid, (job, last) in list(self.active.items()):
            if job.cancelled.is_set():
                self.batch.remove(uid)
                del self.active[uid]
                self._finished(job, last, cancelled=True)

    def _fail_requests(self, failed: dict) -> None:
        """The jobs of the requests that failed in a step (already dropped by the batch, nothing
        of them kept) get their error; the others decode on."""
        for uid in [uid for uid in failed if uid in self.active]:
            job, _ = self.active.pop(uid)
            answer_error(job, failed[uid])

    def _fail(self, uids: set, error: Exception) -> None:
        """Jobs of `uids` failed with `error`, their rows dropped keeping nothing."""
        for uid in uids:
            try:
                self.batch.discard(uid)
            except Exception:  # the batch is broken too: the job is answered all the same
                logger.exception("dropping failed request %d", uid)
        self._fail_requests(dict.fromkeys(uids, error))

    def _fail_active(self, error: Exception) -> None:
        """Every job still running or waiting answered with `error` (the engine thread is ending)."""
        for job, _ in self.active.values():
            answer_error(job, error)
        self.active = {}
