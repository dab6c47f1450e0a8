// Sparse MLA backward for Hopper (sm_90a), dKV (shared parts and the inputs: sparse_mla_bwd.cuh).
//
// dKV kernel: one CTA per block of 32 latent rows (b, t0 .. t0 + 31), 8 warps, deterministic
// (no atomics; every row of dkv written by exactly one CTA, in a fixed order). A key index
// built once per index set in XLA (sparse_mla/cuda.py, `key_index`) lists, per block, the
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

#include "sparse_mla_bwd.cuh"

namespace glm_sparse_mla {
namespace bwd {

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

cudaError_t launch_dkv(const DkvParams& p, int blocks, cudaStream_t stream) {
  constexpr int smem = DkvLayout::kBytes;
  cudaError_t err = cudaFuncSetAttribute(sparse_mla_dkv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  sparse_mla_dkv_kernel<<<blocks, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
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
