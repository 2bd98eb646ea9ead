// What the CPU kernels' op files (pack.cpp, unpack.cpp, combine.cpp) share with the two
// transport paths (pairs.cpp: slot rows, dedup.cpp: token rows): the row types both passes
// read, and each path's passes, overloaded on the path (pairs.h, dedup.h) so an op file
// calls the one its transport picked (transports.h: with_transport), never tests the code.
#pragma once

#include "../checks.h"

#include <cstdlib>
#include <vector>

namespace epkit {

// ---- pack ----------------------------------------------------------------------------------
// Where pack writes: chunk d of the send buffer is [token (pairs: slot) section | dedup slot
// section], each a run of fixed-size rows; under the static exchange each section opens with a
// header row carrying its count in-band.
struct PackLayout {
  int64_t R = 0, E = 0, L = 0, K = 0, T = 0, P = 0, B = 0, cap = -1, hdr = 0;
  const int64_t* plan = nullptr;
  const int64_t* own_kept = nullptr;  // [E] kept slots of this rank per expert
  const int64_t* counts = nullptr;    // [R] data rows each chunk holds
  int64_t send_slots = 0;            // plan offset of the [R] slot rows each chunk holds
  std::vector<int64_t> chunk, slot_sec, row_start, rank_of, local_of;

  // Byte offset of data row i of chunk d; and its row in the row space that combine and the
  // backward passes exchange (compact, or static chunks of 1 + cap rows).
  int64_t byte_of(int64_t d, int64_t i) const { return chunk[d] + (hdr + i) * B; }
  int64_t row_of(int64_t d, int64_t i) const {
    return cap >= 0 ? d * (1 + cap) + 1 + i : row_start[d] + i;
  }
  int64_t rows_sent() const { return R ? row_start[R - 1] + counts[R - 1] : 0; }
};

// topk_idx[t, k], checked against [-1, E).
inline int64_t expert_at(const int64_t* ip, int64_t t, int64_t k, int64_t K, int64_t E) {
  const int64_t e = ip[t * K + k];
  TORCH_CHECK(e >= -1 && e < E, "epkit.pack: topk_idx[", t, ", ", k, "] = ", e,
              " outside [-1, ", E, ")");
  return e;
}

[[noreturn]] inline void overrun(const PackLayout& l, int64_t d, int64_t i) {
  TORCH_CHECK(false, "epkit.pack: row ", i, " of chunk ", d, " is past the plan's ", l.counts[d],
              " rows (a plan from another call?)");
  std::abort();  // not reached: TORCH_CHECK(false) throws
}

// This call's slots are the plan's (pack.cpp): all of them kept without capacity, else at
// least the kept ones.
void check_slots_are_the_plans(const PackLayout& l, const std::vector<int64_t>& cursor);

// The path's passes over the routing (ip [T, K] int64, wp [T, K] float32, xb [T, P] bytes):
// its serial index pass (send_map mp, the chunks' rows), then its parallel payload pass into
// the send buffer sb. cursor [E]: the slots seen per expert, zeros on entry.
void pack_rows(Pairs, const PackLayout& l, const int64_t* ip, const float* wp, const uint8_t* xb,
               int64_t* mp, uint8_t* sb, std::vector<int64_t>& cursor);
void pack_rows(Dedup, const PackLayout& l, const int64_t* ip, const float* wp, const uint8_t* xb,
               int64_t* mp, uint8_t* sb, std::vector<int64_t>& cursor);

// ---- unpack --------------------------------------------------------------------------------
// A received data row: its bytes, its row in the row space (compact, or static chunks of
// 1 + cap rows), its source rank, and (dedup) where its slot rows start.
struct RecvRow { const uint8_t* bytes; int64_t row, src; const uint8_t* slots; };

// Where an expert-major row comes from: a received row's bytes, (dedup) its slot row, its
// source rank. bytes == nullptr: a padding row.
struct Source { const uint8_t* bytes; const uint8_t* slot; int64_t src; };

// The path's index pass: the expert-major row of every received slot (recv_map mp [N, C]) and
// its inverse (each expert-major row's source, `from`).
void index_rows(Pairs, const int64_t* plan, const PlanOffsets& o, const std::vector<RecvRow>& rows,
                int64_t P, int64_t K, int64_t* mp, std::vector<Source>& from);
void index_rows(Dedup, const int64_t* plan, const PlanOffsets& o, const std::vector<RecvRow>& rows,
                int64_t P, int64_t K, int64_t* mp, std::vector<Source>& from);

// ---- combine -------------------------------------------------------------------------------
// The expert side's arguments, per path (after the checks both share, combine.cpp): pairs
// copies a slot's row of y as is (any dtype; recv_map [N, 1]); dedup reads each token row's K
// slots, forms float32 partials and (weighted) multiplies by row_weight [M].
void check_gather(Pairs, const char* op, const Tensor& expert_y, const Tensor& recv_map,
                  const Tensor& row_weight, bool weighted);
void check_gather(Dedup, const char* op, const Tensor& expert_y, const Tensor& recv_map,
                  const Tensor& row_weight, bool weighted);

// Where gather_units writes, per path: pairs a row per received row (no first); dedup each
// token row's units at first [N].
void check_units(Pairs, const char* op, const Tensor& out, const Tensor& recv_map,
                 const std::optional<Tensor>& first, c10::Device dev);
void check_units(Dedup, const char* op, const Tensor& out, const Tensor& recv_map,
                 const std::optional<Tensor>& first, c10::Device dev);

// The expert side of the return path into `ob`, the output's bytes (U units of H elements):
// pairs, received row n's slot row of y at n; dedup, token row n's units at unit fp[n] (fp
// null: at n * per, its 4H bytes, the unused bytes zero).
void gather_into(Pairs, const char* op_name, const Tensor& y, const Tensor& recv_map,
                 const Tensor& row_weight, bool weighted, const int64_t* fp, int64_t U,
                 uint8_t* ob);
void gather_into(Dedup, const char* op_name, const Tensor& y, const Tensor& recv_map,
                 const Tensor& row_weight, bool weighted, const int64_t* fp, int64_t U,
                 uint8_t* ob);

}  // namespace epkit
