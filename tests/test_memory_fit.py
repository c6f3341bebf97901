"""What the first run decides from the machine it runs on: which variant of a published model it
loads (8-bit where it fits, else 4-bit; chosen before any download, said in one line with why,
refused with the numbers), and the key
of its measured cost curve (chip, MLX version, kernels, dtype), timed at two contexts."""

import ast
import json
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mlx.api import loading, registry
from dflash_mlx.decode import costs
from dflash_mlx.decode.costs import CostModel, StepTimes, cached_costs, costs_path, curve_key, measure_costs
from tiny_models import random_draft, tiny_target

GIB = 1 << 30


def mac(gb: int) -> tuple[int, int]:
    """A Mac's memory and the GPU working set macOS recommends on it: 2/3 up to 32 GB, 3/4 above
    (16 GB: 10.67 GiB, 64 GB: 48 GiB, as Macs report)."""
    return gb * GIB, gb * GIB * (2 if gb <= 32 else 3) // (3 if gb <= 32 else 4)


@pytest.fixture
def offline(monkeypatch):
    """No weights on this machine, and a download is an error: the choice comes first."""
    monkeypatch.setattr(registry, "try_to_load_from_cache", lambda repo, name: None)
    fetched = []

    def fetch(repo, patterns):
        fetched.append(repo)
        raise RuntimeError("no downloads in this test")

    monkeypatch.setattr(loading, "fetch", fetch)
    return fetched


def machine(monkeypatch, total: int, recommended=None) -> None:
    monkeypatch.setattr(registry, "device_memory", lambda: (total, recommended))


@pytest.mark.parametrize(
    "gb, quant, why",
    [(16, 4, "the only variant that fits"), (24, 8, "the default where it fits"), (64, 8, "the default where it fits")],
)
def test_a_short_name_loads_the_8bit_variant_where_it_fits(monkeypatch, offline, capsys, gb, quant, why):
    """8-bit even where bf16 fits (64 GB): a decode step reads every weight, and 8 bits are half
    of bf16's; 4-bit where only that fits; the load line says which, why, and what bf16 needs."""
    machine(monkeypatch, *mac(gb))
    with pytest.raises(RuntimeError, match="no downloads"):
        loading.load("Qwen3.5-9B")
    assert offline == [f"mlx-community/Qwen3.5-9B-{quant}bit"]  # the first download is the choice
    said = " ".join(capsys.readouterr().err.split())
    assert f"loading the {quant}-bit variant (mlx-community/Qwen3.5-9B-{quant}bit), {why}" in said
    assert f"of {mac(gb)[1] / GIB:.1f} GiB available (the GPU's recommended working set" in said
    assert "bf16 would need ~21.3 GiB" in said and said.endswith("--quant 16 (bf16), 8 or 4 chooses")
    if quant == 4:
        assert "8-bit would need ~13.4 GiB" in said


def test_quant_16_loads_the_weights_as_published(monkeypatch, offline, capsys):
    machine(monkeypatch, *mac(64))
    with pytest.raises(RuntimeError, match="no downloads"):
        loading.load("Qwen3.5-9B", quant=16)
    assert offline == ["Qwen/Qwen3.5-9B"] and "note:" not in capsys.readouterr().err
    machine(monkeypatch, *mac(16))
    assert registry.fit_note("Qwen3.5-9B", 16, "z-lab/Qwen3.5-9B-DFlash").endswith("--quant 4 would fit")
    with pytest.raises(ValueError, match="quant must be 16, 8 or 4, got 2"):
        registry.resolve("Qwen3.5-9B", quant=2)


def test_a_pair_published_below_8_bits_loads_as_published(monkeypatch, offline):
    """gpt-oss ships MXFP4 experts (~5.3 bits a weight): smaller than the 8-bit conversion, as precise."""
    machine(monkeypatch, *mac(64))
    choice = registry.fitting_variant("gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash")
    assert (
        choice.quant == 16
        and "loading the published ~5.3-bit variant (openai/gpt-oss-20b), as published" in choice.reason
    )
    assert choice.reason.endswith("--quant 16 (published ~5.3-bit), 8 or 4 chooses")


def test_a_machine_too_small_is_refused_with_the_numbers(monkeypatch, offline):
    machine(monkeypatch, *mac(8))
    with pytest.raises(ValueError) as refused:
        loading.load("Qwen3.5-9B")
    message = str(refused.value)
    assert "Qwen3.5-9B does not fit this machine: even its 4-bit variant needs ~9.2 GiB" in message
    assert "of 5.3 GiB available" in message and "KV caches of 32768 tokens" in message
    assert "bf16 would need ~21.3 GiB" in message and "8-bit would need ~13.4 GiB" in message
    assert message.endswith("even without KV caches this one does not fit")
    assert offline == []
    machine(monkeypatch, *mac(16))
    with pytest.raises(
        ValueError, match="pass --quant 4 to load it anyway: its caches then have room for ~22431 tokens"
    ):
        loading.load("Qwen3-8B")  # 4-bit: 12.3 GiB of 10.7, 5.1 of them the KV caches of 32768 tokens


def test_without_a_recommended_working_set_three_quarters_of_the_memory_are_used(monkeypatch, offline):
    machine(monkeypatch, 24 * GIB)
    choice = registry.fitting_variant("Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash")
    assert choice.quant == 8 and "of 18.0 GiB available (3/4 of this machine's 24.0 GiB)" in choice.reason


def test_an_explicit_quant_a_path_or_a_pipeline_is_never_changed(monkeypatch, offline, capsys, tmp_path):
    machine(monkeypatch, *mac(16))
    with pytest.raises(RuntimeError):
        loading.load("Qwen3.5-9B", quant=8)
    assert offline[-1] == "mlx-community/Qwen3.5-9B-8bit"
    assert "does not fit" not in capsys.readouterr().err  # a note, not a refusal
    note = registry.fit_note("Qwen3.5-9B", 8, "z-lab/Qwen3.5-9B-DFlash")
    assert "needs ~13.4 GiB" in note and "of 10.7 GiB available" in note and note.endswith("--quant 4 would fit")
    assert registry.fit_note("Qwen3.5-9B", 4, "z-lab/Qwen3.5-9B-DFlash") is None
    machine(monkeypatch, *mac(8))
    assert registry.fit_note("Qwen3.5-9B", 4, None).endswith("no variant fits")
    for model, kwargs, loaded in (
        (str(tmp_path), {}, str(tmp_path)),
        ("Qwen3.5-9B", {"distributed": "pipeline"}, "Qwen/Qwen3.5-9B"),  # the published weights, as before
    ):
        with pytest.raises(RuntimeError):
            loading.load(model, **kwargs)
        assert offline[-1] == loaded


def test_what_is_on_this_machine_counts_and_what_is_not_loaded_does_not(monkeypatch, tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 7 * GIB}, "weight_map": {}}))
    cached = {("mlx-community/Qwen3.5-9B-8bit", "model.safetensors.index.json"): str(index)}
    monkeypatch.setattr(registry, "try_to_load_from_cache", lambda repo, name: cached.get((repo, name)))
    need = registry.footprint("Qwen3.5-9B", 8, None, 1024)
    assert need.weights == 7 * GIB and need.draft == 0 and need.kv == 1024 * 52 * 1024
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "model.safetensors").write_bytes(bytes(1000))
    assert registry.footprint("Qwen3.5-9B", 4, str(drafter), 1024).draft == 1000
    estimated = registry.footprint("Qwen3.5-9B", 4, "z-lab/Qwen3.5-9B-DFlash", 1024)
    assert estimated.weights == int(9e9 * 4.5 / 8) and estimated.draft == int(1e9 * 2)


def test_the_batch_cap_is_the_servers():
    """Read from the server's source: the fit is decided without importing the server."""
    source = (Path(registry.__file__).parent.parent / "serve" / "app.py").read_text()
    caps = [
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["MAX_BATCH_TOKENS"]
    ]
    assert caps == [registry.BATCH_CAP_TOKENS]


# ---------------------------------------------------------------- the cost curve


def test_the_cost_curve_key_changes_with_what_the_curve_depends_on(monkeypatch, tmp_path):
    base = curve_key("pair", mx.bfloat16)
    keys = {base, curve_key("pair", mx.float16)}
    other_kernels = not costs.use_metal()
    changes = [
        (costs, "chip_name", lambda: "Apple M9 Ultra"),
        (mx, "__version__", "0.0.1"),
        (costs, "use_metal", lambda: other_kernels),
    ]
    for owner, name, value in changes:
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, value)
            keys.add(curve_key("pair", mx.bfloat16))
    assert len(keys) == 5 and len({costs_path(key, tmp_path) for key in keys}) == 5
    assert costs.chip_name() in base and mx.__version__ in base


def test_an_old_format_cost_file_is_measured_again(tmp_path, capsys):
    key = curve_key("pair", mx.bfloat16)
    old = {"widths": [1, 2], "seconds": [0.01, 0.02], "draft_seconds": 0.001}
    old |= {"draft_per_token": 0.0, "sample_row": 0.0, "filtered_row": 0.0}  # v9: one context only
    path = costs_path(key, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(old))
    measured = CostModel([1, 2], [0.02, 0.03], 0.002, context=128, long_context=2048, long_widths=[1, 2])
    measured.long_seconds = [0.04, 0.06]
    assert cached_costs(key, lambda: measured, tmp_path) == measured
    assert "measuring again" in capsys.readouterr().err
    assert CostModel.from_dict(json.loads(path.read_text())) == measured
    assert path.name.endswith("-v11.json")  # older files' names end -v10 or before: never looked at


def test_the_long_context_anchors_the_longer_context_classes():
    cost = CostModel([1, 4], [0.1, 0.2], 0.01, context=128, long_context=2048, long_widths=[1, 4])
    cost.long_seconds = [0.2, 0.6]
    assert cost.context_ratio(4, 512) == 1.0  # the class the curve was timed in
    at_2048 = 1 + 2 * (1536 - 128) / 1920  # the class's middle, 3/4 of it
    assert cost.context_ratio(4, 2048) == pytest.approx(at_2048)
    assert cost.context_ratio(4, 8192) > at_2048 and cost.context_ratio(1, 2048) < at_2048
    times = StepTimes(by_context=cost.context_ratio)
    assert times.ratio(1, 4, 2048) == pytest.approx(at_2048) and times.ratio(1, 4, 512) == 1.0
    times.observe(1, 4, modelled=0.2, seconds=0.3, span=2048)
    assert times.ratio(1, 4, 2048) == pytest.approx(1.5)  # what a step of that class took, once one ran
    assert CostModel([1, 4], [0.1, 0.2], 0.01).context_ratio(4, 8192) == 1.0  # no long curve: the curve


def test_measure_costs_times_a_long_context_too():
    target = tiny_target("qwen3", seed=1, num_hidden_layers=2)
    draft = random_draft(target, layer_ids=(0, 1), block_size=8)
    cost = measure_costs(target, draft, context=32, repeats=1, long_context=256)
    assert (cost.context, cost.long_context, cost.long_widths) == (32, 256, [1, 4, 8])
    assert cost.long_seconds == sorted(cost.long_seconds) and all(s > 0 for s in cost.long_seconds)
    assert CostModel.from_dict(json.loads(json.dumps(cost.__dict__))) == cost
    assert measure_costs(target, draft, context=32, repeats=1).long_widths == []
