// CUDA kernels of the epkit ops (schemas: ../registration.cpp). Compiled only in a CUDA build.
#include "common.cuh"

TORCH_LIBRARY_IMPL(epkit, CUDA, m) {
  m.impl("layout", &epkit::cuda::layout_cuda);
  m.impl("prepare", &epkit::cuda::prepare_cuda);
  m.impl("plan", &epkit::cuda::plan_cuda);
  m.impl("pack", &epkit::cuda::pack_cuda);
  m.impl("unpack", &epkit::cuda::unpack_cuda);
  m.impl("gather_rows", &epkit::cuda::gather_rows_cuda);
  m.impl("gather_units", &epkit::cuda::gather_units_cuda);
  m.impl("reduce_tokens", &epkit::cuda::reduce_tokens_cuda);
  m.impl("scatter_rows", &epkit::cuda::scatter_rows_cuda);
  m.impl("pack_into", &epkit::cuda::pack_into_cuda);
  m.impl("scatter_rows_into", &epkit::cuda::scatter_rows_into_cuda);
  m.impl("empty_large", &epkit::cuda::empty_large_cuda);
  m.impl("combine_backward_dest", &epkit::cuda::combine_backward_dest_cuda);
  m.impl("gather_slot_values", &epkit::cuda::gather_slot_values_cuda);
  m.impl("quantize_mxfp8", &epkit::cuda::quantize_mxfp8_cuda);
  m.impl("quantize_fp8_block128", &epkit::cuda::quantize_fp8_block128_cuda);
  m.impl("scatter_slot_values", &epkit::cuda::scatter_slot_values_cuda);
  m.impl("unpack_status_word", &epkit::cuda::unpack_status_word);
}

// CUDA-only: the device's sticky unpack status word (unpack.cu), an int32 [1] alias that
// epkit.device.unpack_status / check_static read (a host wait) and clear. Not in the CPU
// schema file: it has no CPU kernel and no meaning there.
TORCH_LIBRARY_FRAGMENT(epkit, m) {
  m.def("unpack_status_word(Tensor like) -> Tensor");
}
