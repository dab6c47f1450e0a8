// The FP8 latent row (pallas_kernels/fp8.py, Fp8Latent) in the paged forward: its 656 bytes
// gathered with cp.async into a staging ring, then dequantized into the bf16 swizzled row
// layout the MMA loop reads (sparse_mla_fwd.cuh).
//
// Staging row (656 bytes = 41 chunks of 16, rows packed, no swizzle):
//   bytes   0 .. 511  512 e4m3 latent values (chunks 0 .. 31)
//   bytes 512 .. 527  4 float32 scales, one per 128 values (chunk 32)
//   bytes 528 .. 655  64 bf16 rope values (chunks 33 .. 40)
// Dequantized: bf16 value c = bf16_rn(float(e4m3[c]) * scale[c / 128]) (e4m3 -> f16 exactly,
// f16 -> f32, one f32 product, then round to nearest even), rope copied as is.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "sparse_mla_common.cuh"

namespace glm_sparse_mla {

constexpr int kLatent = 512;                      // e4m3 values of a row
constexpr int kRope = kDk - kLatent;              // 64 bf16 rope values
constexpr int kGroup = 128;                       // values per scale
constexpr int kScales = kLatent / kGroup;         // 4
constexpr int kFp8ValueChunks = kLatent / 16;     // 32
constexpr int kFp8ScaleOffset = kLatent;          // 512
constexpr int kFp8RopeOffset = kLatent + 4 * kScales;  // 528
constexpr int kFp8Chunks = kFp8RopeOffset / 16 + kRope / 8;  // 41
constexpr int kFp8RowBytes = kFp8Chunks * 16;     // 656

// Issues the cp.async of this thread's chunks (sub, sub + tpr, ...) of one FP8 row into its
// staging row at dst; values / scales / rope point at the row's fields (any valid row when
// !valid: nothing is read, the chunks are zero-filled).
template <int TPR>
__device__ __forceinline__ void gather_fp8_row(uint32_t dst, const uint8_t* values, const float* scales,
                                               const __nv_bfloat16* rope, int sub, bool valid) {
#pragma unroll
  for (int ch = sub; ch < kFp8Chunks; ch += TPR) {
    const void* src = ch < kFp8ValueChunks ? static_cast<const void*>(values + ch * 16)
                      : ch == kFp8ValueChunks ? static_cast<const void*>(scales)
                                              : static_cast<const void*>(rope + (ch - kFp8ValueChunks - 1) * 8);
    cp_async16(dst + ch * 16, src, valid);
  }
}

__device__ __forceinline__ void store16(uint32_t dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(a), "r"(b), "r"(c), "r"(d));
}

// Two e4m3 (the low byte first) times scale -> two bf16 packed, the low byte's value low.
__device__ __forceinline__ uint32_t dequant_e4m3x2(uint32_t pair, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return pack_bf16(f.x * scale, f.y * scale);
}

// Dequantizes the staged rows [rows][656] at `staged` into the bf16 swizzled tile at `tile`
// (row r at swizzle(r, chunk)). Thread (r, sub) = (tid / 8, tid % 8) converts value chunks
// sub + 8 i (i = 0..3: 16 e4m3 of scale group i -> bf16 chunks 2 (sub + 8 i), + 1) and copies
// rope chunk sub; 8 threads a row, so rows = threads / 8.
__device__ __forceinline__ void dequantize_rows(const unsigned char* staged, uint32_t tile, int tid) {
  const int r = tid >> 3;
  const int sub = tid & 7;
  const unsigned char* src = staged + r * kFp8RowBytes;
  const float4 sc = *reinterpret_cast<const float4*>(src + kFp8ScaleOffset);
  const float scale[kScales] = {sc.x, sc.y, sc.z, sc.w};
#pragma unroll
  for (int i = 0; i < kScales; ++i) {
    const int vc = sub + 8 * i;
    const uint4 v = *reinterpret_cast<const uint4*>(src + vc * 16);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t o[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o[2 * k] = dequant_e4m3x2(w[k], scale[i]);
      o[2 * k + 1] = dequant_e4m3x2(w[k] >> 16, scale[i]);
    }
    store16(tile + swizzle(r, 2 * vc), o[0], o[1], o[2], o[3]);
    store16(tile + swizzle(r, 2 * vc + 1), o[4], o[5], o[6], o[7]);
  }
  const uint4 rope = *reinterpret_cast<const uint4*>(src + kFp8RopeOffset + sub * 16);
  store16(tile + swizzle(r, kLatent / 8 + sub), rope.x, rope.y, rope.z, rope.w);
}

}  // namespace glm_sparse_mla
