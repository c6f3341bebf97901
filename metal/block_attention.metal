// Block attention with KV injection (body of an mx.fast.metal_kernel).
//
// The drafter's block queries attend to the injected context keys/values,
// read in place from the drafter's preallocated cache buffer, and to the
// block's own keys/values, in one pass: no concatenated copy of the context
// is made per cycle.  Online softmax in float32.
//
// Inputs
//   queries     [B, HQ, L, D]     block queries (RoPE applied)
//   keys        [B, HKV, L, D]    block keys
//   values      [B, HKV, L, D]    block values
//   ctx_keys    [B, HKV, CAP, D]  context buffer (only [start, start + len) is live)
//   ctx_values  [B, HKV, CAP, D]
//   geometry    int32 [4]: cap, start, len, window (0 = none)
//   scale       float
// Output
//   out         [B, HQ, L, D]
// Template: T (storage type), D (multiple of 32), HQ, HKV, L, SIMDGROUPS, CAUSAL.
// Launch: grid (32 * SIMDGROUPS, L, B * HQ), threadgroup (32 * SIMDGROUPS, 1, 1).
//
// Keys j in [0, len + L) are the len context entries then the block, in
// temporal order, so key j is j - len - i positions after query row i.  Row i
// sees keys with j - len - i <= 0 when CAUSAL and |j - len - i| < window when
// windowed: one contiguous range, so no per-key test is needed.

constexpr int PER_LANE = D / 32;

const int row = thread_position_in_grid.y;
const int bh = thread_position_in_grid.z;
const int b = bh / HQ;
const int hkv = (bh % HQ) / (HQ / HKV);
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;

const int cap = geometry[0];
const int start = geometry[1];
const int len = geometry[2];
const int window = geometry[3];

int first = 0;
int stop = len + L;
if (CAUSAL) {
  stop = len + row + 1;
}
if (window > 0) {
  first = metal::max(first, len + row - window + 1);
  stop = metal::min(stop, len + row + window);
}

const int q_offset = (bh * L + row) * D + lane * PER_LANE;
float q[PER_LANE];
float acc[PER_LANE];
for (int e = 0; e < PER_LANE; ++e) {
  q[e] = static_cast<float>(queries[q_offset + e]) * scale;
  acc[e] = 0.0f;
}
float running_max = -INFINITY;
float running_sum = 0.0f;

const int ctx_base = (b * HKV + hkv) * cap;
const int block_base = (b * HKV + hkv) * L;
for (int j = first + int(sg); j < stop; j += SIMDGROUPS) {
  const bool in_context = j < len;
  const int k_offset = (in_context ? ctx_base + start + j : block_base + j - len) * D + lane * PER_LANE;
  float partial = 0.0f;
  for (int e = 0; e < PER_LANE; ++e) {
    const float k = in_context ? static_cast<float>(ctx_keys[k_offset + e]) : static_cast<float>(keys[k_offset + e]);
    partial += q[e] * k;
  }
  const float score = simd_sum(partial);
  const float new_max = metal::max(running_max, score);
  const float rescale = metal::exp(running_max - new_max);
  const float weight = metal::exp(score - new_max);
  running_sum = running_sum * rescale + weight;
  for (int e = 0; e < PER_LANE; ++e) {
    const float v = in_context ? static_cast<float>(ctx_values[k_offset + e]) : static_cast<float>(values[k_offset + e]);
    acc[e] = acc[e] * rescale + weight * v;
  }
  running_max = new_max;
}

// Merge the simdgroups' partial softmaxes.
threadgroup float group_max[SIMDGROUPS];
threadgroup float group_sum[SIMDGROUPS];
threadgroup float group_acc[SIMDGROUPS * D];
if (lane == 0) {
  group_max[sg] = running_max;
  group_sum[sg] = running_sum;
}
for (int e = 0; e < PER_LANE; ++e) {
  group_acc[sg * D + lane * PER_LANE + e] = acc[e];
}
threadgroup_barrier(mem_flags::mem_threadgroup);

if (sg == 0) {
  float total_max = -INFINITY;
  for (int s = 0; s < SIMDGROUPS; ++s) {
    total_max = metal::max(total_max, group_max[s]);
  }
  float total_sum = 0.0f;
  float merged[PER_LANE];
  for (int e = 0; e < PER_LANE; ++e) {
    merged[e] = 0.0f;
  }
  for (int s = 0; s < SIMDGROUPS; ++s) {
    // A simdgroup that saw no key has max -inf and sum 0: its factor is 0.
    const float factor = metal::exp(group_max[s] - total_max);
    total_sum += group_sum[s] * factor;
    for (int e = 0; e < PER_LANE; ++e) {
      merged[e] += group_acc[s * D + lane * PER_LANE + e] * factor;
    }
  }
  for (int e = 0; e < PER_LANE; ++e) {
    out[q_offset + e] = static_cast<T>(merged[e] / total_sum);
  }
}
