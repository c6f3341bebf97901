"""Import a GGUF checkpoint (llama, qwen2, qwen3, gemma3) as an mlx-lm model directory.

MLX reads Q4_0 / Q4_1 / Q8_0 GGUF tensors directly as affine-quantized arrays
(group size 32).  We keep them (`dtype="native"`) or dequantize to a float
dtype (other types, K-quants included, through the `gguf` package), optionally
quantize with mlx-lm, map llama.cpp tensor names to Hugging Face names, undo
what llama.cpp's converter did to the weights (`Family`), rebuild a
`tokenizer.json` from the GGUF vocabulary, and let mlx-lm's own model class
check every tensor (strict load) before saving.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.utils import save_config, save_model

from ..io.storage import staged
from ..target.mlx_lm_compat import model_classes
from ..io.progress import add_task, progress

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
Q_GROUP = 64  # mlx-lm's default group when we quantize dequantized weights


def _gemma3_config(get) -> dict:
    """What llama.cpp's gemma3 graph hard-codes rather than stores: every sixth layer global, the
    local layers' RoPE base, and the query scale (1/sqrt(head_dim); 1/sqrt(hidden/heads) for 27B)."""
    hidden, heads, head_dim = get("embedding_length"), get("attention.head_count"), get("attention.key_length")
    return {
        "sliding_window": get("attention.sliding_window"),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": hidden // heads if get("block_count") == 62 else head_dim,
    }


@dataclass(frozen=True)
class Family:
    """How llama.cpp wrote one architecture, and the mlx-lm model that reads it back."""

    hf_class: str
    model_type: Optional[str] = None  # mlx-lm's, when it differs from the GGUF architecture
    layer_names: dict = field(default_factory=dict)  # llama.cpp -> HF names beside _LAYER_NAMES
    permuted_qk: bool = False  # llama.cpp interleaved each head's rotary halves of q/k rows
    norm_shift: float = 0.0  # llama.cpp stored norm weights + this (Gemma's 1 + w); mlx-lm adds it itself
    extra_config: Callable = lambda get: {}
    end_tokens: tuple = ()  # beside the GGUF's EOS: the chat template's end of turn
    chat_template: Optional[str] = None  # when the GGUF carries none


# the standard Gemma template (google/gemma-3 instruction-tuned models), lenient on role order:
# agents send runs of user or tool turns; those become user turns
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

FAMILIES = {
    "llama": Family("LlamaForCausalLM", permuted_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", extra_config=lambda get: {"attention_bias": True}),
    "qwen3": Family("Qwen3ForCausalLM"),
    "gemma3": Family(
        "Gemma3ForCausalLM",
        model_type="gemma3_text",
        layer_names={
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norm_shift=1.0,
        extra_config=_gemma3_config,
        end_tokens=("<end_of_turn>",),
        chat_template=GEMMA_CHAT_TEMPLATE,
    ),
}
ARCHITECTURES = tuple(FAMILIES)


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


def _hf_name(gguf_name: str, family: Family) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, kind, suffix = parts[1], parts[2], ".".join(parts[3:])
        names = {**_LAYER_NAMES, **family.layer_names}
        if kind not in names:
            raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{names[kind]}.{suffix}"
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
    tokens = list(md["tokenizer.ggml.tokens"])
    family = FAMILIES[arch]
    eos = _scalar(md.get("tokenizer.ggml.eos_token_id"))
    ends = [tokens.index(t) for t in family.end_tokens if t in tokens]
    config = {
        "model_type": family.model_type or arch,
        "architectures": [family.hf_class],
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
        "eos_token_id": [eos, *ends] if ends else eos,
    }
    config.update(family.extra_config(get))
    return config


def _unshift_norms(weights: dict, shift: float) -> None:
    for name in [n for n in weights if n.endswith("norm.weight")]:
        weights[name] = weights[name] - shift


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


def _tokenizer_files(md: dict, family: Family) -> dict:
    """tokenizer.json + tokenizer_config.json rebuilt from GGUF metadata."""
    from tokenizers import processors

    builders = {"gpt2": _byte_level_tokenizer, "llama": _sentencepiece_tokenizer}
    kind = md.get("tokenizer.ggml.model")
    if kind not in builders:
        raise GGUFError(
            f"GGUF tokenizer type {kind!r} is not supported (byte-level BPE 'gpt2' or SentencePiece 'llama')"
        )
    tokens = list(md["tokenizer.ggml.tokens"])
    tok = builders[kind](md, tokens)

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
    template = md.get("tokenizer.chat_template", family.chat_template)
    if template:
        config["chat_template"] = template
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}


def _byte_level_tokenizer(md: dict, tokens: list):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(_PRE_TOKENIZERS))}")
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
    return tok


def _sentencepiece_tokenizer(md: dict, tokens: list):
    """transformers' own GGUF builder: BPE merges recovered from the vocabulary, byte fallback,
    control tokens special and user-defined ones (Gemma's runs of newlines) kept whole."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as e:
        raise GGUFError(f"SentencePiece GGUF tokenizers need transformers >= 5 ({e})") from None
    tokenizer_dict = {
        "tokenizer_type": "llama",
        "tokens": tokens,
        "scores": [float(x) for x in md["tokenizer.ggml.scores"]],
        "token_type": [int(t) for t in md["tokenizer.ggml.token_type"]],
        "add_prefix_space": bool(_scalar(md.get("tokenizer.ggml.add_space_prefix", True))),
    }
    backend, _ = convert_gguf_tokenizer(md.get("general.architecture"), tokenizer_dict)
    return backend


def convert_gguf(
    gguf_path,
    out_dir,
    dtype: Optional[str] = "float32",
    force: bool = False,
    show_progress: bool = True,
    q_bits: Optional[int] = None,
) -> Path:
    """Write an mlx-lm model directory for `gguf_path`; returns `out_dir`.

    `dtype`: "float32" | "bfloat16" | "float16" dequantize; "native" keeps the
    GGUF quantization; None: native where MLX reads the file's types, else float32.
    `q_bits` (4 or 8): quantize the dequantized weights with mlx-lm (group 64; the
    rest bfloat16) -- for files MLX cannot keep quantized (K-quants, Q5_0...).
    Nothing is left behind if conversion fails.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype is not None and dtype not in DTYPES:
        raise GGUFError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if q_bits is not None and (q_bits not in (4, 8) or dtype == "native"):
        raise GGUFError("GGUF --q-bits must be 4 or 8, and quantizes float weights: not with --dtype native")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} already exists; pass --force to overwrite it")

    with progress(show_progress) as bar:
        step = add_task(
            bar, f"GGUF → MLX ({f'{q_bits}-bit' if q_bits else dtype or 'auto'})", total=4, info=gguf_path.name
        )
        weights, md, dequantized = read_gguf(gguf_path)
        if dtype is None:
            dtype = "float32" if dequantized or q_bits else "native"
        if dequantized and dtype == "native":
            raise GGUFError(
                f"MLX cannot keep {', '.join(sorted(dequantized))} tensors quantized; "
                "convert with --dtype float16/bfloat16/float32 or --q-bits 8/4 instead"
            )
        if q_bits and any(name.endswith(".scales") for name in weights):
            raise GGUFError(
                "this GGUF's Q4_0/Q4_1/Q8_0 tensors are kept as they are (--dtype native): re-quantizing "
                "them degrades them, so --q-bits is for float files and files MLX cannot read natively"
            )
        arch = md.get("general.architecture")
        if arch not in FAMILIES:
            raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        family = FAMILIES[arch]
        bar.advance(step)

        config = _config(arch, md, weights)
        weights = {_hf_name(k, family): v for k, v in weights.items()}
        if family.permuted_qk:
            _unpermute_qk(weights, config["num_attention_heads"], config["num_key_value_heads"])
        if family.norm_shift:
            _unshift_norms(weights, family.norm_shift)
        if DTYPES[dtype] is not None:
            weights = _dequantize(weights, mx.bfloat16 if q_bits else DTYPES[dtype])
        quantization = _quantization(weights)
        if quantization:
            config["quantization"] = quantization
        tokenizer_files = _tokenizer_files(md, family)
        bar.advance(step)

        model = _build_model(config, weights)
        if q_bits:
            from mlx_lm.utils import quantize_model

            model, config = quantize_model(model, config, Q_GROUP, q_bits)
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
    if hasattr(model, "sanitize"):  # e.g. Gemma ties its head by dropping lm_head here
        weights = model.sanitize(dict(weights))
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
