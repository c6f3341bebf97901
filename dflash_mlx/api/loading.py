"""Loading a target and its drafter: by short name, Hugging Face repo or local directory,
with the adaptive plan's measured costs, on one machine or split over several."""

import hashlib
import json
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx_lm
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..decode.costs import (
    LONG_CONTEXT,
    PROBE_CONTEXT,
    StepTimes,
    cached_costs,
    curve_key,
    measure_costs,
    step_times_path,
)
from ..drafters import DFlashDraftModel, load_draft
from ..drafters.precision import DraftPrecision, apply_precision, check_draft_quant, draft_precision, runs_packed
from ..kernels.fused_ops import fuse
from ..io import blas
from ..io.progress import console
from ..io.storage import atomic_write, cache_dir, fetch
from ..decode.learning import Learning, keep
from ..decode.model import DFlashModel
from ..decode.plan import WIDEST_WITHOUT_DRAFTER, Planner
from ..decode.suffix import SuffixStore
from ..target.wrapper import Target


def load(
    model: Optional[str] = None,
    draft: Optional[str] = None,
    *,
    quant: Optional[int] = None,
    draft_quant: Optional[int] = None,
    use_draft: bool = True,
    adaptive: bool = True,
    distributed: Optional[str] = None,
    split: Optional[Sequence[int]] = None,
    timeout: float = 60.0,
    batch_tokens: Optional[int] = None,
) -> tuple[DFlashModel, TokenizerWrapper]:
    """Load a target by short name, HF repo or local path, with its drafter.

    `draft` overrides the drafter the registry pairs with `model`;
    `use_draft=False` loads the target alone (the same loop, copies alone proposing);
    `adaptive` picks the verify width per cycle from this machine's measured
    cost curve (measured once per model and machine, then cached), and copies
    from the prompt and from the model's earlier answers where they pay, with a
    drafter or without (`adaptive=False` without a drafter: plain decoding);
    `distributed="pipeline"` (under mlx.launch) splits the target's layers over
    the ranks (`split`: layers per rank, rank 0 first; collective waits bounded
    by `timeout` seconds): rank 0 gets the drafter and drives, the other ranks
    get a target whose `follow()` serves rank 0 until it calls `finish()`.

    `draft_quant` quantizes the drafter on loading: 8 or 4 bits (group 64), or 16 for float
    weights (a quantized checkpoint expanded).  None: on a GPU a float drafter is quantized to
    AUTO_DRAFT_BITS (drafters/precision.py: the acceptance measured there) and a quantized one
    kept as stored; on a CPU, where quantized matmuls are the slower ones, quantized weights are
    expanded to float, as they are for an asked 8 or 4 after quantizing (its drafts, float's
    speed).  The output never depends on it: the target verifies every draft.

    A short name without `quant` loads its 8-bit variant where its weights, drafter and KV caches
    of `batch_tokens` context tokens (default: the server's batch cap) fit this machine, else its
    4-bit one, and says which and why; when none fits, a ValueError says what each needs and what
    is available (registry.fitting_variant).  `quant=16` loads the weights as published (bf16).
    """
    from .registry import resolve  # pulls in the GGUF converter; not needed to decode

    check_draft_quant(draft_quant)
    quant = _fitting_quant(model, draft, quant, draft_quant, use_draft, distributed, batch_tokens)
    resolved = resolve(model, draft, quant)
    target_path = fetch(resolved.target, ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.jinja"])
    group = _pipeline_group(distributed, timeout)
    mlx_model, tokenizer = _load_target(target_path, lazy=group is not None)
    if group is None:
        target = Target(mlx_model)
    else:
        from ..distributed.pipeline import PipelineTarget

        target = PipelineTarget(mlx_model, group, split, timeout)
        mx.eval(target.model.parameters())  # this rank's layers only
        if not target.is_driver:
            return DFlashModel(target, None, f"rank {target.rank} follows rank 0"), tokenizer

    notice = blas.slow_notice()
    if notice and target.dtype == mx.float32 and mx.default_device() == mx.cpu and notice not in _said:
        console.print(notice, style="yellow", soft_wrap=True)
        _said.add(notice)
    drafter, note = None, resolved.draft_note
    if not use_draft:
        note = "drafting disabled (--no-draft)"
    elif resolved.draft:
        draft_path = fetch(resolved.draft, ["*.json", "*.safetensors"])
        drafter, precision = _load_drafter(draft_path, target, draft_quant)
        draft_id = _fingerprint(draft_path) + (f"-as-{precision.name}" if precision.changed else "")
    target_id = _fingerprint(target_path)
    fingerprint = f"{target_path.name}-{target.dtype}-{target_id}"
    if drafter is not None:
        fingerprint += f"-{draft_id}"
    planner = None
    if adaptive:
        alone = alone_key(target_path, target_id)
        measured = f"{target_path.name}-{Path(resolved.draft).name}-{draft_id}" if drafter is not None else alone
        if group is not None:  # the network is part of a pass's cost
            measured += f"-pipeline-{target.start}-{target.end}-of-{group.size()}"
        planner = _planner(target, drafter, curve_key(measured, target.dtype))
    pair = DFlashModel(target, drafter, note, fingerprint, frozenset(tokenizer.eos_token_ids))
    keep(pair, Learning(planner, SuffixStore() if planner is not None else None))  # the process's, across calls
    return pair, tokenizer


def _planner(target: Target, drafter: Optional[DFlashDraftModel], key: str) -> Planner:
    """The adaptive plan over this machine's cost curve for `key` (curve_key), measured on first
    use: verify widths up to the drafter's block, or without a drafter up to the widest copy
    (the prompt lookup and earlier answers propose alone)."""
    widest = drafter.block_size if drafter is not None else WIDEST_WITHOUT_DRAFTER
    long_context = min(LONG_CONTEXT, context_limit(target) or LONG_CONTEXT)

    def measure():
        console.print(
            f"Measuring this machine's verify cost at {PROBE_CONTEXT} and {long_context} tokens of context "
            "for the adaptive block size (once per model and machine)",
            style="dim",
        )
        return measure_costs(target, drafter, long_context=long_context, widest=widest, show_progress=True)

    cost = cached_costs(key, measure, cache_dir())
    step_times = StepTimes.stored(step_times_path(key, cache_dir()), basis=cost.seconds, by_context=cost.context_ratio)
    return Planner(cost, widest, step_times)


_said: set[str] = set()  # one-line notices already printed by this process


def _load_drafter(path: Path, target: Target, draft_quant: Optional[int]) -> tuple[DFlashDraftModel, DraftPrecision]:
    """The drafter in `path` at the precision `draft_quant` asks for (load's rule), bound to
    `target` and fused; its precision, said in one line when loading changes it."""
    # fp16 activations overflow in drafters (zero acceptance seen in other ports)
    dtype = target.dtype if target.dtype in (mx.float32, mx.bfloat16) else mx.bfloat16
    drafter = load_draft(path, dtype=dtype)
    stored = drafter.quantization["bits"] if drafter.quantization else None
    precision = draft_precision(draft_quant, stored, runs_packed())
    if precision.changed:
        console.print(f"drafter: {precision.describe()}; --draft-quant chooses", style="dim", soft_wrap=True)
    return fuse(apply_precision(drafter, precision).bind(target)), precision


def _fitting_quant(
    model: Optional[str],
    draft: Optional[str],
    quant: Optional[int],
    draft_quant: Optional[int],
    use_draft: bool,
    distributed: Optional[str],
    batch_tokens: Optional[int],
) -> Optional[int]:
    """The quant to load, before anything is downloaded.  `quant` as asked, and for anything but a
    short name; for a short name without one, the variant that fits this machine (the drafter
    counted at the precision `draft_quant` loads it at), said in one line (a ValueError when none
    does); an asked-for quant that does not fit is kept, with a note.  Not over pipeline ranks:
    each would judge its own machine, and all must load the same weights."""
    from .registry import BATCH_CAP_TOKENS, PUBLISHED, VARIANTS, fit_note, fitting_variant, planned_draft_precision

    if model not in PUBLISHED or distributed is not None or quant not in (None, *VARIANTS):
        return quant  # (resolve refuses a quant it does not know)
    drafter = (draft or PUBLISHED[model].draft) if use_draft else None
    held = planned_draft_precision(drafter, draft_quant).held if drafter else None
    tokens = batch_tokens or BATCH_CAP_TOKENS
    if quant is not None:
        note = fit_note(model, quant, drafter, tokens, draft_held=held)
        if note:
            console.print(f"note: {note}", style="yellow", soft_wrap=True)
        return quant
    choice = fitting_variant(model, drafter, tokens, draft_held=held)
    console.print(choice.reason, style="dim", soft_wrap=True)
    return choice.quant


WEIGHT_DIGESTS = "weight-digests.json"  # in cache_dir(): each weight file's sha256, by path


def alone_key(target_path: Path, target_id: Optional[str] = None) -> str:
    """What the cost curve of a target without a drafter is kept under (before curve_key adds the
    dtype and the machine): its folder's name and its weights (`target_id`: their _fingerprint)."""
    return f"{target_path.name}-{target_id or _fingerprint(target_path)}"


def _fingerprint(folder: Path) -> str:
    """Changes when a model dir's contents change (its measured costs and saved prompt states
    then do too): a hash of its JSON files' bytes and of its weights' bytes (*.safetensors, all
    that mlx-lm's and the drafter's loaders read; a GGUF is converted to them first).

    Hashing a multi-GB model takes seconds, so each weight file's sha256 is kept in
    WEIGHT_DIGESTS with the file's size, mtime and ctime, and hashed again only when one of them
    changes.  The ctime is what makes this safe: weights rewritten in place at the same size are
    caught even when a tool sets their mtime back, as setting it sets the ctime, which only the
    kernel sets.  Not caught: a rewrite within one tick of the file system's clock after the last
    hashing (the timestamps then repeat).  A ctime changed alone (chmod, a new hard link) costs a
    hashing, and a cache folder that cannot be written one per load; neither fails the load."""
    digest = hashlib.sha1()
    for f in sorted(folder.glob("*.json")):
        digest.update(f"{f.name}:".encode() + f.read_bytes())
    for name, sha256 in _weight_digests(folder).items():
        digest.update(f"{name}:{sha256}".encode())
    return digest.hexdigest()[:10]


def _weight_digests(folder: Path) -> dict[str, str]:
    """The sha256 of each *.safetensors file in `folder`, by name: the stored one while the
    file's stat is unchanged, else hashed now (and stored)."""
    store = cache_dir() / WEIGHT_DIGESTS
    known = _stored_digests(store)
    files = {f: (str(f.resolve()), _stat(f)) for f in sorted(folder.glob("*.safetensors"))}
    stale = [f for f, (path, stat) in files.items() if known.get(path, {}).get("stat") != stat]
    if sum(f.stat().st_size for f in stale) >= 1 << 30:  # seconds: say why the load pauses
        console.print(f"Hashing the weights in {folder} (once, and again when they change)", style="dim")
    for f in stale:
        path, stat = files[f]
        with open(f, "rb") as weights:
            known[path] = {"stat": stat, "sha256": hashlib.file_digest(weights, "sha256").hexdigest()}
    if stale:
        _store_digests(store, known)
    return {f.name: known[path]["sha256"] for f, (path, _) in files.items()}


def _stat(f: Path) -> list[int]:
    """What changes when `f`'s bytes may have: its size, mtime and ctime (a list, as JSON keeps it)."""
    stat = f.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _stored_digests(store: Path) -> dict:
    """{resolved path: {"stat": _stat, "sha256": hex}}; empty when the file is absent or garbled."""
    try:
        stored = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stored, dict):
        return {}
    return {path: record for path, record in stored.items() if isinstance(record, dict) and "sha256" in record}


def _store_digests(store: Path, known: dict) -> None:
    """`known` written to `store` (whole or not at all), without the files that are gone."""
    kept = {path: record for path, record in known.items() if Path(path).exists()}
    try:
        atomic_write(store, json.dumps(kept))
    except OSError:
        pass  # not writable: the weights are hashed again next load, and this one goes on


def _pipeline_group(distributed: Optional[str], timeout: float):
    if distributed is None:
        return None
    if distributed != "pipeline":
        raise ValueError(f"--distributed must be 'pipeline', got {distributed!r}")
    from ..distributed.pipeline import connect

    group = connect(timeout)
    if group.size() < 2:
        raise ValueError(
            "--distributed pipeline needs several ranks: start it with mlx.launch "
            "(e.g. mlx.launch --hosts mac1,mac2 -- dflash-mlx generate ... --distributed pipeline)"
        )
    return group


def _load_target(path: Path, lazy: bool = False):
    """mlx-lm's loader, with what can be wrong with a model dir said in one line."""
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory: no config.json")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise FileNotFoundError(f"{path} has no tokenizer (tokenizer.json); copy the model's tokenizer files there")
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    try:
        return mlx_lm.load(str(path), lazy=lazy)
    except Exception as e:  # mlx-lm raises whatever its parsers raise on a broken dir
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"cannot load the model in {path} ({type(e).__name__}: {reason}); re-download or re-convert it"
        ) from None


def context_limit(target: Target) -> Optional[int]:
    """The longest sequence the target was trained for (None when its config does not say)."""
    owner = getattr(target.model, "language_model", target.model)
    return getattr(getattr(owner, "args", None), "max_position_embeddings", None)
