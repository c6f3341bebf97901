"""Run a kernels.Launch on this CPU: the Metal kernel body compiled as C++
against tests/msl/metal_emulation.h, with the signature mx.fast.metal_kernel
would generate (inputs, outputs, template constants, thread attributes)."""

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from dflash_mlx import kernels

HEADER_DIR = Path(__file__).parent / "msl"
BUILD_DIR = Path(tempfile.gettempdir()) / "dflash-mlx-msl-emulation"
ATTRIBUTES = """uint3 thread_position_in_grid = t.position_in_grid;
uint3 thread_position_in_threadgroup = t.position_in_threadgroup;
uint3 threadgroup_position_in_grid = t.threadgroup_position;
uint thread_index_in_threadgroup = t.index_in_threadgroup;
uint simdgroup_index_in_threadgroup = t.simdgroup;
uint thread_index_in_simdgroup = t.lane;"""

C_TYPES = {mx.float32: "float", mx.float16: "half", mx.bfloat16: "bfloat16_t", mx.int32: "int",
           mx.uint32: "uint", mx.bool_: "bool"}
RAW_VIEW = {mx.float16: mx.uint16, mx.bfloat16: mx.uint16}


def compiler() -> str:
    for name in ("g++", "clang++"):
        if shutil.which(name):
            return name
    raise RuntimeError("the Metal emulation needs a C++ compiler (g++ or clang++) on PATH")


def _as_array(value) -> mx.array:
    if isinstance(value, mx.array):
        return value
    return mx.array(value, dtype=mx.float32 if isinstance(value, float) else mx.int32)


def _template_line(name, value) -> str:
    if isinstance(value, mx.Dtype):
        return f"typedef {C_TYPES[value]} {name};"
    if isinstance(value, bool):
        return f"constexpr bool {name} = {'true' if value else 'false'};"
    return f"constexpr int {name} = {int(value)};"


def program(launch: kernels.Launch, kernel_file: Path) -> str:
    """C++ source: the kernel body inside a function with MLX's generated signature,
    and a main() that reads inputs from files, runs the grid and writes outputs."""
    inputs = {name: _as_array(value) for name, value in launch.inputs.items()}
    params, binds = [], []
    for i, (name, array) in enumerate(inputs.items()):
        ctype = C_TYPES[array.dtype]
        params.append(f"const constant {ctype}& {name}" if array.ndim == 0 else f"const device {ctype}* {name}")
        binds.append(f"*reinterpret_cast<const {ctype}*>(buffers[{i}].data())" if array.ndim == 0
                     else f"reinterpret_cast<const {ctype}*>(buffers[{i}].data())")
    for j, (name, (_, dtype)) in enumerate(launch.outputs.items()):
        params.append(f"device {C_TYPES[dtype]}* {name}")
        binds.append(f"reinterpret_cast<{C_TYPES[dtype]}*>(buffers[{len(inputs) + j}].data())")
    template = "\n".join(_template_line(name, value) for name, value in launch.template)
    n_buffers = len(inputs) + len(launch.outputs)
    return f"""#include <cstdio>
#include <fstream>
#include <iterator>
#include "metal_emulation.h"  // last: it defines the address-space keywords as macros

namespace kernel_scope {{
{template}

void body({", ".join(params)}, const emu::Thread& t) {{
{ATTRIBUTES}
#include "{kernel_file}"
}}
}}  // namespace kernel_scope

int main(int argc, char** argv) {{
  // argv: {n_buffers} buffer files (inputs, then outputs), read and written in place
  std::vector<std::vector<char>> buffers;
  for (int i = 1; i <= {n_buffers}; ++i) {{
    std::ifstream in(argv[i], std::ios::binary);
    buffers.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }}
  try {{
    emu::dispatch({{{launch.grid[0]}, {launch.grid[1]}, {launch.grid[2]}}},
                  {{{launch.threadgroup[0]}, {launch.threadgroup[1]}, {launch.threadgroup[2]}}},
                  [&](emu::Thread& t) {{ kernel_scope::body({", ".join(binds)}, t); }});
  }} catch (const std::exception& e) {{
    fprintf(stderr, "%s\\n", e.what());
    return 1;
  }}
  for (int i = {len(inputs) + 1}; i <= {n_buffers}; ++i) {{
    std::ofstream out(argv[i], std::ios::binary);
    out.write(buffers[i - 1].data(), buffers[i - 1].size());
  }}
  return 0;
}}
"""


def build(launch: kernels.Launch, source_dir: Optional[Path] = None) -> Path:
    kernel_file = (source_dir or kernels._metal_dir()) / f"{launch.kernel}.metal"
    source = program(launch, kernel_file)
    digest = hashlib.sha1((source + kernel_file.read_text()
                           + (HEADER_DIR / "metal_emulation.h").read_text()).encode()).hexdigest()[:16]
    binary = BUILD_DIR / f"{launch.kernel}-{digest}"
    if not binary.exists():
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        cpp = binary.with_suffix(".cpp")
        cpp.write_text(source)
        result = subprocess.run([compiler(), "-std=c++17", "-O1", "-Wall", "-Wno-unused-variable",
                                 "-Wno-unused-parameter", "-I", str(HEADER_DIR), str(cpp), "-o", str(binary) + ".tmp"],
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"emulated {launch.kernel} does not compile:\n{result.stderr}")
        Path(str(binary) + ".tmp").rename(binary)
    return binary


def _to_bytes(array: mx.array) -> bytes:
    if array.dtype in RAW_VIEW:
        array = array.view(RAW_VIEW[array.dtype])
    return np.ascontiguousarray(np.array(array)).tobytes()


def run_emulated(launch: kernels.Launch, source_dir: Optional[Path] = None) -> list[mx.array]:
    """The launch's outputs, computed by the emulated kernel (metal/<kernel>.metal,
    or from `source_dir`)."""
    binary = build(launch, source_dir)
    inputs = [_as_array(v) for v in launch.inputs.values()]
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, array in enumerate(inputs):
            files.append(Path(tmp) / f"in{i}")
            files[-1].write_bytes(_to_bytes(array))
        for j, (shape, dtype) in enumerate(launch.outputs.values()):
            files.append(Path(tmp) / f"out{j}")
            files[-1].write_bytes(bytes(int(np.prod(shape)) * dtype.size))
        result = subprocess.run([str(binary), *map(str, files)], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"emulated {launch.kernel} failed: {result.stderr.strip()}")
        outputs = []
        for path, (shape, dtype) in zip(files[len(inputs):], launch.outputs.values()):
            raw = RAW_VIEW.get(dtype, dtype)
            data = np.frombuffer(path.read_bytes(), dtype=np.dtype(_NUMPY[raw])).reshape(shape)
            outputs.append(mx.array(data).view(dtype) if raw != dtype else mx.array(data))
        return outputs


_NUMPY = {mx.float32: "float32", mx.uint16: "uint16", mx.int32: "int32", mx.uint32: "uint32"}
