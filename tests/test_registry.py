"""Short names, repo ids and paths resolve to the right target/drafter pair."""

import pytest

from dflash_mlx.api import registry
from dflash_mlx.io.storage import cache_dir


def test_short_names_map_to_published_pairs():
    pair = registry.resolve("Qwen3.5-9B")
    assert (pair.target, pair.draft) == ("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash")
    assert registry.resolve("Qwen3.5-9B", quant=4).target == "mlx-community/Qwen3.5-9B-4bit"
    assert registry.resolve("Qwen3-8B", quant=8).target == "mlx-community/Qwen3-8B-8bit"
    assert registry.resolve("Llama-3.1-8B-Instruct").draft == "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    assert registry.resolve("Qwen3-4B", draft="/my/drafter").draft == "/my/drafter"
    pair = registry.resolve("gpt-oss-20b", quant=4)
    assert (pair.target, pair.draft) == ("mlx-community/gpt-oss-20b-4bit", "z-lab/gpt-oss-20b-DFlash")
    assert registry.resolve("gemma-4-31B").draft == "z-lab/gemma-4-31B-it-DFlash"
    assert registry.resolve("Kimi-K2.5").target == "moonshotai/Kimi-K2.5"


def test_every_published_pair_says_what_it_holds_in_memory():
    """The variant that fits a machine is chosen from these before anything is downloaded
    (tests/test_memory_fit.py); figures read off a model's name and family are marked estimates."""
    for pair in registry.PUBLISHED.values():
        size = pair.size
        assert size.params > size.draft_params > 0 and size.kv_kib > 0 and 4 <= size.native_bits <= 16
    estimated = {name for name, pair in registry.PUBLISHED.items() if pair.size.estimate}
    assert {"Qwen3-4B", "Qwen3-8B", "Llama-3.1-8B-Instruct", "gpt-oss-20b"}.isdisjoint(estimated)
    assert {"Qwen3.5-9B", "gemma-4-31B", "Kimi-K2.5"} <= estimated
    assert registry.PUBLISHED["gpt-oss-20b"].size.native_bits < 8  # MXFP4 experts: below the 8-bit conversion
    assert registry.label("gpt-oss-20b", None) == "published ~5.3-bit" and registry.label("Qwen3-8B", 8) == "8-bit"


def test_unknown_names_and_paths_are_explained():
    with pytest.raises(ValueError, match="Qwen3.5-9B.*Llama-3.1-8B-Instruct"):
        registry.resolve("Qwen9-1B")
    with pytest.raises(FileNotFoundError, match="no model directory at ./nowhere"):
        registry.resolve("./nowhere")
    with pytest.raises(ValueError, match="quant must be 16, 8 or 4"):
        registry.resolve("Qwen3-4B", quant=3)
    with pytest.raises(ValueError, match="short names only"):
        registry.resolve("someone/model", quant=4)


def test_repo_ids_and_local_dirs_need_a_drafter(tmp_path):
    pair = registry.resolve("someone/model")
    assert pair.target == "someone/model" and pair.draft is None and "--draft" in pair.draft_note
    pair = registry.resolve(str(tmp_path), draft="someone/drafter")
    assert (pair.target, pair.draft) == (str(tmp_path), "someone/drafter")


def test_default_model_says_when_it_has_no_drafter(monkeypatch, tmp_path, smollm2_dir):
    monkeypatch.setattr(registry, "DEFAULT_DRAFT", tmp_path / "absent")
    pair = registry.resolve(None)
    assert pair.target == str(smollm2_dir) and pair.draft is None
    assert "no trained drafter" in pair.draft_note
    monkeypatch.setattr(registry, "DEFAULT_DRAFT", tmp_path)
    assert registry.resolve(None).draft == str(tmp_path)


def test_gemma3_short_name_converts_its_variant_on_first_use(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(registry, "gemma3_path", lambda variant=None: asked.append(variant) or tmp_path / str(variant))
    monkeypatch.setattr(registry, "GEMMA3_DRAFT", tmp_path / "absent")
    pair = registry.resolve("gemma-3-270m")
    assert pair.target == str(tmp_path / "None") and pair.draft is None and "no trained drafter" in pair.draft_note
    assert registry.resolve("gemma-3-270m", quant=8).target == str(tmp_path / "q8")
    assert registry.resolve("gemma-3-270m", quant=4, draft="/d").draft == "/d"
    assert asked == [None, "q8", "q4"]
    monkeypatch.setattr(registry, "GEMMA3_DRAFT", tmp_path)
    assert registry.resolve("gemma-3-270m").draft == str(tmp_path)
    assert "gemma-3-270m" in registry.known_names()


def test_offline_models_refuse_unknown_variants_in_one_line():
    from dflash_mlx.convert.gemma3 import gemma3_path

    with pytest.raises(ValueError, match="MLX cannot keep quantized: use --quant 8 or 4"):
        gemma3_path("native")
    with pytest.raises(ValueError, match="unknown variant 'int3' of gemma-3-270m"):
        gemma3_path("int3")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
