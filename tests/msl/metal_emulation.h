// Just enough of the Metal Shading Language to run dflash-mlx's kernel bodies
// (metal/*.metal) as C++ on a CPU, with the semantics the kernels rely on:
//
//   thread indices      uint / uint3 attributes, set per emulated thread
//   threadgroup memory  `threadgroup` declarations become function statics,
//                       shared by the threads of the one threadgroup running
//   barriers            threadgroup_barrier: every live thread of the group
//                       must arrive; returning before one is reported
//   simd reductions     simd_sum over the active lanes of a simdgroup; lanes
//                       reaching different synchronisation points is reported;
//                       each simdgroup's simd operations are counted per
//                       threadgroup (where a kernel's work lands)
//   storage types       half and bfloat16_t (round to nearest even), float math
//   buffers             device and constant pointers become emu::Buffer views:
//                       an out-of-bounds access stops the run naming the
//                       buffer, and device reads are counted per buffer
//   dispatch            dispatchThreads semantics: a grid need not be a
//                       multiple of the threadgroup; edge groups are smaller
//
// Threads are cooperative fibers (ucontext) run in lockstep phases: each runs
// to its next synchronisation point, then the scheduler resolves the simd
// operations and barriers that every participant has reached.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <ucontext.h>
#include <vector>

typedef unsigned int uint;
struct uint3 {
  uint x, y, z;
};

// Address spaces: plain memory on a CPU.  Threadgroup variables are statics:
// one threadgroup runs at a time, and all its threads share them.
#define device
#define constant
#define thread
#define threadgroup static

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = 0x7fc0;  // NaN
    } else {
      bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  operator float() const { return bits_float(static_cast<uint32_t>(bits) << 16); }
};

struct half {
  uint16_t bits;
  half() = default;
  half(float f) {
    uint32_t u = float_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t mag = u & 0x7fffffffu;
    if (mag > 0x7f800000u) {
      bits = static_cast<uint16_t>(sign | 0x7e00u);
    } else if (mag >= 0x477ff000u) {  // rounds to >= 65520: infinity
      bits = static_cast<uint16_t>(sign | 0x7c00u);
    } else if (mag < 0x38800000u) {  // subnormal half (or zero)
      float scaled = bits_float(mag) * 16777216.0f;  // * 2^24: the subnormal unit becomes 1
      bits = static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
    } else {
      uint32_t rounded = mag + 0xfffu + ((mag >> 13) & 1u);
      bits = static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
    }
  }
  operator float() const {
    uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    uint32_t exponent = (bits >> 10) & 0x1fu;
    uint32_t mantissa = bits & 0x3ffu;
    if (exponent == 0) {
      float value = static_cast<float>(mantissa) / 16777216.0f;
      return sign ? -value : value;
    }
    if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
    return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
};
typedef half float16_t;

namespace metal {
template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
}  // namespace metal

enum class mem_flags { mem_none, mem_device, mem_threadgroup };

namespace emu {

// Bytes read from each device buffer during the run, by buffer index.
inline std::vector<unsigned long long>& bytes_read() {
  static std::vector<unsigned long long> counts(64, 0);
  return counts;
}

// Simd operations each simdgroup executed, per threadgroup in dispatch order.
inline std::vector<std::vector<unsigned long long>>& simd_operations() {
  static std::vector<std::vector<unsigned long long>> counts;
  return counts;
}

// A kernel's view of one buffer argument: bounds-checked, reads counted.
template <typename T>
struct Buffer {
  T* data;
  long size;
  int index;
  const char* name;
  bool counted;  // device memory (constant-space arguments are not device traffic)

  T& operator[](long i) const {
    if (i < 0 || i >= size) {
      fprintf(stderr, "out-of-bounds access %s[%ld] (size %ld)\n", name, i, size);
      std::exit(3);
    }
    if (counted) bytes_read()[index] += sizeof(T);
    return data[i];
  }
};

enum class Wait { running, barrier, simd, done };

struct Thread {
  ucontext_t context;
  std::vector<char> stack;
  Wait wait = Wait::running;
  float value = 0.0f;
  float result = 0.0f;
  uint3 position_in_grid, position_in_threadgroup, threadgroup_position, threads_per_threadgroup;
  uint index_in_threadgroup, simdgroup, lane;
};

struct Group {
  std::vector<Thread> threads;
  ucontext_t scheduler;
  Thread* current = nullptr;
  std::function<void(Thread&)> body;
  std::string error;
};

inline Group*& group() {
  static Group* g = nullptr;
  return g;
}

inline void suspend(Wait wait) {
  Thread& t = *group()->current;
  t.wait = wait;
  swapcontext(&t.context, &group()->scheduler);
}

inline void trampoline() {
  Thread& t = *group()->current;
  group()->body(t);
  suspend(Wait::done);
}

inline float simd_sum(float x) {
  Thread& t = *group()->current;
  t.value = x;
  suspend(Wait::simd);
  return group()->current->result;
}

// Resolve the simd operations and barriers every participant has reached.
// Returns false when nothing can proceed.
inline bool resolve(Group& g) {
  bool progressed = false;
  size_t n = g.threads.size();
  for (size_t first = 0; first < n; first += 32) {
    size_t last = std::min(n, first + 32);
    bool any_simd = false, all_simd = true;
    for (size_t i = first; i < last; ++i) {
      Wait w = g.threads[i].wait;
      if (w == Wait::simd) any_simd = true;
      else if (w != Wait::done) all_simd = false;
    }
    if (!any_simd) continue;
    if (!all_simd) {
      g.error = "divergence: lanes of simdgroup " + std::to_string(first / 32) + " reached different operations";
      return false;
    }
    float acc = 0.0f;
    for (size_t i = first; i < last; ++i) {
      if (g.threads[i].wait == Wait::simd) acc += g.threads[i].value;
    }
    for (size_t i = first; i < last; ++i) {
      if (g.threads[i].wait == Wait::simd) {
        g.threads[i].result = acc;
        g.threads[i].wait = Wait::running;
      }
    }
    ++simd_operations().back()[first / 32];
    progressed = true;
  }
  if (progressed) return true;
  bool any_barrier = false, any_done = false, all_barrier = true;
  for (Thread& t : g.threads) {
    if (t.wait == Wait::barrier) any_barrier = true;
    else if (t.wait == Wait::done) any_done = true;
    else all_barrier = false;
  }
  if (!any_barrier) return false;
  if (!all_barrier) {
    g.error = "deadlock: some threads wait at a barrier, others at a simd operation";
    return false;
  }
  if (any_done) {
    g.error = "barrier reached after some threads of the threadgroup returned";
    return false;
  }
  for (Thread& t : g.threads) t.wait = Wait::running;
  return true;
}

// Run `body` once per thread of a dispatchThreads(grid, threadgroup) launch:
// ceil(grid / size) threadgroups, those at the grid's edge cut to what is left.
inline void dispatch(uint3 grid, uint3 size, std::function<void(Thread&)> body) {
  Group g;
  g.body = body;
  group() = &g;
  for (uint gz = 0; gz * size.z < grid.z; ++gz)
    for (uint gy = 0; gy * size.y < grid.y; ++gy)
      for (uint gx = 0; gx * size.x < grid.x; ++gx) {
        uint3 local_size = {std::min(size.x, grid.x - gx * size.x), std::min(size.y, grid.y - gy * size.y),
                            std::min(size.z, grid.z - gz * size.z)};
        uint count = local_size.x * local_size.y * local_size.z;
        g.threads.resize(count);  // fibers and their stacks are reused from group to group
        simd_operations().emplace_back((count + 31) / 32, 0);
        for (uint i = 0; i < count; ++i) {
          Thread& t = g.threads[i];
          if (t.stack.empty()) t.stack.resize(1 << 16);
          uint3 local = {i % local_size.x, (i / local_size.x) % local_size.y, i / (local_size.x * local_size.y)};
          t.position_in_threadgroup = local;
          t.threadgroup_position = {gx, gy, gz};
          t.threads_per_threadgroup = local_size;
          t.position_in_grid = {gx * size.x + local.x, gy * size.y + local.y, gz * size.z + local.z};
          t.index_in_threadgroup = i;
          t.simdgroup = i / 32;
          t.lane = i % 32;
          t.wait = Wait::running;
          getcontext(&t.context);
          t.context.uc_stack.ss_sp = t.stack.data();
          t.context.uc_stack.ss_size = t.stack.size();
          t.context.uc_link = nullptr;
          makecontext(&t.context, trampoline, 0);
        }
        bool alive = true;
        while (alive) {
          alive = false;
          for (Thread& t : g.threads) {
            if (t.wait != Wait::running) continue;
            g.current = &t;
            swapcontext(&g.scheduler, &t.context);
          }
          for (Thread& t : g.threads) alive = alive || t.wait != Wait::done;
          if (alive && !resolve(g)) {
            throw std::runtime_error(g.error.empty() ? "emulator: threads stuck" : "emulator: " + g.error);
          }
        }
      }
  group() = nullptr;
}

}  // namespace emu

inline float simd_sum(float x) { return emu::simd_sum(x); }
inline void threadgroup_barrier(mem_flags) { emu::suspend(emu::Wait::barrier); }
