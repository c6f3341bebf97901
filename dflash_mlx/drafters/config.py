"""A drafter's configuration in the z-lab schema (config.json with `dflash_config`,
also read by SGLang and vLLM), and the checks that a drafter fits its target."""

from dataclasses import dataclass, field, fields
from typing import Optional


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
            raise DraftLoadError(
                f"drafter architecture {self.architecture!r} is not supported ({' or '.join(ARCHITECTURES)})"
            )
        values = {k: getattr(self, k) for k in DFLASH2_KEYS}
        if self.dflash2 and not all(isinstance(v, int) and v > 0 for v in values.values()):
            bad = next(k for k, v in values.items() if not (isinstance(v, int) and v > 0))
            raise DraftLoadError(
                f"drafter config: a DFlash 2 drafter needs dflash_config.{bad} > 0, got {values[bad]!r}"
            )
        if not self.dflash2 and any(values.values()):
            bad = next(k for k, v in values.items() if v)
            raise DraftLoadError(
                f"drafter config: {bad} is a DFlash 2 field, but the architecture "
                "says DFlashDraftModel; fix the config's architectures"
            )
        if self.dflash2 and self.hidden_size % self.conv_group_size:
            raise DraftLoadError(
                f"drafter config: conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}"
            )

    @classmethod
    def from_config(cls, config: dict) -> "DraftArgs":
        """Read a z-lab drafter config.json the way z-lab's own loader does; fields that
        would change the computation and that we do not implement are refused."""
        dflash = config.get("dflash_config") or {}
        unknown = sorted(set(dflash) - DFLASH_CONFIG_KEYS)
        if unknown:
            raise DraftLoadError(
                f"drafter config: unknown dflash_config field {unknown[0]!r}; this drafter needs a newer dflash-mlx"
            )
        for key, allowed in UNSUPPORTED_FIELDS.items():
            if key in config and config[key] not in allowed:
                raise DraftLoadError(
                    f"drafter config: {key}={config[key]!r} is not supported "
                    f"(it would change the drafter's computation)"
                )
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
        extras = {
            "input_embedding_scale": (self.input_embedding_scale, 1.0),
            "output_multiplier": (self.output_multiplier, 1.0),
            "final_logit_softcapping": (self.final_logit_softcapping, None),
        }
        config["dflash_config"].update({k: v for k, (v, default) in extras.items() if v != default})
        if self.dflash2:
            config["dflash_config"].update({k: getattr(self, k) for k in DFLASH2_KEYS})
        return config


ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")  # no ".weight" on disk
DFLASH_CONFIG_KEYS = {
    "mask_token_id",
    "target_layer_ids",
    "block_size",
    "final_logit_softcapping",
    "input_embedding_scale",
    "output_multiplier",
    *DFLASH2_KEYS,
}
# config fields that would change what the drafter computes: the values we implement
UNSUPPORTED_FIELDS = {
    "hidden_act": ("silu",),
    "mlp_bias": (False,),
    "attn_logit_softcapping": (None,),
    "partial_rotary_factor": (1.0, 1),
    "query_pre_attn_scalar": (None,),
}


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
