// Sparse MLA forward for Hopper (sm_90a), called from JAX through the XLA FFI.
//
// One CTA handles one query row (b, s), one group of 64 heads (the M dimension of the MMAs)
// and one split of its K selected latent rows. The 64 x 576 query tile stays in shared
// memory; the selected rows are gathered block by block (BK rows) with cp.async straight into
// a ring of STAGES swizzled shared-memory buffers, each thread copying 16-byte chunks of one
// row. Eight warps compute on each block:
//
//   S phase   warp w: heads 16 * (w % 4) .. + 16, block columns (w / 4) * BK/2 .. + BK/2;
//             S = Q K^T with mma.sync m16n8k16 (bf16 in, f32 accumulate), operands loaded with
//             ldmatrix. Invalid slots (index -1, out of range, past K) are masked to -inf.
//   softmax   the two column halves of a head exchange their row maxima through shared memory;
//             both compute the same running max, write P = exp2(S - m) in bf16 to shared
//             memory and keep their half of the running sum in registers.
//   PV phase  warp w: heads 32 * (w % 2) .. + 32, value columns 128 * (w / 2) .. + 128;
//             O (64 x 512 f32 over the CTA, 128 registers a thread) is rescaled by the block's
//             alpha and accumulates P V, V read from the same buffer with ldmatrix.trans.
//
// Everything is base-2 inside (logits pre-multiplied by sm_scale * log2 e); lse is returned in
// the natural base. A query (or split) without a valid slot writes out 0 and lse -inf.
// With splits > 1 each split writes its normalised partial (f32) and its lse, merged by the
// caller (log-sum-exp weights). The paged form translates each logical row through the page
// table: kv_pages[slot, page_table[b, t / P], t % P].
//
// FP8 pages (FP8 = true, paged only; the row layout in sparse_mla_fp8.cuh): the ring holds the
// rows' 656 gathered bytes (e4m3 values, scales, rope) instead, and one bf16 tile of BK rows
// takes the dequantized block: after the barrier that opens block j (its bytes landed, every
// warp done with block j - 1) and the cp.async of block j + STAGES - 1, all threads dequantize
// block j into the tile, one more barrier, then the same S, softmax and PV phases.
//
// Deterministic: fixed loop order, no atomics.

#pragma once

#include "sparse_mla_common.cuh"
#include "sparse_mla_fp8.cuh"

namespace glm_sparse_mla {

constexpr int kHeads = 64;             // heads per CTA
constexpr int kThreads = 256;          // 8 warps

struct Params {
  const __nv_bfloat16* q;    // [rows, heads, 576]
  const __nv_bfloat16* kv;   // [B, T, 576] or [slots, pages, P, 576] (bf16 rows)
  const uint8_t* values;     // [slots, pages, P, 512] e4m3 (FP8 rows)
  const float* scales;       // [slots, pages, P, 4] (FP8 rows)
  const __nv_bfloat16* rope; // [slots, pages, P, 64] (FP8 rows)
  const int* indices;        // [rows, topk]
  const int* page_table;     // [B, pages_per_seq] (paged)
  const int* slot;           // [1] (paged)
  void* out;                 // [rows, splits, heads, 512], bf16 or f32
  float* lse;                // [rows, splits, heads]
  int heads;
  int seq_len;               // S: row / S is the batch index
  int num_keys;              // T (contiguous) or pages_per_seq * P (paged)
  int topk;
  int splits;
  int blocks_per_split;
  int page_size;
  int pages_per_seq;
  int pages_in_slot;
  float scale_log2;          // sm_scale * log2(e)
};

// bf16 rows: the ring of STAGES bf16 tiles at kKV. FP8 rows: one bf16 tile at kKV, the ring of
// STAGES staging buffers ([BK][656] bytes) at kStaged.
template <int BK, int STAGES, bool FP8>
struct Layout {
  static constexpr int kStageBytes = BK * kRowBytes;
  static constexpr int kStagedBytes = BK * kFp8RowBytes;
  static constexpr int kPStride = BK + 8;  // bf16 per P row: 16-byte aligned, rows 16 bytes apart in banks
  static constexpr int kQ = 0;
  static constexpr int kKV = kQ + kHeads * kRowBytes;
  static constexpr int kStaged = kKV + (FP8 ? 1 : STAGES) * kStageBytes;
  static constexpr int kP = kStaged + (FP8 ? STAGES * kStagedBytes : 0);
  static constexpr int kMax = kP + kHeads * kPStride * 2;        // f32 [2][64]
  static constexpr int kAlpha = kMax + 2 * kHeads * 4;           // f32 [64]
  static constexpr int kSum = kAlpha + kHeads * 4;               // f32 [2][64]
  static constexpr int kM = kSum + 2 * kHeads * 4;               // f32 [64]
  static constexpr int kValid = kM + kHeads * 4;                 // u8 [STAGES][BK]
  static constexpr int kBytes = kValid + STAGES * BK;
  static_assert(kBytes <= 232448, "more shared memory than a Hopper CTA may have");
};

template <int BK, int STAGES, bool PAGED, bool FP8, typename OutT>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_fwd_kernel(const Params p) {
  using L = Layout<BK, STAGES, FP8>;
  static_assert(!FP8 || (PAGED && BK * 8 == kThreads), "FP8 rows: paged, 8 threads a row");
  constexpr int kTPR = kThreads / BK;   // loader threads per row
  constexpr int kCPT = kChunks / kTPR;  // 16-byte chunks per loader thread
  constexpr int kNT = BK / 16;          // 8-wide n tiles of an S-phase warp (BK / 2 columns)
  static_assert(kChunks % kTPR == 0 && kNT % 2 == 0, "unsupported block");

  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* s_p = reinterpret_cast<__nv_bfloat16*>(smem + L::kP);
  float* s_max = reinterpret_cast<float*>(smem + L::kMax);
  float* s_alpha = reinterpret_cast<float*>(smem + L::kAlpha);
  float* s_sum = reinterpret_cast<float*>(smem + L::kSum);
  float* s_m = reinterpret_cast<float*>(smem + L::kM);
  unsigned char* s_valid = smem + L::kValid;
  const uint32_t s_q = smem_addr(smem + L::kQ);
  const uint32_t s_kv = smem_addr(smem + L::kKV);
  const uint32_t s_staged = smem_addr(smem + L::kStaged);
  const uint32_t s_pa = smem_addr(s_p);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int row = blockIdx.x;
  const int split = blockIdx.y;
  const int h0 = blockIdx.z * kHeads;
  const int b = row / p.seq_len;
  const int total_blocks = (p.topk + BK - 1) / BK;
  const int first = split * p.blocks_per_split;
  const int nblocks = max(0, min(total_blocks, first + p.blocks_per_split) - first);
  const int* idx_row = p.indices + static_cast<long long>(row) * p.topk;

  // the query tile (part of the first cp.async group)
  const __nv_bfloat16* q_tile = p.q + (static_cast<long long>(row) * p.heads + h0) * kDk;
  for (int c = tid; c < kHeads * kChunks; c += kThreads) {
    const int r = c / kChunks;
    const int ch = c - r * kChunks;
    cp_async16(s_q + swizzle(r, ch), q_tile + r * kDk + ch * 8, true);
  }

  const int ld_row = tid / kTPR;
  const int ld_sub = tid % kTPR;
  const int slot = PAGED ? __ldg(p.slot) : 0;
  // This thread's row of block blk: its slot index (-1 past K or past the split's blocks), then
  // (paged) the page holding it. The main loop fetches both ahead (software pipelined: the index
  // of block n + 2 and the page of block n + 1 while block n is issued), so the two dependent
  // global loads wait behind a block's compute instead of in front of its cp.async.
  auto slot_index = [&](int blk) -> int {
    const int k = (first + blk) * BK + ld_row;
    return blk < nblocks && k < p.topk ? __ldg(idx_row + k) : -1;
  };
  auto page_of = [&](int t) -> int {
    if constexpr (PAGED) {
      if (t >= 0 && t < p.num_keys)
        return __ldg(p.page_table + static_cast<long long>(b) * p.pages_per_seq + t / p.page_size);
    }
    return 0;
  };
  auto load_block = [&](int stage, int t, int page) {
    const bool valid = t >= 0 && t < p.num_keys;
    long long at = 0;  // the row's index in the store (rows of 576 bf16 or FP8 rows)
    if (valid) {
      if constexpr (PAGED) {
        at = (static_cast<long long>(slot) * p.pages_in_slot + page) * p.page_size + t % p.page_size;
      } else {
        at = static_cast<long long>(b) * p.num_keys + t;
      }
    }
    if constexpr (FP8) {
      gather_fp8_row<kTPR>(s_staged + stage * L::kStagedBytes + ld_row * kFp8RowBytes, p.values + at * kLatent,
                           p.scales + at * kScales, p.rope + at * kRope, ld_sub, valid);
    } else {
      const __nv_bfloat16* src = p.kv + at * kDk;
      const uint32_t dst = s_kv + stage * L::kStageBytes;
#pragma unroll
      for (int i = 0; i < kCPT; ++i) {
        const int ch = ld_sub + i * kTPR;
        cp_async16(dst + swizzle(ld_row, ch), src + ch * 8, valid);
      }
    }
    if (ld_sub == 0) s_valid[stage * BK + ld_row] = valid ? 1 : 0;
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nblocks) {
      const int t = slot_index(s);
      load_block(s, t, page_of(t));
    }
    cp_async_commit();
  }
  int t_next = slot_index(STAGES - 1);  // the row of the block the loop issues next, its page,
  int page_next = page_of(t_next);      // and the row of the block after it
  int t_after = slot_index(STAGES);

  // S-phase roles
  const int s_mt = warp & 3;
  const int s_cg = warp >> 2;
  const int col0 = s_cg * (BK / 2);
  // PV-phase roles
  const int pv_hh = warp & 1;
  const int pv_dq = warp >> 1;

  float m_run[2] = {-INFINITY, -INFINITY};  // rows lane/4 and lane/4 + 8 of the S-phase head tile
  float l_run[2] = {0.f, 0.f};              // this thread's share of the running sum
  float o[2][16][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 16; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.f;

  for (int j = 0; j < nblocks; ++j) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // block j (and Q) visible to all; everyone is done with block j - 1 and P
    {
      const int next = j + STAGES - 1;
      if (next < nblocks) load_block(next % STAGES, t_next, page_next);
      cp_async_commit();
      page_next = page_of(t_after);  // block next + 1
      t_next = t_after;
      t_after = slot_index(next + 2);
    }
    const int stage = j % STAGES;
    uint32_t s_k = s_kv + stage * L::kStageBytes;
    if constexpr (FP8) {
      dequantize_rows(smem + L::kStaged + stage * L::kStagedBytes, s_kv, tid);
      __syncthreads();  // the bf16 tile of block j complete
      s_k = s_kv;
    }

    // ---- S = Q K^T for 16 heads x BK/2 columns
    float s[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
    {
      const int a_row = s_mt * 16 + (lane & 15);
      const int a_ch = lane >> 4;
      const int b_row = col0 + ((lane >> 4) << 3) + (lane & 7);
      const int b_ch = (lane >> 3) & 1;
#pragma unroll(BK == 64 ? 2 : 4)
      for (int kk = 0; kk < kDk / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(s_q + swizzle(a_row, kk * 2 + a_ch), a);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t bf[4];
          ldmatrix_x4(s_k + swizzle(b_row + np * 16, kk * 2 + b_ch), bf);
          mma_bf16(s[2 * np], a, bf[0], bf[1]);
          mma_bf16(s[2 * np + 1], a, bf[2], bf[3]);
        }
      }
    }

    // ---- mask, row maxima over both column halves
    const unsigned char* valid = s_valid + stage * BK;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = col0 + nt * 8 + (lane & 3) * 2 + (e & 1);
        const float v = valid[col] ? s[nt][e] * p.scale_log2 : -INFINITY;
        s[nt][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
    const int h_lo = s_mt * 16 + (lane >> 2);  // and h_lo + 8
    if ((lane & 3) == 0) {
      s_max[s_cg * kHeads + h_lo] = mx[0];
      s_max[s_cg * kHeads + h_lo + 8] = mx[1];
    }
    __syncthreads();

    // ---- online softmax: P to shared memory, alpha for the PV warps
    float m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int h = h_lo + 8 * i;
      const float m_new = fmaxf(m_run[i], fmaxf(s_max[h], s_max[kHeads + h]));
      m_use[i] = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = fast_exp2(m_run[i] - m_use[i]);  // exp2(-inf) = 0
      m_run[i] = m_new;
      l_run[i] *= alpha;
      if (s_cg == 0 && (lane & 3) == 0) s_alpha[h] = alpha;
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const float p0 = fast_exp2(s[nt][0] - m_use[0]);
      const float p1 = fast_exp2(s[nt][1] - m_use[0]);
      const float p2 = fast_exp2(s[nt][2] - m_use[1]);
      const float p3 = fast_exp2(s[nt][3] - m_use[1]);
      l_run[0] += p0 + p1;
      l_run[1] += p2 + p3;
      const int col = col0 + nt * 8 + (lane & 3) * 2;
      store_pair(s_p + h_lo * L::kPStride + col, p0, p1);
      store_pair(s_p + (h_lo + 8) * L::kPStride + col, p2, p3);
    }
    __syncthreads();

    // ---- O = alpha O + P V for 32 heads x 128 value columns
    {
      float al[2][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int i = 0; i < 2; ++i) al[mt][i] = s_alpha[pv_hh * 32 + mt * 16 + (lane >> 2) + 8 * i];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
          o[mt][nt][0] *= al[mt][0];
          o[mt][nt][1] *= al[mt][0];
          o[mt][nt][2] *= al[mt][1];
          o[mt][nt][3] *= al[mt][1];
        }
      const int v_row = ((lane >> 3) & 1) * 8 + (lane & 7);
      const int v_ch = pv_dq * 16 + (lane >> 4);
#pragma unroll(BK == 64 ? 1 : 2)
      for (int kk = 0; kk < BK / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int r = pv_hh * 32 + mt * 16 + (lane & 15);
          ldmatrix_x4(s_pa + (r * L::kPStride + kk * 16 + (lane >> 4) * 8) * 2, a[mt]);
        }
#pragma unroll
        for (int np = 0; np < 8; ++np) {
          uint32_t bf[4];
          ldmatrix_x4_trans(s_k + swizzle(kk * 16 + v_row, v_ch + np * 2), bf);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma_bf16(o[mt][2 * np], a[mt], bf[0], bf[1]);
            mma_bf16(o[mt][2 * np + 1], a[mt], bf[2], bf[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- the row sums of both column halves, then out = O / l and lse
  const int h_lo = s_mt * 16 + (lane >> 2);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  if ((lane & 3) == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s_sum[s_cg * kHeads + h_lo + 8 * i] = l_run[i];
      if (s_cg == 0) s_m[h_lo + 8 * i] = m_run[i];
    }
  }
  __syncthreads();

  OutT* out = static_cast<OutT*>(p.out);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int h = pv_hh * 32 + mt * 16 + (lane >> 2) + 8 * i;
      const float l = s_sum[h] + s_sum[kHeads + h];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const long long base = (static_cast<long long>(row) * p.splits + split) * p.heads + h0 + h;
      OutT* orow = out + base * kDv + pv_dq * 128 + (lane & 3) * 2;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) store_pair(orow + nt * 8, o[mt][nt][2 * i] * inv, o[mt][nt][2 * i + 1] * inv);
      if (pv_dq == 0 && (lane & 3) == 0)
        p.lse[base] = l > 0.f ? (s_m[h] + log2f(l)) * 0.69314718055994531f : -INFINITY;
    }
}

template <int BK, int STAGES, bool PAGED, bool FP8, typename OutT>
cudaError_t launch(const Params& p, int rows, cudaStream_t stream) {
  auto kernel = sparse_mla_fwd_kernel<BK, STAGES, PAGED, FP8, OutT>;
  constexpr int smem = Layout<BK, STAGES, FP8>::kBytes;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  dim3 grid(rows, p.splits, p.heads / kHeads);
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

// (64, 2) is not compiled for FP8 rows: its bf16 tile and staging ring exceed shared memory.
template <bool PAGED, bool FP8, typename OutT>
cudaError_t dispatch(const Params& p, int rows, int block_k, int stages, cudaStream_t stream) {
  if constexpr (!FP8) {
    if (block_k == 64 && stages == 2) return launch<64, 2, PAGED, false, OutT>(p, rows, stream);
  }
  if (block_k == 32 && stages == 3) return launch<32, 3, PAGED, FP8, OutT>(p, rows, stream);
  if (block_k == 32 && stages == 4) return launch<32, 4, PAGED, FP8, OutT>(p, rows, stream);
  return cudaErrorInvalidValue;
}

// Launches the kernel for the checked p (nothing for no rows), out bf16 or f32 -> the FFI error.
template <bool PAGED, bool FP8>
ffi::Error run(const char* name, const Params& p, int rows, ffi::Result<ffi::AnyBuffer>& out, int64_t block_k,
               int64_t stages, cudaStream_t stream) {
  if (rows == 0) return ffi::Error::Success();
  const int bk = static_cast<int>(block_k), st = static_cast<int>(stages);
  return finish(name, out->element_type() == ffi::DataType::BF16
                          ? dispatch<PAGED, FP8, __nv_bfloat16>(p, rows, bk, st, stream)
                          : dispatch<PAGED, FP8, float>(p, rows, bk, st, stream));
}

// Checks shared by both forms; fills p.q, p.indices, p.out, p.lse and the sizes.
inline ffi::Error check_common(const char* name, ffi::AnyBuffer& q, ffi::Buffer<ffi::S32>& indices,
                        ffi::Result<ffi::AnyBuffer>& out, ffi::Result<ffi::Buffer<ffi::F32>>& lse, int64_t block_k,
                        int64_t stages, int64_t splits, Params& p, int& rows) {
  auto qd = q.dimensions();
  if (q.element_type() != ffi::DataType::BF16 || qd.size() != 4 || qd[3] != kDk || qd[2] % kHeads != 0)
    return ffi::Error::InvalidArgument(std::string(name) + ": q must be bf16 [B, S, H, 576] with H a multiple of 64, got " +
                                       dims_str(qd));
  auto id = indices.dimensions();
  if (id.size() != 3 || id[0] != qd[0] || id[1] != qd[1])
    return ffi::Error::InvalidArgument(std::string(name) + ": indices must be int32 [B, S, K] matching q, got " +
                                       dims_str(id));
  if (!((block_k == 64 && stages == 2) || (block_k == 32 && (stages == 3 || stages == 4))))
    return ffi::Error::InvalidArgument(std::string(name) + ": (block_k, stages) must be (64, 2), (32, 3) or (32, 4)");
  rows = static_cast<int>(qd[0] * qd[1]);
  const int topk = static_cast<int>(id[2]);
  const int total_blocks = (topk + static_cast<int>(block_k) - 1) / static_cast<int>(block_k);
  if (splits < 1 || topk < 1)
    return ffi::Error::InvalidArgument(std::string(name) + ": splits and K must be >= 1");
  auto od = out->dimensions();
  const bool bf16_out = out->element_type() == ffi::DataType::BF16;
  if (!(bf16_out || out->element_type() == ffi::DataType::F32) || od.size() != 4 || od[0] != rows ||
      od[1] != splits || od[2] != qd[2] || od[3] != kDv)
    return ffi::Error::InvalidArgument(std::string(name) + ": out must be bf16 or f32 [B*S, splits, H, 512], got " +
                                       dims_str(od));
  auto ld = lse->dimensions();
  if (ld.size() != 3 || ld[0] != rows || ld[1] != splits || ld[2] != qd[2])
    return ffi::Error::InvalidArgument(std::string(name) + ": lse must be f32 [B*S, splits, H], got " + dims_str(ld));
  p.q = static_cast<const __nv_bfloat16*>(q.untyped_data());
  p.indices = indices.typed_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.heads = static_cast<int>(qd[2]);
  p.seq_len = static_cast<int>(qd[1]);
  p.topk = topk;
  p.splits = static_cast<int>(splits);
  p.blocks_per_split = (total_blocks + p.splits - 1) / p.splits;
  return ffi::Error::Success();
}

// Checks of the paged forms' page table and slot against a store of leading dims
// [slots, pages, P, ..]; fills p.page_table, p.slot and the page sizes.
inline ffi::Error check_pages(const char* name, ffi::Span<const int64_t> kd, ffi::AnyBuffer& q,
                              ffi::Buffer<ffi::S32>& page_table, ffi::Buffer<ffi::S32>& slot, Params& p) {
  auto pd = page_table.dimensions();
  if (pd.size() != 2 || pd[0] != q.dimensions()[0])
    return ffi::Error::InvalidArgument(std::string(name) + ": page_table must be int32 [B, n], got " + dims_str(pd));
  if (slot.element_count() != 1)
    return ffi::Error::InvalidArgument(std::string(name) + ": slot must be one int32");
  p.page_table = page_table.typed_data();
  p.slot = slot.typed_data();
  p.page_size = static_cast<int>(kd[2]);
  p.pages_in_slot = static_cast<int>(kd[1]);
  p.pages_per_seq = static_cast<int>(pd[1]);
  p.num_keys = static_cast<int>(pd[1] * kd[2]);
  return ffi::Error::Success();
}

// The contiguous bf16 rows kv [B, T, 576] of q's batch: fills p.kv, p.num_keys and p.scale_log2.
inline ffi::Error take_rows(const char* name, ffi::AnyBuffer& q, ffi::AnyBuffer& kv, float sm_scale, Params& p) {
  auto kd = kv.dimensions();
  auto qd = q.dimensions();
  if (kv.element_type() != ffi::DataType::BF16 || kd.size() != 3 || kd[0] != qd[0] || kd[2] != kDk)
    return ffi::Error::InvalidArgument(std::string(name) + ": kv must be bf16 [B, T, 576], got " + dims_str(kd));
  p.kv = static_cast<const __nv_bfloat16*>(kv.untyped_data());
  p.num_keys = static_cast<int>(kd[1]);
  p.scale_log2 = sm_scale * 1.4426950408889634f;
  return ffi::Error::Success();
}

// The paged bf16 rows kv_pages [slots, pages, P, 576] with their page table and slot: fills
// p.kv, the page fields (`check_pages`) and p.scale_log2.
inline ffi::Error take_paged_rows(const char* name, ffi::AnyBuffer& q, ffi::AnyBuffer& kv_pages,
                                  ffi::Buffer<ffi::S32>& page_table, ffi::Buffer<ffi::S32>& slot, float sm_scale,
                                  Params& p) {
  auto kd = kv_pages.dimensions();
  if (kv_pages.element_type() != ffi::DataType::BF16 || kd.size() != 4 || kd[3] != kDk)
    return ffi::Error::InvalidArgument(std::string(name) + ": kv_pages must be bf16 [slots, pages, P, 576], got " +
                                       dims_str(kd));
  if (auto e = check_pages(name, kd, q, page_table, slot, p); e.failure()) return e;
  p.kv = static_cast<const __nv_bfloat16*>(kv_pages.untyped_data());
  p.scale_log2 = sm_scale * 1.4426950408889634f;
  return ffi::Error::Success();
}

}  // namespace glm_sparse_mla
