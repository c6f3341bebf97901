"""The benchmark harness runs end to end on a tiny model pair (structure, not speed)."""

import json

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from dflash_mlx import load
from dflash_mlx.bench.harness import run_bench
from dflash_mlx.decode.learning import kept
from dflash_mlx.cli import app
from dflash_mlx.drafters import DFlashDraftModel, save_draft
from dflash_mlx.convert.gguf import convert_gguf
from gguf_fixtures import write_gguf
from tiny_models import draft_args


def tiny_pair(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama")
    target_dir = convert_gguf(tmp_path / "m.gguf", tmp_path / "target", show_progress=False)
    model, _ = load(str(target_dir), use_draft=False, adaptive=False)
    mx.random.seed(0)
    drafter = DFlashDraftModel(draft_args(model.target, layer_ids=(0, 1), block_size=4))
    return target_dir, save_draft(drafter, tmp_path / "drafter")


@pytest.mark.slow  # matplotlib plots
def test_harness_writes_results_tables_and_plots(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))  # cost curve cached here, not in ~
    target_dir, drafter_dir = tiny_pair(tmp_path)
    model, tokenizer = load(str(target_dir), str(drafter_dir))
    assert kept(model).planner is not None
    results = run_bench(
        model, tokenizer, ["gsm8k", "mtbench"], 2, 6, ["greedy", "sampled"], tmp_path / "out", show_progress=False
    )
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} >= {
        "results.json",
        "results.md",
        "speedup.png",
        "acceptance.png",
        "tps_vs_length.png",
    }
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["runs"]) == 2 * 2 * 2 * 2  # sets x prompts x modes x decoders
    assert {(r["set"], r["mode"]) for r in saved["summary"]} == {
        (s, m) for s in ("gsm8k", "mtbench", "all") for m in ("greedy", "sampled")
    }
    assert all(r["speedup"] > 0 and r["tau"] >= 1 for r in results["summary"])
    assert "| gsm8k | greedy | 2 |" in (out / "results.md").read_text()


def test_bench_cli_rejects_bad_modes():
    result = CliRunner().invoke(app, ["bench", "--modes", "fast"])
    assert result.exit_code == 1 and "--modes" in result.output


def test_held_out_taus_count_tokens_from_a_restart(tmp_path):
    from dflash_mlx.bench.plots import held_out_taus, tau_curves

    log = tmp_path / "train_log.jsonl"
    log.write_text('{"step": 1, "tokens_seen": 100, "loss": 3.0}\n{"step": 2, "tokens_seen": 200, "tau": 1.5}\n')
    assert held_out_taus(log, tokens_before=1000) == [(1200, 1.5)]
    png = tau_curves({"a": [(0, 1.0), (1200, 1.5)]}, tmp_path / "curve.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_turn_clock_leaves_out_the_time_it_was_stopped():
    import time

    from dflash_mlx.bench.turns import TurnClock

    clock = TurnClock()
    time.sleep(0.05)  # it starts stopped
    start = clock()
    clock.start()
    time.sleep(0.05)
    clock.stop()
    time.sleep(0.2)
    assert clock() - start < 0.1  # stopped: reads the same
    clock.start()
    time.sleep(0.05)
    assert 0.1 <= clock() - start < 0.2


def test_decodings_in_turns_give_plain_greedys_tokens_each_timed_by_its_own_clock(tmp_path, monkeypatch):
    import time

    from dflash_mlx.bench.turns import decode_in_turns
    from dflash_mlx.decode.decoder import decode
    from dflash_mlx.decode.request import Request

    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    target_dir, drafter_dir = tiny_pair(tmp_path)
    model, _ = load(str(target_dir), str(drafter_dir))
    prompt = list(range(3, 40))
    plain = [token for step in decode(model, Request(prompt, 24, block_size=1)) for token in step.tokens]
    tic = time.perf_counter()
    sides = decode_in_turns([(model, 1), (model, None), (model, 1)], prompt, 24, turn=4, first=1)
    wall = time.perf_counter() - tic
    assert [side.tokens for side in sides] == [plain] * 3
    assert all(side.finished and side.last_turn >= 2 for side in sides)  # each had turns after its first token
    assert sum(side.last_at - side.first_at for side in sides) <= wall  # no second counted on two clocks
    assert all(side.tokens_per_second > 0 for side in sides)


def test_the_planner_replayed_is_credited_for_drafts_kept_and_charged_for_drafts_refused():
    """A recording whose drafts the target always keeps replays well above plain decoding, one
    whose drafts it never keeps at about plain speed (the probes' cost) on a fresh planner and
    below it on one that just learnt the first; the same seed replays the same; the drafts'
    confidence cuts the verifies it foretells are refused; and the planner's estimates are
    scored against what its steps committed."""
    from dflash_mlx.bench.replay import Recorded, Replay, bounds, calibration
    from dflash_mlx.decode.costs import CostModel

    cost = CostModel([1, 2, 4, 8, 16], [0.1 * (1 + 0.11 * (w - 1)) for w in (1, 2, 4, 8, 16)], 0.012)
    tokens, block = 48, 8
    prompt, answer = list(range(100, 140)), list(range(1, tokens + block + 1))

    def recorded(agreed, sure) -> Recorded:
        """Drafts agreeing `agreed(c)` tokens after c committed, `sure(c)` confident in each."""
        widths = range(2, block + 1)
        return Recorded(
            prompt,
            answer,
            [{w: min(agreed(c), w - 1) for w in widths} for c in range(1, tokens + 1)],
            [{w: [sure(c)] * (w - 1) for w in widths} for c in range(1, tokens + 1)],
        )

    right, wrong = recorded(lambda c: block, lambda c: 0.95), recorded(lambda c: 0, lambda c: 0.15)
    kept, refused = (Replay(cost, frozenset({2}), block, tokens, seed=1).prompt(r) for r in (right, wrong))
    assert kept.gain > 2 and kept.tau > 4
    assert 0.85 < refused.gain <= 1.0 and sum(c.width > 1 for c in refused.cycles) <= 8
    after = Replay(cost, frozenset({2}), block, tokens, seed=1)
    assert after.prompt(right).gain == kept.gain  # the same seed replays the same
    assert after.prompt(wrong).gain < refused.gain  # a planner that learnt a drafter always right pays to unlearn it
    assert bounds(right, cost, block, tokens)[:2] == (block, pytest.approx(kept.gain, rel=0.3))
    assert bounds(wrong, cost, block, tokens)[1:] == pytest.approx((1.0, 1.0))
    # drafts wrong at every third position: a planner that reads how sure they are cuts the wrong ones' verify
    informed = recorded(lambda c: block * (c % 3 > 0), lambda c: 0.95 if c % 3 else 0.15)
    blind = recorded(lambda c: block * (c % 3 > 0), lambda c: 0.5)
    replays = [Replay(cost, frozenset({2}), block, tokens, seed=1).prompt(r) for r in (informed, blind)]
    assert replays[0].gain > 1.03 * replays[1].gain
    scores = calibration([kept, refused])
    assert scores and all(steps > 0 and committed >= 1 for steps, _, committed in scores.values())
