"""An engine batch replaced by a script (for the HTTP wiring's tests): each request is answered
by the text pieces `reply(prompt)` gives, one piece per step."""

import time
from types import SimpleNamespace


def responses(prompt: list[int], pieces: list[str], finish: str = "stop"):
    """The engine's responses for `pieces`, one per step, the last ending at `finish`."""
    for i, text in enumerate(pieces):
        yield SimpleNamespace(
            text=text,
            tokens=[1000 + i],
            finish_reason=finish if i == len(pieces) - 1 else None,
            prompt_tokens=len(prompt),
            generation_tokens=i + 1,
            tau=1.0,
            acceptance_histogram=[i + 1],
            widths=[1] * (i + 1),
            sources=["plain"] * (i + 1),
            block_size=4,
            generation_tps=1.0,
            cached_tokens=0,
            logprobs=None,
            stop_sequence=None,
        )


def scripted_batch(reply):
    """A stand-in for api.BatchGenerator whose requests get `reply(prompt)`'s pieces."""

    class ScriptedBatch:
        """Up to `max_batch` requests answered together, the others waiting (first come first
        served) as the decoder's do; prompts offered for idle prefills are recorded."""

        last_step = None
        failed: dict = {}

        def __init__(self, model=None, tokenizer=None, max_batch=8, *args):
            self.max_batch, self.offered = max_batch, []
            self.running, self.queued, self.uids, self.last = {}, {}, iter(range(1 << 30)), {}

        @property
        def busy(self):
            return bool(self.running or self.queued)

        @property
        def waiting(self):
            return list(self.queued)

        def prefill_when_idle(self, prompt):
            self.offered.append(prompt)

        def add(self, request):
            uid = next(self.uids)
            self.queued[uid] = request
            return uid

        def answer(self, request):
            return responses(request.prompt, reply(request.prompt))

        def next(self):
            while self.queued and len(self.running) < self.max_batch:
                uid = next(iter(self.queued))
                self.running[uid] = self.answer(self.queued.pop(uid))
            out = [(uid, next(steps)) for uid, steps in self.running.items()]
            for uid, response in out:
                self.last[uid] = response
                if response.finish_reason:
                    self.remove(uid)
            return out

        def cut(self, uid):
            """Ended now, as if at its max_tokens (api.BatchGenerator.cut)."""
            last = self.last.pop(uid, None)
            self.remove(uid)
            if last is None:
                return None
            ending = dict(text="", tokens=[], logprobs=None, stop_sequence=None, finish_reason="length")
            return SimpleNamespace(**{**vars(last), **ending})

        def remove(self, uid):
            self.running.pop(uid, None)
            self.queued.pop(uid, None)

        discard = remove

        def close(self):
            pass

    return ScriptedBatch


def endless_batch(piece: str):
    """A model that never ends its answer (a base model): `piece` per token until the request's
    max_tokens, ending at its "length", or at the "context" where the server cut max_tokens to the
    window."""
    base = scripted_batch(lambda prompt: [])

    class Endless(base):
        def answer(self, request):
            finish = "context" if request.ends_at_context else "length"
            return responses(request.prompt, [piece] * request.max_tokens, finish)

    return Endless


def slow_batch(pieces: int, seconds_per_step: float):
    """The scripted engine answering `pieces` pieces per request, each step taking `seconds_per_step`."""
    base = scripted_batch(lambda prompt: [f"w{i} " for i in range(pieces)])

    class Slow(base):
        def next(self):
            time.sleep(seconds_per_step)
            return super().next()

    return Slow
