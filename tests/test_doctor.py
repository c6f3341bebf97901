"""`dflash-mlx doctor`: every fact it promises, as lines and as JSON, and what a model would take,
offline: a short name is resolved without Hugging Face, the network or a conversion."""

import json
import socket

import pytest
from typer.testing import CliRunner

from dflash_mlx.api import doctor, registry
from dflash_mlx.kernels import metal
from dflash_mlx.cli import app

runner = CliRunner()
GIB = 1 << 30
ITEMS = [
    "platform",
    "chip",
    "memory",
    "python",
    "distribution",
    "mlx",
    "mlx-lm",
    "default device",
    "metal",
    "blas",
    "cache dir",
]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network, no Hugging Face download, no conversion of the default model; an empty cache
    and an empty Hugging Face cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("doctor must not reach the network, download or convert")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr("huggingface_hub.snapshot_download", refuse)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", refuse)
    monkeypatch.setattr(registry, "smollm2_path", refuse)
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    return tmp_path


def test_doctor_names_each_item(offline):
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for item in ITEMS:
        assert any(line.startswith(f"{item}: ") for line in lines), item
    for kernel in ("block_attention", "gated_delta_tape", "self_check_file"):
        assert any(line.startswith(f"  {kernel}: ") for line in lines), kernel
    assert any("cost curves: " in line for line in lines)
    assert "attention_softmax" in result.output or "norms_rope_attention" in result.output


def test_doctor_json_has_every_fact(offline):
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    assert set(facts) == {
        "platform",
        "chip",
        "memory",
        "python",
        "distribution",
        "mlx",
        "mlx_lm",
        "default_device",
        "metal",
        "kernels",
        "blas",
        "cost_curves",
        "cache_dir",
    }
    assert facts["memory"]["total_gib"] > 0 and facts["chip"]
    assert facts["cache_dir"] == str(offline / "cache")
    assert facts["cost_curves"] == {"folder": str(offline / "cache" / "costs"), "files": [], "present": False}
    assert isinstance(facts["metal"]["available"], bool)


class Dist:
    def __init__(self, script: str):
        from importlib.metadata import EntryPoint, EntryPoints

        self.entry_points = EntryPoints([EntryPoint("x", script, "console_scripts")])


@pytest.mark.parametrize(
    "owners, script, warning",
    [
        (["mlx-dflash"], None, None),
        (["dflash-mlx", "mlx-dflash"], "dflash_mlx.cli:main", "another DFlash port"),  # the other project's `dflash`
        (["dflash-mlx"], "dflash_mlx.cli:app", "an older install of this project"),
    ],
)
def test_doctor_names_the_distribution_that_owns_dflash_mlx(monkeypatch, owners, script, warning):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"dflash_mlx": owners})
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Dist(script))
    monkeypatch.setattr(doctor, "_version", lambda name: "1.0")
    found = doctor.distribution()
    assert found["owners"] == [f"{name} 1.0" for name in owners]
    assert (found["warning"] is None) if warning is None else (warning in found["warning"])
    if warning:
        assert "pip uninstall dflash-mlx" in doctor._distribution_line(found)


def test_this_checkout_is_installed_under_its_own_name():
    import importlib.metadata

    assert "mlx-dflash" in importlib.metadata.packages_distributions()["dflash_mlx"]


def small_mac(monkeypatch):
    """16 GB, of which the GPU may take 10.67 GiB (what macOS recommends there)."""
    monkeypatch.setattr(registry, "device_memory", lambda: (16 * GIB, 16 * GIB * 2 // 3))


def test_a_short_name_is_judged_as_load_judges_it_offline(offline, monkeypatch):
    """Without --quant, the variant `load` would choose on this machine, with the reason; sizes
    from the registry's figures (nothing of the model is on this machine)."""
    small_mac(monkeypatch)
    result = runner.invoke(app, ["doctor", "--model", "Qwen3.5-9B", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)["model"]
    assert plan["target"] == "mlx-community/Qwen3.5-9B-4bit" and plan["draft"] == "z-lab/Qwen3.5-9B-DFlash"
    assert plan["quant"] == "4-bit" and plan["fits"] == "yes" and plan["usable_gib"] == pytest.approx(10.67)
    need = registry.footprint("Qwen3.5-9B", 4, plan["draft"], registry.BATCH_CAP_TOKENS)
    assert plan["footprint_gib"] == round(need.total / GIB, 2) and plan["target_gib"] == round(need.weights / GIB, 2)
    assert "loading the 4-bit variant" in plan["why"] and "the only variant that fits" in plan["why"]
    assert "bf16 would need" in plan["why"] and "8-bit would need" in plan["why"]
    text = runner.invoke(app, ["doctor", "--model", "Qwen3.5-9B"]).output
    for item in ("  target: ", "  draft: ", "  quant: ", "  footprint: ", "  why: ", "  cost curve: "):
        assert item in text, item


def test_a_big_mac_is_told_why_it_gets_8_bits_and_how_to_get_bf16(offline, monkeypatch):
    monkeypatch.setattr(registry, "device_memory", lambda: (64 * GIB, 48 * GIB))
    plan = doctor.model_plan("Qwen3.5-9B", None)
    assert plan["target"] == "mlx-community/Qwen3.5-9B-8bit" and plan["quant"] == "8-bit"
    assert "the default where it fits (a decode step reads half of bf16's bytes" in plan["why"]
    assert "bf16 would need ~21.3 GiB" in plan["why"] and "--quant 16 (bf16), 8 or 4 chooses" in plan["why"]
    asked = doctor.model_plan("Qwen3.5-9B", 16)
    assert asked["target"] == "Qwen/Qwen3.5-9B" and asked["quant"] == "bf16" and asked["fits"] == "yes"


def test_the_kernel_self_check_key_names_the_os(offline):
    facts = doctor.report()["kernels"]
    assert metal.os_version() in facts["self_check_key"] and metal.os_version() in facts["self_check_file"]


def test_a_variant_asked_for_or_none_that_fits_is_said_not_to_fit(offline, monkeypatch):
    small_mac(monkeypatch)
    asked = json.loads(runner.invoke(app, ["doctor", "-m", "Qwen3.5-27B", "--quant", "8", "--json"]).output)["model"]
    assert asked["target"] == "mlx-community/Qwen3.5-27B-8bit" and asked["fits"] == "no"
    huge = json.loads(runner.invoke(app, ["doctor", "-m", "Kimi-K2.5", "--json"]).output)["model"]
    assert huge["fits"] == "no" and "does not fit this machine" in huge["why"]


def test_a_model_already_in_the_hugging_face_cache_is_sized_from_its_files(offline, monkeypatch):
    small_mac(monkeypatch)
    snapshot = offline / "hf" / "models--z-lab--Qwen3.5-9B-DFlash" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2 * GIB}}))
    plan = doctor.model_plan("Qwen3.5-9B", 4)
    assert plan["draft_gib"] == 2.0


def test_the_default_model_is_described_without_converting_it(offline):
    plan = doctor.model_plan(registry.DEFAULT_MODEL, None)
    assert plan["target"].startswith(str(offline / "cache" / "models" / "SmolLM2-135M-Instruct-"))
    assert plan["draft"] == str(registry.DEFAULT_DRAFT) and plan["draft_gib"] > 0
    assert plan["target_gib"] > 0 and plan["fits"] == "yes"
    assert not (offline / "cache" / "models").exists()


def test_a_repo_not_on_this_machine_is_sized_from_its_name_or_unknown(offline):
    assert doctor.model_plan("someone/Big-70B-4bit", None)["target_gib"] == round(70e9 * 4.5 / 8 / GIB, 2)
    unknown = doctor.model_plan("someone/mystery-model", None)
    assert unknown["target_gib"] is None and unknown["fits"] == "unknown" and unknown["draft"] == "none"


def test_an_unknown_model_is_one_line(offline):
    result = runner.invoke(app, ["doctor", "--model", "no-such-model"])
    assert result.exit_code == 1 and "unknown model 'no-such-model'" in result.output


@pytest.mark.parametrize(
    "name,parameters",
    [
        ("Qwen3.5-9B", 9e9),
        ("mlx-community/Qwen3-Coder-30B-A3B-Instruct-4bit", 30e9),
        ("gpt-oss-20b", 20e9),
        ("Llama-3.1-8B-Instruct", 8e9),
        ("SmolLM2-135M-Instruct", 135e6),
        ("Kimi-K2.5", None),
        ("Qwen3-Coder-Next", None),
    ],
)
def test_parameters_in_a_name(name, parameters):
    assert doctor.parameters_in_name(name) == parameters


def test_a_model_without_a_drafter_lists_its_own_cost_curve_only(offline):
    """A target alone's curve is keyed by its folder's name and weights (loading.alone_key): the
    plan lists it, not another target's, nor this target's with a drafter, nor one of its older
    weights."""
    import mlx.core as mx

    from dflash_mlx.api.loading import alone_key
    from dflash_mlx.decode.costs import costs_path, curve_key

    target = offline / "models" / "base-270m"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    costs = offline / "cache"

    def stored(name: str) -> str:
        path = costs_path(curve_key(name, mx.float32), costs)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
        return str(path)

    own = stored(alone_key(target))
    stored(f"other-1b-{alone_key(target).rsplit('-', 1)[1]}")
    stored("base-270m-some-draft-0123456789")
    assert doctor.model_plan(str(target), None)["cost_curve"]["files"] == [own]
    (target / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "vocab_size": 3}))
    assert doctor.model_plan(str(target), None)["cost_curve"] == {
        "folder": str(costs / "costs"),
        "files": [],
        "present": False,
    }
    assert len(doctor.report()["cost_curves"]["files"]) == 3  # doctor alone lists every curve
