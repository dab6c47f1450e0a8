// Sparse MLA backward for Hopper (sm_90a): two kernels, called from JAX through the XLA FFI.
//
// Inputs as the differentiation rule (attention/vjp.py) gives them: q bf16 [B, S, H, 576],
// kv bf16 [B, T, 576] (V = its first 512 columns), indices int32 [B, S, K], dout bf16
// [B, S, H, 512], lse and delta f32 [B, S, H] (delta = rowsum(out * dout) - dlse). For a pair
// (s, h, j) with t = idx[s, j] valid: p = exp(sm_scale q.k_t - lse), dp = dout . v_t,
// ds = p (dp - delta); dq += sm_scale ds k_t, dkv_t += sm_scale ds q (576), dkv_t[:512] += p dout.
//
// dq kernel: one CTA per (query, 64 heads), 8 warps. Q [64, 576] and dO [64, 512] stay in shared
// memory; the selected rows are gathered in blocks of 32 with cp.async into a 2-buffer swizzled
// ring (as the forward). Per block:
//   S/dP phase  warp w: heads 16 (w % 4) .. + 16, block columns 16 (w / 4) .. + 16:
//               S = Q K^T (k = 576) and dP = dO V^T (k = 512) with mma.sync m16n8k16;
//               P = exp2(S sm_scale log2e - lse log2e) (0 on invalid slots), dS = P (dP - delta)
//               written bf16 to shared memory;
//   dq phase    warp w: heads 32 (w % 2) .. + 32, columns 144 (w / 2) .. + 144:
//               dq += dS K (k = 32 rows), K read with ldmatrix.trans; 144 f32 registers a thread.
// Epilogue: dq * sm_scale written in the output dtype.
//
// dKV kernel: one CTA per block of 32 latent rows (b, t0 .. t0 + 31), 8 warps, deterministic
// (no atomics; every row of dkv written by exactly one CTA, in a fixed order). A key index
// built once per index set in XLA (attention/cuda.py, `key_index`) lists, per block, the
// queries that selected one of its rows ("units", ascending s) and per unit its run of pairs
// (the selected rows' offsets within the block, duplicates repeated). The block's 32 rows stay
// in shared memory; the CTA walks items (unit, 32-head tile) with a 2-buffer cp.async ring of
// the query's Q tile [32, 576], dO tile [32, 512], lse and delta, and the unit's per-row pair
// counts (a row listed twice by the query counts twice; 0 for rows it did not select; warp 1,
// lane = row, through shuffles). Index reads (the item's query, its run, the dq kernel's slot
// indices) are made one item / block ahead of the copies that use them:
//   S^T/dP^T    warp w: block rows 16 (w % 2) .. + 16, all 32 heads, quarter w / 2 of k:
//               S^T = K Q^T (k = 576 / 4), dP^T = V dO^T (k = 512 / 4), f32 partials to shared
//               memory; then every thread sums the quarters of 4 elements and writes
//               P'^T = count p and dS'^T = count sm_scale p (dp - delta) (0 where count is 0)
//               bf16 to shared memory;
//   dkv phase   warp w: rows 16 (w % 2) .. + 16, columns 144 (w / 2) .. + 144:
//               dkv += dS'^T Q (k = 32 heads) and, for columns < 512, dkv += P'^T dO;
//               72 f32 registers a thread.
// Both phases skip a warp's products where the item's query selected none of its 16 rows (a
// warp-uniform test of the counts; at long contexts most 16-row tiles of an item are empty).
// Epilogue: the block's dkv rows written f32 (rows >= T skipped; rows nobody selected get 0).

#include "sparse_mla_common.cuh"

namespace glm_sparse_mla {
namespace bwd {

constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

// ----------------------------------------------------------------------------------------- dq

constexpr int kDqHeads = 64;   // heads per CTA (MMA M)
constexpr int kDqBK = 32;      // gathered rows per block
constexpr int kDqStages = 2;

struct DqParams {
  const __nv_bfloat16* q;     // [rows, heads, 576]
  const __nv_bfloat16* kv;    // [B, T, 576]
  const int* indices;         // [rows, topk]
  const __nv_bfloat16* dout;  // [rows, heads, 512]
  const float* lse;           // [rows, heads]
  const float* delta;         // [rows, heads]
  void* dq;                   // [rows, heads, 576], bf16 or f32
  int heads;
  int seq_len;
  int num_keys;
  int topk;
  float sm_scale;
  float scale_log2;
};

struct DqLayout {
  static constexpr int kStageBytes = kDqBK * kRowBytes;
  static constexpr int kDsStride = kDqBK + 8;                     // bf16 per dS row
  static constexpr int kQ = 0;
  static constexpr int kDo = kQ + kDqHeads * kRowBytes;           // [64][512] bf16, swizzle_v
  static constexpr int kKV = kDo + kDqHeads * kDv * 2;
  static constexpr int kDs = kKV + kDqStages * kStageBytes;
  static constexpr int kLse = kDs + kDqHeads * kDsStride * 2;     // f32 [64], times log2 e
  static constexpr int kDelta = kLse + kDqHeads * 4;              // f32 [64]
  static constexpr int kValid = kDelta + kDqHeads * 4;            // u8 [stages][BK]
  static constexpr int kBytes = kValid + kDqStages * kDqBK;
  static_assert(kBytes <= 232448, "more shared memory than a Hopper CTA may have");
};

template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_dq_kernel(const DqParams p) {
  using L = DqLayout;
  constexpr int BK = kDqBK;
  constexpr int kTPR = kThreads / BK;   // 8 loader threads per row
  constexpr int kCPT = kChunks / kTPR;  // 9 chunks each

  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* s_ds = reinterpret_cast<__nv_bfloat16*>(smem + L::kDs);
  float* s_lse = reinterpret_cast<float*>(smem + L::kLse);
  float* s_delta = reinterpret_cast<float*>(smem + L::kDelta);
  unsigned char* s_valid = smem + L::kValid;
  const uint32_t s_q = smem_addr(smem + L::kQ);
  const uint32_t s_do = smem_addr(smem + L::kDo);
  const uint32_t s_kv = smem_addr(smem + L::kKV);
  const uint32_t s_dsa = smem_addr(s_ds);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int row = blockIdx.x;
  const int h0 = blockIdx.y * kDqHeads;
  const int b = row / p.seq_len;
  const int nblocks = (p.topk + BK - 1) / BK;
  const int* idx_row = p.indices + static_cast<long long>(row) * p.topk;
  const long long head_base = static_cast<long long>(row) * p.heads + h0;

  // Q, dO (first cp.async group), lse and delta (plain loads, seen after the first barrier)
  const __nv_bfloat16* q_tile = p.q + head_base * kDk;
  for (int c = tid; c < kDqHeads * kChunks; c += kThreads) {
    const int r = c / kChunks;
    const int ch = c - r * kChunks;
    cp_async16(s_q + swizzle(r, ch), q_tile + r * kDk + ch * 8, true);
  }
  const __nv_bfloat16* do_tile = p.dout + head_base * kDv;
  for (int c = tid; c < kDqHeads * (kDv / 8); c += kThreads) {
    const int r = c >> 6;
    const int ch = c & 63;
    cp_async16(s_do + swizzle_v(r, ch), do_tile + r * kDv + ch * 8, true);
  }
  if (tid < kDqHeads) {
    s_lse[tid] = p.lse[head_base + tid] * kLog2e;
    s_delta[tid] = p.delta[head_base + tid];
  }

  const int ld_row = tid / kTPR;
  const int ld_sub = tid % kTPR;
  // this thread's index of a block (read one block ahead of its copy, so that the copy does not
  // wait for the index load)
  auto fetch_index = [&](int blk) {
    const int k = blk * BK + ld_row;
    return k < p.topk ? __ldg(idx_row + k) : -1;
  };
  auto load_block = [&](int t, int stage) {
    const bool valid = t >= 0 && t < p.num_keys;
    const __nv_bfloat16* src = valid ? p.kv + (static_cast<long long>(b) * p.num_keys + t) * kDk : p.kv;
    const uint32_t dst = s_kv + stage * L::kStageBytes;
#pragma unroll
    for (int i = 0; i < kCPT; ++i) {
      const int ch = ld_sub + i * kTPR;
      cp_async16(dst + swizzle(ld_row, ch), src + ch * 8, valid);
    }
    if (ld_sub == 0) s_valid[stage * BK + ld_row] = valid ? 1 : 0;
  };

  if (nblocks > 0) load_block(fetch_index(0), 0);
  cp_async_commit();
  int next_t = nblocks > 1 ? fetch_index(1) : -1;

  // S/dP roles
  const int s_mt = warp & 3;
  const int col0 = (warp >> 2) * 16;
  // dq roles
  const int dq_hh = warp & 1;
  const int dq_cg = warp >> 1;

  float acc[2][18][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 18; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

  for (int j = 0; j < nblocks; ++j) {
    cp_async_wait<0>();
    __syncthreads();  // block j (Q, dO) visible; everyone is done with block j - 1 and dS
    if (j + 1 < nblocks) {
      load_block(next_t, (j + 1) % kDqStages);
      if (j + 2 < nblocks) next_t = fetch_index(j + 2);
    }
    cp_async_commit();
    const int stage = j % kDqStages;
    const uint32_t s_k = s_kv + stage * L::kStageBytes;

    // ---- S = Q K^T and dP = dO V^T for 16 heads x 16 columns
    float s[2][4], dp[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
    {
      const int a_row = s_mt * 16 + (lane & 15);
      const int a_ch = lane >> 4;
      const int b_row = col0 + ((lane >> 4) << 3) + (lane & 7);
      const int b_ch = (lane >> 3) & 1;
#pragma unroll 4
      for (int kk = 0; kk < kDk / 16; ++kk) {
        uint32_t a[4], bf[4];
        ldmatrix_x4(s_q + swizzle(a_row, kk * 2 + a_ch), a);
        ldmatrix_x4(s_k + swizzle(b_row, kk * 2 + b_ch), bf);
        mma_bf16(s[0], a, bf[0], bf[1]);
        mma_bf16(s[1], a, bf[2], bf[3]);
      }
#pragma unroll 4
      for (int kk = 0; kk < kDv / 16; ++kk) {
        uint32_t a[4], bf[4];
        ldmatrix_x4(s_do + swizzle_v(a_row, kk * 2 + a_ch), a);
        ldmatrix_x4(s_k + swizzle(b_row, kk * 2 + b_ch), bf);
        mma_bf16(dp[0], a, bf[0], bf[1]);
        mma_bf16(dp[1], a, bf[2], bf[3]);
      }
    }

    // ---- P from lse, dS = P (dP - delta), bf16 to shared memory
    {
      const unsigned char* valid = s_valid + stage * BK;
      const int h_lo = s_mt * 16 + (lane >> 2);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = col0 + nt * 8 + (lane & 3) * 2;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int h = h_lo + 8 * i;
          const float l2 = s_lse[h];
          const float dl = s_delta[h];
          float ds[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const bool ok = valid[col + e] && l2 != -INFINITY;
            const float pv = ok ? fast_exp2(s[nt][2 * i + e] * p.scale_log2 - l2) : 0.f;
            ds[e] = ok ? pv * (dp[nt][2 * i + e] - dl) : 0.f;
          }
          store_pair(s_ds + h * L::kDsStride + col, ds[0], ds[1]);
        }
      }
    }
    __syncthreads();

    // ---- dq += dS K for 32 heads x 144 columns
    {
      const int v_row = ((lane >> 3) & 1) * 8 + (lane & 7);
      const int v_ch = dq_cg * 18 + (lane >> 4);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int r = dq_hh * 32 + mt * 16 + (lane & 15);
          ldmatrix_x4(s_dsa + (r * L::kDsStride + kk * 16 + (lane >> 4) * 8) * 2, a[mt]);
        }
#pragma unroll
        for (int np = 0; np < 9; ++np) {
          uint32_t bf[4];
          ldmatrix_x4_trans(s_k + swizzle(kk * 16 + v_row, v_ch + np * 2), bf);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma_bf16(acc[mt][2 * np], a[mt], bf[0], bf[1]);
            mma_bf16(acc[mt][2 * np + 1], a[mt], bf[2], bf[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  OutT* dq = static_cast<OutT*>(p.dq);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int h = dq_hh * 32 + mt * 16 + (lane >> 2) + 8 * i;
      OutT* drow = dq + (head_base + h) * kDk + dq_cg * 144 + (lane & 3) * 2;
#pragma unroll
      for (int nt = 0; nt < 18; ++nt)
        store_pair(drow + nt * 8, acc[mt][nt][2 * i] * p.sm_scale, acc[mt][nt][2 * i + 1] * p.sm_scale);
    }
}

// ---------------------------------------------------------------------------------------- dKV

constexpr int kKvRows = 32;    // latent rows per CTA (MMA M of the dkv products)
constexpr int kKvHeads = 32;   // heads per item (MMA N of S^T, k of the dkv products)
constexpr int kKvStages = 2;

struct DkvParams {
  const __nv_bfloat16* q;     // [rows, heads, 576]
  const __nv_bfloat16* kv;    // [B, T, 576]
  const __nv_bfloat16* dout;  // [rows, heads, 512]
  const float* lse;           // [rows, heads]
  const float* delta;         // [rows, heads]
  const int* pair_row;        // [P]: row within its block of each (block, query)-sorted pair
  const int* unit_query;      // [P]: query s (within its sequence) of each unit
  const int* unit_start;      // [P + 1]: first pair of each unit (then the end of the last)
  const int* block_units;     // [B * nblk + 1]: first unit of each block
  float* dkv;                 // [B, T, 576]
  int heads;
  int seq_len;
  int num_keys;
  int nblk;                   // ceil(T / 32)
  float sm_scale;
  float scale_log2;
};

struct DkvLayout {
  static constexpr int kStQ = 0;                                  // [32][576] bf16, swizzle
  static constexpr int kStDo = kStQ + kKvHeads * kRowBytes;       // [32][512] bf16, swizzle_v
  static constexpr int kStLse = kStDo + kKvHeads * kDv * 2;       // f32 [32]
  static constexpr int kStDelta = kStLse + kKvHeads * 4;          // f32 [32]
  static constexpr int kStCount = kStDelta + kKvHeads * 4;        // f32 [32] (per block row)
  static constexpr int kStageBytes = kStCount + kKvRows * 4;
  static constexpr int kTStride = kKvHeads + 8;                   // bf16 per P^T / dS^T row
  static constexpr int kK = 0;                                    // [32][576] bf16, swizzle
  static constexpr int kStages = kK + kKvRows * kRowBytes;
  static constexpr int kPt = kStages + kKvStages * kStageBytes;
  static constexpr int kDst = kPt + kKvRows * kTStride * 2;
  static constexpr int kRedStride = kKvHeads + 8;                 // f32 per partial row
  static constexpr int kRed = kDst + kKvRows * kTStride * 2;      // f32 [S, dP][4 quarters][32][40]
  static constexpr int kBytes = kRed + 2 * 4 * kKvRows * kRedStride * 4;
  static_assert(kStageBytes % 128 == 0, "stages 128-byte aligned");
  static_assert(kBytes <= 232448, "more shared memory than a Hopper CTA may have");
};

__global__ void __launch_bounds__(kThreads, 1) sparse_mla_dkv_kernel(const DkvParams p) {
  using L = DkvLayout;
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* s_pt = reinterpret_cast<__nv_bfloat16*>(smem + L::kPt);
  __nv_bfloat16* s_dst = reinterpret_cast<__nv_bfloat16*>(smem + L::kDst);
  float* s_red = reinterpret_cast<float*>(smem + L::kRed);
  const uint32_t s_k = smem_addr(smem + L::kK);
  const uint32_t s_st = smem_addr(smem + L::kStages);
  const uint32_t s_pta = smem_addr(s_pt);
  const uint32_t s_dsta = smem_addr(s_dst);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int blk = blockIdx.x;          // b * nblk + block
  const int b = blk / p.nblk;
  const int t0 = (blk - b * p.nblk) * kKvRows;
  const int head_tiles = p.heads / kKvHeads;
  const int u0 = __ldg(p.block_units + blk);
  const int n_items = (__ldg(p.block_units + blk + 1) - u0) * head_tiles;

  // the block's rows (zero past T), part of the first cp.async group
  for (int c = tid; c < kKvRows * kChunks; c += kThreads) {
    const int r = c / kChunks;
    const int ch = c - r * kChunks;
    const bool valid = t0 + r < p.num_keys;
    const __nv_bfloat16* src = valid ? p.kv + (static_cast<long long>(b) * p.num_keys + t0 + r) * kDk + ch * 8 : p.kv;
    cp_async16(s_k + swizzle(r, ch), src, valid);
  }

  // An item's metadata: its query, its unit's run of pairs and (warp 1) the run's first 32 rows,
  // read one item ahead of the copies that need them so that no copy waits for an index load.
  struct Meta {
    int query, start, end, rows;
  };
  auto fetch_meta = [&](int item) {
    Meta m;
    const int u = u0 + item / head_tiles;
    m.query = __ldg(p.unit_query + u);
    m.start = __ldg(p.unit_start + u);
    m.end = __ldg(p.unit_start + u + 1);
    m.rows = -1;
    if (warp == 1 && m.start + lane < m.end) m.rows = __ldg(p.pair_row + m.start + lane);
    return m;
  };

  auto load_item = [&](int item, const Meta& m, int stage) {
    const int h0 = (item - (item / head_tiles) * head_tiles) * kKvHeads;
    const long long head_base = (static_cast<long long>(b) * p.seq_len + m.query) * p.heads + h0;
    const uint32_t st = s_st + stage * L::kStageBytes;
    const __nv_bfloat16* q_tile = p.q + head_base * kDk;
#pragma unroll
    for (int i = 0; i < kKvHeads * kChunks / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / kChunks;
      const int ch = c - r * kChunks;
      cp_async16(st + L::kStQ + swizzle(r, ch), q_tile + r * kDk + ch * 8, true);
    }
    const __nv_bfloat16* do_tile = p.dout + head_base * kDv;
#pragma unroll
    for (int i = 0; i < kKvHeads * (kDv / 8) / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c >> 6;
      const int ch = c & 63;
      cp_async16(st + L::kStDo + swizzle_v(r, ch), do_tile + r * kDv + ch * 8, true);
    }
    if (tid < 8) {
      cp_async16(st + L::kStLse + tid * 16, p.lse + head_base + tid * 4, true);
    } else if (tid < 16) {
      cp_async16(st + L::kStDelta + (tid - 8) * 16, p.delta + head_base + (tid - 8) * 4, true);
    } else if (warp == 1) {
      // pairs per block row (lane = row) over the unit's run, 32 rows at a time through shuffles;
      // plain stores, seen after the next barrier
      int count = 0;
      int v = m.rows;
      for (int base = m.start; base < m.end; base += 32) {
        if (base != m.start) v = base + lane < m.end ? __ldg(p.pair_row + base + lane) : -1;
#pragma unroll
        for (int j = 0; j < 32; ++j) count += __shfl_sync(0xffffffffu, v, j) == lane;
      }
      reinterpret_cast<float*>(smem + L::kStages + stage * L::kStageBytes + L::kStCount)[lane] =
          static_cast<float>(count);
    }
  };
  static_assert(kKvRows == 32, "one lane of warp 1 per block row");

  if (n_items > 0) load_item(0, fetch_meta(0), 0);
  cp_async_commit();
  Meta next{};
  if (n_items > 1) next = fetch_meta(1);

  // S^T / dP^T roles
  const int s_mt = warp & 1;
  const int s_kq = warp >> 1;
  // dkv roles
  const int d_mt = warp & 1;
  const int d_cg = warp >> 1;

  float acc[18][4];
#pragma unroll
  for (int nt = 0; nt < 18; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;

  for (int it = 0; it < n_items; ++it) {
    cp_async_wait<0>();
    __syncthreads();  // item it visible; everyone is done with item it - 1, the partials, P^T / dS^T
    if (it + 1 < n_items) {
      load_item(it + 1, next, (it + 1) % kKvStages);
      if (it + 2 < n_items) next = fetch_meta(it + 2);
    }
    cp_async_commit();
    const int stage = it % kKvStages;
    const uint32_t st = s_st + stage * L::kStageBytes;
    const float* st_f = reinterpret_cast<const float*>(smem + L::kStages + stage * L::kStageBytes);
    const float* s_lse = st_f + L::kStLse / 4;
    const float* s_delta = st_f + L::kStDelta / 4;
    const float* s_count = st_f + L::kStCount / 4;

    // ---- S^T = K Q^T, dP^T = V dO^T: warp w computes 16 rows x 32 heads over a quarter of k
    // (S: 144 columns, dP: 128) and stores its f32 partials
    {
      float s[4][4], dp[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
      // a warp whose 16 rows the query did not select skips its products (its partials are 0)
      if (__any_sync(0xffffffffu, s_count[s_mt * 16 + (lane & 15)] > 0.f)) {
        const int a_row = s_mt * 16 + (lane & 15);
        const int a_ch = lane >> 4;
        const int b_row = ((lane >> 4) << 3) + (lane & 7);
        const int b_ch = (lane >> 3) & 1;
#pragma unroll 3
        for (int kk = 0; kk < kDk / 64; ++kk) {
          const int ks = s_kq * (kDk / 64) + kk;
          uint32_t a[4];
          ldmatrix_x4(s_k + swizzle(a_row, ks * 2 + a_ch), a);
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            uint32_t bf[4];
            ldmatrix_x4(st + L::kStQ + swizzle(b_row + np * 16, ks * 2 + b_ch), bf);
            mma_bf16(s[2 * np], a, bf[0], bf[1]);
            mma_bf16(s[2 * np + 1], a, bf[2], bf[3]);
          }
        }
#pragma unroll 4
        for (int kk = 0; kk < kDv / 64; ++kk) {
          const int ks = s_kq * (kDv / 64) + kk;
          uint32_t a[4];
          ldmatrix_x4(s_k + swizzle(a_row, ks * 2 + a_ch), a);
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            uint32_t bf[4];
            ldmatrix_x4(st + L::kStDo + swizzle_v(b_row + np * 16, ks * 2 + b_ch), bf);
            mma_bf16(dp[2 * np], a, bf[0], bf[1]);
            mma_bf16(dp[2 * np + 1], a, bf[2], bf[3]);
          }
        }
      }
      float* red_s = s_red + (s_kq * kKvRows) * L::kRedStride;
      float* red_dp = s_red + ((4 + s_kq) * kKvRows) * L::kRedStride;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int off = (s_mt * 16 + (lane >> 2) + 8 * i) * L::kRedStride + nt * 8 + (lane & 3) * 2;
          store_pair(red_s + off, s[nt][2 * i], s[nt][2 * i + 1]);
          store_pair(red_dp + off, dp[nt][2 * i], dp[nt][2 * i + 1]);
        }
    }
    __syncthreads();

    // ---- the quarters summed; P'^T = count p, dS'^T = count sm_scale p (dp - delta), bf16 to
    // shared memory (thread: row tid / 8, heads 4 (tid % 8) .. + 4)
    {
      const int r = tid >> 3;
      const int h4 = (tid & 7) * 4;
      float sv[4] = {0.f, 0.f, 0.f, 0.f}, dv[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kq = 0; kq < 4; ++kq) {
        const float4 a = *reinterpret_cast<const float4*>(s_red + (kq * kKvRows + r) * L::kRedStride + h4);
        const float4 c = *reinterpret_cast<const float4*>(s_red + ((4 + kq) * kKvRows + r) * L::kRedStride + h4);
        sv[0] += a.x; sv[1] += a.y; sv[2] += a.z; sv[3] += a.w;
        dv[0] += c.x; dv[1] += c.y; dv[2] += c.z; dv[3] += c.w;
      }
      const float count = s_count[r];
      float pv[4], dsv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float l2 = s_lse[h4 + e] * kLog2e;
        const bool ok = count > 0.f && l2 != -INFINITY;
        const float pe = ok ? fast_exp2(sv[e] * p.scale_log2 - l2) : 0.f;
        pv[e] = ok ? count * pe : 0.f;
        dsv[e] = ok ? count * p.sm_scale * pe * (dv[e] - s_delta[h4 + e]) : 0.f;
      }
      store_pair(s_pt + r * L::kTStride + h4, pv[0], pv[1]);
      store_pair(s_pt + r * L::kTStride + h4 + 2, pv[2], pv[3]);
      store_pair(s_dst + r * L::kTStride + h4, dsv[0], dsv[1]);
      store_pair(s_dst + r * L::kTStride + h4 + 2, dsv[2], dsv[3]);
    }
    __syncthreads();

    // ---- dkv += dS'^T Q (576 columns) + P'^T dO (512) for 16 rows x 144 columns (skipped, as
    // adding zeros, where the query selected none of the 16 rows)
    if (__any_sync(0xffffffffu, s_count[d_mt * 16 + (lane & 15)] > 0.f)) {
      const int v_row = ((lane >> 3) & 1) * 8 + (lane & 7);
      const int v_ch = d_cg * 18 + (lane >> 4);
#pragma unroll
      for (int kk = 0; kk < kKvHeads / 16; ++kk) {
        uint32_t a_ds[4], a_p[4];
        const int r = d_mt * 16 + (lane & 15);
        const uint32_t off = (r * L::kTStride + kk * 16 + (lane >> 4) * 8) * 2;
        ldmatrix_x4(s_dsta + off, a_ds);
        ldmatrix_x4(s_pta + off, a_p);
#pragma unroll
        for (int np = 0; np < 9; ++np) {
          uint32_t bf[4];
          ldmatrix_x4_trans(st + L::kStQ + swizzle(kk * 16 + v_row, v_ch + np * 2), bf);
          mma_bf16(acc[2 * np], a_ds, bf[0], bf[1]);
          mma_bf16(acc[2 * np + 1], a_ds, bf[2], bf[3]);
          if (d_cg * 18 + np * 2 < kDv / 8) {  // warp-uniform: the value columns
            ldmatrix_x4_trans(st + L::kStDo + swizzle_v(kk * 16 + v_row, v_ch + np * 2), bf);
            mma_bf16(acc[2 * np], a_p, bf[0], bf[1]);
            mma_bf16(acc[2 * np + 1], a_p, bf[2], bf[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = t0 + d_mt * 16 + (lane >> 2) + 8 * i;
    if (t < p.num_keys) {
      float* drow = p.dkv + (static_cast<long long>(b) * p.num_keys + t) * kDk + d_cg * 144 + (lane & 3) * 2;
#pragma unroll
      for (int nt = 0; nt < 18; ++nt) store_pair(drow + nt * 8, acc[nt][2 * i], acc[nt][2 * i + 1]);
    }
  }
}

// ------------------------------------------------------------------------------------ launch

template <typename OutT>
cudaError_t launch_dq(const DqParams& p, int rows, cudaStream_t stream) {
  auto kernel = sparse_mla_dq_kernel<OutT>;
  constexpr int smem = DqLayout::kBytes;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  dim3 grid(rows, p.heads / kDqHeads);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_dkv(const DkvParams& p, int blocks, cudaStream_t stream) {
  constexpr int smem = DkvLayout::kBytes;
  cudaError_t err = cudaFuncSetAttribute(sparse_mla_dkv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  sparse_mla_dkv_kernel<<<blocks, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// Checks of q [B, S, H, 576] bf16, kv [B, T, 576] bf16, dout [B, S, H, 512] bf16, lse / delta f32
// [B, S, H] shared by both handlers.
ffi::Error check_inputs(const char* name, ffi::AnyBuffer& q, ffi::AnyBuffer& kv, ffi::AnyBuffer& dout,
                        ffi::Buffer<ffi::F32>& lse, ffi::Buffer<ffi::F32>& delta) {
  auto qd = q.dimensions();
  if (q.element_type() != ffi::DataType::BF16 || qd.size() != 4 || qd[3] != kDk || qd[2] % 64 != 0)
    return ffi::Error::InvalidArgument(std::string(name) + ": q must be bf16 [B, S, H, 576] with H a multiple of 64, got " +
                                       dims_str(qd));
  auto kd = kv.dimensions();
  if (kv.element_type() != ffi::DataType::BF16 || kd.size() != 3 || kd[0] != qd[0] || kd[2] != kDk)
    return ffi::Error::InvalidArgument(std::string(name) + ": kv must be bf16 [B, T, 576], got " + dims_str(kd));
  auto dd = dout.dimensions();
  if (dout.element_type() != ffi::DataType::BF16 || dd.size() != 4 || dd[0] != qd[0] || dd[1] != qd[1] ||
      dd[2] != qd[2] || dd[3] != kDv)
    return ffi::Error::InvalidArgument(std::string(name) + ": dout must be bf16 [B, S, H, 512], got " + dims_str(dd));
  for (auto* buf : {&lse, &delta}) {
    auto ld = buf->dimensions();
    if (ld.size() != 3 || ld[0] != qd[0] || ld[1] != qd[1] || ld[2] != qd[2])
      return ffi::Error::InvalidArgument(std::string(name) + ": lse and delta must be f32 [B, S, H], got " +
                                         dims_str(ld));
  }
  return ffi::Error::Success();
}

ffi::Error SparseMlaDqImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                           ffi::AnyBuffer dout, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                           ffi::Result<ffi::AnyBuffer> dq, float sm_scale) {
  const char* name = "glm_sparse_mla_dq";
  if (auto e = check_inputs(name, q, kv, dout, lse, delta); e.failure()) return e;
  auto qd = q.dimensions();
  auto id = indices.dimensions();
  if (id.size() != 3 || id[0] != qd[0] || id[1] != qd[1] || id[2] < 1)
    return ffi::Error::InvalidArgument(std::string(name) + ": indices must be int32 [B, S, K >= 1] matching q, got " +
                                       dims_str(id));
  auto od = dq->dimensions();
  const bool bf16_out = dq->element_type() == ffi::DataType::BF16;
  if (!(bf16_out || dq->element_type() == ffi::DataType::F32) || od.size() != 4 || od[0] != qd[0] ||
      od[1] != qd[1] || od[2] != qd[2] || od[3] != kDk)
    return ffi::Error::InvalidArgument(std::string(name) + ": dq must be bf16 or f32 [B, S, H, 576], got " +
                                       dims_str(od));
  DqParams p{};
  p.q = static_cast<const __nv_bfloat16*>(q.untyped_data());
  p.kv = static_cast<const __nv_bfloat16*>(kv.untyped_data());
  p.indices = indices.typed_data();
  p.dout = static_cast<const __nv_bfloat16*>(dout.untyped_data());
  p.lse = lse.typed_data();
  p.delta = delta.typed_data();
  p.dq = dq->untyped_data();
  p.heads = static_cast<int>(qd[2]);
  p.seq_len = static_cast<int>(qd[1]);
  p.num_keys = static_cast<int>(kv.dimensions()[1]);
  p.topk = static_cast<int>(id[2]);
  p.sm_scale = sm_scale;
  p.scale_log2 = sm_scale * kLog2e;
  const int rows = static_cast<int>(qd[0] * qd[1]);
  if (rows == 0) return ffi::Error::Success();
  return finish(name, bf16_out ? launch_dq<__nv_bfloat16>(p, rows, stream) : launch_dq<float>(p, rows, stream));
}

ffi::Error SparseMlaDkvImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer dout,
                            ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> pair_row,
                            ffi::Buffer<ffi::S32> unit_query, ffi::Buffer<ffi::S32> unit_start,
                            ffi::Buffer<ffi::S32> block_units, ffi::Result<ffi::Buffer<ffi::F32>> dkv,
                            float sm_scale) {
  const char* name = "glm_sparse_mla_dkv";
  if (auto e = check_inputs(name, q, kv, dout, lse, delta); e.failure()) return e;
  auto qd = q.dimensions();
  auto kd = kv.dimensions();
  const int64_t nblk = (kd[1] + kKvRows - 1) / kKvRows;
  const int64_t pairs = pair_row.element_count();
  if (unit_query.element_count() != pairs || unit_start.element_count() != pairs + 1 ||
      block_units.element_count() != qd[0] * nblk + 1)
    return ffi::Error::InvalidArgument(std::string(name) + ": the key index must hold pair_row [P], unit_query [P], "
                                       "unit_start [P + 1] and block_units [B * ceil(T / 32) + 1]");
  auto dd = dkv->dimensions();
  if (dd.size() != 3 || dd[0] != kd[0] || dd[1] != kd[1] || dd[2] != kDk)
    return ffi::Error::InvalidArgument(std::string(name) + ": dkv must be f32 [B, T, 576], got " + dims_str(dd));
  DkvParams p{};
  p.q = static_cast<const __nv_bfloat16*>(q.untyped_data());
  p.kv = static_cast<const __nv_bfloat16*>(kv.untyped_data());
  p.dout = static_cast<const __nv_bfloat16*>(dout.untyped_data());
  p.lse = lse.typed_data();
  p.delta = delta.typed_data();
  p.pair_row = pair_row.typed_data();
  p.unit_query = unit_query.typed_data();
  p.unit_start = unit_start.typed_data();
  p.block_units = block_units.typed_data();
  p.dkv = dkv->typed_data();
  p.heads = static_cast<int>(qd[2]);
  p.seq_len = static_cast<int>(qd[1]);
  p.num_keys = static_cast<int>(kd[1]);
  p.nblk = static_cast<int>(nblk);
  p.sm_scale = sm_scale;
  p.scale_log2 = sm_scale * kLog2e;
  const int blocks = static_cast<int>(kd[0] * nblk);
  if (blocks == 0) return ffi::Error::Success();
  return finish(name, launch_dkv(p, blocks, stream));
}

}  // namespace bwd
}  // namespace glm_sparse_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmSparseMlaDq, glm_sparse_mla::bwd::SparseMlaDqImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmSparseMlaDkv, glm_sparse_mla::bwd::SparseMlaDkvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));
