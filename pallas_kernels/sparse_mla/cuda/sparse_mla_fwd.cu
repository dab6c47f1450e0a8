// The sparse MLA forward's FFI handlers over bf16 latent rows: contiguous [B, T, 576] and paged
// [slots, pages, P, 576]. The kernel and its design: sparse_mla_fwd.cuh.

#include "sparse_mla_fwd.cuh"

namespace glm_sparse_mla {

ffi::Error SparseMlaFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale,
                            int64_t block_k, int64_t stages, int64_t splits) {
  const char* name = "glm_sparse_mla_fwd";
  Params p{};
  int rows = 0;
  if (auto e = check_common(name, q, indices, out, lse, block_k, stages, splits, p, rows); e.failure()) return e;
  if (auto e = take_rows(name, q, kv, sm_scale, p); e.failure()) return e;
  return run<false, false>(name, p, rows, out, block_k, stages, stream);
}

ffi::Error PagedSparseMlaFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_pages,
                                 ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> slot,
                                 ffi::Buffer<ffi::S32> indices, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale, int64_t block_k,
                                 int64_t stages, int64_t splits) {
  const char* name = "glm_paged_sparse_mla_fwd";
  Params p{};
  int rows = 0;
  if (auto e = check_common(name, q, indices, out, lse, block_k, stages, splits, p, rows); e.failure()) return e;
  if (auto e = take_paged_rows(name, q, kv_pages, page_table, slot, sm_scale, p); e.failure()) return e;
  return run<true, false>(name, p, rows, out, block_k, stages, stream);
}

}  // namespace glm_sparse_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmSparseMlaFwd, glm_sparse_mla::SparseMlaFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("splits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GlmPagedSparseMlaFwd, glm_sparse_mla::PagedSparseMlaFwdImpl,
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
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("splits"));
