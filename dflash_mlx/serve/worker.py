"""The engine thread: jobs from a bounded FIFO, decoded together.

The HTTP side puts a Job in a bounded queue (full: the caller answers 429) and
reads the job's events.  The Worker decodes up to `max_batch` jobs together
(api.BatchGenerator; one at a time where the target cannot batch, e.g. the
pipeline-parallel mode): a job joins between steps, and leaves when it finishes or
its `cancelled` is set (a client gone), freeing its row for the next.  `drain` ends it
gracefully: no new jobs, the running ones finish (or are cut at a deadline, ending as if at
their max_tokens).

While nothing waits (an agent is running its tools; others may be decoding), the worker
prefills the conversations as their next requests will render them (`prefill_when_idle`),
into the prompt cache, on a row of its own beside a full batch; a request arriving meanwhile
stops that, or waits for it when it continues that very conversation (the prefill is then its
own).
"""

import copy
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from ..api import BatchGenerator

DONE = object()
logger = logging.getLogger(__name__)


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    options: dict  # temp, top_p, top_k, seed, block_size, stop
    events: "queue.Queue" = field(default_factory=queue.Queue)  # GenerationResponse | Exception | DONE
    cancelled: threading.Event = field(default_factory=threading.Event)
    output: list[int] = field(default_factory=list)  # the tokens answered so far (the engine thread's)


class QueueFull(Exception):
    pass


class Draining(Exception):
    """The server is stopping: a job it will not start."""

    def __init__(self):
        super().__init__("the server is shutting down; send the request again once it is back")


class Worker:
    """Up to `max_batch` jobs decoded together on the engine thread; `on_step(size, width, passes)`
    after each step, `on_finish(last response, cancelled)` when a job ends."""

    def __init__(
        self,
        model,
        tokenizer,
        max_queue: int = 16,
        on_finish=None,
        max_batch: int = 8,
        prompt_cache=None,
        on_step=None,
        max_batch_tokens: Optional[int] = None,
        warm_up: bool = False,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.on_step = max_batch, on_step
        self.active: dict[int, tuple[Job, Any]] = {}  # uid -> (job, its last response)
        # where requests are batched, one row more than max_batch: the idle prefills' (they run beside a full batch)
        self.rows = max_batch + 1 if max_batch > 1 and prompt_cache is not None else max_batch
        self.batch = BatchGenerator(model, tokenizer, self.rows, prompt_cache, max_batch_tokens)
        self.jobs: "queue.Queue[Optional[Job]]" = queue.Queue(maxsize=max_queue)
        self._stopping = False
        self._deadline: Optional[float] = None  # draining: when running jobs are cut
        self._closing = threading.Lock()
        self._closed = False  # the engine thread has ended: a job submitted now is refused
        self.on_finish = on_finish  # called with the last GenerationResponse of each finished job
        self.prompt_cache = prompt_cache
        # an idle prefill of fewer new tokens saves the next turn less than the extra pass costs
        # when the client comes back at once (it waits for that pass): its closing tokens alone
        self.idle_prefill_min_tokens = 32
        self.idle_prompts: deque = deque(maxlen=max_batch)  # prefilled when idle, latest last
        self.idle_prefill: Optional[tuple[int, list[int]]] = None  # (uid, prompt) running
        self.held: list[Job] = []  # jobs continuing the idle prefill's conversation: they wait for it
        self._admitted: deque = deque(maxlen=4 * max_batch)  # recent prompts: an idle prefill they extend is stale
        self._idle_lock = threading.Lock()  # idle_prompts and _admitted: the HTTP side adds, the engine takes
        self.warm_up = warm_up  # a throw-away request first (jobs wait for it), on the engine thread
        self.warmed = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="dflash-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return self.jobs.qsize() + len(self.held) + self.running

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> Job:
        with self._closing:
            if self._closed or self._deadline is not None:
                raise Draining()
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                raise QueueFull(f"{self.jobs.maxsize} requests are already waiting; retry later") from None
        return job

    def prefill_when_idle(self, prompt: list[int]) -> None:
        """Prefill `prompt` into the prompt cache once nothing waits or runs (the conversation as
        its next request will begin: a chat answer re-tokenised as the client sends it back, and
        the turn's closing tokens).  Latest first; the oldest are forgotten past max_batch."""
        with self._idle_lock:
            if self.prompt_cache is None or any(extends(seen, prompt) for seen in self._admitted):
                return  # asked for already: the next request came first
            for earlier in [p for p in self.idle_prompts if extends(prompt, p)]:
                self.idle_prompts.remove(earlier)  # the same conversation, further on
            self.idle_prompts.append(prompt)
        try:
            self.jobs.put_nowait(None)  # wakes an idle engine thread
        except queue.Full:
            pass

    def stop(self) -> None:
        """Finish the current cycle and end (waiting jobs are dropped); safe to call twice."""
        self._stopping = True
        try:
            self.jobs.put_nowait(None)  # wakes an idle engine thread
        except queue.Full:
            pass
        self._thread.join(timeout=30)

    def drain(self, seconds: float) -> None:
        """Start no more jobs (waiting ones get Draining), let the running ones finish for up to
        `seconds`, then end them as if they had reached their max_tokens; returns once the
        engine thread has ended."""
        self._deadline = time.monotonic() + seconds
        try:
            self.jobs.put_nowait(None)  # wakes an idle engine thread
        except queue.Full:
            pass
        self._thread.join(timeout=seconds + 30)

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

    @property
    def running(self) -> int:
        return len(self.active)

    def _run(self) -> None:
        while not self._stopping:
            if self._deadline is not None and self._drained():
                return
            if not self._admit():
                return
            self._drop_cancelled()
            if not self.active and self.idle_prefill is None:
                continue
            try:
                responses = self.batch.next()
            except Exception as error:  # not a request's own failure (those are in batch.failed): all fail
                logger.exception("a decode step failed outside any request; failing every running request")
                self._fail(set(self.active) | ({self.idle_prefill[0]} if self.idle_prefill else set()), error)
                continue
            if self.batch.failed:
                self._fail_requests(self.batch.failed)
            step = self.batch.last_step
            if self.on_step is not None and step is not None:
                self.on_step(step.size, step.width, step.passes)
            for uid, response in responses:
                if self.idle_prefill is not None and uid == self.idle_prefill[0]:
                    if response.finish_reason:  # its one token is out: its prompt's state is kept
                        self.idle_prefill = None
                    continue
                job, _ = self.active[uid]
                job.output += response.tokens
                job.events.put(response)
                self.active[uid] = (job, response)
                if response.finish_reason:
                    del self.active[uid]
                    self._finished(job, response, cancelled=False)

    def _admit(self) -> bool:
        """Take waiting jobs while there is room (blocking when idle) and the worker is not
        draining, then, when none waits, start an idle prefill; False when stopping."""
        while len(self.active) < self.max_batch and self._deadline is None:
            if self.held and self.idle_prefill is None:
                job = self.held.pop(0)
            else:
                try:
                    job = self.jobs.get(block=not self.active and self.idle_prefill is None and not self.idle_prompts)
                except queue.Empty:
                    break
            if self._stopping:
                return False
            if job is None or job.cancelled.is_set():  # None: a wake-up
                continue
            if self.idle_prefill is not None:
                if extends(job.prompt, self.idle_prefill[1]):
                    self.held.append(job)  # its conversation's prefill is under way: it is this job's
                    continue
                self._stop_idle_prefill()  # idle time is over
            with self._idle_lock:
                self._admitted.append(job.prompt)
                stale = [p for p in self.idle_prompts if extends(job.prompt, p)]
                for prompt in stale:
                    self.idle_prompts.remove(prompt)
            try:
                uid = self.batch.insert(job.prompt, job.max_tokens, **job.options)
            except Exception as e:
                job.events.put(e)
                job.events.put(DONE)
                continue
            self.active[uid] = (job, None)
        if (
            self.idle_prefill is None
            and self.idle_prompts
            and len(self.active) < self.rows
            and not self._jobs_waiting()
            and self._deadline is None
        ):
            self._start_idle_prefill()
        return True

    def _jobs_waiting(self) -> bool:
        """Whether a job is queued (wake-ups aside: a full batch leaves them in the queue)."""
        with self.jobs.mutex:
            return any(job is not None for job in self.jobs.queue)

    def _start_idle_prefill(self) -> None:
        """The latest idle prompt prefilled, unless the prompt cache or a running job's tokens
        (its answer so far, where its text reads back as the model wrote it) hold all of it but
        idle_prefill_min_tokens."""
        with self._idle_lock:
            prompt = self.idle_prompts.pop()
        held = prompt[: len(prompt) - self.idle_prefill_min_tokens + 1]
        if self.prompt_cache.covered(prompt) >= len(held) or any(
            extends(job.prompt + job.output, held) for job, _ in self.active.values()
        ):
            return
        try:
            self.idle_prefill = (self.batch.insert(prompt, 1), prompt)
        except ValueError:  # too long for the context: a request would be refused too
            pass

    def _stop_idle_prefill(self) -> None:
        if self.idle_prefill is not None:
            self.batch.remove(self.idle_prefill[0])
            self.idle_prefill = None

    def _drained(self) -> bool:
        """Draining: waiting jobs refused, running ones cut once the deadline is past; True when
        nothing runs any more."""
        self._refuse_waiting()
        if self.active and time.monotonic() >= self._deadline:
            for uid, (job, last) in list(self.active.items()):
                self.batch.remove(uid)
                del self.active[uid]
                if last is None:  # nothing out yet: refused as a waiting job is
                    job.events.put(Draining())
                    job.events.put(DONE)
                    continue
                end = copy.copy(last)
                end.text, end.tokens, end.accepted, end.logprobs = "", [], 0, None
                end.stop_sequence, end.finish_reason = None, "length"
                job.events.put(end)
                self._finished(job, end, cancelled=False)
        return not self.active

    def _refuse_waiting(self) -> None:
        self._stop_idle_prefill()
        with self._idle_lock:
            self.idle_prompts.clear()
        for job in self.held:
            job.events.put(Draining())
            job.events.put(DONE)
        self.held = []
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.events.put(Draining())
                job.events.put(DONE)

    def _drop_cancelled(self) -> None:
        for job in [job for job in self.held if job.cancelled.is_set()]:
            self.held.remove(job)
            job.events.put(DONE)
        for uid, (job, last) in list(self.active.items()):
            if job.cancelled.is_set():
                self.batch.remove(uid)
                del self.active[uid]
                self._finished(job, last, cancelled=True)

    def _fail_requests(self, failed: dict) -> None:
        """The jobs of the requests that failed in a step (already dropped by the batch, nothing
        of them kept) get their error; the others decode on."""
        if self.idle_prefill is not None and self.idle_prefill[0] in failed:
            error = failed[self.idle_prefill[0]]  # no client to answer: said here (a job's is logged as its 500)
            logger.error("an idle prefill failed: %s", error, exc_info=error)
            self.idle_prefill = None
        for uid in [uid for uid in failed if uid in self.active]:
            job, _ = self.active.pop(uid)
            job.events.put(failed[uid])
            job.events.put(DONE)

    def _fail(self, uids: set, error: Exception) -> None:
        """Jobs of `uids` failed with `error`, their rows dropped keeping nothing."""
        for uid in uids:
            try:
                self.batch.discard(uid)
            except Exception:  # the batch is broken too: the job is answered all the same
                logger.exception("dropping failed request %d", uid)
        self._fail_requests(dict.fromkeys(uids, error))

    def _fail_active(self, error: Exception) -> None:
        """Every job still running or held answered with `error` (the engine thread is ending)."""
        for job, _ in self.active.values():
            job.events.put(error)
            job.events.put(DONE)
        self.active = {}
        for job in self.held:
            job.events.put(error)
            job.events.put(DONE)
        self.held = []


def extends(prompt: list[int], prefix: list[int]) -> bool:
    return len(prompt) >= len(prefix) and prompt[: len(prefix)] == prefix
