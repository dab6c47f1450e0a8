// The paged sparse MLA forward's FFI handler over FP8 latent rows (pallas_kernels/fp8.py,
// Fp8Latent: values e4m3 [slots, pages, P, 512], scales f32 [.., 4], rope bf16 [.., 64]). The
// kernel: sparse_mla_fwd.cuh with FP8 = true; the row layout: sparse_mla_fp8.cuh.

#include "sparse_mla_fwd.cuh"

namespace glm_sparse_mla {

// The store's three fields: the same leading dims [slots, pages, P], these element types and widths.
ffi::Error check_fp8_store(const char* name, ffi::AnyBuffer& values, ffi::Buffer<ffi::F32>& scales,
                           ffi::AnyBuffer& rope) {
  auto vd = values.dimensions();
  auto sd = scales.dimensions();
  auto rd = rope.dimensions();
  bool ok = values.element_type() == ffi::DataType::F8E4M3FN && rope.element_type() == ffi::DataType::BF16 &&
            vd.size() == 4 && sd.size() == 4 && rd.size() == 4 && vd[3] == kLatent && sd[3] == kScales &&
            rd[3] == kRope;
  for (int i = 0; ok && i < 3; ++i) ok = sd[i] == vd[i] && rd[i] == vd[i];
  if (!ok)
    return ffi::Error::InvalidArgument(std::string(name) + ": the FP8 store must be values e4m3 [slots, pages, P, 512], "
                                       "scales f32 [.., 4], rope bf16 [.., 64]; got " + dims_str(vd) + ", " +
                                       dims_str(sd) + ", " + dims_str(rd));
  return ffi::Error::Success();
}

ffi::Error PagedSparseMlaFp8FwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer values,
                                    ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer rope,
                                    ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> slot,
                                    ffi::Buffer<ffi::S32> indices, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale, int64_t block_k,
                                    int64_t stages, int64_t splits) {
  const char* name = "glm_paged_sparse_mla_fp8_fwd";
  if (block_k != 32)
    return ffi::Error::InvalidArgument(std::string(name) + ": (block_k, stages) must be (32, 3) or (32, 4)");
  Params p{};
  int rows = 0;
  if (auto e = check_common(name, q, indices, out, lse, block_k, stages, splits, p, rows); e.failure()) return e;
  if (auto e = check_fp8_store(name, values, scales, rope); e.failure()) return e;
  if (auto e = check_pages(name, values.dimensions(), q, page_table, slot, p); e.failure()) return e;
  p.values = static_cast<const uint8_t*>(values.untyped_data());
  p.scales = scales.typed_data();
  p.rope = static_cast<const __nv_bfloat16*>(rope.untyped_data());
  p.scale_log2 = sm_scale * 1.4426950408889634f;
  return run<true, true>(name, p, rows, out, block_k, stages, stream);
}

}  // namespace glm_sparse_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmPagedSparseMlaFp8Fwd, glm_sparse_mla::PagedSparseMlaFp8FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("splits"));
