// Op schemas (TORCH_LIBRARY) and CPU kernels (TORCH_LIBRARY_IMPL). Fake kernels and autograd
// are registered in Python (production/fakes.py, production/ops.py) with
// torch.library.register_fake / register_autograd.
//
// Sizes that depend on routing (rows sent, rows in the expert-major output) are SymInt
// arguments read from the plan on the host, never computed inside a kernel, so every fake
// kernel knows its output shapes without an unbacked size.
#include "epkit.h"

TORCH_LIBRARY(epkit, m) {
  m.def("layout(Tensor topk_idx, int num_experts, int num_ranks) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("prepare(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int num_ranks, "
        "int[] pre_error, int payload) -> Tensor");
  m.def("plan(Tensor words, int rank, int num_experts, int align, int capacity, int transport, "
        "int exchange, int max_tokens_per_rank) -> Tensor");
  // plan_host: the plan's words in host memory (epkit::count_exchange's second output), which
  // the device path's kernels size their launches from; the CPU kernels read the plan itself.
  m.def("pack(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor plan, int transport, int num_ranks, "
        "SymInt send_bytes, Tensor? plan_host=None) -> (Tensor, Tensor)");
  m.def("unpack(Tensor recv, Tensor plan, int transport, int hidden, ScalarType dtype, int topk, "
        "SymInt recv_rows, SymInt expert_rows, Tensor? plan_host=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("gather_rows(Tensor expert_y, Tensor recv_map, Tensor row_weight, int transport, bool weighted) -> Tensor");
  m.def("gather_units(Tensor expert_y, Tensor recv_map, Tensor row_weight, int transport, bool weighted, "
        "Tensor? first, Tensor(a!) out) -> ()");
  m.def("reduce_tokens(Tensor back, Tensor send_map, Tensor topk_idx, Tensor topk_weights, int num_experts, "
        "int num_ranks, int transport, bool weighted, ScalarType out_dtype, int ranks_per_node=1, "
        "Tensor? first=None) -> Tensor");
  m.def("scatter_rows(Tensor src, Tensor send_map, SymInt send_rows) -> Tensor");
  m.def("pack_into(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor plan, int transport, "
        "int num_ranks, Tensor(a!) send, Tensor? plan_host=None) -> Tensor");
  m.def("scatter_rows_into(Tensor src, Tensor send_map, Tensor(a!) out) -> ()");
  m.def("empty_large(Tensor like, SymInt[] size, ScalarType dtype) -> Tensor");
  // No tensor argument: one kernel for every device (the CPU's kept blocks; cpu/alloc.cpp).
  m.def("release_cache() -> int", &epkit::release_cache);
  m.def("cached_bytes() -> int", &epkit::cached_bytes);
  m.def("combine_backward_dest(Tensor recv, Tensor recv_map, Tensor row_weight, Tensor expert_y, "
        "bool weighted) -> (Tensor, Tensor)");
  m.def("gather_slot_values(Tensor values, Tensor recv_map, Tensor first, SymInt out_rows) -> Tensor");
  m.def("quantize_mxfp8(Tensor x) -> (Tensor, Tensor)");
  m.def("quantize_fp8_block128(Tensor x) -> (Tensor, Tensor)");
  m.def("scatter_slot_values(Tensor back, Tensor send_map, Tensor topk_idx, Tensor first, "
        "int num_experts, int num_ranks, int transport) -> Tensor");
}

TORCH_LIBRARY_IMPL(epkit, CPU, m) {
  m.impl("layout", &epkit::layout_cpu);
  m.impl("prepare", &epkit::prepare_cpu);
  m.impl("plan", &epkit::plan_cpu);
  m.impl("pack", &epkit::pack_cpu);
  m.impl("unpack", &epkit::unpack_cpu);
  m.impl("gather_rows", &epkit::gather_rows_cpu);
  m.impl("gather_units", &epkit::gather_units_cpu);
  m.impl("reduce_tokens", &epkit::reduce_tokens_cpu);
  m.impl("scatter_rows", &epkit::scatter_rows_cpu);
  m.impl("pack_into", &epkit::pack_into_cpu);
  m.impl("scatter_rows_into", &epkit::scatter_rows_into_cpu);
  m.impl("empty_large", &epkit::empty_large_cpu);
  m.impl("combine_backward_dest", &epkit::combine_backward_dest_cpu);
  m.impl("gather_slot_values", &epkit::gather_slot_values_cpu);
  m.impl("quantize_mxfp8", &epkit::quantize_mxfp8_cpu);
  m.impl("quantize_fp8_block128", &epkit::quantize_fp8_block128_cpu);
  m.impl("scatter_slot_values", &epkit::scatter_slot_values_cpu);
}
