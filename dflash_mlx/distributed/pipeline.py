"""A target whose layers are split over the ranks of an mlx.distributed group.

Rank r holds a contiguous run of layers (rank 0 the last ones, as mlx-lm's
PipelineMixin splits them): hidden states go from the rank holding the first
layers down to rank 0, then every rank gets the final hidden state. Rank 0 is
the *driver*: it runs the decode loop, the drafter, the output head and
sampling, exactly as on one machine. The other ranks *follow*: the driver's
calls on the target and its caches (make, checkpoint, roll back, forward) are
sent to them as a small program of int32 words, which they replay on their own
layers' caches, so every rank rolls back to the length the driver decided.

Per target pass the network carries: the program (<= 256 bytes for a verify),
the hidden state from stage to stage, the final hidden state to every rank, and
once per pass the features of the drafter's target layers (summed from the
ranks that computed them). Every wait is bounded: a lost peer ends the rank
with one line (the ring backend reports it), a silent one is caught by a
watchdog after `timeout` seconds.
"""

import os
import signal
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..target.wrapper import StandIn, Target, TargetCache, model_parts
from ..distributed import DistributedError

DRIVER = 0
HEADER = 64  # words of the fixed-size program message; longer programs take a second one
MAKE, FREE, CHECKPOINT, ROLLBACK, FORWARD, STOP = range(1, 7)


def connect(timeout: float):
    """mx.distributed.init(), bounded: a rank that cannot reach the others ends with one line.
    init holds the GIL while it retries, so the deadline is kept by a forked process."""
    rank, parent = os.environ.get("MLX_RANK", "?"), os.getpid()
    deadline = os.fork()
    if deadline == 0:  # only sleeps, writes and signals: safe in a fork
        time.sleep(timeout)
        if os.getppid() == parent:
            os.write(
                2,
                f"error: rank {rank}: connecting to the other ranks: no answer in {timeout:g} s (check "
                "the hosts, the network, and that every host runs the same command)\n".encode(),
            )
            os.kill(parent, signal.SIGKILL)
        os._exit(0)
    try:
        return mx.distributed.init()
    finally:
        os.kill(deadline, signal.SIGKILL)
        os.waitpid(deadline, 0)


def even_split(num_layers: int, size: int) -> list[int]:
    """Layers per rank, mlx-lm's default: even, the low ranks take the extra ones."""
    base, extra = divmod(num_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def parse_split(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--split must be comma-separated layer counts, one per rank (rank 0 first), got {text!r}"
        ) from None


@dataclass
class StageStats:
    """What one rank spent, summed over target passes."""

    passes: float = 0
    wait_s: float = 0  # until the hidden state from the previous stage arrived
    compute_s: float = 0  # this rank's layers
    after_s: float = 0  # handing on: send, final gather, features (and rank 0's output head)
    bytes_sent: float = 0  # payload this rank handed to send / all_gather / all_sum

    def vector(self) -> mx.array:
        return mx.array(astuple(self), dtype=mx.float32)

    @classmethod
    def from_vector(cls, values) -> "StageStats":
        return cls(*[float(v) for v in values])

    def describe(self) -> str:
        n = max(self.passes, 1)
        return (
            f"{self.compute_s / n * 1e3:.1f} ms compute, {self.wait_s / n * 1e3:.1f} ms waiting, "
            f"{self.after_s / n * 1e3:.1f} ms handing on, {self.bytes_sent / n / 1024:.1f} KiB sent per pass"
        )


class Watchdog:
    """Ends the process with one line when a collective wait outlives its deadline
    (a blocked collective cannot be interrupted from Python)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._deadline: Optional[float] = None
        self._what = ""
        threading.Thread(target=self._watch, daemon=True).start()

    @contextmanager
    def waiting(self, what: str, timeout: Optional[float]):
        self._what, self._timeout = what, timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        try:
            yield
        except DistributedError:
            raise
        except RuntimeError as e:  # the ring backend's "connection to a peer was lost"
            raise DistributedError(
                f"rank {self.rank}: {what}: {str(e).strip()}; another rank stopped or the link failed"
            ) from None
        finally:
            self._deadline = None

    def _watch(self):
        while True:
            time.sleep(0.1)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                sys.stderr.write(
                    f"error: rank {self.rank}: {self._what}: no answer from the other ranks in "
                    f"{self._timeout:g} s (a rank stopped or the link is down)\n"
                )
                sys.stderr.flush()
                os._exit(3)


class Channel:
    """The driver's programs, broadcast as a sum to which the other ranks add zeros."""

    def __init__(self, group):
        self.group = group

    def _sum(self, words: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(words), group=self.group)
        mx.eval(out)
        return np.array(out)

    def send(self, program: list[int]) -> int:
        head = np.zeros(HEADER, dtype=np.int32)
        head[0] = len(program)
        head[1 : 1 + min(len(program), HEADER - 1)] = program[: HEADER - 1]
        self._sum(head)
        if len(program) > HEADER - 1:
            self._sum(np.array(program[HEADER - 1 :], dtype=np.int32))
        return 4 * max(HEADER, len(program) + 1)

    def receive(self) -> tuple[list[int], int]:
        head = self._sum(np.zeros(HEADER, dtype=np.int32))
        n = int(head[0])
        program = head[1 : 1 + min(n, HEADER - 1)].tolist()
        if n > HEADER - 1:
            program += self._sum(np.zeros(n - (HEADER - 1), dtype=np.int32)).tolist()
        return program, 4 * max(HEADER, n + 1)


class StageEntry(StandIn):
    """Around this rank's first layer: takes the previous stage's hidden state (when
    the model's own forward does not) and times the wait for it."""

    def __init__(self, layer, stage: "PipelineTarget", receive: bool):
        super().__init__(layer, None)
        self._stage, self._receive = stage, receive

    def __call__(self, x, *args, **kwargs):
        if self._receive:
            x = mx.distributed.recv_like(x, self._stage.rank + 1, group=self._stage.group)
        tic = time.perf_counter()
        mx.eval(x)
        self._stage.clock["entered"] = time.perf_counter()
        self._stage.stats.wait_s += self._stage.clock["entered"] - tic
        return self.inner(x, *args, **kwargs)


class StageExit(StandIn):
    """Around this rank's last layer: times the layers and (when the model's own
    forward does not) hands the hidden state to the next stage."""

    def __init__(self, layer, stage: "PipelineTarget", send: bool):
        super().__init__(layer, None)
        self._stage, self._send = stage, send

    def __call__(self, *args, **kwargs):
        h = self.inner(*args, **kwargs)
        mx.eval(h)
        self._stage.clock["computed"] = time.perf_counter()
        self._stage.stats.compute_s += self._stage.clock["computed"] - self._stage.clock["entered"]
        if self._send:
            h = mx.distributed.send(h, self._stage.rank - 1, group=self._stage.group)
        return h


class FinalHidden(StandIn):
    """Around the final norm: keeps its input (what a following rank evaluates
    instead of the logits), after gathering it when the model's forward does not."""

    def __init__(self, norm, stage: "PipelineTarget", gather: bool):
        super().__init__(norm, None)
        self._stage, self._gather = stage, gather

    def __call__(self, h):
        if self._gather:
            h = mx.distributed.all_gather(h, group=self._stage.group)[: h.shape[0]]
        self._stage.final = h
        return self.inner(h)


class PipelineCache(TargetCache):
    """The driver's cache of its own layers; each call is also queued for the other ranks."""

    def __init__(self, target: "PipelineTarget"):
        super().__init__(target.model)
        self.id = target._new_cache_id()
        self._queue = target._queue
        self._queue(MAKE, self.id)
        weakref.finalize(self, target._queue, FREE, self.id)

    def checkpoint(self):
        super().checkpoint()
        self._queue(CHECKPOINT, self.id)

    def rollback(self, keep: int):
        super().rollback(keep)
        self._queue(ROLLBACK, self.id, keep)


class PipelineTarget(Target):
    """A Target holding layers [start, end) of the model on this rank."""

    def __init__(self, model, group, split: Optional[Sequence[int]] = None, timeout: float = 60.0):
        super().__init__(model)
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.timeout = timeout
        _, inner = model_parts(model)
        total = len(inner.layers)
        split = list(split) if split else even_split(total, self.size)
        if len(split) != self.size or min(split) < 1 or sum(split) != total:
            raise ValueError(
                f"split {split} must give each of the {self.size} ranks >= 1 layer and sum to "
                f"the model's {total} layers"
            )
        self.start = sum(split[self.rank + 1 :])
        self.end = self.start + split[self.rank]
        self._total = total
        own_split = not hasattr(inner, "pipeline")
        if own_split:
            self._check_uniform(inner)
            inner.layers = inner.layers[self.start : self.end]
            first, last = 0, len(inner.layers) - 1
        else:  # mlx-lm's own split: it sends, receives and gathers in the model's forward
            inner.pipeline(group, split)
            first, last = self.start, self.end - 1
        inner.layers[first] = StageEntry(inner.layers[first], self, receive=own_split and self.rank < self.size - 1)
        inner.layers[last] = StageExit(inner.layers[last], self, send=own_split and self.rank > 0)
        inner.norm = FinalHidden(inner.norm, self, gather=own_split)
        for i in range(total):
            if not self.start <= i < self.end:
                self.layers[i] = None  # its weights are never loaded here
        self.stats, self.clock, self.final = StageStats(), {}, None
        self._program: list[int] = []
        self._next_id = 0
        self._started = False
        self.channel = Channel(group)
        self.watchdog = Watchdog(self.rank)

    def _check_uniform(self, inner):
        if inner.get("norm") is None:
            raise ValueError(
                f"target model type {self.model_type!r} has no final norm to gather the pipeline's "
                "output at; it cannot be split"
            )
        kinds = {type(c).__name__ for c in make_prompt_cache(self.model)}
        classes = {type(layer.inner).__name__ for layer in inner.layers}
        if len(kinds) > 1 or len(classes) > 1:
            raise ValueError(
                f"target model type {self.model_type!r}: mlx-lm gives it no pipeline() and its layers "
                f"are not all alike (caches {sorted(kinds)}, layers {sorted(classes)}), so its own "
                "forward cannot run a contiguous slice of them; run it on one machine"
            )

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER

    @property
    def num_layers(self) -> int:
        return self._total

    # ------------------------------------------------------------ the driver's side

    def make_cache(self) -> TargetCache:
        if getattr(self, "channel", None) is None or not self.is_driver:  # before the split, or following
            return TargetCache(self.model)
        return PipelineCache(self)

    def _new_cache_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _queue(self, *words: int):
        self._program += words

    def _flush(self):
        program, self._program = self._program, []
        with self._waiting("sending the next step to the other ranks"):
            self.stats.bytes_sent += self.channel.send(program)

    def __call__(self, tokens, cache, feature_layers=(), logits_at=None):
        if self.is_driver:
            ids = tokens.reshape(-1).tolist()  # one row: the pipeline decodes one request
            at = 0 if logits_at is None else logits_at[0] + 1
            self._queue(FORWARD, cache.id, at, len(feature_layers), *feature_layers, len(ids), *ids)
            self._flush()
        return self._forward(tokens, cache, feature_layers, logits_at)

    def finish(self) -> list[StageStats]:
        """Release the following ranks; every rank's figures (rank 0 first)."""
        self._queue(STOP)
        self._flush()
        return self._exchange_stats()

    # ------------------------------------------------------------ every rank

    @contextmanager
    def _waiting(self, what: str):
        # the first exchange also waits for the slowest rank to load its layers
        timeout = self.timeout if self._started else max(self.timeout, 600.0)
        with self.watchdog.waiting(what, timeout):
            yield
        self._started = True

    def _forward(self, tokens, cache, feature_layers, logits_at):
        tic = time.perf_counter()
        with self._waiting("target pass"):
            logits, features = super().__call__(tokens, cache, feature_layers, logits_at)
            states = [c.state for c in cache.layers]
            mx.eval(self.final, states, logits if self.is_driver else [])  # the stage-to-stage traffic
            if features is not None:
                mx.eval(features)  # then the features' sum: never interleaved with the gather
        self.stats.passes += 1
        self.stats.after_s += time.perf_counter() - self.clock.get("computed", tic)
        positions, itemsize = tokens.shape[1], self.final.dtype.size
        hidden = positions * self.hidden_size * itemsize
        self.stats.bytes_sent += hidden * ((self.rank > 0) + 1)  # send onwards, share in the gather
        if features is not None:
            self.stats.bytes_sent += features.nbytes
        self.final = None
        return logits, features

    def _features(self, captured, feature_layers, length):
        """Each rank's share of the features, the others' zero; summed over the ranks."""
        parts = [
            captured[i] if i in captured else mx.zeros((1, length, self.hidden_size), dtype=self.dtype)
            for i in feature_layers
        ]
        return mx.distributed.all_sum(mx.concatenate(parts, axis=-1), group=self.group)

    def _exchange_stats(self) -> list[StageStats]:
        with self._waiting("collecting the ranks' figures"):
            gathered = mx.distributed.all_gather(self.stats.vector()[None], group=self.group)
            mx.eval(gathered)
        return [StageStats.from_vector(row) for row in np.array(gathered)]

    # ------------------------------------------------------------ the following ranks

    def follow(self, wait_forever: bool = False) -> list[StageStats]:
        """Replay the driver's programs on this rank's layers until it stops (between
        programs, wait at most `timeout` seconds unless `wait_forever`: a server's idle time)."""
        if self.is_driver:
            raise RuntimeError("rank 0 drives the pipeline; follow() is for the other ranks")
        caches: dict[int, TargetCache] = {}
        while True:
            with (
                self.watchdog.waiting("waiting for rank 0", None)
                if wait_forever
                else self._waiting("waiting for rank 0")
            ):
                program, nbytes = self.channel.receive()
            self.stats.bytes_sent += nbytes
            i = 0
            while i < len(program):
                op = program[i]
                if op == MAKE:
                    caches[program[i + 1]] = TargetCache(self.model)
                    i += 2
                elif op == FREE:
                    caches.pop(program[i + 1], None)
                    i += 2
                elif op == CHECKPOINT:
                    caches[program[i + 1]].checkpoint()
                    i += 2
                elif op == ROLLBACK:
                    caches[program[i + 1]].rollback(program[i + 2])
                    i += 3
                elif op == FORWARD:
                    cache_id, at, n_layers = program[i + 1 : i + 4]
                    layers = program[i + 4 : i + 4 + n_layers]
                    n_tokens = program[i + 4 + n_layers]
                    start = i + 5 + n_layers
                    tokens = mx.array(program[start : start + n_tokens], dtype=mx.int32)[None]
                    self._forward(tokens, caches[cache_id], layers, [at - 1] if at else None)
                    i = start + n_tokens
                elif op == STOP:
                    return self._exchange_stats()
                else:
                    raise DistributedError(
                        f"rank {self.rank}: unknown pipeline op {op}: ranks run different dflash-mlx versions?"
                    )


def describe_ranks(ranks: list[StageStats], last) -> str:
    """Per rank and pass, then per generated token: where a pipelined decode's time went."""
    lines = [f"rank {r}: {s.describe()} ({s.passes:.0f} passes)" for r, s in enumerate(ranks)]
    if last is not None and last.generation_tokens:
        sent = sum(s.bytes_sent for s in ranks)
        lines.append(
            f"{last.generation_tokens} tokens at {last.generation_tps:.1f} tok/s, tau {last.tau:.2f}, "
            f"{sent / last.generation_tokens / 1024:.1f} KiB sent per token (all ranks, prompt included)"
        )
    return "\n".join(lines)
