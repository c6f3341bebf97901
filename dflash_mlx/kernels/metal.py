"""Custom Metal kernels and their pure-MLX twins.

Two operations of the decode loop have kernels in metal/ (shipped as package
data as ``dflash_mlx/metal``):

    block_attention    drafter block queries over [context buffer, block] in
                       one pass, reading the context in place (no concat copy)
    gated_delta_tape   GatedDeltaNet recurrence over a verify block that also
                       records delta_t, so rollback is a closed-form matmul

Each has a twin written with MLX ops, same signature and semantics.  Where Metal
is available (and the default device is the GPU) a kernel proves itself at its
first use per shape class (head counts, head dim, dtype, width and context
buckets): it runs beside its twin on those real inputs, and it is used for that
class only if each output agrees within its own dtype's tolerance and the kernel
is at least 5% faster; otherwise one log line (logger ``dflash_mlx.kernels``)
says why and the twin runs.  A kernel that fails to compile or run is reported
once, with the compiler's first error, and its twin runs for the rest of the
process.  The decisions are kept beside the cost curves, per chip, macOS, MLX
version and kernel sources, so a later process skips the timing; a passing
failure (memory, a GPU timeout) is not kept.  Every process still evaluates a
proven kernel's first call of each class inside a `try`, so a kernel that stops
compiling (a new Metal compiler) costs one log line, not the run.
DFLASH_MLX_KERNELS=mlx forces the twins, =metal the kernels (unchecked).  A
kernel call is described by a ``Launch`` (source, inputs, template, grid,
outputs, and any MLX ops that finish its results), which is what both
mx.fast.metal_kernel and the C++ emulation in tests/ execute.
"""

import hashlib
import json
import logging
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache, partial
from pathlib import Path
from typing import Callable, Optional, Union

import mlx.core as mx

from .fused_ops import fusing, scaled_dot_product_attention
from ..io.storage import atomic_write, cache_dir, shipped

logger = logging.getLogger("dflash_mlx.kernels")

BACKENDS = ("auto", "metal", "mlx")
ATTENTION_SIMDGROUPS = 8
# block attention splits a long context's keys across threadgroups until about this many are busy:
# more than a Max chip has GPU cores (up to 40)
ATTENTION_THREADGROUPS = 64
SPLIT_KEYS = 256  # keys a split keeps at least: a short context stays one threadgroup per tile
# threads per threadgroup a kernel launches at most.  A compiled pipeline's real maximum
# (maxTotalThreadsPerThreadgroup) falls below the device's 1024 when the kernel uses many registers,
# and MLX does not expose it; 256 is what Metal guarantees any compute pipeline
THREADGROUP_CEILING = 256
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
THREADGROUP_MEMORY = 32 * 1024  # bytes per threadgroup on Apple GPUs


# ----------------------------------------------------------------- dispatch


def use_metal() -> bool:
    choice = os.environ.get("DFLASH_MLX_KERNELS", "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"DFLASH_MLX_KERNELS={choice!r} is not one of {', '.join(BACKENDS)}")
    if choice == "mlx":
        return False
    available = mx.metal.is_available() and mx.default_device() == mx.gpu
    if choice == "metal" and not available:
        raise RuntimeError(
            "DFLASH_MLX_KERNELS=metal but Metal is not available here (needs a Mac GPU); unset it or set it to mlx"
        )
    return available


def forced_metal() -> bool:
    """DFLASH_MLX_KERNELS=metal: the kernels run unchecked (the Mac tests, debugging a kernel)."""
    return os.environ.get("DFLASH_MLX_KERNELS", "auto").lower() == "metal"


@cache
def _say_once(message: str):
    logger.warning(message)


def _metal_fits(name: str, head_dim: int, dtype: mx.Dtype) -> bool:
    missing = missing_sources()
    if missing:
        _say_once(f"dflash-mlx: the Metal kernels' sources cannot be read ({missing}); the MLX twins run")
        return False
    if head_dim % 32 == 0 and dtype in KERNEL_DTYPES:
        if name != "block_attention" or attention_tiling(head_dim, dtype) is not None:
            return True
        _say_once(
            f"dflash-mlx: block_attention Metal kernel: head_dim {head_dim} in {dtype} needs more than "
            f"{THREADGROUP_MEMORY // 1024} KiB of threadgroup memory; using the slower MLX twin"
        )
        return False
    _say_once(
        f"dflash-mlx: {name} Metal kernel needs head_dim % 32 == 0 and a float dtype "
        f"(got {head_dim}, {dtype}); using the slower MLX twin"
    )
    return False


@dataclass
class Launch:
    """One kernel call: everything mx.fast.metal_kernel (or an emulator) needs."""

    kernel: str  # metal/<kernel>.metal
    inputs: dict[str, Union[mx.array, float, int]]
    outputs: dict[str, tuple[tuple[int, ...], mx.Dtype]]
    template: list[tuple[str, Union[int, bool, mx.Dtype]]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    # MLX ops from the kernel's outputs to the call's results, in the same graph (block attention
    # combines its per-split partials); None: the outputs are the results
    finish: Optional[Callable[[list[mx.array]], list[mx.array]]] = None

    def results(self, outputs: list[mx.array]) -> list[mx.array]:
        return self.finish(outputs) if self.finish else outputs


def source(kernel: str) -> str:
    return (_metal_dir() / f"{kernel}.metal").read_text()


@cache
def missing_sources() -> Optional[str]:
    """Why the shipped kernel sources cannot be read (then the twins run), or None."""
    try:
        folder = shipped("metal")
    except FileNotFoundError as e:
        return str(e)
    absent = [f"{kernel}.metal" for kernel in KERNELS if not (folder / f"{kernel}.metal").is_file()]
    return f"{', '.join(absent)} not found in {folder}; reinstall the package" if absent else None


@cache
def _metal_dir() -> Path:
    try:
        return shipped("metal")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"dflash-mlx: {e}") from None


@cache
def _metal_kernel(kernel: str, input_names: tuple, output_names: tuple):
    return mx.fast.metal_kernel(
        name=f"dflash_{kernel}", input_names=list(input_names), output_names=list(output_names), source=source(kernel)
    )


def run_metal(launch: Launch) -> list[mx.array]:
    fn = _metal_kernel(launch.kernel, tuple(launch.inputs), tuple(launch.outputs))
    outputs = fn(
        inputs=list(launch.inputs.values()),
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=[shape for shape, _ in launch.outputs.values()],
        output_dtypes=[dtype for _, dtype in launch.outputs.values()],
    )
    return launch.results(outputs)


# --------------------------------------------------------------- self-check

KERNELS = ("block_attention", "gated_delta_tape")
# max |kernel - twin| / max |twin| each output may show, by the output's own dtype: a float32 one
# (the tape's state and delta, carried into every later token) 1e-4, as the GPU's exp is not
# correctly rounded and sums run in another order; a half-precision one a few ulps of its largest
# value, as kernel and twin each round it once
FLOAT32_TOLERANCE = 1e-4
HALF_PRECISION_ULPS = 3
MANTISSA_BITS = {mx.float16: 10, mx.bfloat16: 7}
SELF_CHECK_REPEATS = 5  # timed evaluations of each, interleaved, after the warm-up that gave the outputs
# calls per timed evaluation: a lone call times mostly a command buffer's commit and wait, which
# decoding shares among many ops
CALLS_PER_TIMING = 8
WINNING_SHARE = 0.95  # the kernel is chosen at no more than this share of its twin's time: a 5% win
# errors that say nothing of the kernel (memory, a GPU timeout): not kept, the next process checks again
PASSING_FAILURE = re.compile(r"out ?of ?memory|insufficient memory|unable to allocate|timed? ?out", re.IGNORECASE)
SHORTEST_CONTEXT_CLASS = 256  # shorter contexts cost alike: one class
# how loudly each verdict is logged: a kernel that disagrees or fails is a bug to report; a slower
# one is the check doing its job
VERDICT_LEVELS = {"faster": logging.DEBUG, "slower": logging.INFO, "disagrees": logging.WARNING}


@dataclass
class Decision:
    """What the self-check found for one kernel on one shape class."""

    verdict: str  # faster (the kernel runs), slower, disagrees or failed (the twin runs)
    reason: str  # one line, as logged
    max_error: Optional[float] = None
    kernel_ms: Optional[float] = None
    twin_ms: Optional[float] = None
    passing: bool = False  # a failure that says nothing of the kernel: kept in memory only

    @property
    def use_kernel(self) -> bool:
        return self.verdict == "faster"


def relative_error(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return float(mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-30))


def size_class(n: int, floor: int = 1) -> int:
    """n rounded up to a power of two (at least `floor`): the sizes that share a decision."""
    return 1 << (max(n, floor) - 1).bit_length()


def _evaluated(outputs) -> list[mx.array]:
    outputs = list(outputs)
    mx.eval(outputs)
    return outputs


def tolerance(dtype: mx.Dtype) -> float:
    """The largest max |kernel - twin| / max |twin| an output of `dtype` may show."""
    if dtype in MANTISSA_BITS:
        return HALF_PRECISION_ULPS * 2.0 ** -MANTISSA_BITS[dtype]
    return FLOAT32_TOLERANCE


def disagreement(names, got: list[mx.array], want: list[mx.array]) -> tuple[Optional[str], float]:
    """(Why the kernel's outputs are refused, or None; their largest max rel. error.)  Each output
    (`names`: the launch's, in order) is judged against its own dtype's tolerance."""
    if len(got) != len(want):
        return f"it returns {len(got)} outputs, the twin {len(want)}", math.inf
    errors = []
    for name, a, b in zip(names, got, want):
        if a.shape != b.shape or a.dtype != b.dtype:
            theirs = f"{b.shape} {dtype_name(b.dtype)}"
            return f"its {name} is {a.shape} {dtype_name(a.dtype)}, the twin's {theirs}", math.inf
        error, allowed = relative_error(a, b), tolerance(b.dtype)
        if not error <= allowed:  # a NaN disagrees too
            why = f"its {name} ({dtype_name(b.dtype)}) disagrees with the twin (max rel. error {error:.1e} > {allowed:.1e})"
            return why, error
        errors.append(error)
    return None, max(errors, default=0.0)


def _interleaved_ms(kernel: Callable[[], list], twin: Callable[[], list]) -> tuple[float, float]:
    """Median ms per call of the kernel and of its twin: CALLS_PER_TIMING calls per evaluation,
    the two timed in turn so that a change in the machine's load weighs on both."""
    times = {kernel: [], twin: []}
    for _ in range(SELF_CHECK_REPEATS):
        for run, taken in times.items():
            tic = time.perf_counter()
            mx.eval([run() for _ in range(CALLS_PER_TIMING)])
            taken.append((time.perf_counter() - tic) / CALLS_PER_TIMING)
    return tuple(1e3 * statistics.median(taken) for taken in times.values())


def one_line(error: BaseException) -> str:
    """The error in one line: its first, and where diagnostics follow it (MLX's Metal compile
    error starts "Unable to build metal library from source"), the first `error:` among them."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    diagnostic = next((line for line in lines[1:] if "error:" in line), None)
    if diagnostic:
        text = f"{text}: {diagnostic}"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def failure(error: BaseException) -> Decision:
    """The decision a kernel's error makes: failed, for good unless the error says nothing of it."""
    passing = isinstance(error, MemoryError) or bool(PASSING_FAILURE.search(str(error)))
    return Decision("failed", f"the kernel failed ({one_line(error)})", passing=passing)


def prove(launch: Launch, twin: Callable[[], list]) -> tuple[Decision, list[mx.array]]:
    """Run the kernel and its twin on the same (real) inputs: the kernel is chosen if each output
    agrees within its dtype's tolerance and the kernel is at least 5% faster.  Returns the
    decision and the chosen outputs (the twin's unless the kernel won)."""
    mx.eval([x for x in launch.inputs.values() if isinstance(x, mx.array)])  # neither times their graph
    want = _evaluated(twin())  # also the twin's warm-up
    try:
        got = _evaluated(run_metal(launch))  # compiles the kernel: also its warm-up
        why, error = disagreement(launch.outputs, got, want)
        if why:
            return Decision("disagrees", why, error), want
        kernel_ms, twin_ms = _interleaved_ms(lambda: run_metal(launch), twin)
    except Exception as e:  # a compile or run error of the kernel: the twin's outputs stand
        return failure(e), want
    timing = f"{kernel_ms:.3f} ms vs {twin_ms:.3f} ms for the twin, {CALLS_PER_TIMING} calls an evaluation"
    if kernel_ms > WINNING_SHARE * twin_ms:
        return Decision("slower", f"it is not 5% faster ({timing})", error, kernel_ms, twin_ms), want
    return Decision(
        "faster", f"it agrees (max rel. error {error:.1e}) and is faster ({timing})", error, kernel_ms, twin_ms
    ), got


@cache
def chip_name() -> str:
    """The machine's processor as its OS names it (on a Mac the chip, e.g. "Apple M3 Max")."""
    if sys.platform == "darwin":
        try:
            brand = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            brand = ""
        return brand or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def os_version() -> str:
    """The OS release; on a Mac the macOS version, whose Metal compiler builds the kernels."""
    if sys.platform == "darwin":
        return f"macOS{platform.mac_ver()[0]}"
    return f"{platform.system()}{platform.release()}"


def sources_hash() -> str:
    """Changes with any kernel body or with this file (the launches' geometry lives here)."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for kernel in KERNELS if not missing_sources() else ():
        digest.update(source(kernel).encode())
    return digest.hexdigest()[:12]


def decisions_path() -> Path:
    """Beside the cost curves (decode/costs.py keeps them in <cache>/costs): one file per chip,
    OS (the Metal compiler), MLX version and kernel sources, as a decision holds for exactly those."""
    key = f"kernels-{chip_name()}-{os_version()}-mlx{mx.__version__}-{sources_hash()}"
    name = re.sub(r"[^\w.-]+", "_", key)
    return cache_dir() / "costs" / f"{name}.json"


class KernelChoices:
    """The self-check's decision per (kernel, shape class), in memory and in a JSON file, so a
    later process skips the timing; the kernels that failed in this process; and the classes whose
    kernel has run in it (a proven kernel's first call in a process is evaluated in a `try`)."""

    def __init__(self, path: Optional[Path] = None):
        self._path = path
        self._decided: Optional[dict[str, dict[str, Decision]]] = None
        self.failed: dict[str, str] = {}  # kernel -> why: its twin runs for the rest of the process
        self.ran: set[tuple[str, str]] = set()  # (kernel, shape class) evaluated in this process

    @property
    def path(self) -> Path:
        if self._path is None:
            self._path = decisions_path()
        return self._path

    def decided(self) -> dict[str, dict[str, Decision]]:
        if self._decided is None:
            self._decided = self._read()
        return self._decided

    def get(self, kernel: str, shape_class: str) -> Optional[Decision]:
        return self.decided().get(kernel, {}).get(shape_class)

    def record(self, kernel: str, shape_class: str, decision: Decision) -> None:
        self.decided().setdefault(kernel, {})[shape_class] = decision
        if decision.passing:
            return  # in memory only: the next process checks again
        on_disk = self._read()  # another process may have added classes since
        for name, classes in self.decided().items():
            on_disk.setdefault(name, {}).update({c: d for c, d in classes.items() if not d.passing})
        stored = {name: {c: asdict(d) for c, d in classes.items()} for name, classes in on_disk.items()}
        try:
            atomic_write(self.path, json.dumps({"decisions": stored}, indent=1))
        except OSError as e:
            _say_once(
                f"dflash-mlx: could not keep the kernel self-checks in {self.path} ({e.strerror}); a new process checks again"
            )

    def _read(self) -> dict[str, dict[str, Decision]]:
        """The stored decisions; none when the file is absent, truncated or foreign."""
        try:
            stored = json.loads(self.path.read_text())["decisions"]
            return {name: {c: Decision(**d) for c, d in classes.items()} for name, classes in stored.items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}


choices = KernelChoices()


def dispatch(kernel: str, shape_class: str, launch: Launch, twin: Callable[[], list]) -> list:
    """The kernel's outputs where it has proven itself on this shape class, else the twin's."""
    if forced_metal():
        return run_metal(launch)
    if kernel in choices.failed:
        return twin()
    decision = choices.get(kernel, shape_class)
    if decision is None:
        decision, outputs = prove(launch, twin)
        choices.record(kernel, shape_class, decision)
        if decision.use_kernel:
            choices.ran.add((kernel, shape_class))
        _report(kernel, shape_class, decision)
        return outputs
    if not decision.use_kernel:
        return twin()
    try:
        outputs = run_metal(launch)
        if (kernel, shape_class) not in choices.ran:
            # proven, maybe by an earlier process under another Metal compiler: this process's first
            # call of the class is compiled and run here, where an error can still hand over to the
            # twin (later calls are evaluated with the rest of the step)
            outputs = _evaluated(outputs)
            choices.ran.add((kernel, shape_class))
        return outputs
    except Exception as e:
        decision = failure(e)
        choices.record(kernel, shape_class, decision)
        _report(kernel, shape_class, decision)
        return twin()


def _report(kernel: str, shape_class: str, decision: Decision) -> None:
    if decision.passing:
        logger.warning(
            f"dflash-mlx: {kernel} [{shape_class}]: the MLX twin runs in this process (the next one checks "
            f"again): {decision.reason}"
        )
        return
    if decision.verdict == "failed":
        choices.failed[kernel] = decision.reason
        logger.warning(f"dflash-mlx: {kernel}: the MLX twin runs for the rest of this process: {decision.reason}")
        return
    runs = "the Metal kernel runs" if decision.use_kernel else "the MLX twin runs"
    logger.log(VERDICT_LEVELS[decision.verdict], f"dflash-mlx: {kernel} [{shape_class}]: {runs}: {decision.reason}")


def kernel_plan() -> dict[str, str]:
    """What each Metal kernel would run here and why (`dflash-mlx doctor`)."""
    try:
        metal = use_metal()
    except (ValueError, RuntimeError) as e:
        return {kernel: f"error: {e}" for kernel in KERNELS}
    if os.environ.get("DFLASH_MLX_KERNELS", "auto").lower() == "mlx":
        return {kernel: "the MLX twin: DFLASH_MLX_KERNELS=mlx" for kernel in KERNELS}
    if not metal:
        return {kernel: "the MLX twin: no Metal here (needs a Mac GPU as MLX's default device)" for kernel in KERNELS}
    if missing_sources():
        return {kernel: f"the MLX twin: the kernel sources cannot be read ({missing_sources()})" for kernel in KERNELS}
    if forced_metal():
        return {kernel: "the Metal kernel, unchecked: DFLASH_MLX_KERNELS=metal" for kernel in KERNELS}
    return {kernel: _checked_plan(kernel) for kernel in KERNELS}


def _checked_plan(kernel: str) -> str:
    if kernel in choices.failed:
        return f"the MLX twin for the rest of this process: {choices.failed[kernel]}"
    decided = list(choices.decided().get(kernel, {}).values())
    kept = sum(d.use_kernel for d in decided)
    summary = (
        f"{len(decided)} decided on this machine: {kept} kernel, {len(decided) - kept} twin"
        if decided
        else "none decided yet"
    )
    refused = [d.reason for d in decided if d.verdict in ("failed", "disagrees")]
    if refused:
        summary += f"; refused: {refused[-1]}"
    return f"the Metal kernel where it proves itself against its twin, per shape class ({summary})"


# ---------------------------------------------------------- block attention


@dataclass
class ContextSpan:
    """The live entries [start, start + length) of a preallocated context buffer (B, Hkv, capacity, D)."""

    keys: mx.array
    values: mx.array
    start: int
    length: int

    def followed_by(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The live entries followed by a block's keys / values (B, Hkv, L, D): written into the
        buffer's free room behind them and read in place where it has room (a concatenation would
        copy the whole context, per layer and per draft: ~2 ms a copy at 8k positions on a CPU),
        else concatenated.  The room is free: the next entries appended overwrite it."""
        end, width = self.start + self.length, keys.shape[2]
        live = slice(self.start, end)
        if end + width > self.keys.shape[2]:
            return (
                mx.concatenate([self.keys[..., live, :], keys], axis=2),
                mx.concatenate([self.values[..., live, :], values], axis=2),
            )
        self.keys[..., end : end + width, :] = keys
        self.values[..., end : end + width, :] = values
        both = slice(self.start, end + width)
        return self.keys[..., both, :], self.values[..., both, :]


def block_visibility(L: int, context_length: int, causal: bool, window: Optional[int]) -> Optional[mx.array]:
    """(L, context_length + L) bool mask of the keys each block row sees, or None for all."""
    if not causal and not window:
        return None
    ahead = mx.arange(context_length + L)[None] - context_length - mx.arange(L)[:, None]
    visible = mx.ones(ahead.shape, dtype=mx.bool_)
    if causal:
        visible = visible & (ahead <= 0)
    if window:
        visible = visible & (mx.abs(ahead) < window)
    return visible


def block_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    context: Optional[ContextSpan],
    *,
    scale: float,
    causal: bool = False,
    window: Optional[int] = None,
) -> mx.array:
    """Attention of block queries (B, Hq, L, D) over the context span then the block's own
    keys/values (B, Hkv, L, D); bidirectional inside the block unless `causal`."""

    def twin():
        return [block_attention_mlx(queries, keys, values, context, scale=scale, causal=causal, window=window)]

    if not (use_metal() and _metal_fits("block_attention", queries.shape[-1], queries.dtype)):
        return twin()[0]
    launch = block_attention_launch(queries, keys, values, context, scale=scale, causal=causal, window=window)
    shape_class = attention_class(queries, keys, context, causal, window)
    return dispatch("block_attention", shape_class, launch, twin)[0]


def attention_class(queries, keys, context: Optional[ContextSpan], causal: bool, window: Optional[int]) -> str:
    """The shapes that share a self-check decision: same heads, head dim, dtype and masking;
    batch, width and the context a row sees in the same power-of-two class."""
    B, HQ, L, D = queries.shape
    seen = context.length if context is not None else 0
    seen = min(seen, window) if window else seen
    masking = ("causal" if causal else "bidirectional") + (" windowed" if window else "")
    return (
        f"HQ={HQ} HKV={keys.shape[1]} D={D} {dtype_name(queries.dtype)} {masking} "
        f"B<={size_class(B)} L<={size_class(L)} context<={size_class(seen, SHORTEST_CONTEXT_CLASS)}"
    )


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def block_attention_mlx(queries, keys, values, context: Optional[ContextSpan], *, scale, causal=False, window=None):
    length = context.length if context is not None else 0
    if length:
        keys, values = context.followed_by(keys, values)
    mask = block_visibility(queries.shape[2], length, causal, window)
    if fusing():  # our softmax (fused_ops.py)
        return scaled_dot_product_attention(queries, keys, values, None, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def attention_threadgroup_bytes(chunk: int, head_dim: int, dtype: mx.Dtype) -> int:
    """Threadgroup memory of the block attention kernel: a chunk of keys and of values, and the
    float32 accumulator, max and sum of one row per simdgroup, where simdgroups sharing rows
    combine them."""
    return 2 * chunk * head_dim * dtype.size + ATTENTION_SIMDGROUPS * (head_dim + 2) * 4


def attention_tiling(head_dim: int, dtype: mx.Dtype) -> Optional[tuple[int, int]]:
    """(query rows per simdgroup, keys per chunk) of the block attention kernel, or None when
    even the smallest chunk would overflow threadgroup memory.  The largest chunk that leaves
    room for a second resident threadgroup is preferred."""
    rows = 8 if head_dim <= 128 else 4  # q and the accumulator stay in registers
    fitting = [
        chunk for chunk in (32, 16, 8) if attention_threadgroup_bytes(chunk, head_dim, dtype) <= THREADGROUP_MEMORY
    ]
    roomy = [
        chunk for chunk in fitting if attention_threadgroup_bytes(chunk, head_dim, dtype) <= THREADGROUP_MEMORY // 2
    ]
    if not fitting:
        return None
    return rows, (roomy or fitting)[0]


@dataclass(frozen=True)
class AttentionLayout:
    """How one block attention call spreads over the GPU (see metal/block_attention.metal)."""

    tiles: int  # threadgroups of query rows per KV head
    splits: int  # threadgroups sharing a tile, each over its own contiguous part of the keys
    key_slots: int  # simdgroups sharing a set of rows, each taking every key_slots-th key
    slot_rows: int  # query rows in each set


def attention_layout(rows: int, keys: int, kv_heads: int, simdgroup_rows: int) -> AttentionLayout:
    """The layout for `rows` query rows per KV head (GQA group x block width) seeing up to `keys`
    keys, on `kv_heads` (batch x KV heads).  Rows fill tiles of ATTENTION_SIMDGROUPS x
    `simdgroup_rows`; a narrower block gives each set of rows to several simdgroups, so every
    simdgroup has work; a longer context splits each tile's keys across threadgroups until about
    ATTENTION_THREADGROUPS are busy, each split keeping at least SPLIT_KEYS keys."""
    tiles = -(-rows // (ATTENTION_SIMDGROUPS * simdgroup_rows))
    row_sets = min(ATTENTION_SIMDGROUPS, size_class(-(-rows // simdgroup_rows)))
    slot_rows = -(-rows // (tiles * row_sets))
    splits = max(1, min(-(-ATTENTION_THREADGROUPS // (tiles * kv_heads)), keys // SPLIT_KEYS))
    return AttentionLayout(tiles, splits, ATTENTION_SIMDGROUPS // row_sets, slot_rows)


def attention_results(outputs: list[mx.array], splits: int, dtype: mx.Dtype) -> list[mx.array]:
    """The block attention kernel's result: its `out` when the keys were not split, else the
    splits' normalised outputs (B, HQ, L, splits, D) and log-sum-exps (B, HQ, L, splits), both
    float32, combined: every split weighted by its share of the row's softmax mass."""
    out, split_out, split_logsumexp = outputs
    if splits == 1:
        return [out]
    weights = mx.softmax(split_logsumexp, axis=-1)
    return [(weights[..., None] * split_out).sum(axis=-2).astype(dtype)]


def block_attention_launch(
    queries, keys, values, context: Optional[ContextSpan], *, scale, causal=False, window=None
) -> Launch:
    B, HQ, L, D = queries.shape
    HKV = keys.shape[1]
    tiling = attention_tiling(D, queries.dtype)
    if tiling is None:
        raise ValueError(f"block_attention: head_dim {D} in {queries.dtype} does not fit in threadgroup memory")
    rows, chunk = tiling
    if context is None:  # nothing to read: any buffer of the right layout will do
        context = ContextSpan(keys, values, 0, 0)
    seen = min(context.length, window) if window else context.length
    layout = attention_layout(HQ // HKV * L, seen + L, B * HKV, rows)
    split_rows = (B, HQ, L, layout.splits)
    geometry = mx.array(
        [
            context.keys.shape[2],
            context.start,
            context.length,
            window or 0,
            L,
            layout.splits,
            layout.key_slots,
            layout.slot_rows,
        ],
        dtype=mx.int32,
    )
    return Launch(
        kernel="block_attention",
        inputs=dict(
            queries=queries,
            keys=keys,
            values=values,
            ctx_keys=context.keys,
            ctx_values=context.values,
            geometry=geometry,
            scale=float(scale),
        ),
        outputs=dict(
            out=(queries.shape, queries.dtype),  # written when the keys are not split
            split_out=(split_rows + (D,) if layout.splits > 1 else (1,), mx.float32),  # (1,): unused
            split_logsumexp=(split_rows if layout.splits > 1 else (1,), mx.float32),
        ),
        template=[
            ("T", queries.dtype),
            ("D", D),
            ("HQ", HQ),
            ("HKV", HKV),
            ("SIMDGROUPS", ATTENTION_SIMDGROUPS),
            ("ROWS", rows),
            ("CHUNK", chunk),
            ("CAUSAL", bool(causal)),
        ],
        grid=(32 * ATTENTION_SIMDGROUPS, layout.tiles * layout.splits, B * HKV),
        threadgroup=(32 * ATTENTION_SIMDGROUPS, 1, 1),
        finish=partial(attention_results, splits=layout.splits, dtype=queries.dtype),
    )


# ------------------------------------------------------- GatedDeltaNet tape


def initial_state(state: Optional[mx.array], k: mx.array, v: mx.array) -> mx.array:
    """`state`, or the zero state (B, Hv, Dv, Dk) float32 a layer starts from."""
    if state is not None:
        return state
    return mx.zeros((k.shape[0], v.shape[2], v.shape[3], k.shape[3]), dtype=mx.float32)


def gated_delta_tape(q, k, v, g, beta, state: Optional[mx.array]) -> tuple[mx.array, mx.array, mx.array]:
    """The gated delta rule over T steps, also returning delta (B, T, Hv, Dv) float32.

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta (B, T, Hv); state (B, Hv, Dv, Dk) float32
    or None (zeros).  Returns (y (B, T, Hv, Dv) in q's dtype, final state, delta)."""
    state = initial_state(state, k, v)

    def twin():
        return gated_delta_tape_mlx(q, k, v, g, beta, state)

    if not (use_metal() and _metal_fits("gated_delta_tape", k.shape[-1], q.dtype)):
        return twin()
    launch = gated_delta_tape_launch(q, k, v, g, beta, state)
    return tuple(dispatch("gated_delta_tape", tape_class(q, k, v), launch, twin))


def tape_class(q, k, v) -> str:
    """The shapes that share a self-check decision: same heads, head dims and dtype; batch and
    steps in the same power-of-two class (the state's size does not grow with the context)."""
    B, T, HK, DK = k.shape
    HV, DV = v.shape[2:]
    return f"HK={HK} HV={HV} DK={DK} DV={DV} {dtype_name(q.dtype)} B<={size_class(B)} T<={size_class(T)}"


@mx.compile
def _tape_step(q, k, v, g, beta, state):
    state = state * g[..., None, None]
    delta = (v - (state * k[..., None, :]).sum(-1)) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    return (state * q[..., None, :]).sum(-1), state, delta


def gated_delta_tape_mlx(q, k, v, g, beta, state):
    heads = v.shape[2] // k.shape[2]
    q32 = mx.repeat(q.astype(mx.float32), heads, axis=2)
    k32 = mx.repeat(k.astype(mx.float32), heads, axis=2)
    v32, g, beta = v.astype(mx.float32), g.astype(mx.float32), beta.astype(mx.float32)
    ys, deltas = [], []
    for t in range(q.shape[1]):
        y, state, delta = _tape_step(q32[:, t], k32[:, t], v32[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        deltas.append(delta)
    return mx.stack(ys, axis=1).astype(q.dtype), state, mx.stack(deltas, axis=1)


def gated_delta_tape_launch(q, k, v, g, beta, state) -> Launch:
    B, T, HK, DK = k.shape
    HV, DV = v.shape[2:]
    simdgroups = min(DV, THREADGROUP_CEILING // 32)  # one threadgroup per value head
    return Launch(
        kernel="gated_delta_tape",
        inputs=dict(
            q=q,
            k=k,
            v=v,
            g=g.astype(mx.float32),
            beta=beta.astype(mx.float32),
            state_in=state.astype(mx.float32),
            steps=T,
        ),
        outputs=dict(
            y=((B, T, HV, DV), q.dtype), state_out=((B, HV, DV, DK), mx.float32), delta=((B, T, HV, DV), mx.float32)
        ),
        template=[
            ("T_IN", q.dtype),
            ("DK", DK),
            ("DV", DV),
            ("HK", HK),
            ("HV", HV),
            ("SIMDGROUPS", simdgroups),
            ("ROWS", -(-DV // simdgroups)),
        ],
        grid=(32 * simdgroups, 1, B * HV),
        threadgroup=(32 * simdgroups, 1, 1),
    )


def gated_delta_replay(state: Optional[mx.array], k: mx.array, g: mx.array, delta: mx.array, steps: int) -> mx.array:
    """The state after the first `steps` tape steps from `state` (None: zeros), in closed form:
    S_n = (g_1..g_n) S_0 + sum_t (g_{t+1}..g_n) delta_t k_t^T  -- one matmul, no recurrence."""
    state = initial_state(state, k, delta)
    if steps == 0:
        return state
    k = mx.repeat(k[:, :steps].astype(mx.float32), delta.shape[2] // k.shape[2], axis=2)
    g, delta = g[:, :steps], delta[:, :steps]
    later = mx.cumprod(g, axis=1, reverse=True, inclusive=False)  # g_{t+1} ... g_n
    update = mx.einsum("bthv,bthk->bhvk", delta * later[..., None], k)
    return mx.cumprod(g, axis=1)[:, -1, :, None, None] * state + update
