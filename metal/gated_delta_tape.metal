// GatedDeltaNet recurrence over a verify block, recording a replay tape
// (body of an mx.fast.metal_kernel).
//
// Per value row v of head h, with state S[h] (Dv x Dk) in float32:
//     S_t     = g_t * S_{t-1}
//     delta_t = beta_t * (v_t - S_t k_t)
//     S_t     = S_t + delta_t k_t^T
//     y_t     = S_t q_t
// Besides y and the final state it writes delta_t, so the state after any
// prefix of n steps is the closed form
//     S_n = (g_1 ... g_n) S_0 + sum_t (g_{t+1} ... g_n) delta_t k_t^T
// which rollback evaluates as one matmul instead of re-running the loop.
//
// One threadgroup serves one value head: each step's q_t, k_t, v_t, g_t and
// beta_t are read from device memory once, into threadgroup memory, and every
// value row of the head reads them there (a simdgroup per row read q and k
// once per row: Dv times).
//
// Inputs
//   q, k        [B, T, HK, DK]   (normalized; q carries the readout scale)
//   v           [B, T, HV, DV]
//   g, beta     [B, T, HV]       float32 decay and write strength
//   state_in    [B, HV, DV, DK]  float32
//   steps       int: T, a run-time value, so one compiled kernel serves every block width
// Outputs
//   y           [B, T, HV, DV]   T_IN
//   state_out   [B, HV, DV, DK]  float32
//   delta       [B, T, HV, DV]   float32
// Template: T_IN, DK (multiple of 32), DV, HK, HV, SIMDGROUPS, ROWS (value rows
// per simdgroup: SIMDGROUPS * ROWS >= DV).
// Launch: grid (32 * SIMDGROUPS, 1, B * HV), threadgroup (32 * SIMDGROUPS, 1, 1);
// simdgroup s serves value rows s, s + SIMDGROUPS, ...

constexpr int PER_LANE = DK / 32;
constexpr int THREADS = 32 * SIMDGROUPS;

const int bh = threadgroup_position_in_grid.z;
const int b = bh / HV;
const int hv = bh % HV;
const int hk = hv / (HV / HK);
const int tid = int(thread_index_in_threadgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);

float s[ROWS][PER_LANE];
for (int r = 0; r < ROWS; ++r) {
  const int row = sg + r * SIMDGROUPS;
  if (row < DV) {
    const int state_offset = (bh * DV + row) * DK + lane * PER_LANE;
    for (int e = 0; e < PER_LANE; ++e) {
      s[r][e] = state_in[state_offset + e];
    }
  }
}

threadgroup float step_q[DK];
threadgroup float step_k[DK];
threadgroup float step_v[DV];
threadgroup float step_gate[2];

for (int t = 0; t < steps; ++t) {
  const int qk_base = ((b * steps + t) * HK + hk) * DK;
  const int gate = (b * steps + t) * HV + hv;
  for (int e = tid; e < DK; e += THREADS) {
    step_q[e] = static_cast<float>(q[qk_base + e]);
    step_k[e] = static_cast<float>(k[qk_base + e]);
  }
  for (int e = tid; e < DV; e += THREADS) {
    step_v[e] = static_cast<float>(v[gate * DV + e]);
  }
  if (tid == 0) {
    step_gate[0] = g[gate];
    step_gate[1] = beta[gate];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const float decay = step_gate[0];
  const float strength = step_gate[1];
  for (int r = 0; r < ROWS; ++r) {
    const int row = sg + r * SIMDGROUPS;
    if (row >= DV) {
      break;  // the same for every lane of the simdgroup
    }
    float partial = 0.0f;
    for (int e = 0; e < PER_LANE; ++e) {
      s[r][e] *= decay;
      partial += s[r][e] * step_k[lane * PER_LANE + e];
    }
    const float d = (step_v[row] - simd_sum(partial)) * strength;

    partial = 0.0f;
    for (int e = 0; e < PER_LANE; ++e) {
      s[r][e] += step_k[lane * PER_LANE + e] * d;
      partial += s[r][e] * step_q[lane * PER_LANE + e];
    }
    const float readout = simd_sum(partial);
    if (lane == 0) {
      y[gate * DV + row] = static_cast<T_IN>(readout);
      delta[gate * DV + row] = d;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int r = 0; r < ROWS; ++r) {
  const int row = sg + r * SIMDGROUPS;
  if (row < DV) {
    const int state_offset = (bh * DV + row) * DK + lane * PER_LANE;
    for (int e = 0; e < PER_LANE; ++e) {
      state_out[state_offset + e] = s[r][e];
    }
  }
}
