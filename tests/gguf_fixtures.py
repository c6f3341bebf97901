"""Write tiny GGUF checkpoints the way llama.cpp's converter does, for import tests."""

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from tokenizers import ByteLevelBPETokenizer, Regex, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "I have 12 apples and 30 pears; that's 42 fruits in total!",
    "Hello world, hello tokenizer. Numbers: 0 1 2 3 4 5 6 7 8 9 100 2024.",
]
# Qwen2's split regex (as in its tokenizer.json); transformers applies it to qwen2/qwen3 models
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_tokenizer(pre: str = "default") -> ByteLevelBPETokenizer:
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=320, min_frequency=1, special_tokens=SPECIALS, show_progress=False)
    if pre == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return tok


def tiny_hf_model(arch: str, vocab_size: int, seed: int = 0):
    """A random mlx-lm model whose dims suit GGUF's 32-wide quantization blocks."""
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    config = dict(
        model_type=arch,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # non-trivial norm weights and biases, so a wrong mapping shows up in the logits
    model.update(tree_map(lambda p: p + 0.1 * mx.random.normal(p.shape), model.parameters()))
    mx.eval(model.parameters())
    return model, config


def _gguf_name(hf_name: str, names: dict = HF_TO_GGUF) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, *rest = hf_name.split(".")
        module, suffix = ".".join(rest[:-1]), rest[-1]
        return f"blk.{layer}.{names[module]}.{suffix}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (llama only)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_hyperparameters(writer, config: dict) -> None:
    """The llama.cpp hyperparameters every architecture's GGUF carries, from an HF config."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def write_gguf(path: Path, arch: str = "llama", qtype: str = "F32", seed: int = 0):
    """Write a tiny `arch` GGUF with 2-D weights stored as `qtype`; returns (source model, tokenizer)."""
    pre = "default" if arch == "llama" else "qwen2"
    tok = tiny_tokenizer(pre)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    model, config = tiny_hf_model(arch, len(tokens), seed)
    writer = gguf.GGUFWriter(str(path), arch)
    add_hyperparameters(writer, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(_merges(tok))
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, w in tree_flatten(model.parameters()):
        w = np.array(w, dtype=np.float32)
        if arch == "llama" and "q_proj" in name:
            w = _permute(w, config["num_attention_heads"])
        elif arch == "llama" and "k_proj" in name:
            w = _permute(w, config["num_key_value_heads"])
        kind = gguf.GGMLQuantizationType[qtype if w.ndim == 2 else "F32"]
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), w)
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tok


def _merges(tok: ByteLevelBPETokenizer) -> list[str]:
    import json

    merges = json.loads(tok._tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


# llama.cpp's gemma3 names where they differ from llama's, and its SentencePiece token types
GEMMA3_TO_GGUF = {
    **HF_TO_GGUF,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
SPM_NORMAL, SPM_CONTROL, SPM_USER_DEFINED, SPM_BYTE = 1, 3, 4, 6
GEMMA3_PIECES = ["▁", "▁▁", "▁▁▁▁", "he", "ll", "hell", "hello", "▁w", "or", "▁wor", "ld", "▁world", "de", "def", "▁f"]


def gemma3_vocab() -> tuple[list[str], list[int]]:
    """A tiny Gemma-shaped SentencePiece vocabulary: specials, a user-defined newline, pieces
    (spaces spelled as llama.cpp stores Gemma's: real spaces), the ASCII letters, byte fallback."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = [p.replace("▁", " ") if not p.strip("▁") else p for p in GEMMA3_PIECES]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("():.,+=0123456789")
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + ["\n"] + pieces + letters + bytes_
    types = (
        [SPM_CONTROL] * len(specials)
        + [SPM_USER_DEFINED]
        + [SPM_NORMAL] * (len(pieces) + len(letters))
        + [SPM_BYTE] * len(bytes_)
    )
    return tokens, types


def write_gemma3_gguf(path: Path, qtype: str = "F32", seed: int = 0):
    """A tiny gemma3 GGUF written as llama.cpp's converter writes one (norms stored as 1 + w, no
    q/k permutation, SentencePiece vocabulary without merges); returns (source model, config)."""
    from mlx_lm.utils import _get_classes

    tokens, types = gemma3_vocab()
    config = dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=6,  # the sixth is the global one
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        sliding_window=8,
        sliding_window_pattern=6,
        vocab_size=len(tokens),
        max_position_embeddings=4096,
    )
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.sanitize({})  # no lm_head: tied, as Gemma's
    model.update(tree_map(lambda p: p + 0.1 * mx.random.normal(p.shape), model.parameters()))
    mx.eval(model.parameters())

    writer = gguf.GGUFWriter(str(path), "gemma3")
    add_hyperparameters(writer, config)
    writer.add_value_length(config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    for name, w in tree_flatten(model.parameters()):
        w = np.array(w, dtype=np.float32)
        if name.endswith("norm.weight"):
            w = w + 1.0
        kind = gguf.GGMLQuantizationType[qtype if w.ndim == 2 else "F32"]
        gguf_name = _gguf_name(name, GEMMA3_TO_GGUF)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, w)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, config
