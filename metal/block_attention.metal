// Block attention with KV injection (body of an mx.fast.metal_kernel).
//
// The drafter's block queries attend to the injected context keys/values,
// read in place from the drafter's preallocated cache buffer, and to the
// block's own keys/values, in one pass: no concatenated copy of the context
// is made per cycle.  Online softmax in float32.
//
// One threadgroup serves a tile of query rows that share a KV head (every
// block row of every GQA head of that KV head, SIMDGROUPS * ROWS rows per
// tile): it streams the keys and values through threadgroup memory in chunks
// of CHUNK, so each K/V element is read from device memory once per tile, not
// once per query row.  Each simdgroup owns ROWS query rows, D / 32 elements
// of each per lane.
//
// Inputs
//   queries     [B, HQ, L, D]     block queries (RoPE applied)
//   keys        [B, HKV, L, D]    block keys
//   values      [B, HKV, L, D]    block values
//   ctx_keys    [B, HKV, CAP, D]  context buffer (only [start, start + len) is live)
//   ctx_values  [B, HKV, CAP, D]
//   geometry    int32 [5]: cap, start, len, window (0 = none), L
//   scale       float
// Output
//   out         [B, HQ, L, D]
// Template: T (storage type), D (multiple of 32), HQ, HKV, SIMDGROUPS, ROWS,
// CHUNK, CAUSAL.  The block length L and the context geometry are run-time
// values, so one compiled kernel serves every block width.
// Launch: grid (32 * SIMDGROUPS, tiles, B * HKV), threadgroup
// (32 * SIMDGROUPS, 1, 1), tiles = ceil(HQ / HKV * L / (SIMDGROUPS * ROWS)).
//
// Keys j in [0, len + L) are the len context entries then the block, in
// temporal order, so key j is j - len - i positions after block row i.  Row i
// sees keys with j - len - i <= 0 when CAUSAL and |j - len - i| < window when
// windowed: one contiguous range [first(i), stop(i)), both ends
// non-decreasing in i.

constexpr int PER_LANE = D / 32;
constexpr int GROUP = HQ / HKV;
constexpr int THREADS = 32 * SIMDGROUPS;
constexpr int TILE_ROWS = SIMDGROUPS * ROWS;

const int start = geometry[1];
const int len = geometry[2];
const int window = geometry[3];
const int L = geometry[4];

const int b = threadgroup_position_in_grid.z / HKV;
const int hkv = threadgroup_position_in_grid.z % HKV;
const int tile_first = threadgroup_position_in_grid.y * TILE_ROWS;
const int tile_last = metal::min(tile_first + TILE_ROWS, GROUP * L) - 1;
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;

// Block row i sees keys [len + i + first_ahead, len + i + stop_ahead), clipped to [0, len + L).
const int first_ahead = window > 0 ? 1 - window : -(len + L);
const int stop_ahead = CAUSAL ? 1 : (window > 0 ? window : len + L);

// Rows n = GROUP-head-major index over (head in the KV group, block row).
int out_offset[ROWS];
int first[ROWS];
int stop[ROWS];
float q[ROWS][PER_LANE];
float acc[ROWS][PER_LANE];
float running_max[ROWS];
float running_sum[ROWS];
for (int r = 0; r < ROWS; ++r) {
  const int n = tile_first + int(sg) * ROWS + r;
  const bool active = n <= tile_last;
  const int i = active ? n % L : 0;
  const int hq = hkv * GROUP + (active ? n / L : 0);
  out_offset[r] = ((b * HQ + hq) * L + i) * D + lane * PER_LANE;
  first[r] = active ? metal::max(0, len + i + first_ahead) : 0;
  stop[r] = active ? metal::min(len + L, len + i + stop_ahead) : 0;
  for (int e = 0; e < PER_LANE; ++e) {
    q[r][e] = active ? static_cast<float>(queries[out_offset[r] + e]) * scale : 0.0f;
    acc[r][e] = 0.0f;
  }
  running_max[r] = -INFINITY;
  running_sum[r] = 0.0f;
}

// The keys any row of the tile sees: from the smallest block row's first key
// to the largest's stop.  Every thread runs the same chunk loop (barriers).
const bool whole_block = tile_last - tile_first + 1 >= L || tile_first / L != tile_last / L;
const int tile_keys_first = metal::max(0, len + (whole_block ? 0 : tile_first % L) + first_ahead);
const int tile_keys_stop = metal::min(len + L, len + (whole_block ? L - 1 : tile_last % L) + stop_ahead);

threadgroup T chunk_keys[CHUNK * D];
threadgroup T chunk_values[CHUNK * D];
const int ctx_base = (b * HKV + hkv) * geometry[0] + start;
const int block_base = (b * HKV + hkv) * L - len;
for (int c = tile_keys_first; c < tile_keys_stop; c += CHUNK) {
  const int count = metal::min(CHUNK, tile_keys_stop - c);
  for (int e = int(tid); e < count * D; e += THREADS) {
    const int j = c + e / D;
    const int offset = e % D;
    if (j < len) {
      chunk_keys[e] = ctx_keys[(ctx_base + j) * D + offset];
      chunk_values[e] = ctx_values[(ctx_base + j) * D + offset];
    } else {
      chunk_keys[e] = keys[(block_base + j) * D + offset];
      chunk_values[e] = values[(block_base + j) * D + offset];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int r = 0; r < ROWS; ++r) {
    const int from = metal::max(c, first[r]);
    const int to = metal::min(c + count, stop[r]);
    for (int j = from; j < to; ++j) {
      const int k_offset = (j - c) * D + lane * PER_LANE;
      float partial = 0.0f;
      for (int e = 0; e < PER_LANE; ++e) {
        partial += q[r][e] * static_cast<float>(chunk_keys[k_offset + e]);
      }
      const float score = simd_sum(partial);
      const float new_max = metal::max(running_max[r], score);
      const float rescale = metal::exp(running_max[r] - new_max);
      const float weight = metal::exp(score - new_max);
      running_sum[r] = running_sum[r] * rescale + weight;
      for (int e = 0; e < PER_LANE; ++e) {
        acc[r][e] = acc[r][e] * rescale + weight * static_cast<float>(chunk_values[k_offset + e]);
      }
      running_max[r] = new_max;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int r = 0; r < ROWS; ++r) {
  if (first[r] < stop[r]) {
    for (int e = 0; e < PER_LANE; ++e) {
      out[out_offset[r] + e] = static_cast<T>(acc[r][e] / running_sum[r]);
    }
  }
}
