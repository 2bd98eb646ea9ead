// Argument checks of the public ops (torch.ops.epkit.*): every malformed call raises a clear
// error ("epkit.<op>: <argument> ...") instead of crashing or reading out of bounds.
//
// Two kinds:
// - Shape, dtype, device, option and plan-header checks (the first sections): they read no
//   tensor data, except the plan header through a host pointer.
// - Map-range reports (the last section): they read index data through a host pointer, so they
//   are for the CPU kernels only (on a GPU they would be a host sync: the Triton kernels mask
//   out-of-range entries instead, epkit/triton). The kernels fuse the range
//   test into the loops that already read the maps and call these only to report a failure.
#pragma once

#include "transports.h"

#include <c10/util/ArrayRef.h>

#include <limits>

namespace epkit {

// Sizes beyond these are absurd for the layout (and would overflow the plan's arithmetic).
constexpr int64_t kMaxRanks = int64_t(1) << 20;
constexpr int64_t kMaxExperts = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxAlign = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();  // tokens travel as int32
// What a transport's rows can encode (k, j) is its path's (pairs.h, dedup.h).

// ---- tensors ------------------------------------------------------------------------------
inline void check_dim(const char* op, const char* name, const Tensor& t, int64_t dim) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got ", t.dim(),
              "-D of shape ", t.sizes());
}

inline void check_dtype(const char* op, const char* name, const Tensor& t, at::ScalarType dt) {
  TORCH_CHECK(t.scalar_type() == dt, op, ": ", name, " must be ", dtype_name(dt), ", got ",
              dtype_name(t.scalar_type()));
}

// float32 or bfloat16: the payload dtypes of the arithmetic kernels.
inline void check_float_dtype(const char* op, const char* name, at::ScalarType dt) {
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op, ": ", name,
              " must be float32 or bfloat16, got ", dtype_name(dt));
}

// Expert ids: any integer dtype (converted to int64 by the kernels), never bool.
inline void check_index_dtype(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(at::isIntegralType(t.scalar_type(), /*includeBool=*/false), op, ": ", name,
              " must have an integer dtype, got ", dtype_name(t.scalar_type()));
}

// A map (send_map / recv_map): int64 of `dim` dimensions.
inline void check_map(const char* op, const char* name, const Tensor& t, int64_t dim = 2) {
  check_dim(op, name, t, dim);
  check_dtype(op, name, t, at::kLong);
}

inline void check_device(const char* op, const char* name, const Tensor& t, at::Device dev) {
  TORCH_CHECK(t.device() == dev, op, ": ", name, " is on ", t.device(), ", expected ", dev);
}

inline void check_size(const char* op, const char* name, const Tensor& t, int64_t d,
                       int64_t want, const char* what) {
  TORCH_CHECK(t.size(d) == want, op, ": ", name, " must have size(", d, ") == ", want, " (",
              what, "), got shape ", t.sizes());
}

inline void check_same_shape(const char* op, const char* name, const Tensor& t,
                             const char* ref_name, const Tensor& ref) {
  TORCH_CHECK(t.sizes() == ref.sizes(), op, ": ", name, " must have the shape of ", ref_name, " ",
              ref.sizes(), ", got ", t.sizes());
}

inline void check_nonneg(const char* op, const char* name, int64_t v) {
  TORCH_CHECK(v >= 0, op, ": ", name, " must be >= 0, got ", v);
}

// ---- options --------------------------------------------------------------------------------
inline void check_num_ranks(const char* op, int64_t R) {
  TORCH_CHECK(R >= 1 && R <= kMaxRanks, op, ": num_ranks must be in [1, ", kMaxRanks, "], got ",
              R);
}

// num_experts E >= 1, a multiple of num_ranks R (so L = E / R >= 1 divides nothing by zero).
inline void check_experts_ranks(const char* op, int64_t E, int64_t R) {
  check_num_ranks(op, R);
  TORCH_CHECK(E >= 1 && E <= kMaxExperts, op, ": num_experts must be in [1, ", kMaxExperts,
              "], got ", E);
  TORCH_CHECK(E % R == 0, op, ": num_experts ", E, " is not a multiple of num_ranks ", R);
}

// ---- the plan -------------------------------------------------------------------------------
// The plan tensor itself: 1-D int64, contiguous, at least its header.
inline void check_plan_tensor(const char* op, const Tensor& plan, at::Device dev) {
  check_dim(op, "plan", plan, 1);
  check_dtype(op, "plan", plan, at::kLong);
  check_device(op, "plan", plan, dev);
  TORCH_CHECK(plan.is_contiguous(), op, ": plan must be contiguous");
  TORCH_CHECK(plan.numel() >= kPlanHeader, op, ": plan has ", plan.numel(),
              " words, fewer than its ", static_cast<int64_t>(kPlanHeader), "-word header");
}

// plan_host (optional): the plan's words in host memory, which the device path's kernels size
// their launches from (the CPU kernels read the plan itself): 1-D int64 on the CPU, as many
// words as the plan.
inline void check_plan_host(const char* op, const std::optional<Tensor>& plan_host,
                            const Tensor& plan) {
  if (!plan_host.has_value()) return;
  const Tensor& h = *plan_host;
  check_dim(op, "plan_host", h, 1);
  check_dtype(op, "plan_host", h, at::kLong);
  check_device(op, "plan_host", h, at::Device(at::kCPU));
  TORCH_CHECK(h.numel() == plan.numel(), op, ": plan_host has ", h.numel(), " words, the plan ",
              plan.numel());
}

// The header of a plan made by epkit.plan (p: n words of host memory): R >= 1, E % R == 0,
// L == E / R, transport in {0, 1}, align >= 1, no error code, and n == PlanOffsets(R, E).size.
inline PlanOffsets check_plan_header(const char* op, const int64_t* p, int64_t n) {
  TORCH_CHECK(n >= kPlanHeader, op, ": plan has ", n, " words, fewer than its header");
  const int64_t R = p[kRanks], E = p[kExperts], L = p[kLocalExperts];
  TORCH_CHECK(R >= 1 && R <= kMaxRanks, op, ": plan header: ranks ", R, " outside [1, ",
              kMaxRanks, "]");
  TORCH_CHECK(E >= 1 && E <= kMaxExperts && E % R == 0, op, ": plan header: experts ", E,
              " is not a positive multiple of ranks ", R);
  TORCH_CHECK(L == E / R, op, ": plan header: local experts ", L, " != experts / ranks ", E / R);
  TORCH_CHECK(transport_known(p[kTransport]), op, ": plan header: transport ", p[kTransport],
              " is not ", Pairs::kCode, " or ", Dedup::kCode);
  TORCH_CHECK(p[kAlign] >= 1, op, ": plan header: align ", p[kAlign], " < 1");
  TORCH_CHECK(p[kErrCode] == 0, op, ": the plan carries error code ", p[kErrCode],
              " (raise it instead of using the plan)");
  const PlanOffsets o(R, E);
  TORCH_CHECK(n == o.size, op, ": plan has ", n, " words, PlanOffsets(R=", R, ", E=", E,
              ") needs ", o.size);
  return o;
}

// The chunks of one direction of the dispatch exchange (send: pack's buffer, recv: unpack's):
// their byte sizes add up to `total`, and chunk d holds its token section (`counts[d]` data rows
// of B bytes, after a header row under the static exchange) and, where the path has one
// (dedup), its slot section (`slots[d]` rows of 8 bytes, after a header row under the static
// exchange). The plan's transport is known (check_plan_header).
inline void check_plan_chunks(const char* op, const int64_t* p, const PlanOffsets& o, bool recv,
                              int64_t B, int64_t total) {
  const int64_t R = p[kRanks];
  const int64_t sec = with_transport(op, p[kTransport], [](auto path) {
    return int64_t(decltype(path)::kSlotSection);  // 1: the chunk has a slot section
  });
  const bool stat = p[kStaticCap] >= 0;
  const int64_t tokcap = p[kTokCap], slotcap = p[kSlotCap], hdr = stat ? 1 : 0;
  const int64_t* counts = p + (recv ? o.recv_counts : o.send_counts);
  const int64_t* slots = p + (recv ? o.recv_slots : o.send_slots);
  const int64_t* bytes = p + (recv ? o.recv_bytes : o.send_bytes);
  const char* dir = recv ? "recv" : "send";
  TORCH_CHECK(!stat || tokcap == 1 + p[kStaticCap], op, ": plan header: static exchange with ",
              tokcap, " token rows per chunk and capacity ", p[kStaticCap]);
  TORCH_CHECK(!stat || !sec || slotcap >= 1, op,
              ": plan header: static exchange with slot rows ", slotcap);
  int64_t sum = 0;
  for (int64_t d = 0; d < R; ++d) {
    const int64_t nb = bytes[d], c = counts[d], s = sec * slots[d];
    TORCH_CHECK(nb >= 0 && nb <= total - sum, op, ": plan: ", dir, "_bytes[", d, "] = ", nb,
                " overruns the ", total, "-byte buffer");
    sum += nb;
    const int64_t tok_rows = tokcap >= 0 ? tokcap : c;
    const int64_t slot_rows = sec * (slotcap >= 0 ? slotcap : s);
    TORCH_CHECK(c >= 0 && c <= tok_rows - hdr && tok_rows <= nb / B, op, ": plan: ", dir,
                "_counts[", d, "] = ", c, " rows do not fit chunk ", d, " (", nb, " bytes)");
    const int64_t left = nb - tok_rows * B;
    TORCH_CHECK(s >= 0 && s <= slot_rows - hdr * sec && slot_rows <= left / kSlotRowBytes, op,
                ": plan: ", dir, "_slots[", d, "] = ", s, " slot rows do not fit chunk ", d, " (",
                nb, " bytes)");
  }
  TORCH_CHECK(sum == total, op, ": plan: ", dir, "_bytes add up to ", sum, ", not ", total);
}

// ---- per op ---------------------------------------------------------------------------------
// x [T, H] (any dtype), topk_idx [T, K] of an integer dtype, topk_weights [T, K] float32, on
// x's device: the routing arguments of prepare and pack.
inline void check_routing_args(const char* op, const Tensor& x, const Tensor& topk_idx,
                               const Tensor& topk_weights) {
  check_dim(op, "x", x, 2);
  check_dim(op, "topk_idx", topk_idx, 2);
  check_index_dtype(op, "topk_idx", topk_idx);
  check_device(op, "topk_idx", topk_idx, x.device());
  check_size(op, "topk_idx", topk_idx, 0, x.size(0), "tokens of x");
  check_dim(op, "topk_weights", topk_weights, 2);
  check_dtype(op, "topk_weights", topk_weights, at::kFloat);
  check_device(op, "topk_weights", topk_weights, x.device());
  check_same_shape(op, "topk_weights", topk_weights, "topk_idx", topk_idx);
}

inline void check_layout_args(const Tensor& topk_idx, int64_t E, int64_t R) {
  constexpr const char* op = "epkit.layout";
  check_dim(op, "topk_idx", topk_idx, 2);
  check_index_dtype(op, "topk_idx", topk_idx);
  check_experts_ranks(op, E, R);
}

// pre_error = [code, a, b, x dtype code (, max_tokens_per_rank)]. A nonzero code is the caller's
// own verdict on its arguments, which then travels in the words: the tensors are not looked at
// and E, R only size the words (8 + E + R of them, so E >= -R).
inline void check_prepare_args(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                               int64_t E, int64_t R, c10::IntArrayRef pre_error,
                               int64_t payload) {
  constexpr const char* op = "epkit.prepare";
  TORCH_CHECK(int64_t(pre_error.size()) > kPreErrorB, op,
              ": pre_error must be [code, a, b(, x dtype code(, max_tokens_per_rank))], got ",
              pre_error.size(), " values");
  check_num_ranks(op, R);
  TORCH_CHECK(payload_known(payload), op,
              ": payload must be one of ", kPayloadChoices, ", got ", payload);
  if (pre_error[kPreErrorCode] != 0) {
    TORCH_CHECK(E >= -R && E <= kMaxExperts, op, ": num_experts ", E,
                " leaves no room for the count words' header (num_ranks ", R, ")");
    return;
  }
  check_experts_ranks(op, E, R);
  check_routing_args(op, x, topk_idx, topk_weights);
  check_float_dtype(op, "x", x.scalar_type());
  if (int64_t(pre_error.size()) > kPreErrorMaxTokens)
    TORCH_CHECK(pre_error[kPreErrorMaxTokens] >= -1, op,
                ": pre_error's max_tokens_per_rank must be >= -1, got ",
                pre_error[kPreErrorMaxTokens]);
}

// Always: the words' shape, rank and the option codes. The remaining options are checked by
// check_plan_options once no rank's words carry an error (a plan that carries an error uses
// none of them, and the error must reach every rank as such).
inline void check_plan_args(const Tensor& words, int64_t rank, int64_t E, int64_t transport,
                            int64_t exchange) {
  constexpr const char* op = "epkit.plan";
  check_dim(op, "words", words, 2);
  check_dtype(op, "words", words, at::kLong);
  const int64_t R = words.size(0);
  TORCH_CHECK(R >= 1 && R <= kMaxRanks, op, ": words must have one row per rank (1 to ",
              kMaxRanks, "), got ", R);
  TORCH_CHECK(E >= -R && E <= kMaxExperts && words.size(1) == kWordHeader + E + R, op,
              ": words must be [R, 8 + E + R] for R = ", R, " and num_experts ", E, ", got ",
              words.sizes());
  TORCH_CHECK(rank >= 0 && rank < R, op, ": rank ", rank, " outside [0, ", R, ")");
  check_transport(op, transport);
  TORCH_CHECK(exchange >= kReqRagged && exchange <= kReqStatic, op, ": exchange code ", exchange,
              " outside [0, 5]");
}

inline void check_plan_options(int64_t E, int64_t R, int64_t align, int64_t capacity,
                               int64_t exchange, int64_t max_tokens) {
  constexpr const char* op = "epkit.plan";
  check_experts_ranks(op, E, R);
  TORCH_CHECK(align >= 1 && align <= kMaxAlign, op, ": align must be in [1, ", kMaxAlign,
              "], got ", align);
  TORCH_CHECK(capacity >= -1, op, ": capacity must be >= 0 (or -1: none), got ", capacity);
  TORCH_CHECK(max_tokens >= -1 && max_tokens <= kMaxTokens, op,
              ": max_tokens_per_rank must be in [0, ", kMaxTokens, "] (or -1), got ", max_tokens);
  TORCH_CHECK(exchange != kReqStatic || max_tokens >= 0, op,
              ": the static exchange needs max_tokens_per_rank >= 0, got ", max_tokens);
}

// Tensors of pack (no data read). Then check_pack_plan with the plan's host words.
inline void check_pack_args(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weights,
                            const Tensor& plan, int64_t transport, int64_t send_bytes,
                            const std::optional<Tensor>& plan_host,
                            const char* op = "epkit.pack") {
  check_routing_args(op, x, topk_idx, topk_weights);
  check_plan_tensor(op, plan, x.device());
  check_plan_host(op, plan_host, plan);
  check_transport(op, transport);
  check_nonneg(op, "send_bytes", send_bytes);
  with_transport(op, transport, [&](auto path) {
    using Path = decltype(path);
    TORCH_CHECK(topk_idx.size(1) <= Path::kMaxTopK, op, ": ", Path::kName, " carries k in ",
                Path::kTopKBits, " bits: topk ", topk_idx.size(1), " > ", Path::kMaxTopK);
  });
}

// A row's bytes on the wire: the payload, then the path's metadata.
inline int64_t row_bytes(const char* op, int64_t transport, int64_t payload_bytes) {
  return payload_bytes + with_transport(op, transport, [](auto path) {
    return decltype(path)::kMetaBytes;
  });
}

// The plan's host words p[0, n) against pack's other arguments; returns its offsets.
inline PlanOffsets check_pack_plan(const int64_t* p, int64_t n, int64_t transport,
                                   int64_t num_ranks, int64_t payload_bytes, int64_t send_bytes) {
  constexpr const char* op = "epkit.pack";
  const PlanOffsets o = check_plan_header(op, p, n);
  TORCH_CHECK(num_ranks == p[kRanks], op, ": num_ranks ", num_ranks, " disagrees with the plan's ",
              p[kRanks]);
  TORCH_CHECK(transport == p[kTransport], op, ": transport ", transport,
              " disagrees with the plan's ", p[kTransport]);
  with_transport(op, transport, [&](auto path) {
    using Path = decltype(path);
    TORCH_CHECK(p[kLocalExperts] <= Path::kMaxLocal, op, ": ", Path::kName,
                " carries the local expert in ", Path::kLocalBits, " bits: ", p[kLocalExperts],
                " local experts");
  });
  TORCH_CHECK(payload_bytes == p[kPayloadBytes], op, ": payload of ", payload_bytes,
              " bytes, the plan says ", p[kPayloadBytes]);
  TORCH_CHECK(send_bytes == p[kSendBytes], op, ": send_bytes ", send_bytes,
              " disagrees with the plan's ", p[kSendBytes]);
  check_plan_chunks(op, p, o, /*recv=*/false, row_bytes(op, transport, payload_bytes), send_bytes);
  return o;
}

inline void check_unpack_args(const Tensor& recv, const Tensor& plan, int64_t transport,
                              int64_t hidden, at::ScalarType dtype, int64_t topk,
                              int64_t recv_rows, int64_t expert_rows,
                              const std::optional<Tensor>& plan_host) {
  constexpr const char* op = "epkit.unpack";
  check_dim(op, "recv", recv, 1);
  check_dtype(op, "recv", recv, at::kByte);
  check_plan_tensor(op, plan, recv.device());
  check_plan_host(op, plan_host, plan);
  check_transport(op, transport);
  TORCH_CHECK(hidden >= 0 && hidden <= std::numeric_limits<int32_t>::max(), op, ": hidden ",
              hidden, " outside [0, 2^31)");
  const int64_t max_topk = with_transport(op, transport, [](auto path) {
    return decltype(path)::kMaxTopK;
  });
  TORCH_CHECK(topk >= 0 && topk <= max_topk, op, ": topk ", topk, " out of range for transport ",
              transport);
  TORCH_CHECK(dtype != at::ScalarType::Undefined && c10::elementSize(dtype) >= 1, op,
              ": dtype ", dtype_name(dtype), " has no element size");
  check_nonneg(op, "recv_rows", recv_rows);
  check_nonneg(op, "expert_rows", expert_rows);
}

// The plan's host words against unpack's other arguments; returns its offsets.
inline PlanOffsets check_unpack_plan(const int64_t* p, int64_t n, int64_t transport,
                                     int64_t payload_bytes, int64_t recv_rows,
                                     int64_t expert_rows, int64_t recv_numel) {
  constexpr const char* op = "epkit.unpack";
  const PlanOffsets o = check_plan_header(op, p, n);
  TORCH_CHECK(transport == p[kTransport], op, ": transport ", transport,
              " disagrees with the plan's ", p[kTransport]);
  TORCH_CHECK(payload_bytes == p[kPayloadBytes], op, ": rows of ", payload_bytes,
              " payload bytes (hidden * dtype size), the plan says ", p[kPayloadBytes]);
  TORCH_CHECK(expert_rows == p[kExpertRows], op, ": expert_rows ", expert_rows,
              " disagrees with the plan's ", p[kExpertRows]);
  TORCH_CHECK(recv_rows == p[kRecvRows], op, ": recv_rows ", recv_rows,
              " disagrees with the plan's ", p[kRecvRows]);
  TORCH_CHECK(recv_numel == p[kRecvBytes], op, ": received ", recv_numel,
              " bytes, the plan says ", p[kRecvBytes]);
  const int64_t L = p[kLocalExperts], *off = p + o.offsets;
  TORCH_CHECK(off[0] >= 0, op, ": plan: offsets[0] = ", off[0]);
  for (int64_t j = 0; j < L; ++j)
    TORCH_CHECK(off[j + 1] >= off[j], op, ": plan: offsets decrease at local expert ", j);
  TORCH_CHECK(off[L] <= expert_rows, op, ": plan: offsets end at ", off[L], " > expert_rows ",
              expert_rows);
  check_plan_chunks(op, p, o, /*recv=*/true, row_bytes(op, transport, payload_bytes), recv_numel);
  return o;
}

// dedup's unit places (cpu/combine.cpp): first [rows] int64 on `dev`.
inline void check_first(const char* op, const std::optional<Tensor>& first, int64_t transport,
                        int64_t rows, const char* what, c10::Device dev) {
  if (!first.has_value()) return;
  const bool places = with_transport(op, transport, [](auto path) {
    return decltype(path)::kUnitPlaces;
  });
  TORCH_CHECK(places, op, ": first (the return path's unit places) is dedup's only");
  check_dim(op, "first", *first, 1);
  check_dtype(op, "first", *first, at::kLong);
  check_device(op, "first", *first, dev);
  if (rows >= 0) check_size(op, "first", *first, 0, rows, what);  // (reduce_tokens: any rows)
}

// The source side's send_map [T, C] (C = R for dedup, K for pairs) and topk_idx [T, K] of an
// integer dtype, on back's device: reduce_tokens and scatter_slot_values.
inline void check_send_map_args(const char* op, const Tensor& back, const Tensor& send_map,
                                const Tensor& topk_idx, int64_t R, int64_t transport) {
  check_map(op, "send_map", send_map);
  check_device(op, "send_map", send_map, back.device());
  check_dim(op, "topk_idx", topk_idx, 2);
  check_index_dtype(op, "topk_idx", topk_idx);
  check_device(op, "topk_idx", topk_idx, back.device());
  check_size(op, "topk_idx", topk_idx, 0, send_map.size(0), "tokens of send_map");
  with_transport(op, transport, [&](auto path) {
    using Path = decltype(path);
    check_size(op, "send_map", send_map, 1, Path::send_map_cols(topk_idx.size(1), R),
               Path::kSendMapCols);
  });
}

inline void check_reduce_tokens_args(const Tensor& back, const Tensor& send_map,
                                     const Tensor& topk_idx, const Tensor& topk_weights, int64_t E,
                                     int64_t R, int64_t transport, bool weighted,
                                     at::ScalarType out_dtype, int64_t G,
                                     const std::optional<Tensor>& first = std::nullopt) {
  constexpr const char* op = "epkit.reduce_tokens";
  check_experts_ranks(op, E, R);
  TORCH_CHECK(G >= 1 && R % G == 0, op, ": ranks_per_node ", G, " must be >= 1 and divide ", R);
  check_transport(op, transport);
  check_dim(op, "back", back, 2);
  check_float_dtype(op, "back", back.scalar_type());
  check_float_dtype(op, "out_dtype", out_dtype);
  check_send_map_args(op, back, send_map, topk_idx, R, transport);
  check_first(op, first, transport, -1, "", back.device());
  // without first: rows of per * H elements (dedup: a float32 row, per = 4 / itemsize(y))
  const int64_t per = with_transport(op, transport, [&](auto path) {
    return decltype(path)::per(back.element_size());
  });
  TORCH_CHECK(first.has_value() || back.size(1) % per == 0, op,
              ": dedup's back must be [S, 4 H / itemsize] (a float32 row per token row), got ",
              back.sizes(), " of ", dtype_name(back.scalar_type()));
  if (weighted) {  // the source's own weights (dedup: for the rows that come back raw)
    check_dim(op, "topk_weights", topk_weights, 2);
    check_dtype(op, "topk_weights", topk_weights, at::kFloat);
    check_device(op, "topk_weights", topk_weights, back.device());
    check_same_shape(op, "topk_weights", topk_weights, "topk_idx", topk_idx);
  }
}

// A send buffer an op writes into (pack_into): 1-D uint8, contiguous, on `dev`.
inline void check_send_buffer(const char* op, const Tensor& send, c10::Device dev) {
  check_dim(op, "send", send, 1);
  check_dtype(op, "send", send, at::kByte);
  check_device(op, "send", send, dev);
  TORCH_CHECK(send.is_contiguous(), op, ": send must be contiguous");
}

inline void check_scatter_rows_args(const Tensor& src, const Tensor& send_map, int64_t send_rows,
                                    const char* op = "epkit.scatter_rows") {
  check_dim(op, "src", src, 2);
  check_map(op, "send_map", send_map);
  check_device(op, "send_map", send_map, src.device());
  check_size(op, "send_map", send_map, 0, src.size(0), "tokens of src");
  check_nonneg(op, "send_rows", send_rows);
}

// scatter_rows_into: scatter_rows' arguments and its out [send_rows, H] in src's dtype.
inline void check_scatter_rows_into_args(const Tensor& src, const Tensor& send_map,
                                         const Tensor& out) {
  constexpr const char* op = "epkit.scatter_rows_into";
  check_dim(op, "out", out, 2);
  check_scatter_rows_args(src, send_map, out.size(0), op);
  check_dtype(op, "out", out, src.scalar_type());
  check_device(op, "out", out, src.device());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  check_size(op, "out", out, 1, src.size(1), "hidden of src");
}

inline void check_combine_backward_dest_args(const Tensor& recv, const Tensor& recv_map,
                                             const Tensor& row_weight, const Tensor& expert_y,
                                             bool weighted) {
  constexpr const char* op = "epkit.combine_backward_dest";
  check_dim(op, "expert_y", expert_y, 2);
  check_float_dtype(op, "expert_y", expert_y.scalar_type());
  check_dim(op, "recv", recv, 2);
  check_float_dtype(op, "recv", recv.scalar_type());
  check_device(op, "recv", recv, expert_y.device());
  check_map(op, "recv_map", recv_map);
  check_device(op, "recv_map", recv_map, expert_y.device());
  check_size(op, "recv", recv, 0, recv_map.size(0), "rows of recv_map");
  check_size(op, "recv", recv, 1, expert_y.size(1), "hidden of expert_y");
  if (weighted) {
    check_dim(op, "row_weight", row_weight, 1);
    check_dtype(op, "row_weight", row_weight, at::kFloat);
    check_device(op, "row_weight", row_weight, expert_y.device());
    check_size(op, "row_weight", row_weight, 0, expert_y.size(0), "rows of expert_y");
  }
}

// x of a payload's quantize kernel: [T, H] float32 or bfloat16 with H % block == 0.
inline void check_quantize_args(const char* op, const Tensor& x, int64_t block) {
  check_dim(op, "x", x, 2);
  check_float_dtype(op, "x", x.scalar_type());
  TORCH_CHECK(x.size(1) % block == 0, op, ": x must be [T, H] with H % ", block,
              " == 0, got H = ", x.size(1));
}

inline void check_quantize_mxfp8_args(const Tensor& x) {
  check_quantize_args("epkit.quantize_mxfp8", x, kMxfp8Block);
}

inline void check_quantize_fp8_block128_args(const Tensor& x) {
  check_quantize_args("epkit.quantize_fp8_block128", x, kFp8Block128Block);
}

// first: [rows] int64 on `dev` (a position per row, -1: none), the weight gradients' layout.
inline void check_first(const char* op, const Tensor& first, int64_t rows, const char* what,
                        at::Device dev) {
  check_map(op, "first", first, 1);
  check_device(op, "first", first, dev);
  check_size(op, "first", first, 0, rows, what);
}

inline void check_gather_slot_values_args(const Tensor& values, const Tensor& recv_map,
                                          const Tensor& first, int64_t out_rows) {
  constexpr const char* op = "epkit.gather_slot_values";
  check_dim(op, "values", values, 1);
  check_dtype(op, "values", values, at::kFloat);
  check_map(op, "recv_map", recv_map);
  check_device(op, "recv_map", recv_map, values.device());
  check_first(op, first, recv_map.size(0), "rows of recv_map", values.device());
  check_nonneg(op, "out_rows", out_rows);
}

inline void check_scatter_slot_values_args(const Tensor& back, const Tensor& send_map,
                                           const Tensor& topk_idx, const Tensor& first,
                                           int64_t E, int64_t R, int64_t transport) {
  constexpr const char* op = "epkit.scatter_slot_values";
  check_experts_ranks(op, E, R);
  check_transport(op, transport);
  check_dim(op, "back", back, 1);
  check_dtype(op, "back", back, at::kFloat);
  check_send_map_args(op, back, send_map, topk_idx, R, transport);
  check_map(op, "first", first, 1);  // [S]: one per row of the send row space
  check_device(op, "first", first, back.device());
}

// ---- map ranges (host data: the CPU kernels) ----------------------------------------------
// Raises for the first of mp[0, n) outside [-1, rows) (`what` names what the rows index).
inline void check_map_range(const char* op, const char* name, const int64_t* mp, int64_t n,
                            int64_t rows, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(mp[i] >= -1 && mp[i] < rows, op, ": ", name, " entry ", i, " is ", mp[i],
                ", outside [-1, ", rows, ") (", what, ")");
}

// The same, called once a fused range test failed (inside at::parallel_for the kernels only
// raise a flag; this runs after the loop): always raises.
inline void report_map_range(const char* op, const char* name, const int64_t* mp, int64_t n,
                             int64_t rows, const char* what) {
  check_map_range(op, name, mp, n, rows, what);
  TORCH_CHECK(false, op, ": ", name, " names a row outside [-1, ", rows, ") (", what, ")");
}

// The inverse of recv_map [N, C]: for each of the M expert-major rows, the entry (n * C + c)
// that names it, or -1 (a padding row); raises, naming `op`, for an entry outside [-1, M) or a
// row named twice. Kernels that write the M rows walk them in this order, so their large
// outputs are written front to back (a stream the prefetcher follows), not scattered by row.
inline std::vector<int64_t> source_rows(const Tensor& recv_map, int64_t M, const char* op,
                                        const char* what) {
  std::vector<int64_t> src(M, -1);
  const int64_t* mp = recv_map.data_ptr<int64_t>();
  for (int64_t i = 0, n = recv_map.numel(); i < n; ++i) {
    const int64_t m = mp[i];
    if (m < 0 || m >= M) {
      if (m != -1) report_map_range(op, "recv_map", mp, n, M, what);
      continue;
    }
    TORCH_CHECK(src[m] < 0, op, ": recv_map entries ", src[m], " and ", i, " both name row ", m,
                " (", what, ")");
    src[m] = i;
  }
  return src;
}

// Expert ids: raises for the first of ip[0, n) outside [-1, E).
inline void check_expert_range(const char* op, const int64_t* ip, int64_t n, int64_t E) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= -1 && ip[i] < E, op, ": topk_idx entry ", i, " is ", ip[i],
                ", outside [-1, ", E, ")");
}

}  // namespace epkit
