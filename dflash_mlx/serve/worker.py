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
own).  IdlePrefills keeps that bookkeeping; the Worker runs it.
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


def answer_error(job: Job, error: Exception) -> None:
    """`job` ended by `error`, its last event."""
    job.events.put(error)
    job.events.put(DONE)


class Worker:
    """Up to `max_batch` jobs decoded together on the engine thread; `on_step(size, width, passes)`
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
        self.idle = IdlePrefills(self.batch, prompt_cache, max_batch)
        self.warm_up = warm_up  # a throw-away request first (jobs wait for it), on the engine thread
        self.warmed = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="dflash-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return self.jobs.qsize() + len(self.idle.held) + self.running

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # the idle prefills' state, on the worker where tests watch it (and tune min_tokens)
    @property
    def idle_prompts(self) -> deque:
        return self.idle.prompts

    @property
    def idle_prefill(self) -> Optional[tuple[int, list[int]]]:
        return self.idle.running

    @property
    def held(self) -> list[Job]:
        return self.idle.held

    @property
    def idle_prefill_min_tokens(self) -> int:
        return self.idle.min_tokens

    @idle_prefill_min_tokens.setter
    def idle_prefill_min_tokens(self, tokens: int) -> None:
        self.idle.min_tokens = tokens

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
        """Prefill `prompt` into the prompt cache once nothing waits or runs (IdlePrefills.offer:
        latest first; the oldest are forgotten past max_batch)."""
        if self.idle.offer(prompt):
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
        try:
            self.jobs.put_nowait(None)
        except queue.Full:  # a full queue wakes it anyway
            pass

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
            if not self.active and self.idle.running is None:
                continue
            try:
                responses = self.batch.next()
            except Exception as error:  # not a request's own failure (those are in batch.failed): all fail
                logger.exception("a decode step failed outside any request; failing every running request")
                self._fail(set(self.active) | self.idle.uids(), error)
                continue
            if self.batch.failed:
                self._fail_requests(self.batch.failed)
            step = self.batch.last_step
            if self.on_step is not None and step is not None:
                self.on_step(step.size, step.width, step.passes)
            for uid, response in responses:
                if self.idle.stepped(uid, response):
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
            job = self.idle.next_held()
            if job is None:
                try:
                    job = self.jobs.get(block=not self.active and not self.idle.busy)
                except queue.Empty:
                    break
            if self._stopping:
                return False
            if job is None or job.cancelled.is_set():  # None: a wake-up
                continue
            if self.idle.hold(job):
                continue
            self.idle.admitted(job.prompt)
            try:
                uid = self.batch.insert(job.prompt, job.max_tokens, **job.options)
            except Exception as e:
                answer_error(job, e)
                continue
            self.active[uid] = (job, None)
        if self.idle.ready and len(self.active) < self.rows and not self._jobs_waiting() and self._deadline is None:
            self.idle.start([job for job, _ in self.active.values()])
        return True

    def _jobs_waiting(self) -> bool:
        """Whether a job is queued (wake-ups aside: a full batch leaves them in the queue)."""
        with self.jobs.mutex:
            return any(job is not None for job in self.jobs.queue)

    def _drained(self) -> bool:
        """Draining: waiting jobs refused, running ones cut once the deadline is past; True when
        nothing runs any more."""
        self._refuse_waiting()
        if self.active and time.monotonic() >= self._deadline:
            for uid, (job, last) in list(self.active.items()):
                self.batch.remove(uid)
                del self.active[uid]
                if last is None:  # nothing out yet: refused as a waiting job is
                    answer_error(job, Draining())
                    continue
                end = copy.copy(last)
                end.text, end.tokens, end.accepted, end.logprobs = "", [], 0, None
                end.stop_sequence, end.finish_reason = None, "length"
                job.events.put(end)
                self._finished(job, end, cancelled=False)
        return not self.active

    def _refuse_waiting(self) -> None:
        self.idle.clear()
        for job in self.idle.take_held():
            answer_error(job, Draining())
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                answer_error(job, Draining())

    def _drop_cancelled(self) -> None:
        for job in self.idle.drop_cancelled():
            job.events.put(DONE)
        for uid, (job, last) in list(self.active.items()):
            if job.cancelled.is_set():
                self.batch.remove(uid)
                del self.active[uid]
                self._finished(job, last, cancelled=True)

    def _fail_requests(self, failed: dict) -> None:
        """The jobs of the requests that failed in a step (already dropped by the batch, nothing
        of them kept) get their error; the others decode on."""
        self.idle.failed(failed)
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
        """Every job still running or held answered with `error` (the engine thread is ending)."""
        for job, _ in self.active.values():
            answer_error(job, error)
        self.active = {}
        for job in self.idle.take_held():
            answer_error(job, error)


class IdlePrefills:
    """The conversations the Worker prefills while nothing waits (Worker.prefill_when_idle), one
    at a time on a row of its own: the HTTP side offers prompts, the engine thread runs them,
    latest first.  A job continuing the conversation being prefilled waits for it (`held`: the
    prefill is then its own); any other job stops it (idle time is over)."""

    def __init__(self, batch, prompt_cache, max_batch: int):
        self.batch, self.prompt_cache = batch, prompt_cache
        # an idle prefill of fewer new tokens saves the next turn less than the extra pass costs
        # when the client comes back at once (it waits for that pass): its closing tokens alone
        self.min_tokens = 32
        self.prompts: deque = deque(maxlen=max_batch)  # offered, latest last
        self.running: Optional[tuple[int, list[int]]] = None  # (uid, prompt) being prefilled
        self.held: list[Job] = []  # jobs continuing the running prefill's conversation: they wait for it
        self._admitted: deque = deque(maxlen=4 * max_batch)  # recent prompts: an idle prefill they extend is stale
        self._lock = threading.Lock()  # prompts and _admitted: the HTTP side adds, the engine thread takes

    def offer(self, prompt: list[int]) -> bool:
        """Prefill `prompt` once nothing waits or runs (the conversation as its next request will
        begin: a chat answer re-tokenised as the client sends it back, and the turn's closing
        tokens); the oldest are forgotten past max_batch.  False when there is nothing to do."""
        with self._lock:
            if self.prompt_cache is None or any(extends(seen, prompt) for seen in self._admitted):
                return False  # asked for already: the next request came first
            for earlier in [p for p in self.prompts if extends(prompt, p)]:
                self.prompts.remove(earlier)  # the same conversation, further on
            self.prompts.append(prompt)
        return True

    @property
    def busy(self) -> bool:
        """Whether a prefill runs or waits to start (the engine thread has work without jobs)."""
        return self.running is not None or bool(self.prompts)

    @property
    def ready(self) -> bool:
        """Whether a prefill can start: one is offered and none runs."""
        return self.running is None and bool(self.prompts)

    def uids(self) -> set[int]:
        """The batch row the running prefill decodes on, if any."""
        return {self.running[0]} if self.running is not None else set()

    def admitted(self, prompt: list[int]) -> None:
        """A job's `prompt` joined the batch: the offered prompts it extends are stale, and so
        will be any offered later (offer)."""
        with self._lock:
            self._admitted.append(prompt)
            for stale in [p for p in self.prompts if extends(prompt, p)]:
                self.prompts.remove(stale)

    def hold(self, job: Job) -> bool:
        """A job arriving while a prefill runs: held (True) when it continues that conversation,
        else the prefill is stopped and the job goes in."""
        if self.running is None:
            return False
        if extends(job.prompt, self.running[1]):
            self.held.append(job)  # its conversation's prefill is under way: it is this job's
            return True
        self.stop()
        return False

    def next_held(self) -> Optional[Job]:
        """A held job, once the prefill it waited for is in."""
        return self.held.pop(0) if self.held and self.running is None else None

    def start(self, active: list[Job]) -> None:
        """The latest offered prompt prefilled, unless the prompt cache or an `active` job's tokens
        (its answer so far, where its text reads back as the model wrote it) hold all of it but
        min_tokens."""
        with self._lock:
            prompt = self.prompts.pop()
        enough = prompt[: len(prompt) - self.min_tokens + 1]
        if self.prompt_cache.covered(prompt) >= len(enough) or any(
            extends(job.prompt + job.output, enough) for job in active
        ):
            return
        try:
            self.running = (self.batch.insert(prompt, 1), prompt)
        except ValueError:  # too long for the context: a request would be refused too
            pass

    def stepped(self, uid: int, response) -> bool:
        """Whether `response` is the running prefill's (its one token out: its prompt's state is
        kept, and the row free)."""
        if self.running is None or uid != self.running[0]:
            return False
        if response.finish_reason:
            self.running = None
        return True

    def failed(self, failed: dict) -> None:
        """The running prefill's row failed in a step (`failed`: uid -> error): no client to
        answer, so it is said here (a job's error is logged as its 500)."""
        if self.running is not None and self.running[0] in failed:
            error = failed[self.running[0]]
            logger.error("an idle prefill failed: %s", error, exc_info=error)
            self.running = None

    def stop(self) -> None:
        if self.running is not None:
            self.batch.remove(self.running[0])
            self.running = None

    def clear(self) -> None:
        """The running prefill stopped and the offered ones forgotten (the worker is draining or ending)."""
        self.stop()
        with self._lock:
            self.prompts.clear()

    def drop_cancelled(self) -> list[Job]:
        """The held jobs whose clients have gone, no longer held."""
        cancelled = [job for job in self.held if job.cancelled.is_set()]
        for job in cancelled:
            self.held.remove(job)
        return cancelled

    def take_held(self) -> list[Job]:
        """Every held job, no longer held."""
        held, self.held = self.held, []
        return held


def extends(prompt: list[int], prefix: list[int]) -> bool:
    return len(prompt) >= len(prefix) and prompt[: len(prefix)] == prefix
