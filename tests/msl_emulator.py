"""Run a kernels.Launch on this CPU.

The Metal source is the one mx.fast.metal_kernel itself generates for the launch
(signature, address spaces, template instantiation): mx.export_function records
the call without a Metal device, through the same kernels.run_metal the decoder
uses.  That source is compiled as C++ against tests/msl/metal_emulation.h and
run over the grid with Metal's dispatchThreads semantics; device reads are
counted per input buffer, simd operations per simdgroup of each threadgroup.
Outputs start as NaN bytes, as a GPU's fresh buffers hold garbage: an element
the kernel never writes shows up in the results."""

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_mlx.kernels import metal as kernels

launch_on_metal = kernels.run_metal  # the real launch, kept before tests route kernels.run_metal here

HEADER_DIR = Path(__file__).parent / "msl"
BUILD_DIR = Path(tempfile.gettempdir()) / "dflash-mlx-msl-emulation"
MAX_THREADS_PER_THREADGROUP = 1024
# Apple's SDK only declares the (deprecated) ucontext routines the fibers use under _XOPEN_SOURCE
PLATFORM_FLAGS = ["-D_XOPEN_SOURCE=600", "-Wno-deprecated-declarations"] if sys.platform == "darwin" else []

# Metal thread attributes -> fields of emu::Thread
THREAD_ATTRIBUTES = {
    "thread_position_in_grid": "position_in_grid",
    "thread_position_in_threadgroup": "position_in_threadgroup",
    "threadgroup_position_in_grid": "threadgroup_position",
    "threads_per_threadgroup": "threads_per_threadgroup",
    "thread_index_in_threadgroup": "index_in_threadgroup",
    "simdgroup_index_in_threadgroup": "simdgroup",
    "thread_index_in_simdgroup": "lane",
}
RAW_VIEW = {mx.float16: mx.uint16, mx.bfloat16: mx.uint16}
NUMPY = {mx.float32: "float32", mx.uint16: "uint16", mx.int32: "int32", mx.uint32: "uint32", mx.bool_: "bool"}
PARAMETER = re.compile(r"^\s*(?P<decl>.+?)\s*(?P<name>\w+) \[\[(?P<attribute>\w+)(?:\((?P<slot>\d+)\))?\]\],?$")


@dataclass
class Generated:
    """What mx.fast.metal_kernel built for one launch."""

    name: str
    source: str
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]


@dataclass
class Emulation:
    outputs: list[mx.array]  # the launch's results (its kernel's outputs through launch.results)
    bytes_read: dict[str, int]  # device-memory bytes read per input
    simd_operations: list[list[int]]  # per threadgroup (dispatch order), per simdgroup: simd_sum calls


def generated(launch: kernels.Launch) -> Generated:
    """The kernel MLX generates for `launch`, recorded by mx.export_function (no Metal needed)."""
    found = []

    def record(node):
        if node.get("name") == "CustomKernel":
            arguments = node["arguments"]
            found.append(Generated(arguments[0], arguments[1], tuple(arguments[2:5]), tuple(arguments[5:8])))

    mx.eval([value for value in launch.inputs.values() if isinstance(value, mx.array)])  # constants, not a graph
    mx.export_function(record, lambda: launch_on_metal(launch))
    (kernel,) = found
    return kernel


def _element_type(decl: str) -> str:
    """`const device float*` -> `float`."""
    return " ".join(re.sub(r"\b(const|device|constant)\b|[*&]", " ", decl).split())


def cpp_program(kernel: Generated, inputs: list, outputs: list) -> str:
    """C++ source: MLX's generated kernel with its attributes resolved by the emulator, and a
    main() that maps buffer files, runs the grid and writes outputs and read counts."""
    head, rest = kernel.source.split("[[kernel]] void ", 1)
    signature, rest = rest.split(") {\n", 1)
    body, instantiation = rest.rsplit("\n}\n", 1)
    template_args = re.search(r"decltype\(\w+(<.*>)\)", instantiation)
    parameters, arguments = [], []
    buffers = [*inputs, *outputs]
    for line in signature.split("\n")[1:]:
        match = PARAMETER.match(line)
        if match is None:
            raise NotImplementedError(f"emulator: cannot read kernel parameter {line.strip()!r}")
        decl, name, attribute = match["decl"], match["name"], match["attribute"]
        if attribute == "buffer":
            slot, element = int(match["slot"]), _element_type(decl)
            if decl.endswith("&"):  # a scalar, passed by value in constant space
                parameters.append(f"const {element}& {name}")
                arguments.append(f"*reinterpret_cast<const {element}*>(files[{slot}].data())")
            else:
                const = "const " if decl.startswith("const ") else ""
                device = "true" if "device" in decl.split() else "false"
                parameters.append(f"emu::Buffer<{const}{element}> {name}")
                arguments.append(
                    f"{{reinterpret_cast<{const}{element}*>(files[{slot}].data()), "
                    f'{int(np.prod(buffers[slot][0]))}, {slot}, "{name}", {device}}}'
                )
        elif attribute in THREAD_ATTRIBUTES:
            parameters.append(f"{decl} {name}")
            arguments.append(f"t.{THREAD_ATTRIBUTES[attribute]}")
        else:
            raise NotImplementedError(f"emulator: thread attribute {attribute!r} is not emulated")
    call = "kernel_function" + (template_args[1] if template_args else "")
    parameter_list = ",\n  ".join(parameters)
    grid, group = kernel.grid, tuple(min(t, g) for t, g in zip(kernel.threadgroup, kernel.grid))  # as MLX does
    return f"""#include <fstream>
#include <iterator>
#include "metal_emulation.h"  // last: it defines the address-space keywords as macros

namespace kernel_scope {{
{head}void kernel_function(
  {parameter_list}) {{
{body}
}}
}}  // namespace kernel_scope

int main(int argc, char** argv) {{
  // argv: {len(buffers)} buffer files (inputs, then outputs), read and written in place
  std::vector<std::vector<char>> files;
  for (int i = 1; i <= {len(buffers)}; ++i) {{
    std::ifstream in(argv[i], std::ios::binary);
    files.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }}
  try {{
    emu::dispatch({{{grid[0]}, {grid[1]}, {grid[2]}}}, {{{group[0]}, {group[1]}, {group[2]}}},
                  [&](emu::Thread& t) {{ kernel_scope::{call}({", ".join(arguments)}); }});
  }} catch (const std::exception& e) {{
    fprintf(stderr, "%s\\n", e.what());
    return 1;
  }}
  for (int i = {len(inputs) + 1}; i <= {len(buffers)}; ++i) {{
    std::ofstream out(argv[i], std::ios::binary);
    out.write(files[i - 1].data(), files[i - 1].size());
  }}
  for (int i = 0; i < {len(inputs)}; ++i) printf("%llu\\n", emu::bytes_read()[i]);
  for (const auto& simdgroups : emu::simd_operations()) {{
    for (unsigned long long count : simdgroups) printf("%llu ", count);
    printf("\\n");
  }}
  return 0;
}}
"""


def compiler() -> str:
    for name in ("g++", "clang++"):
        if shutil.which(name):
            return name
    raise RuntimeError("the Metal emulation needs a C++ compiler (g++ or clang++) on PATH")


def build(source: str, label: str) -> Path:
    digest = hashlib.sha1((source + (HEADER_DIR / "metal_emulation.h").read_text()).encode()).hexdigest()[:16]
    binary = BUILD_DIR / f"{label}-{digest}"
    if not binary.exists():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        cpp = binary.with_suffix(".cpp")
        cpp.write_text(source)
        result = subprocess.run(
            [
                compiler(),
                "-std=c++17",
                "-O1",
                "-Wall",
                "-Wno-unused-variable",
                "-Wno-unused-parameter",
                "-Wno-unused-but-set-variable",
                *PLATFORM_FLAGS,
                "-I",
                str(HEADER_DIR),
                str(cpp),
                "-o",
                str(binary) + ".tmp",
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode:
            raise RuntimeError(f"emulated {label} does not compile:\n{result.stderr}")
        Path(str(binary) + ".tmp").rename(binary)
    return binary


def _as_array(value) -> mx.array:
    if isinstance(value, mx.array):
        return value
    return mx.array(value, dtype=mx.float32 if isinstance(value, float) else mx.int32)


def _to_bytes(array: mx.array) -> bytes:
    if array.dtype in RAW_VIEW:
        array = array.view(RAW_VIEW[array.dtype])
    return np.ascontiguousarray(np.array(array)).tobytes()


def emulate(launch: kernels.Launch) -> Emulation:
    """Run the launch's generated kernel on this CPU: its outputs and device traffic."""
    kernel = generated(launch)
    if np.prod(kernel.threadgroup) > MAX_THREADS_PER_THREADGROUP:
        raise ValueError(f"threadgroup {kernel.threadgroup} exceeds {MAX_THREADS_PER_THREADGROUP} threads")
    inputs = [_as_array(v) for v in launch.inputs.values()]
    shapes = [(a.shape, a.dtype) for a in inputs] + list(launch.outputs.values())
    binary = build(cpp_program(kernel, shapes[: len(inputs)], shapes[len(inputs) :]), launch.kernel)
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, array in enumerate(inputs):
            files.append(Path(tmp) / f"in{i}")
            files[-1].write_bytes(_to_bytes(array))
        for j, (shape, dtype) in enumerate(launch.outputs.values()):
            files.append(Path(tmp) / f"out{j}")
            files[-1].write_bytes(b"\xff" * (int(np.prod(shape)) * dtype.size))
        result = subprocess.run([str(binary), *map(str, files)], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"emulated {launch.kernel} failed: {result.stderr.strip()}")
        outputs = []
        for path, (shape, dtype) in zip(files[len(inputs) :], launch.outputs.values()):
            raw = RAW_VIEW.get(dtype, dtype)
            data = np.frombuffer(path.read_bytes(), dtype=np.dtype(NUMPY[raw])).reshape(shape)
            outputs.append(mx.array(data).view(dtype) if raw != dtype else mx.array(data))
    lines = result.stdout.splitlines()
    bytes_read = dict(zip(launch.inputs, map(int, lines[: len(inputs)])))
    simd_operations = [[int(count) for count in line.split()] for line in lines[len(inputs) :]]
    return Emulation(launch.results(outputs), bytes_read, simd_operations)


def run_emulated(launch: kernels.Launch) -> list[mx.array]:
    """The launch's outputs, computed by the emulated kernel."""
    return emulate(launch).outputs
