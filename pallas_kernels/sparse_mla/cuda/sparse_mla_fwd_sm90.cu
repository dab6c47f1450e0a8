// Sparse MLA forward for Hopper with warpgroup MMAs (wgmma): the same contract and FFI
// signature as sparse_mla_fwd.cu (bf16 rows, contiguous [B, T, 576] or paged
// [slots, pages, P, 576]; out [B*S, splits, H, 512] bf16 or f32 and lse [B*S, splits, H]),
// a different design.
//
// One CTA of three warpgroups (384 threads) handles one query row (b, s), one group of 64
// heads (the M dimension of every MMA) and one split of its selected rows, in blocks of 64 rows
// through two shared-memory buffers (layout below; everything 128-byte swizzled, sm90.cuh):
//
//   producer  (warpgroup 2, 72 registers a thread): copies the query tile once, then gathers
//             each block's 64 selected rows with 16-byte cp.async (8 threads a 128-byte line,
//             zero-filled where a slot is invalid) into the free buffer; the buffer's `full`
//             barrier completes when the copies land.
//   consumer0 (warpgroup 0, 240 registers): S = Q K^T [64 heads x 64 rows] as 36 wgmma
//             m64n64k16 with both operands in shared memory (Q read by the tensor cores, not
//             by every warp), the mask, the online softmax (base 2), P to bf16: in registers
//             as the A operand of its own P V (value columns 0..255, wgmma m64n256k16, V the
//             same buffer read MN-major), and to shared memory (over the buffer's rope
//             columns, which only S reads) with the block's rescale factors for consumer1.
//   consumer1 (warpgroup 1, 160 registers; the launch gives every thread 168, `setmaxnreg`
//             moves them): waits for P, rescales its accumulator and adds
//             P V for value columns 256..511 (wgmma with both operands in shared memory).
// Each consumer holds a 64 x 256 f32 accumulator (128 registers a thread). A buffer is free
// again when both consumers' P V on it completed (`empty` barrier, 256 arrivals).
//
// Shared memory (bytes, every tile 1024-aligned): Q 9 tiles (73,728) | buffer 0 9 tiles | buffer 1
// 9 tiles | alpha f32 [2][64] | l, m f32 [64] each | barriers. 9 tiles = the 576 columns in
// 64-column tiles; the value columns are tiles 0..7, the rope columns tile 8 (P lands there).
//
// Masked slots (index -1, out of range, past K or past the split) get the logit -inf; a query
// (or split) without a valid slot writes out 0 and lse -inf; splits > 1 write normalised
// partials merged by the caller, as sparse_mla_fwd.cu does. Deterministic: fixed order, no atomics.
//
// The indexer target (`sparse_mla_target_sm90_kernel`, contiguous rows): given the forward's
// lse, target[j] = sum over the CTA's 64 heads of exp(sm_scale q_h . kv[indices[j]] - lse_h)
// (the caller sums head groups and divides by H; 0 at masked slots). The same producer and
// the same S = Q K^T; no P V, so both consumer warpgroups compute S, each on its own buffer
// (blocks alternate), and sum their block's columns over the heads in registers, warp
// shuffles and a [4][64] shared-memory exchange.

#include "sm90.cuh"
#include "sparse_mla_fwd.cuh"

namespace glm_sparse_mla {
namespace sm90 {

constexpr int kBK = 64;                    // selected rows a block
constexpr int kTiles = kDk / 64;           // 9 column tiles of a 576-wide row
constexpr int kRopeTile = kTiles - 1;      // columns 512..575
constexpr int kRowsBytes = kTiles * kTileBytes;   // 73,728: 64 rows x 576 bf16
constexpr int kFwdThreads = 384;

// The shared memory both kernels start with, from a 1024-aligned base: Q (9 tiles), two buffers
// of 64 rows (9 tiles each); their own parts follow, then the barriers q_full, full[2], empty[2]
// at kBars (the forward adds p_full[2]).
struct Ring {
  static constexpr int kKV = kRowsBytes;
  static constexpr int kEnd = kKV + 2 * kRowsBytes;
  uint32_t base, bars;

  __device__ uint32_t q() const { return base; }
  __device__ uint32_t kv(int buf, int d = 0) const { return base + kKV + buf * kRowsBytes + d * kTileBytes; }
  __device__ uint32_t bar_q() const { return bars; }
  __device__ uint32_t full(int buf) const { return bars + 8 + 8 * buf; }
  __device__ uint32_t empty(int buf) const { return bars + 24 + 8 * buf; }

  // The ring of a kernel's dynamic shared memory (Layout: its kBars); *smem: the aligned base.
  template <typename Layout>
  __device__ static Ring of(unsigned char* raw, unsigned char** smem) {
    const uint32_t at = smem_addr(raw);
    const uint32_t base = (at + 1023u) & ~1023u;
    *smem = raw + (base - at);
    return Ring{base, base + Layout::kBars};
  }

  // One thread: the barriers, `empty_arrivals` a phase of empty (the threads that free a buffer).
  __device__ void init(int empty_arrivals) const {
    mbar_init(bar_q(), 128);
    for (int i = 0; i < 2; ++i) {
      mbar_init(full(i), 128);
      mbar_init(empty(i), empty_arrivals);
    }
  }
};

struct FwdLayout {
  static constexpr int kAlpha = Ring::kEnd;                 // f32 [2][64]
  static constexpr int kL = kAlpha + 2 * 64 * 4;            // f32 [64]
  static constexpr int kM = kL + 64 * 4;                    // f32 [64]
  static constexpr int kBars = kM + 64 * 4;                 // u64: q_full, full[2], empty[2], p_full[2]
  static constexpr int kBytes = kBars + 7 * 8;
  static constexpr int kAlloc = kBytes + 1024;              // the base is aligned to 1024 in the kernel
  static_assert(kAlloc <= 232448, "more shared memory than a Hopper CTA may have");
};

// Row pointer of logical key t of query batch b (nullptr where t is not a key).
template <bool PAGED>
__device__ __forceinline__ const __nv_bfloat16* key_row(const Params& p, int b, int slot, int t) {
  if (t < 0 || t >= p.num_keys) return nullptr;
  if constexpr (PAGED) {
    const int page = __ldg(p.page_table + static_cast<long long>(b) * p.pages_per_seq + t / p.page_size);
    const long long r = (static_cast<long long>(slot) * p.pages_in_slot + page) * p.page_size + t % p.page_size;
    return p.kv + r * kDk;
  } else {
    return p.kv + (static_cast<long long>(b) * p.num_keys + t) * kDk;
  }
}

// The producer warpgroup's work, shared by both kernels: the query tile (64 heads at q_tile) into
// the ring's Q, then each block's 64 rows (key_of(blk, r): the logical key of row r, -1 masked)
// into its buffer blk & 1, waiting for the buffer's `empty` barrier before
// reusing it. Thread t copies chunk t % 8 of rows t / 8 + 16 i.
template <bool PAGED, typename KeyOf>
__device__ __forceinline__ void produce(const Params& p, const Ring& ring, const __nv_bfloat16* q_tile, int b,
                                        int nblocks, KeyOf key_of, int t) {
  const int g = t / 8, c = t % 8;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int d = 0; d < kTiles; ++d)
      cp_async16(ring.q() + d * kTileBytes + sw128(g + 16 * i, c), q_tile + (g + 16 * i) * kDk + d * 64 + c * 8, true);
  mbar_arrive_cp_async(ring.bar_q());
  const int slot = PAGED ? __ldg(p.slot) : 0;
  for (int blk = 0; blk < nblocks; ++blk) {
    const int buf = blk & 1;
    if (blk >= 2) mbar_wait(ring.empty(buf), ((blk >> 1) - 1) & 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = g + 16 * i;
      const __nv_bfloat16* src = key_row<PAGED>(p, b, slot, key_of(blk, r));
      const bool valid = src != nullptr;
      const __nv_bfloat16* from = valid ? src + c * 8 : p.kv;
#pragma unroll
      for (int d = 0; d < kTiles; ++d)
        cp_async16(ring.kv(buf, d) + sw128(r, c), from + (valid ? d * 64 : 0), valid);
    }
    mbar_arrive_cp_async(ring.full(buf));
  }
}

// Bit 2 j + e: whether slot 8 j + 2 (lane % 4) + e of block blk (this thread's 16 accumulator
// columns) holds a key.
template <typename KeyOf>
__device__ __forceinline__ uint32_t valid_columns(KeyOf key_of, int blk, int lane) {
  uint32_t valid = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) valid |= static_cast<uint32_t>(key_of(blk, 8 * j + 2 * (lane % 4) + e) >= 0) << (2 * j + e);
  return valid;
}

// s = Q K^T of one block: 64 heads (Q at q_smem) x 64 rows (the buffer at kv_smem), 9 column
// tiles of 4 k16 steps each, both operands read from shared memory; returns when it is done.
__device__ __forceinline__ void block_scores(float (&s)[32], uint32_t q_smem, uint32_t kv_smem) {
  fence_regs(s);
  wgmma_fence();
#pragma unroll
  for (int d = 0; d < kTiles; ++d)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n64k16_ss(s, make_desc(q_smem + d * kTileBytes + 32 * kk, 16), make_desc(kv_smem + d * kTileBytes + 32 * kk, 16),
                         d + kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s);
}

template <bool PAGED, typename OutT>
__global__ void __launch_bounds__(kFwdThreads, 1) sparse_mla_fwd_sm90_kernel(const Params p) {
  using L = FwdLayout;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem;
  const Ring ring = Ring::of<L>(smem_raw, &smem);
  float* s_alpha = reinterpret_cast<float*>(smem + L::kAlpha);
  float* s_l = reinterpret_cast<float*>(smem + L::kL);
  float* s_m = reinterpret_cast<float*>(smem + L::kM);
  auto bar_p = [&](int buf) { return ring.bars + 40 + 8 * buf; };

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int t = tid % 128;
  const int row = blockIdx.x;
  const int split = blockIdx.y;
  const int h0 = blockIdx.z * 64;
  const int b = row / p.seq_len;
  const int total_blocks = (p.topk + kBK - 1) / kBK;
  const int first = split * p.blocks_per_split;
  const int nblocks = max(0, min(total_blocks, first + p.blocks_per_split) - first);
  const int* idx_row = p.indices + static_cast<long long>(row) * p.topk;
  // slot k's key (-1: masked: past K, past the split's blocks or not a key)
  auto key_of = [&](int blk, int r) -> int {
    const int k = (first + blk) * kBK + r;
    if (blk >= nblocks || k >= p.topk) return -1;
    const int key = __ldg(idx_row + k);
    return key >= 0 && key < p.num_keys ? key : -1;
  };

  if (tid == 0) {
    ring.init(256);
    for (int i = 0; i < 2; ++i) mbar_init(bar_p(i), 128);
  }
  __syncthreads();

  if (wg == 2) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<72>();
    produce<PAGED>(p, ring, p.q + (static_cast<long long>(row) * p.heads + h0) * kDk, b, nblocks, key_of, t);
    return;
  }

  const int w = t / 32;
  const int lane = t % 32;
  const int r0 = 16 * w + lane / 4;     // this thread's accumulator rows r0 and r0 + 8
  float o[128];                          // O[:, 256 wg .. 256 wg + 255] (accumulator layout)
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};

  if (wg == 0) {
    // ------------------------------------------------------------------ consumer 0
    setmaxnreg_inc<240>();
    mbar_wait(ring.bar_q(), 0);
    for (int blk = 0; blk < nblocks; ++blk) {
      const int buf = blk & 1;
      const uint32_t valid = valid_columns(key_of, blk, lane);
      mbar_wait(ring.full(buf), (blk >> 1) & 1);
      float s[32];
      block_scores(s, ring.q(), ring.kv(buf));

      // mask, running max and rescale factor of rows r0 (i = 0) and r0 + 8 (i = 1)
      float alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[4 * j + 2 * i + e];
            x = (valid >> (2 * j + e)) & 1u ? x * p.scale_log2 : -INFINITY;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[i], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        alpha[i] = fast_exp2(m_run[i] - m_use);
        m_run[i] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[4 * j + 2 * i + e];
            x = fast_exp2(x - m_use);
            sum += x;
          }
        l_run[i] = l_run[i] * alpha[i] + sum;
      }

      // P in bf16: the A operand (k16 slice kk = n8 blocks 2 kk, 2 kk + 1) and, for consumer 1,
      // the swizzled [64 heads x 64 slots] tile over this buffer's rope columns
      uint32_t a[4][4];
      const uint32_t p_tile = ring.kv(buf, kRopeTile);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * kk + h;
          a[kk][2 * h] = pack_bf16(s[4 * j], s[4 * j + 1]);
          a[kk][2 * h + 1] = pack_bf16(s[4 * j + 2], s[4 * j + 3]);
          const int col = 8 * j + 2 * (lane % 4);
          const uint32_t off = (col % 8) * 2;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_tile + sw128(r0, j) + off), "r"(a[kk][2 * h]));
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_tile + sw128(r0 + 8, j) + off), "r"(a[kk][2 * h + 1]));
        }
      if (lane % 4 == 0) {
        s_alpha[buf * 64 + r0] = alpha[0];
        s_alpha[buf * 64 + r0 + 8] = alpha[1];
      }
      fence_async_smem();
      mbar_arrive(bar_p(buf));

#pragma unroll
      for (int j = 0; j < 32; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) o[4 * j + v] *= alpha[v / 2];
      fence_regs(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n256k16_rs_tb(o, a[kk], make_desc(ring.kv(buf) + 2048 * kk, kTileBytes), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      mbar_arrive(ring.empty(buf));
    }
    // the row sums over the 4 lanes of a row; consumer 1 reads them (and the max for lse)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
      l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
    }
    if (lane % 4 == 0) {
      s_l[r0] = l_run[0];
      s_l[r0 + 8] = l_run[1];
      s_m[r0] = m_run[0];
      s_m[r0 + 8] = m_run[1];
    }
  } else {
    // ------------------------------------------------------------------ consumer 1
    setmaxnreg_dec<160>();   // from the 168 of the launch (ptxas allocates the launch bound's 168)
    for (int blk = 0; blk < nblocks; ++blk) {
      const int buf = blk & 1;
      mbar_wait(bar_p(buf), (blk >> 1) & 1);
      const float alpha0 = s_alpha[buf * 64 + r0];
      const float alpha1 = s_alpha[buf * 64 + r0 + 8];
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j] *= alpha0;
        o[4 * j + 1] *= alpha0;
        o[4 * j + 2] *= alpha1;
        o[4 * j + 3] *= alpha1;
      }
      fence_regs(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n256k16_ss_tb(o, make_desc(ring.kv(buf, kRopeTile) + 32 * kk, 16),
                               make_desc(ring.kv(buf, 4) + 2048 * kk, kTileBytes), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      mbar_arrive(ring.empty(buf));
    }
  }

  named_barrier(1, 256);   // consumer 0's row sums and maxima are in shared memory
  OutT* out = static_cast<OutT*>(p.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int h = r0 + 8 * i;
    const float l = s_l[h];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const long long at = (static_cast<long long>(row) * p.splits + split) * p.heads + h0 + h;
    OutT* orow = out + at * kDv + 256 * wg + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < 32; ++j) store_pair(orow + 8 * j, o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv);
    if (wg == 0 && lane % 4 == 0) p.lse[at] = l > 0.f ? (s_m[h] + log2f(l)) * 0.69314718055994531f : -INFINITY;
  }
}

struct TargetLayout {
  static constexpr int kSums = Ring::kEnd;                  // f32 [2 consumers][4 warps][64]
  static constexpr int kBars = kSums + 2 * 4 * 64 * 4;      // u64: q_full, full[2], empty[2]
  static constexpr int kBytes = kBars + 5 * 8;
  static constexpr int kAlloc = kBytes + 1024;
  static_assert(kAlloc <= 232448, "more shared memory than a Hopper CTA may have");
};

struct TargetParams {
  Params p;                 // q, kv, indices, sizes, scale_log2 (contiguous rows; out unused)
  const float* lse;         // [rows, heads], natural log
  float* target;            // [rows, heads / 64, topk]
};

__global__ void __launch_bounds__(kFwdThreads, 1) sparse_mla_target_sm90_kernel(const TargetParams tp) {
  using L = TargetLayout;
  const Params& p = tp.p;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem;
  const Ring ring = Ring::of<L>(smem_raw, &smem);
  float* s_sums = reinterpret_cast<float*>(smem + L::kSums);

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int t = tid % 128;
  const int row = blockIdx.x;
  const int group = blockIdx.z;
  const int h0 = group * 64;
  const int b = row / p.seq_len;
  const int nblocks = (p.topk + kBK - 1) / kBK;
  const int* idx_row = p.indices + static_cast<long long>(row) * p.topk;
  auto key_of = [&](int blk, int r) -> int {
    const int k = blk * kBK + r;
    if (k >= p.topk) return -1;
    const int key = __ldg(idx_row + k);
    return key >= 0 && key < p.num_keys ? key : -1;
  };

  if (tid == 0) ring.init(128);
  __syncthreads();

  if (wg == 2) {
    produce<false>(p, ring, p.q + (static_cast<long long>(row) * p.heads + h0) * kDk, b, nblocks, key_of, t);
    return;
  }

  // consumer wg (0 or 1) takes the blocks of buffer wg (the launch's registers suffice: no setmaxnreg)
  const int w = t / 32, lane = t % 32;
  const int r0 = 16 * w + lane / 4;
  float lse2[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float l = __ldg(tp.lse + static_cast<long long>(row) * p.heads + h0 + r0 + 8 * i);
    lse2[i] = isfinite(l) ? l * 1.4426950408889634f : INFINITY;   // no valid slot: every term 0
  }
  float* sums = s_sums + wg * 4 * 64;
  float* out = tp.target + (static_cast<long long>(row) * (p.heads / 64) + group) * p.topk;
  mbar_wait(ring.bar_q(), 0);
  for (int blk = wg; blk < nblocks; blk += 2) {
    const int buf = wg;
    const uint32_t valid = valid_columns(key_of, blk, lane);
    mbar_wait(ring.full(buf), (blk >> 1) & 1);
    float s[32];
    block_scores(s, ring.q(), ring.kv(buf));
    mbar_arrive(ring.empty(buf));          // S is in registers: the buffer may refill
    // this thread's column sums over its two rows, then over the warp's 16 rows
    float col[16];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = 0.f;
        if ((valid >> (2 * j + e)) & 1u)
#pragma unroll
          for (int i = 0; i < 2; ++i) x += fast_exp2(s[4 * j + 2 * i + e] * p.scale_log2 - lse2[i]);
        x += __shfl_xor_sync(0xffffffffu, x, 4);
        x += __shfl_xor_sync(0xffffffffu, x, 8);
        x += __shfl_xor_sync(0xffffffffu, x, 16);
        col[2 * j + e] = x;
      }
    named_barrier(2 + wg, 128);           // the previous block's sums were read
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) sums[w * 64 + 8 * j + 2 * lane + e] = col[2 * j + e];
    }
    named_barrier(2 + wg, 128);
    if (t < 64 && blk * kBK + t < p.topk)
      out[blk * kBK + t] = sums[t] + sums[64 + t] + sums[128 + t] + sums[192 + t];
  }
}

template <bool PAGED, typename OutT>
cudaError_t launch_fwd(const Params& p, int rows, cudaStream_t stream) {
  auto kernel = sparse_mla_fwd_sm90_kernel<PAGED, OutT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, FwdLayout::kAlloc);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(rows, p.splits, p.heads / 64), kFwdThreads, FwdLayout::kAlloc, stream>>>(p);
  return cudaGetLastError();
}

template <bool PAGED>
ffi::Error run_fwd(const char* name, const Params& p, int rows, ffi::Result<ffi::AnyBuffer>& out,
                   cudaStream_t stream) {
  if (rows == 0) return ffi::Error::Success();
  return finish(name, out->element_type() == ffi::DataType::BF16 ? launch_fwd<PAGED, __nv_bfloat16>(p, rows, stream)
                                                                  : launch_fwd<PAGED, float>(p, rows, stream));
}

ffi::Error SparseMlaFwdSm90Impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv,
                                ffi::Buffer<ffi::S32> indices, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale, int64_t splits) {
  const char* name = "glm_sparse_mla_fwd_sm90";
  Params p{};
  int rows = 0;
  if (auto e = check_common(name, q, indices, out, lse, kBK, 2, splits, p, rows); e.failure()) return e;
  if (auto e = take_rows(name, q, kv, sm_scale, p); e.failure()) return e;
  return run_fwd<false>(name, p, rows, out, stream);
}

ffi::Error PagedSparseMlaFwdSm90Impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_pages,
                                     ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> slot,
                                     ffi::Buffer<ffi::S32> indices, ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale, int64_t splits) {
  const char* name = "glm_paged_sparse_mla_fwd_sm90";
  Params p{};
  int rows = 0;
  if (auto e = check_common(name, q, indices, out, lse, kBK, 2, splits, p, rows); e.failure()) return e;
  if (auto e = take_paged_rows(name, q, kv_pages, page_table, slot, sm_scale, p); e.failure()) return e;
  return run_fwd<true>(name, p, rows, out, stream);
}

ffi::Error SparseMlaTargetSm90Impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv,
                                   ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> lse,
                                   ffi::Result<ffi::Buffer<ffi::F32>> target, float sm_scale) {
  const char* name = "glm_sparse_mla_target_sm90";
  TargetParams tp{};
  Params& p = tp.p;
  auto qd = q.dimensions();
  auto id = indices.dimensions();
  if (q.element_type() != ffi::DataType::BF16 || qd.size() != 4 || qd[3] != kDk || qd[2] % 64 != 0)
    return ffi::Error::InvalidArgument(std::string(name) + ": q must be bf16 [B, S, H, 576] with H a multiple of 64, got " +
                                       dims_str(qd));
  if (id.size() != 3 || id[0] != qd[0] || id[1] != qd[1] || id[2] < 1)
    return ffi::Error::InvalidArgument(std::string(name) + ": indices must be int32 [B, S, K] matching q, got " +
                                       dims_str(id));
  auto ld = lse.dimensions();
  const int64_t rows = qd[0] * qd[1];
  if (ld.size() != 2 || ld[0] != rows || ld[1] != qd[2])
    return ffi::Error::InvalidArgument(std::string(name) + ": lse must be f32 [B*S, H], got " + dims_str(ld));
  auto td = target->dimensions();
  if (td.size() != 3 || td[0] != rows || td[1] != qd[2] / 64 || td[2] != id[2])
    return ffi::Error::InvalidArgument(std::string(name) + ": target must be f32 [B*S, H/64, K], got " + dims_str(td));
  if (auto e = take_rows(name, q, kv, sm_scale, p); e.failure()) return e;
  p.q = static_cast<const __nv_bfloat16*>(q.untyped_data());
  p.indices = indices.typed_data();
  p.heads = static_cast<int>(qd[2]);
  p.seq_len = static_cast<int>(qd[1]);
  p.topk = static_cast<int>(id[2]);
  tp.lse = lse.typed_data();
  tp.target = target->typed_data();
  if (rows == 0) return ffi::Error::Success();
  auto kernel = sparse_mla_target_sm90_kernel;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, TargetLayout::kAlloc);
  if (err == cudaSuccess) {
    kernel<<<dim3(static_cast<unsigned>(rows), 1, p.heads / 64), kFwdThreads, TargetLayout::kAlloc, stream>>>(tp);
    err = cudaGetLastError();
  }
  return finish(name, err);
}

}  // namespace sm90
}  // namespace glm_sparse_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmSparseMlaTargetSm90, glm_sparse_mla::sm90::SparseMlaTargetSm90Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmSparseMlaFwdSm90, glm_sparse_mla::sm90::SparseMlaFwdSm90Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("splits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmPagedSparseMlaFwdSm90, glm_sparse_mla::sm90::PagedSparseMlaFwdSm90Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("splits"));
