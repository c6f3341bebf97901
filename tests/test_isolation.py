"""One request never changes another's answer: a step that raises fails only the requests it
was decoding, nothing of them is kept (prompt cache, answer store), every request waiting or
decoding beside them goes on exactly, and later answers are a fresh decoder's."""

import threading
import time
from dataclasses import fields, replace
from typing import Optional

import mlx.core as mx
import pytest

from dflash_mlx import load
from dflash_mlx.decode.decoder import Decoder, StepFailed
from dflash_mlx.cache.prompt_cache import PromptCache
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.learning import Learning, keep, kept
from dflash_mlx.decode.plan import Planner
from dflash_mlx.decode.suffix import SuffixStore

PROMPTS = [[1, 5, 9, 13, 2, 7, 40, 3], [60, 61, 62], list(range(20, 50)), [33, 34, 35, 36, 8]]


class Faulty:
    """A target that raises at its `passes`-th pass once armed, after computing it: its caches
    hold the pass's tokens, as a fault at evaluation leaves them.  Armed with `hold`, its next
    pass first waits for that event (requests sent meanwhile queue up)."""

    def __init__(self, target):
        self.target, self.left, self.hold = target, None, None

    def __getattr__(self, name):
        return getattr(self.target, name)

    def arm(self, passes: int, hold: Optional[threading.Event] = None) -> None:
        self.left, self.hold = passes, hold

    def __call__(self, tokens, cache, *args, **kwargs):
        if self.hold is not None:
            self.hold.wait(timeout=60)
            self.hold = None
        out = self.target(tokens, cache, *args, **kwargs)
        if self.left is not None:
            self.left -= 1
            if self.left < 0:
                self.left = None
                mx.eval(out)
                raise RuntimeError("injected fault")
        return out


class RefusingGrammar:
    """A grammar stand-in that allows everything and refuses the tokens of its `at`-th commit."""

    def __init__(self, at: int):
        self.at = at

    def start(self):
        grammar = self

        class State:
            commits = 0

            def masks(self, proposal):
                return None

            def forced(self, limit):
                return []

            def commit(self, tokens):
                self.commits += 1
                if self.commits == grammar.at:
                    raise RuntimeError("grammar: refused")

        return State()


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    return load(str(model_dir), str(draft_dir))[0]  # adaptive: the planner and the answer store


def run(decoder: Decoder, requests: list[Request]) -> dict[int, list[int]]:
    uids = [decoder.add(r).uid for r in requests]
    out = {uid: [] for uid in uids}
    while decoder.busy:
        for uid, step in decoder.step().steps.items():
            out[uid] += step.tokens
    return [out[uid] for uid in uids]


def fresh_learning(model) -> Learning:
    """The planner the process keeps for `model`, and no answers yet."""
    return Learning(kept(model).planner, SuffixStore())


def fresh_answers(model, prompts, max_tokens=24) -> list[list[int]]:
    fresh = Decoder(model, PromptCache(piece_tokens=8), max_batch=4, learning=fresh_learning(model))
    return run(fresh, [Request(list(p), max_tokens) for p in prompts])


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_failed_step_fails_its_requests_and_keeps_nothing_of_them(tiny, max_batch):
    faulty = Faulty(tiny.target)
    learning, cache = fresh_learning(tiny), PromptCache(piece_tokens=8)
    decoder = Decoder(replace(tiny, target=faulty), cache, max_batch=max_batch, learning=learning)
    uids = [decoder.add(Request(list(p), 24)).uid for p in PROMPTS]
    decoder.step()  # prefill; the first tokens out
    decoder.step()
    faulty.arm(1)  # the fault: the next step's second pass, after its first fed the caches
    with pytest.raises(StepFailed, match="injected fault") as failed:
        while decoder.busy:
            decoder.step()
    in_step = failed.value.uids
    assert in_step and in_step <= set(uids)
    if max_batch == 4:
        assert in_step == set(uids)
    assert not cache.entries and len(learning.suffixes) == 0  # nothing of the failed rows kept
    assert not decoder.rows and decoder.cache is None
    # the requests that were waiting (max_batch 1) go on exactly; so does everything asked later
    waiting = [uid for uid in uids if uid not in in_step]
    left = {}
    while decoder.busy:
        for uid, step in decoder.step().steps.items():
            left.setdefault(uid, []).extend(step.tokens)
    expected = fresh_answers(tiny, PROMPTS)
    assert [left[uid] for uid in waiting] == [expected[uids.index(uid)] for uid in waiting]
    assert run(decoder, [Request(list(p), 24) for p in PROMPTS]) == expected
    turns = [p + a + [7, 8] for p, a in zip(PROMPTS, expected)]  # next turns restore what was kept
    assert run(decoder, [Request(list(t), 12) for t in turns]) == fresh_answers(tiny, turns, 12)


def test_a_row_whose_tokens_are_refused_fails_alone(tiny):
    """A row's own state refusing its tokens (a grammar's) fails that row; the batch's other
    rows go on and answer exactly what they answer alone; nothing of the failed row is kept."""
    cache = PromptCache(piece_tokens=8)
    decoder = Decoder(tiny, cache, max_batch=4, learning=fresh_learning(tiny))
    requests = [Request(list(p), 24, grammar=RefusingGrammar(at=4) if i == 1 else None) for i, p in enumerate(PROMPTS)]
    uids = [decoder.add(r).uid for r in requests]
    out, failed = {uid: [] for uid in uids}, {}
    while decoder.busy:
        step = decoder.step()
        failed.update(step.failed)
        for uid, s in step.steps.items():
            out[uid] += s.tokens
    assert list(failed) == [uids[1]] and "refused" in str(failed[uids[1]])
    expected = fresh_answers(tiny, PROMPTS)
    assert [out[uid] for i, uid in enumerate(uids) if i != 1] == [a for i, a in enumerate(expected) if i != 1]
    failed_prompt = tuple(PROMPTS[1])
    assert all(key[: len(failed_prompt)] != failed_prompt for key in cache.entries)
    assert run(decoder, [Request(list(PROMPTS[1]), 24)]) == [expected[1]]


def test_the_model_holds_no_decoding_state_and_the_process_keeps_it_across_calls(tiny_dirs):
    """The model pair is target and drafter only: a Decoder given its own learning leaves the
    one the process keeps for the model as it was, and generate() calls learn into that kept
    one (the planner's steps, the answers drafted from), one call after another."""
    from dflash_mlx import generate

    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir))
    assert {f.name for f in fields(model)} == {"target", "draft", "draft_note", "fingerprint", "end_tokens"}
    learnt = kept(model)
    own = Learning(Planner(learnt.planner.cost, learnt.planner.max_width), SuffixStore())  # the same curve
    alone, shared = Decoder(model, learning=own), Decoder(model)
    assert alone.learning is own and shared.learning is learnt
    assert run(alone, [Request(list(PROMPTS[0]), 12)]) and len(own.suffixes) > 0 and own.planner.steps > 0
    assert len(learnt.suffixes) == 0 and learnt.planner.steps == 0  # the process's kept nothing of it
    seen = []
    for _ in range(2):
        generate(model, tokenizer, "hello world", max_tokens=12)
        assert kept(model) is learnt
        seen.append((len(learnt.suffixes), learnt.planner.steps))
    assert 0 < seen[0][0] < seen[1][0] and 0 < seen[0][1] < seen[1][1]


CHATS = ["hello world", "the cat sat", "one two three", "tell me more"]


@pytest.mark.slow
def test_a_replayed_mix_leaves_every_later_answer_as_a_fresh_server_gives_it(tiny_dirs):
    """A served mix (requests failing mid-batch, structured output, a tool call, a client that
    gives up, a failed prompt asked again) leaves the fixed greedy prompts answered exactly as
    before the mix, and as offline generation gives them."""
    import json

    import httpx
    import openai

    from dflash_mlx import generate
    from dflash_mlx.api import format_prompt
    from dflash_mlx.serve import make_app, serve_in_background

    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir))
    faulty = Faulty(model.target)
    served = replace(model, target=faulty)
    keep(served, kept(model))  # the planner and the answers offline generation below uses too
    server = make_app(served, tokenizer, "tiny", max_batch=4)
    http, port = serve_in_background(server)
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)

    def chat(text, max_tokens=24, **options):
        messages = [{"role": "user", "content": text}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, **options)
        return reply.choices[0].message.content

    try:
        fresh, _ = load(str(model_dir), str(draft_dir))
        offline = [generate(fresh, tokenizer, format_prompt(tokenizer, text), max_tokens=24) for text in CHATS]
        assert [chat(text) for text in CHATS[:2]] == offline[:2]

        # four at once, the fault at a pass after their prefill: each fails with a 500, nothing hangs
        errors = []

        def failing(text):
            try:
                chat(text)
            except openai.InternalServerError as e:
                errors.append(e)

        # (the first request's prefill is held until all four are sent, so the others join at the
        # next step however slowly their threads start)
        arrived = threading.Event()
        faulty.arm(4, hold=arrived)
        threads = [threading.Thread(target=failing, args=(text,)) for text in CHATS]
        for t in threads:
            t.start()
        time.sleep(1.0)
        arrived.set()
        for t in threads:
            t.join(timeout=120)
        assert len(errors) == 4 and all("injected fault" in str(e) for e in errors)

        schema = {
            "type": "object",
            "properties": {"a": {"enum": ["x", "y"]}},
            "required": ["a"],
            "additionalProperties": False,
        }
        format_ = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": schema}}
        assert json.loads(chat("give json", 200, response_format=format_))["a"] in ("x", "y")
        tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
        chat("weather?", tools=[tool])
        with pytest.raises(httpx.TimeoutException):  # a client that gives up on a long answer
            httpx.post(base + "/v1/completions", json={"prompt": "the cat", "max_tokens": 2000}, timeout=0.3)
        assert [chat(text) for text in CHATS] == offline
    finally:
        http.should_exit = True
        server.worker.stop()
