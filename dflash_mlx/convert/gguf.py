"""Import a GGUF checkpoint (llama, qwen2, qwen3) as an mlx-lm model directory.

MLX reads Q4_0 / Q4_1 / Q8_0 GGUF tensors directly as affine-quantized arrays
(group size 32).  We keep them (`dtype="native"`) or dequantize to a float
dtype, map llama.cpp tensor names to Hugging Face names, undo llama.cpp's q/k
row permutation, rebuild a `tokenizer.json` from the GGUF vocabulary, and let
mlx-lm's own model class check every tensor (strict load) before saving.
"""

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx_lm.utils import save_config, save_model

from ..io.storage import staged
from ..target.mlx_lm_compat import model_classes
from ..io.progress import add_task, progress

ARCHITECTURES = ("llama", "qwen2", "qwen3")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16, "native": None}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's pre-tokenizer names -> the split regex that precedes byte-level BPE
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_PRE_TOKENIZERS = {
    "default": _GPT2_SPLIT,
    "gpt-2": _GPT2_SPLIT,
    "smollm": _GPT2_SPLIT,  # plus: every digit on its own (below)
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_CONTROL_TOKEN = 3
GGUF_GROUP = 32  # Q4_0 / Q4_1 / Q8_0 blocks


class GGUFError(ValueError):
    """A GGUF file this importer cannot turn into a working model."""


def _scalar(value):
    return value.item() if isinstance(value, mx.array) else value


def read_gguf(path: Path) -> tuple[dict, dict, set]:
    """(tensors, metadata, names of GGUF types that had to be dequantized).

    MLX reads F32/F16/BF16 and Q4_0/Q4_1/Q8_0 itself (quantized ones stay quantized);
    for files with other types every tensor goes through the `gguf` package and
    the quantized ones are dequantized to float32."""
    try:
        weights, md = mx.load(str(path), return_metadata=True)
        return weights, md, set()
    except Exception as mlx_error:
        import gguf
        from gguf.quants import dequantize

        try:
            reader = gguf.GGUFReader(str(path))
        except Exception:
            raise GGUFError(f"cannot read {path} as GGUF: {mlx_error}") from None
    md = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    weights, converted = {}, set()
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for tensor in reader.tensors:
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"GGUF tensor type {tensor.tensor_type.name} ({tensor.name}) is not supported") from None
        if tensor.tensor_type not in float_types:
            converted.add(tensor.tensor_type.name)
        weights[tensor.name] = mx.array(values.astype("float32").reshape(tuple(reversed(tensor.shape.tolist()))))
    return weights, md, converted


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, kind, suffix = parts[1], parts[2], ".".join(parts[3:])
        if kind not in _LAYER_NAMES:
            raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    kind, suffix = parts[0], ".".join(parts[1:])
    if kind not in _GLOBAL_NAMES:
        raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[kind]}.{suffix}"


def _config(arch: str, md: dict, weights: dict) -> dict:
    def get(key, default=None):
        return _scalar(md.get(f"{arch}.{key}", default))

    hidden, heads = get("embedding_length"), get("attention.head_count")
    if get("rope.scaling.type") not in (None, "none") or "rope_freqs.weight" in weights:
        raise GGUFError(
            "this GGUF uses RoPE scaling, which the importer does not map yet; convert from the HF checkpoint"
        )
    tokens = md["tokenizer.ggml.tokens"]
    config = {
        "model_type": arch,
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
        ],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": _scalar(md.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _scalar(md.get("tokenizer.ggml.eos_token_id")),
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    return config


def _unpermute_qk(weights: dict, n_heads: int, n_kv_heads: int) -> None:
    """llama.cpp interleaves each head's rotary halves; restore HF row order."""
    for proj, heads in (("q_proj", n_heads), ("k_proj", n_kv_heads)):
        for name in [n for n in weights if f"self_attn.{proj}." in n]:
            w = weights[name]
            rows = w.shape[0]
            w = w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            weights[name] = w.reshape(rows, *w.shape[3:])


def _quantization(weights: dict) -> Optional[dict]:
    """mlx-lm's `quantization` entry: the most common bit width + per-layer exceptions."""
    bits = {
        name[: -len(".scales")]: _bits(weights[name.replace(".scales", ".weight")], scales)
        for name, scales in weights.items()
        if name.endswith(".scales")
    }
    if not bits:
        return None
    default = max(set(bits.values()), key=list(bits.values()).count)
    quant = {"group_size": GGUF_GROUP, "bits": default, "mode": "affine"}
    quant.update({p: {"group_size": GGUF_GROUP, "bits": b, "mode": "affine"} for p, b in bits.items() if b != default})
    return quant


def _bits(packed: mx.array, scales: mx.array) -> int:
    return packed.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP)


def _dequantize(weights: dict, dtype: mx.Dtype) -> dict:
    out = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        prefix = name[: -len(".weight")]
        if f"{prefix}.scales" in weights:
            scales, biases = weights[f"{prefix}.scales"], weights[f"{prefix}.biases"]
            w = mx.dequantize(w, scales, biases, group_size=GGUF_GROUP, bits=_bits(w, scales))
        out[name] = w.astype(dtype)
    return out


def _tokenizer_files(md: dict) -> dict:
    """tokenizer.json + tokenizer_config.json rebuilt from GGUF metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFError(f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(_PRE_TOKENIZERS))}")
    tokens = list(md["tokenizer.ggml.tokens"])
    types = [int(t) for t in md["tokenizer.ggml.token_type"]]
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(_PRE_TOKENIZERS[pre]), behavior="isolated")]
    if pre == "smollm":
        splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL_TOKEN]
    )

    def token(key):
        idx = md.get(f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[_scalar(idx)]

    add_bos = bool(_scalar(md.get("tokenizer.ggml.add_bos_token", False))) and token("bos") is not None
    if add_bos:
        bos = token("bos")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in md:
        config["chat_template"] = md["tokenizer.chat_template"]
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}


def convert_gguf(gguf_path, out_dir, dtype: str = "float32", force: bool = False, show_progress: bool = True) -> Path:
    """Write an mlx-lm model directory for `gguf_path`; returns `out_dir`.

    `dtype`: "float32" | "bfloat16" | "float16" dequantize; "native" keeps the
    GGUF quantization.  Nothing is left behind if conversion fails.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise GGUFError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} already exists; pass --force to overwrite it")

    with progress(show_progress) as bar:
        step = add_task(bar, f"GGUF → MLX ({dtype})", total=4, info=gguf_path.name)
        weights, md, dequantized = read_gguf(gguf_path)
        if dequantized and dtype == "native":
            raise GGUFError(
                f"MLX cannot keep {', '.join(sorted(dequantized))} tensors quantized; "
                "convert with --dtype float16/bfloat16/float32 instead"
            )
        arch = md.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        bar.advance(step)

        config = _config(arch, md, weights)
        weights = {_hf_name(k): v for k, v in weights.items()}
        if arch == "llama":
            _unpermute_qk(weights, config["num_attention_heads"], config["num_key_value_heads"])
        if DTYPES[dtype] is not None:
            weights = _dequantize(weights, DTYPES[dtype])
        quantization = _quantization(weights)
        if quantization:
            config["quantization"] = quantization
        tokenizer_files = _tokenizer_files(md)
        bar.advance(step)

        model = _build_model(config, weights)
        bar.advance(step)

        with staged(out_dir, force) as staging:
            save_model(staging, model)
            save_config(dict(config), staging / "config.json")
            for name, text in tokenizer_files.items():
                (staging / name).write_text(text)
        bar.advance(step)
    return out_dir


def _build_model(config: dict, weights: dict):
    """Instantiate mlx-lm's class and load strictly: names and shapes are checked there."""
    import mlx.nn as nn

    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    if quant := config.get("quantization"):
        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            class_predicate=lambda p, m: quant.get(p, True) if f"{p}.scales" in weights else False,
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise GGUFError(f"GGUF tensors do not fit the {config['model_type']} model: {e}") from None
    mx.eval(model.parameters())
    return model
