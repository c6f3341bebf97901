"""The DFlash drafter (z-lab format): a few Qwen3-style layers that predict a
whole block in one pass, attending to the target's fused hidden features.

    features (target layers, concatenated) -> fc -> hidden_norm -> context
    context  -> every layer's k_proj / v_proj -> cached keys/values (ContextKV)
    block    = target.embed([last token, mask, ..., mask])
    block    -> layers (queries: block; keys: context + block) -> norm -> target.lm_head

The embedding and lm_head are the target's, borrowed at bind() time and never
copied or saved.  Block keys/values are never cached, so the drafter has nothing
to roll back: its cache only ever grows by committed positions.
"""

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.qwen3 import MLP

from .dflash2 import CandidateSelector, GroupedCausalConv
from .kernels import ContextSpan, block_attention
from .sampling import SamplingParams, choose


class DraftLoadError(ValueError):
    """A drafter directory or drafter/target pairing that cannot work."""


@dataclass
class DraftArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    input_embedding_scale: float = 1.0  # times the target's own embedding scale (Gemma)
    output_multiplier: float = 1.0  # on the drafter's logits, before soft-capping
    final_logit_softcapping: Optional[float] = None
    architecture: str = "DFlashDraftModel"  # or "DFlash2DraftModel": the fields below are then > 0
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def dflash2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.layer_types = list(self.layer_types or ["full_attention"] * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise DraftLoadError(
                f"drafter config: {len(self.layer_types)} layer_types for {self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise DraftLoadError(f"drafter config: unsupported layer_types {sorted(unknown)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DraftLoadError("drafter config: sliding_attention layers need sliding_window")
        if self.block_size < 2:
            raise DraftLoadError(f"drafter config: block_size must be >= 2, got {self.block_size}")
        if self.architecture not in ARCHITECTURES:
            raise DraftLoadError(f"drafter architecture {self.architecture!r} is not supported "
                                 f"({' or '.join(ARCHITECTURES)})")
        values = {k: getattr(self, k) for k in DFLASH2_KEYS}
        if self.dflash2 and not all(isinstance(v, int) and v > 0 for v in values.values()):
            bad = next(k for k, v in values.items() if not (isinstance(v, int) and v > 0))
            raise DraftLoadError(f"drafter config: a DFlash 2 drafter needs dflash_config.{bad} > 0, got {values[bad]!r}")
        if not self.dflash2 and any(values.values()):
            bad = next(k for k, v in values.items() if v)
            raise DraftLoadError(f"drafter config: {bad} is a DFlash 2 field, but the architecture "
                                 "says DFlashDraftModel; fix the config's architectures")
        if self.dflash2 and self.hidden_size % self.conv_group_size:
            raise DraftLoadError(f"drafter config: conv_group_size {self.conv_group_size} does not divide "
                                 f"hidden_size {self.hidden_size}")

    @classmethod
    def from_config(cls, config: dict) -> "DraftArgs":
        """Read a z-lab drafter config.json the way z-lab's own loader does; fields that
        would change the computation and that we do not implement are refused."""
        dflash = config.get("dflash_config") or {}
        unknown = sorted(set(dflash) - DFLASH_CONFIG_KEYS)
        if unknown:
            raise DraftLoadError(f"drafter config: unknown dflash_config field {unknown[0]!r}; "
                                 "this drafter needs a newer dflash-mlx")
        for key, allowed in UNSUPPORTED_FIELDS.items():
            if key in config and config[key] not in allowed:
                raise DraftLoadError(f"drafter config: {key}={config[key]!r} is not supported "
                                     f"(it would change the drafter's computation)")
        merged = {**config, **{k: v for k, v in dflash.items() if v is not None}}
        missing = [k for k in ("target_layer_ids", "mask_token_id") if k not in merged]
        if missing:
            raise DraftLoadError(f"drafter config.json lacks dflash_config.{missing[0]}: not a DFlash drafter")
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise DraftLoadError("drafter config: partial_rotary_factor is not supported")
        merged["rope_scaling"] = rope
        merged["rope_theta"] = config.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
        # z-lab reads these two from dflash_config only
        merged["input_embedding_scale"] = float(dflash.get("input_embedding_scale", 1.0))
        merged["output_multiplier"] = float(dflash.get("output_multiplier", 1.0))
        merged["final_logit_softcapping"] = dflash.get("final_logit_softcapping", config.get("final_logit_softcapping"))
        merged["architecture"] = (config.get("architectures") or ["DFlashDraftModel"])[0]
        for key in DFLASH2_KEYS:  # z-lab reads these from dflash_config only
            merged[key] = dflash.get(key, 0)
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in merged.items() if k in names})
        except TypeError as e:
            raise DraftLoadError(f"drafter config.json is incomplete: {e}") from None

    def to_config(self) -> dict:
        """config.json in the z-lab schema (also read by SGLang / vLLM)."""
        config = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }
        if self.is_causal is not None:
            config["is_causal"] = self.is_causal
        extras = {"input_embedding_scale": (self.input_embedding_scale, 1.0),
                  "output_multiplier": (self.output_multiplier, 1.0),
                  "final_logit_softcapping": (self.final_logit_softcapping, None)}
        config["dflash_config"].update({k: v for k, (v, default) in extras.items() if v != default})
        if self.dflash2:
            config["dflash_config"].update({k: getattr(self, k) for k in DFLASH2_KEYS})
        return config


ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")  # no ".weight" on disk
DFLASH_CONFIG_KEYS = {"mask_token_id", "target_layer_ids", "block_size", "final_logit_softcapping",
                      "input_embedding_scale", "output_multiplier", *DFLASH2_KEYS}
# config fields that would change what the drafter computes: the values we implement
UNSUPPORTED_FIELDS = {"hidden_act": ("silu",), "mlp_bias": (False,), "attn_logit_softcapping": (None,),
                      "partial_rotary_factor": (1.0, 1), "query_pre_attn_scalar": (None,)}


class ContextKV:
    """Keys/values of the injected context, in temporal order, preallocated in
    steps so appending a few positions per cycle does not copy the whole
    context.  With a window, entries older than the window are dropped when
    the buffer is regrown."""

    step = 256

    def __init__(self, window: Optional[int] = None):
        self.window = window
        self.keys = self.values = None
        self.offset = 0  # positions appended so far
        self._end = 0  # buffer index after the newest entry

    def append(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        if self.keys is None or self._end + n > self.keys.shape[2]:
            self._regrow(keys, values, n)
        self.keys[..., self._end : self._end + n, :] = keys
        self.values[..., self._end : self._end + n, :] = values
        self._end += n
        self.offset += n

    def _regrow(self, keys, values, n):
        kept = self.span()
        length = kept.length if kept else 0
        capacity = ((length + n + self.step - 1) // self.step + 1) * self.step
        B, H, _, D = keys.shape
        new_k = mx.zeros((B, H, capacity, D), keys.dtype)
        new_v = mx.zeros((B, H, capacity, values.shape[3]), values.dtype)
        if length:
            live = slice(kept.start, kept.start + length)
            new_k[..., :length, :] = kept.keys[..., live, :]
            new_v[..., :length, :] = kept.values[..., live, :]
        self.keys, self.values, self._end = new_k, new_v, length

    def trim(self, n: int) -> None:
        """Forget the newest `n` entries (a context without a window only)."""
        if self.window is not None:
            raise ValueError("a windowed drafter context cannot be cut back")
        self._end -= n
        self.offset -= n

    def span(self) -> Optional[ContextSpan]:
        """The live entries (the last `window` with a window), read in place by attention."""
        if self.keys is None:
            return None
        start = 0 if self.window is None else max(0, self._end - self.window)
        return ContextSpan(self.keys, self.values, start, self._end - start)

    @property
    def state(self):
        return self.keys, self.values

    # the attention-context protocol DraftAttention calls
    @property
    def position(self) -> int:
        return self.offset  # the block starts right after the context

    def attend(self, attn: "DraftAttention", queries, keys, values) -> mx.array:
        return block_attention(queries, keys, values, self.span(), scale=attn.scale,
                               causal=attn.causal, window=attn.window)


class DraftAttention(nn.Module):
    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        sliding = layer_type == "sliding_attention"
        self.window = args.sliding_window if sliding else None
        # z-lab's reference: sliding layers are causal inside the block unless the config says otherwise
        self.causal = sliding if args.is_causal is None else bool(args.is_causal)
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        try:
            self.rope = initialize_rope(
                self.head_dim, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
            )
        except (ValueError, KeyError, TypeError) as e:
            raise DraftLoadError(f"drafter config: RoPE {args.rope_scaling} is not supported ({e})") from None

    def _rope(self, x: mx.array, position) -> mx.array:
        """RoPE at `position`: an int offset for consecutive tokens, or an array with
        one position per token (packed training blocks)."""
        if isinstance(position, int):
            return self.rope(x, offset=position)
        return self.rope(x.swapaxes(0, 2), offset=position).swapaxes(0, 2)

    def keys_values(self, x: mx.array, position) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self._rope(keys, position), values

    def add_context(self, context: mx.array, cache: "ContextKV"):
        cache.append(*self.keys_values(context, cache.offset))

    def __call__(self, x: mx.array, context) -> mx.array:
        """Block queries attend to the injected context and to the whole block.

        `context` is a ContextKV (decoding) or a packed training context; both
        give the block's position(s) and attend(attn, queries, keys, values)."""
        B, L, _ = x.shape
        position = context.position
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        queries = self._rope(queries, position)
        keys, values = self.keys_values(x, position)
        out = context.attend(self, queries, keys, values)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DraftLayer(nn.Module):
    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__()
        self.self_attn = DraftAttention(args, layer_type)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, context) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), context)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlash2Layer(DraftLayer):
    """Each sublayer wrapped in a grouped dynamic causal convolution along the block."""

    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__(args, layer_type)
        self.attention_conv = GroupedCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = GroupedCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def __call__(self, x: mx.array, context) -> mx.array:
        index = getattr(context, "block_index", None)  # packed training blocks; decoding has one block
        y, kernel = self.attention_conv.prepare(self.input_layernorm(x), index)
        h = x + self.attention_conv.finish(self.self_attn(y, context), kernel, index)
        y, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h), index)
        return h + self.mlp_conv.finish(self.mlp(y), kernel, index)


class DFlashDraftModel(nn.Module):
    def __init__(self, args: DraftArgs):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        layer_class = DFlash2Layer if args.dflash2 else DraftLayer
        self.layers = [layer_class(args, t) for t in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.dflash2:
            self.candidate_selector = CandidateSelector(args.hidden_size, args.vocab_size, args.selector_rank,
                                                        args.selector_top_k)
        self._target = None  # a plain object, so its weights are not our parameters
        self.quantization: Optional[dict] = None  # mlx-style entry when the linears are quantized
        self._vocab = DraftVocabulary(None)  # a plain object too: not a parameter

    @property
    def dtype(self) -> mx.Dtype:
        """Activation dtype: the norms' (never a quantized weight's storage type)."""
        return self.norm.weight.dtype

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.args.target_layer_ids)

    @property
    def mask_token_id(self) -> int:
        return self.args.mask_token_id

    def bind(self, target) -> "DFlashDraftModel":
        """Borrow `target`'s embedding and lm_head after checking the pair fits."""
        check_pair(self.args, target)
        self._target = target
        self._vocab.bind(target)
        return self

    @property
    def vocab_ids(self) -> Optional[mx.array]:
        """The token ids it drafts from (None: the whole vocabulary)."""
        return self._vocab.token_ids

    def restrict_vocab(self, token_ids) -> "DFlashDraftModel":
        """Draft from `token_ids` only (sorted, unique); None drafts from the whole vocabulary."""
        self._vocab = DraftVocabulary(token_ids, self.args.vocab_size)
        if self._target is not None:
            self._vocab.bind(self._target)
        return self

    def make_cache(self) -> list[ContextKV]:
        return [ContextKV(layer.self_attn.window) for layer in self.layers]

    def context(self, features: mx.array) -> mx.array:
        """Fused target features (.., n_layers * hidden) -> context vectors (.., hidden)."""
        return self.hidden_norm(self.fc(features.astype(self.dtype)))

    def add_context(self, features: mx.array, cache: list[ContextKV]):
        """Inject target features (1, S, n_layers * hidden) of the next S positions."""
        context = self.context(features)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.add_context(context, c)

    def run_layers(self, block: mx.array, contexts: list) -> mx.array:
        """Final-normed hidden states of every block position (1, L, hidden)."""
        h = self._target.embed_tokens(block).astype(self.dtype)
        scale = self._target.embed_scale * self.args.input_embedding_scale
        if scale != 1.0:
            h = h * scale
        for layer, context in zip(self.layers, contexts):
            h = layer(h, context)
        return self.norm(h)

    def __call__(self, block: mx.array, cache: list[ContextKV]) -> mx.array:
        """Logits for the block's positions 1..L-1 given block = [last token, mask...],
        over its drafting vocabulary (vocab_ids, when restricted)."""
        return self.logits(self.run_layers(block, cache)[:, 1:])

    def propose(self, block: mx.array, cache: list[ContextKV], params: SamplingParams,
                noise: Optional[mx.array]) -> mx.array:
        """The drafted tokens (L-1,) for block = [last token, mask...] (batch 1); `noise`
        (L-1, full vocab) is the Gumbel noise of their output positions when sampling.
        DFlash 1 samples each position from its logits, DFlash 2 walks its selector."""
        ids = self.vocab_ids
        if self.args.dflash2:
            hidden = self.run_layers(block, cache)[:, 1:]
            return self.candidate_selector.walk(hidden[0], self.logits(hidden)[0], block[0, 0], ids, params.temp, noise)
        choice = choose(self(block, cache)[0], params, noise if noise is None or ids is None else noise[:, ids])
        return choice if ids is None else ids[choice]

    def logits(self, hidden: mx.array) -> mx.array:
        logits = self._vocab.head(hidden)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        if self.args.final_logit_softcapping:
            logits = mx.tanh(logits / self.args.final_logit_softcapping) * self.args.final_logit_softcapping
        return logits

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, value in weights.items():
            name = name.removeprefix("model.")
            if name.startswith(("embed_tokens.", "lm_head.")):
                continue  # borrowed from the target
            if "rotary_emb" in name:
                continue
            out[f"{name}.weight" if name in CODEBOOKS else name] = value
        return out


VOCAB_FILE = "draft_vocab.json"  # optional; other runtimes ignore it and draft from the whole vocabulary


class DraftVocabulary:
    """The subset of token ids a drafter proposes from (FR-Spec style): its lm_head then
    runs over those rows only.  Any proposal is verified, so this never changes the
    output, only how cheap and how good the drafts are."""

    def __init__(self, token_ids, vocab_size: Optional[int] = None):
        if token_ids is not None:
            ids = sorted(set(int(t) for t in token_ids))
            if not ids or ids[0] < 0 or (vocab_size is not None and ids[-1] >= vocab_size):
                raise DraftLoadError(f"drafting vocabulary ids must lie in 0..{vocab_size - 1}")
            token_ids = mx.array(ids, dtype=mx.int32)
        self.token_ids = token_ids
        self.head = None

    def bind(self, target) -> None:
        self.head = target.lm_head if self.token_ids is None else target.head_rows(self.token_ids)


def check_pair(args: DraftArgs, target) -> None:
    if args.hidden_size != target.hidden_size:
        raise DraftLoadError(
            f"drafter hidden_size {args.hidden_size} != target hidden_size {target.hidden_size}: "
            "this drafter was trained for another target"
        )
    if args.vocab_size != target.vocab_size:
        raise DraftLoadError(
            f"drafter vocab_size {args.vocab_size} != target vocab_size {target.vocab_size}: "
            "this drafter was trained for another target"
        )
    bad = [i for i in args.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DraftLoadError(
            f"drafter target_layer_ids {bad} out of range for a {target.num_layers}-layer target: "
            "this drafter was trained for another target"
        )
    if args.num_target_layers is not None and args.num_target_layers != target.num_layers:
        raise DraftLoadError(
            f"drafter expects a {args.num_target_layers}-layer target, this target has "
            f"{target.num_layers}: this drafter was trained for another target"
        )
    if not 0 <= args.mask_token_id < target.vocab_size:
        raise DraftLoadError(f"drafter mask_token_id {args.mask_token_id} is outside the target vocabulary")


def safe_activation_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """Drafters never compute in float16: the target features they fuse reach ~3e4
    (massive activations) and fc sums thousands of them, which overflows float16
    (zero acceptance, as reported for 4-bit drafters on M1/M2).  bfloat16 has
    float32's range."""
    return mx.bfloat16 if dtype == mx.float16 else dtype


def load_draft(path: str | Path, dtype: Optional[mx.Dtype] = None, dequantize: bool = False) -> DFlashDraftModel:
    """Load a drafter directory (z-lab format: config.json + *.safetensors).

    Weights and activations use `dtype` (default: as stored), except that
    float16 becomes bfloat16 (see safe_activation_dtype); quantized layers keep
    their packed weights and take their scales in that dtype, unless
    `dequantize`, which expands them to plain `dtype` weights."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DraftLoadError(f"{path} is not a DFlash drafter directory: no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise DraftLoadError(f"{config_file} is not valid JSON ({e}); re-download the drafter") from None
    architecture = (config.get("architectures") or ["DFlashDraftModel"])[0]
    if architecture not in ARCHITECTURES:
        raise DraftLoadError(f"{path}: drafter architecture {architecture!r} is not supported "
                             f"({' or '.join(ARCHITECTURES)})")
    args = DraftArgs.from_config(config)
    model = DFlashDraftModel(args)

    weights = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftLoadError(f"{path} has no *.safetensors weights")
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises bare RuntimeError/ValueError on corrupt files
            raise DraftLoadError(f"{f} is corrupt or unreadable ({e}); re-download or re-convert it") from None
    weights = model.sanitize(weights)

    if quantization := config.get("quantization"):
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
        model.quantization = quantization
    _load_weights_checked(model, weights, path)
    model.set_dtype(safe_activation_dtype(dtype or model.dtype))
    if dequantize and model.quantization:  # after the cast: expanded in the activation dtype
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
        model.quantization = None
    if (path / VOCAB_FILE).is_file():
        try:
            model.restrict_vocab(json.loads((path / VOCAB_FILE).read_text())["token_ids"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DraftLoadError(f"{path / VOCAB_FILE} is not a drafting vocabulary ({e}); delete it or "
                                 "re-export the drafter") from None
    mx.eval(model.parameters())
    model.eval()
    return model


def _load_weights_checked(model: nn.Module, weights: dict[str, Any], path: Path) -> None:
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DraftLoadError(f"{path}: drafter weights missing {', '.join(missing[:3])}{more}")
    if unexpected:
        more = f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise DraftLoadError(f"{path}: unexpected drafter weights {', '.join(unexpected[:3])}{more}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise DraftLoadError(
                f"{path}: weight {name} has shape {tuple(value.shape)}, config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_weights(list(weights.items()))


def save_draft(model: DFlashDraftModel, path: str | Path, quantization: Optional[dict] = None) -> Path:
    """Write `model` as a z-lab drafter directory (config.json + model.safetensors);
    a quantized drafter also records mlx-lm's `quantization` entry."""
    from mlx.utils import tree_flatten

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.args.to_config()
    quantization = quantization or model.quantization
    if quantization:
        model.quantization = quantization
        config["quantization"] = config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {name.removesuffix(".weight") if name.removesuffix(".weight") in CODEBOOKS else name: value
               for name, value in tree_flatten(model.parameters())}
    # "pt" is what transformers / SGLang / vLLM expect in the safetensors header
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    if model.vocab_ids is not None:
        (path / VOCAB_FILE).write_text(json.dumps({"token_ids": model.vocab_ids.tolist()}))
    return path
