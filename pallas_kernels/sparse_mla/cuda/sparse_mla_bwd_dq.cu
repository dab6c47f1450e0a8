// Sparse MLA backward for Hopper (sm_90a), dq (shared parts and the inputs: sparse_mla_bwd.cuh).
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

#include "sparse_mla_bwd.cuh"

namespace glm_sparse_mla {
namespace bwd {

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
