"""Idle prefills: while no request waits, the decoder prefills offered prompts (a conversation as
its next request will begin) into the prompt cache, on a row beyond max_batch; a request joining
stops that, unless it continues that very prompt, which it then waits for and restores."""

import pytest

from dflash_mlx.cache.prompt_cache import PromptCache
from dflash_mlx.decode import decoder as engine
from dflash_mlx.decode.decoder import Decoder, decode
from dflash_mlx.decode.model import DFlashModel
from dflash_mlx.decode.request import Request
from dflash_mlx.sampling import SamplingParams
from tiny_models import random_draft, tiny_target

CHUNK = 8  # prompt tokens a step prefills here: a 40-token prompt takes five steps


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setattr(engine, "PREFILL_STEP", CHUNK)
    monkeypatch.setattr(engine, "CPU_PREFILL_PASS", CHUNK)
    target = tiny_target("qwen3", seed=2)
    return DFlashModel(target, random_draft(target, block_size=4))


def cold(model, prompt, max_tokens=12):
    return [t for step in decode(model, Request(list(prompt), max_tokens, SamplingParams())) for t in step.tokens]


def background(decoder):
    return [row.prompt for row in decoder.filling if row.background]


def test_an_idle_prefill_runs_beside_a_full_batch_unless_a_running_answer_holds_it(model):
    cache = PromptCache()
    decoder = Decoder(model, cache, max_batch=2)
    decoder.idle.min_tokens = 2
    rows = [decoder.add(Request([9, k] * 4, 30)) for k in range(2)]
    while len(decoder.rows) < 2 or not rows[0].output[2:]:
        decoder.step()
    decoder.prefill_when_idle(rows[0].prompt + rows[0].output[:2])  # the running answer holds it
    decoder.step()
    assert not background(decoder) and not decoder.idle.prompts
    departing = rows[1].prompt + [5] * 30
    decoder.prefill_when_idle(departing)
    decoder.step()
    assert background(decoder) == [departing] and decoder.rows == rows  # a third row beside the two
    while background(decoder):
        assert set(decoder.step().steps) <= {row.uid for row in rows}  # no one reads the prefill's row
    assert cache.covered(departing) == len(departing)
    while decoder.busy:
        decoder.step()
    assert [row.output for row in rows] == [cold(model, row.prompt, 30) for row in rows]


def test_a_request_stops_an_idle_prefill(model):
    cache = PromptCache()
    decoder = Decoder(model, cache, max_batch=2)
    offered = list(range(40, 80))
    decoder.prefill_when_idle(offered)
    decoder.step()
    assert background(decoder) == [offered]
    other = decoder.add(Request(list(range(10, 20)), 6))
    steps = []
    while decoder.busy:
        steps.append(decoder.step().steps)
    assert not background(decoder) and cache.covered(offered) < len(offered)  # stopped before its end
    assert all(set(step) <= {other.uid} for step in steps)  # its row was never answered
    assert other.output == cold(model, other.prompt, 6)


def test_a_request_continuing_an_idle_prefill_waits_for_it_and_restores_it(model):
    cache = PromptCache()
    decoder = Decoder(model, cache, max_batch=2)
    offered = list(range(40, 80))
    decoder.prefill_when_idle(offered)
    decoder.step()
    own = decoder.add(Request(offered + [7, 8], 10))
    decoder.step()
    assert background(decoder) == [offered] and decoder.waiting == [own]  # waiting for it, not beside it
    while decoder.busy:
        decoder.step()
    assert own.stats.cached_tokens == len(offered)
    assert own.output == cold(model, own.prompt, 10)


def test_an_offer_a_request_already_asked_for_is_not_prefilled(model):
    cache = PromptCache()
    decoder = Decoder(model, cache, max_batch=2)
    decoder.add(Request(list(range(40, 60)), 4))
    decoder.prefill_when_idle(list(range(40, 50)))  # the request came first
    assert not decoder.idle.prompts
    decoder.prefill_when_idle(list(range(40, 70)))  # further on: still worth a prefill
    decoder.prefill_when_idle(list(range(40, 75)))  # the same conversation, further on: replaces it
    assert list(decoder.idle.prompts) == [list(range(40, 75))]


def test_without_a_prompt_cache_nothing_is_prefilled(model):
    decoder = Decoder(model, None, max_batch=2)
    decoder.prefill_when_idle(list(range(40, 80)))
    assert not decoder.busy


def test_a_decoder_of_one_row_prefills_only_when_nothing_decodes(model):
    cache = PromptCache()
    decoder = Decoder(model, cache, max_batch=1)
    row = decoder.add(Request(list(range(10, 20)), 8))
    decoder.step()
    decoder.prefill_when_idle(list(range(40, 80)))
    while row.left > 0:
        assert not background(decoder)
        decoder.step()
    while decoder.busy:
        decoder.step()
    assert cache.covered(list(range(40, 80))) == 40
