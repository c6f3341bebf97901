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

from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn

from ..sampling import SamplingParams, choose
from .config import CODEBOOKS, DraftArgs, check_pair
from .dflash import ContextKV, ContextRows, DraftLayer, FreshContext, block_positions
from .dflash2 import CandidateSelector, DFlash2Layer
from .vocab import DraftVocabulary


class Drafts(NamedTuple):
    """A drafting pass's tokens (rows, L-1) and their confidence (rows, L-1): the drafter's top
    probability at each position (its logits at the row's temperature, 1 when greedy), which
    foretells whether the target agrees there.  It is the position's distribution's, not the
    drawn token's: a verify cut by it keeps the target's output what it would have been."""

    tokens: mx.array
    confidence: mx.array


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
            self.candidate_selector = CandidateSelector(
                args.hidden_size, args.vocab_size, args.selector_rank, args.selector_top_k
            )
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

    def propose(
        self, block: mx.array, cache: list[ContextKV], params: SamplingParams, noise: Optional[mx.array]
    ) -> mx.array:
        """The drafted tokens (L-1,) for block = [last token, mask...] (batch 1); `noise`
        (L-1, full vocab) is the Gumbel noise of their output positions when sampling.
        DFlash 1 samples each position from its logits, DFlash 2 walks its selector."""
        return self.drafts(block, [cache], [params], [noise]).tokens[0]

    def drafts(
        self,
        blocks: mx.array,
        caches: list[list[ContextKV]],
        params: list[SamplingParams],
        noises: list[Optional[mx.array]],
        fresh: Optional[list[Optional[mx.array]]] = None,
    ) -> Drafts:
        """propose() for several rows' blocks (R, L) in one pass, each row with its own
        context, sampling parameters and noise: what each would draft alone, (R, L-1), up to
        the float rounding of new context (`fresh`: each row's target features not yet in its
        cache, (1, S, n_layers * hidden) or None, injected by this pass); and how confident the
        drafter is in each token (lazily: computed only when read)."""
        contexts = self._contexts(blocks, caches, fresh or [None] * len(caches))
        ids = self.vocab_ids
        greedy = all(row_params.greedy for row_params in params)
        if self.args.dflash2:
            hidden = self.run_layers(blocks, contexts)[:, 1:]
            logits = self.logits(hidden)
            if greedy:
                tokens = self.candidate_selector.walk(hidden, logits, blocks[:, 0], ids, 0.0, None)  # every row in one
            else:
                tokens = mx.stack(
                    [
                        self.candidate_selector.walk(hidden[i], logits[i], blocks[i, 0], ids, row_params.temp, noise)
                        for i, (row_params, noise) in enumerate(zip(params, noises))
                    ]
                )
            return Drafts(tokens, top_probability(logits, params))
        logits = self(blocks, contexts)
        if greedy:
            choices = mx.argmax(logits, axis=-1)  # every row in one
        else:
            choices = mx.stack(
                [
                    choose(logits[i], row_params, noise if noise is None or ids is None else noise[:, ids])
                    for i, (row_params, noise) in enumerate(zip(params, noises))
                ]
            )
        return Drafts(choices if ids is None else ids[choices], top_probability(logits, params))

    def _contexts(self, blocks: mx.array, caches: list[list[ContextKV]], fresh: list[Optional[mx.array]]) -> list:
        """Each layer's attention context for a pass over `blocks`, the `fresh` features in:
        a row alone projects them with its block (FreshContext); rows of a batch, whose new
        positions differ in number, inject theirs first."""
        if len(caches) == 1:
            if fresh[0] is None:
                return caches[0]
            vectors = self.context(fresh[0])
            return [FreshContext(cache, vectors) for cache in caches[0]]
        for features, cache in zip(fresh, caches):
            if features is not None:
                self.add_context(features, cache)
        position = block_positions([cache[0] for cache in caches], blocks.shape[1])  # built once, for every layer
        return [ContextRows(list(layer), blocks.shape[1], position) for layer in zip(*caches)]

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


def top_probability(logits: mx.array, params: list[SamplingParams]) -> mx.array:
    """(rows, positions) the largest probability of each row's softmax(logits / temperature)
    (temperature 1 for a greedy row)."""
    temps = mx.array([1.0 if row_params.greedy else row_params.temp for row_params in params])[:, None, None]
    scaled = logits.astype(mx.float32) / temps
    return mx.exp(scaled.max(axis=-1) - mx.logsumexp(scaled, axis=-1))
