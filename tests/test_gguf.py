"""GGUF import: GGUFs written like llama.cpp's converter come back as the same model."""

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.convert.gguf import GGUFError, convert_gguf
from gguf_fixtures import gemma3_vocab, write_gemma3_gguf, write_gguf

TEXT = "Hello world! I have 12 apples.\n\ndef add(a, b): return a + b <|im_end|>"


def logits(model, ids):
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def relative_error(a, b):
    return np.abs(a - b).mean() / np.abs(b).mean()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_float_gguf_round_trips_exactly(tmp_path, arch):
    source, tok = write_gguf(tmp_path / "m.gguf", arch)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "mlx", show_progress=False)
    model, tokenizer = mlx_lm.load(str(out))
    ids = tok.encode(TEXT).ids
    assert tokenizer.encode(TEXT, add_special_tokens=False) == ids
    assert tokenizer.decode(ids) == TEXT
    np.testing.assert_allclose(logits(model, ids), logits(source, ids), rtol=1e-5, atol=1e-5)


def test_chat_template_and_special_tokens_survive(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    _, tokenizer = mlx_lm.load(str(convert_gguf(tmp_path / "m.gguf", tmp_path / "mlx", show_progress=False)))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.encode("x<|im_end|>", add_special_tokens=False)[-1] == im_end
    assert im_end in tokenizer.eos_token_ids


@pytest.mark.parametrize("qtype, bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_quantized_gguf_native_and_dequantized(tmp_path, qtype, bits):
    source, tok = write_gguf(tmp_path / "m.gguf", "llama", qtype)
    ids = tok.encode(TEXT).ids
    native = convert_gguf(tmp_path / "m.gguf", tmp_path / "native", dtype="native", show_progress=False)
    dense = convert_gguf(tmp_path / "m.gguf", tmp_path / "dense", dtype="float32", show_progress=False)
    config = json.loads((native / "config.json").read_text())
    assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 32
    native_logits = logits(mlx_lm.load(str(native))[0], ids)
    dense_logits = logits(mlx_lm.load(str(dense))[0], ids)
    # the same quantized numbers, computed two ways (native activations are fp16, like its scales)
    assert relative_error(native_logits, dense_logits) < 5e-3
    # every weight dequantizes back close to the source (rows un-permuted, names mapped)
    converted = dict(tree_flatten(mlx_lm.load(str(dense))[0].parameters()))
    for name, w in tree_flatten(source.parameters()):
        error = relative_error(np.array(converted[name]), np.array(w))
        assert error < (0.01 if bits == 8 or w.ndim == 1 else 0.12), name


def test_refuses_to_overwrite_and_leaves_nothing_behind(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="--force"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out", show_progress=False)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "out", force=True, show_progress=False)
    assert (tmp_path / "out" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]


def test_bad_files_give_clear_errors(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFError, match="cannot read"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "o1", show_progress=False)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "o2", show_progress=False)
    write_gguf(tmp_path / "m.gguf", "qwen3")
    with pytest.raises(GGUFError, match="unknown dtype"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "o3", dtype="int3", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.gguf", "m.gguf"]


def test_types_mlx_cannot_read_are_dequantized_or_refused(tmp_path):
    source, tok = write_gguf(tmp_path / "m.gguf", "qwen3", "Q5_0")
    with pytest.raises(GGUFError, match="Q5_0.*--dtype"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "native", dtype="native", show_progress=False)
    assert not (tmp_path / "native").exists()
    dense = convert_gguf(tmp_path / "m.gguf", tmp_path / "dense", dtype="float32", show_progress=False)
    converted = dict(tree_flatten(mlx_lm.load(str(dense))[0].parameters()))
    for name, w in tree_flatten(source.parameters()):
        assert relative_error(np.array(converted[name]), np.array(w)) < 0.05, name


def test_unknown_architecture_is_refused(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="architecture 'phi3' is not supported"):
        convert_gguf(tmp_path / "phi.gguf", tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


GEMMA_TEXT = "hello world\ndef f(x):  hello  world\n\n    hé 世 x"  # longer than the window of 8


def test_gemma3_gguf_round_trips_exactly(tmp_path):
    """Names, norms stored as 1 + w, no q/k permutation, the sliding-window layout, tied head."""
    source, config = write_gemma3_gguf(tmp_path / "g.gguf")
    out = convert_gguf(tmp_path / "g.gguf", tmp_path / "mlx", show_progress=False)
    written = json.loads((out / "config.json").read_text())
    for key in ("model_type", "sliding_window", "sliding_window_pattern", "query_pre_attn_scalar", "head_dim"):
        assert written[key] == config[key], key
    model, tokenizer = mlx_lm.load(str(out))
    ids = tokenizer.encode(GEMMA_TEXT)
    assert ids[0] == 2 and len(ids) > 2 * config["sliding_window"]
    assert tokenizer.decode(ids[1:]) == GEMMA_TEXT
    np.testing.assert_allclose(logits(model, ids), logits(source, ids), rtol=1e-4, atol=1e-4)


def test_gemma3_tokenizer_matches_its_vocabulary(tmp_path):
    """SentencePiece pieces merge as far as the vocabulary allows, runs of spaces and a user-defined
    newline stay whole, what the vocabulary lacks falls back to bytes, specials are special."""
    write_gemma3_gguf(tmp_path / "g.gguf")
    _, tokenizer = mlx_lm.load(str(convert_gguf(tmp_path / "g.gguf", tmp_path / "mlx", show_progress=False)))
    tokens, _ = gemma3_vocab()
    vocab = {t.replace(" ", "▁") if not t.strip() and t != "\n" else t: i for i, t in enumerate(tokens)}

    def pieces(text):
        return [vocab[p] for p in text]

    assert tokenizer.encode("hello world", add_special_tokens=False) == pieces(["hello", "▁world"])
    assert tokenizer.encode("  def\nx", add_special_tokens=False) == pieces(["▁▁", "def", "\n", "x"])
    assert tokenizer.encode("é", add_special_tokens=False) == pieces(["<0xC3>", "<0xA9>"])
    turn = tokenizer.encode("<start_of_turn>x<end_of_turn>", add_special_tokens=False)
    assert turn == pieces(["<start_of_turn>", "x", "<end_of_turn>"])
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<bos><start_of_turn>user\nbe brief\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert set(tokenizer.eos_token_ids) == {1, vocab["<end_of_turn>"]}


def test_gemma3_types_mlx_cannot_read_are_dequantized_or_quantized(tmp_path):
    source, _ = write_gemma3_gguf(tmp_path / "g.gguf", "Q5_0")
    dense = convert_gguf(tmp_path / "g.gguf", tmp_path / "dense", show_progress=False)
    converted = dict(tree_flatten(mlx_lm.load(str(dense))[0].parameters()))
    for name, w in tree_flatten(source.parameters()):
        assert relative_error(np.array(converted[name]), np.array(w)) < (1e-6 if w.ndim == 1 else 0.05), name
    q8 = convert_gguf(tmp_path / "g.gguf", tmp_path / "q8", q_bits=8, show_progress=False)
    assert json.loads((q8 / "config.json").read_text())["quantization"]["bits"] == 8
    # every matrix mlx-lm quantized dequantizes back to the float conversion's (random weights
    # amplify rounding through the layers, so logits are compared on the real model: test_gemma3.py)
    quantized = dict(tree_flatten(mlx_lm.load(str(q8))[0].parameters()))
    for name in [n for n in quantized if n.endswith(".scales")]:
        prefix = name[: -len(".scales")]
        w = mx.dequantize(quantized[f"{prefix}.weight"], quantized[name], quantized[f"{prefix}.biases"], 64, 8)
        assert relative_error(np.array(w.astype(mx.float32)), np.array(converted[f"{prefix}.weight"])) < 0.01, name
    with pytest.raises(GGUFError, match="Q5_0.*--q-bits"):
        convert_gguf(tmp_path / "g.gguf", tmp_path / "native", dtype="native", show_progress=False)
