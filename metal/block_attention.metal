// Block attention with KV injection (body of an mx.fast.metal_kernel).
//
// The drafter's block queries attend to the injected context keys/values,
// read in place from the drafter's preallocated cache buffer, and to the
// block's own keys/values: no concatenated copy of the context is made per
// cycle.  Online softmax in float32.
//
// Work is spread three ways, so that a narrow block over a long context still
// fills the GPU (kernels/metal.py's attention_layout chooses the numbers):
//   tiles      a tile is a run of query rows sharing a KV head (every block row
//              of every GQA head of that KV head), at most SIMDGROUPS * ROWS;
//   splits     each tile's keys are cut into `splits` contiguous parts, one
//              threadgroup each.  A split writes its rows' normalised output
//              and log-sum-exp; MLX combines the splits (Launch.finish), so a
//              4k context is many threadgroups, not one per KV head.  With
//              one split (a short context) the rows are written to `out`
//              directly, and the split outputs are not used;
//   key slots  inside a threadgroup, `key_slots` simdgroups share a set of
//              `slot_rows` rows, each taking every key_slots-th key, and merge
//              their softmax states in threadgroup memory at the end: a block
//              too narrow to give every simdgroup its own rows still keeps
//              all of them busy.
// Each split streams its keys and values through threadgroup memory in chunks
// of CHUNK, so each K/V element is read from device memory once per tile.
// Each simdgroup holds up to ROWS query rows, D / 32 elements of each per lane.
//
// Inputs
//   queries     [B, HQ, L, D]     block queries (RoPE applied)
//   keys        [B, HKV, L, D]    block keys
//   values      [B, HKV, L, D]    block values
//   ctx_keys    [B, HKV, CAP, D]  context buffer (only [start, start + len) is live)
//   ctx_values  [B, HKV, CAP, D]
//   geometry    int32 [8]: cap, start, len, window (0 = none), L, splits,
//               key_slots (a power of two dividing SIMDGROUPS), slot_rows (<= ROWS)
//   scale       float
// Outputs
//   out              [B, HQ, L, D]          T: the attention, when splits == 1
//   split_out        [B, HQ, L, splits, D]  float32, when splits > 1: the row's attention
//                                           over the split's keys
//   split_logsumexp  [B, HQ, L, splits]     float32, when splits > 1: log of the split's
//                                           softmax mass (-FLT_MAX: it sees none of them)
// Every element of the outputs in use is written, an empty split's included.
// Template: T (storage type), D (multiple of 32), HQ, HKV, SIMDGROUPS, ROWS,
// CHUNK, CAUSAL.  The block length L, the context geometry and the layout are
// run-time values, so one compiled kernel serves every block width and context.
// Launch: grid (32 * SIMDGROUPS, tiles * splits, B * HKV), threadgroup
// (32 * SIMDGROUPS, 1, 1); tile rows = SIMDGROUPS / key_slots * slot_rows.
//
// Keys j in [0, len + L) are the len context entries then the block, in
// temporal order, so key j is j - len - i positions after block row i.  Row i
// sees keys with j - len - i <= 0 when CAUSAL and |j - len - i| < window when
// windowed: one contiguous range [first(i), stop(i)), both ends
// non-decreasing in i.

constexpr int PER_LANE = D / 32;
constexpr int GROUP = HQ / HKV;
constexpr int THREADS = 32 * SIMDGROUPS;

const int start = geometry[1];
const int len = geometry[2];
const int window = geometry[3];
const int L = geometry[4];
const int splits = geometry[5];
const int key_slots = geometry[6];
const int slot_rows = geometry[7];
const int tile_rows = SIMDGROUPS / key_slots * slot_rows;

const int b = threadgroup_position_in_grid.z / HKV;
const int hkv = threadgroup_position_in_grid.z % HKV;
const int split = threadgroup_position_in_grid.y % splits;
const int tile_first = threadgroup_position_in_grid.y / splits * tile_rows;
const int tile_last = metal::min(tile_first + tile_rows, GROUP * L) - 1;
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;
const int key_slot = int(sg) % key_slots;
const int slot_first = tile_first + int(sg) / key_slots * slot_rows;

// Block row i sees keys [len + i + first_ahead, len + i + stop_ahead), clipped to [0, len + L).
const int first_ahead = window > 0 ? 1 - window : -(len + L);
const int stop_ahead = CAUSAL ? 1 : (window > 0 ? window : len + L);

// Rows n = GROUP-head-major index over (head in the KV group, block row).  A
// finite lowest max, not -INFINITY: Metal's fast math may assume no infinities,
// and an empty row's rescale exp(max - max) must stay finite.
int out_row[ROWS];
int first[ROWS];
int stop[ROWS];
float q[ROWS][PER_LANE];
float acc[ROWS][PER_LANE];
float running_max[ROWS];
float running_sum[ROWS];
for (int r = 0; r < ROWS; ++r) {
  const int n = slot_first + r;
  const bool active = r < slot_rows && n <= tile_last;
  const int i = active ? n % L : 0;
  const int hq = hkv * GROUP + (active ? n / L : 0);
  out_row[r] = (b * HQ + hq) * L + i;
  first[r] = active ? metal::max(0, len + i + first_ahead) : 0;
  stop[r] = active ? metal::min(len + L, len + i + stop_ahead) : 0;
  for (int e = 0; e < PER_LANE; ++e) {
    q[r][e] = active ? static_cast<float>(queries[out_row[r] * D + lane * PER_LANE + e]) * scale : 0.0f;
    acc[r][e] = 0.0f;
  }
  running_max[r] = -FLT_MAX;
  running_sum[r] = 0.0f;
}

// The keys any row of the tile sees, from the smallest block row's first key
// to the largest's stop, and this split's contiguous share of them.  Every
// thread runs the same chunk loop (barriers).
const bool whole_block = tile_last - tile_first + 1 >= L || tile_first / L != tile_last / L;
const int tile_keys_first = metal::max(0, len + (whole_block ? 0 : tile_first % L) + first_ahead);
const int tile_keys_stop = metal::min(len + L, len + (whole_block ? L - 1 : tile_last % L) + stop_ahead);
const int split_keys = (tile_keys_stop - tile_keys_first + splits - 1) / splits;
const int split_first = tile_keys_first + split * split_keys;
const int split_stop = metal::min(tile_keys_stop, split_first + split_keys);

threadgroup T chunk_keys[CHUNK * D];
threadgroup T chunk_values[CHUNK * D];
const int ctx_base = (b * HKV + hkv) * geometry[0] + start;
const int block_base = (b * HKV + hkv) * L - len;
for (int c = split_first; c < split_stop; c += CHUNK) {
  const int count = metal::min(CHUNK, split_stop - c);
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
    // this simdgroup's keys: j % key_slots == key_slot (interleaved, so the slots stay even
    // whatever range a causal or windowed row sees)
    for (int j = from + (key_slot - from % key_slots + key_slots) % key_slots; j < to; j += key_slots) {
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

// The simdgroups sharing a set of rows merge their softmax states, one row at a
// time (a row of every simdgroup fits in SIMDGROUPS * D floats), into the set's
// first simdgroup (key slot 0).
threadgroup float slot_acc[SIMDGROUPS * D];
threadgroup float slot_max[SIMDGROUPS];
threadgroup float slot_sum[SIMDGROUPS];
const int set_first_sg = int(sg) - key_slot;
for (int r = 0; r < ROWS; ++r) {
  if (key_slots > 1 && r < slot_rows) {  // the same for the whole threadgroup: barriers are safe
    for (int e = 0; e < PER_LANE; ++e) {
      slot_acc[sg * D + lane * PER_LANE + e] = acc[r][e];
    }
    if (lane == 0) {
      slot_max[sg] = running_max[r];
      slot_sum[sg] = running_sum[r];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (key_slot == 0) {
      float set_max = -FLT_MAX;
      for (int s = 0; s < key_slots; ++s) {
        set_max = metal::max(set_max, slot_max[set_first_sg + s]);
      }
      running_sum[r] = 0.0f;
      for (int e = 0; e < PER_LANE; ++e) {
        acc[r][e] = 0.0f;
      }
      for (int s = 0; s < key_slots; ++s) {
        const int other = set_first_sg + s;
        const float rescale = metal::exp(slot_max[other] - set_max);
        running_sum[r] += slot_sum[other] * rescale;
        for (int e = 0; e < PER_LANE; ++e) {
          acc[r][e] += slot_acc[other * D + lane * PER_LANE + e] * rescale;
        }
      }
      running_max[r] = set_max;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

if (key_slot == 0) {
  for (int r = 0; r < ROWS; ++r) {
    if (first[r] >= stop[r]) {
      continue;  // not one of the tile's rows
    }
    if (splits == 1) {  // the row saw all its keys, at least its own: running_sum > 0
      for (int e = 0; e < PER_LANE; ++e) {
        out[out_row[r] * D + lane * PER_LANE + e] = static_cast<T>(acc[r][e] / running_sum[r]);
      }
    } else {
      // a row may see none of this split's keys: zero weight in the combination
      const bool seen = running_sum[r] > 0.0f;
      const int split_row = out_row[r] * splits + split;
      for (int e = 0; e < PER_LANE; ++e) {
        split_out[split_row * D + lane * PER_LANE + e] = seen ? acc[r][e] / running_sum[r] : 0.0f;
      }
      if (lane == 0) {
        split_logsumexp[split_row] = seen ? running_max[r] + metal::log(running_sum[r]) : -FLT_MAX;
      }
    }
  }
}
