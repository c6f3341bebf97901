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
// Template: T_IN, DK (multiple of 32), DV, HK, HV.
// Launch: grid (32, DV, B * HV), threadgroup (32, 4, 1): one simdgroup per value row.

constexpr int PER_LANE = DK / 32;

const int bh = thread_position_in_grid.z;
const int b = bh / HV;
const int hv = bh % HV;
const int hk = hv / (HV / HK);
const int row = thread_position_in_grid.y;
const uint lane = thread_index_in_simdgroup;

float s[PER_LANE];
const int state_offset = (bh * DV + row) * DK + lane * PER_LANE;
for (int e = 0; e < PER_LANE; ++e) {
  s[e] = state_in[state_offset + e];
}

for (int t = 0; t < steps; ++t) {
  const int qk_offset = ((b * steps + t) * HK + hk) * DK + lane * PER_LANE;
  const int gate = (b * steps + t) * HV + hv;
  const int value = gate * DV + row;
  const float decay = g[gate];

  float partial = 0.0f;
  for (int e = 0; e < PER_LANE; ++e) {
    s[e] *= decay;
    partial += s[e] * static_cast<float>(k[qk_offset + e]);
  }
  const float d = (static_cast<float>(v[value]) - simd_sum(partial)) * beta[gate];

  partial = 0.0f;
  for (int e = 0; e < PER_LANE; ++e) {
    s[e] += static_cast<float>(k[qk_offset + e]) * d;
    partial += s[e] * static_cast<float>(q[qk_offset + e]);
  }
  const float readout = simd_sum(partial);
  if (lane == 0) {
    y[value] = static_cast<T_IN>(readout);
    delta[value] = d;
  }
}

for (int e = 0; e < PER_LANE; ++e) {
  state_out[state_offset + e] = s[e];
}
