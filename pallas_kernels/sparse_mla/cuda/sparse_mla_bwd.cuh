// Sparse MLA backward for Hopper (sm_90a): two kernels, called from JAX through the XLA FFI,
// the dq kernel (sparse_mla_bwd_dq.cu) and the dKV kernel (sparse_mla_bwd_dkv.cu). What they share:
// the CTA size and the checks of the inputs both take.
//
// Inputs as the differentiation rule (sparse_mla/vjp.py) gives them: q bf16 [B, S, H, 576],
// kv bf16 [B, T, 576] (V = its first 512 columns), indices int32 [B, S, K], dout bf16
// [B, S, H, 512], lse and delta f32 [B, S, H] (delta = rowsum(out * dout) - dlse). For a pair
// (s, h, j) with t = idx[s, j] valid: p = exp(sm_scale q.k_t - lse), dp = dout . v_t,
// ds = p (dp - delta); dq += sm_scale ds k_t, dkv_t += sm_scale ds q (576), dkv_t[:512] += p dout.

#pragma once

#include "sparse_mla_common.cuh"

namespace glm_sparse_mla {
namespace bwd {

constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

// Checks of q [B, S, H, 576] bf16, kv [B, T, 576] bf16, dout [B, S, H, 512] bf16, lse / delta f32
// [B, S, H] shared by both handlers.
inline ffi::Error check_inputs(const char* name, ffi::AnyBuffer& q, ffi::AnyBuffer& kv, ffi::AnyBuffer& dout,
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

}  // namespace bwd
}  // namespace glm_sparse_mla
