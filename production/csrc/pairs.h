// transport="pairs", the slot-row path: one row per kept slot, its metadata (t, k, j, w) after
// the payload. Everything the kernels do differently for pairs is here or in cpu/pairs.cpp,
// beside dedup.h / cpu/dedup.cpp (the way DeepEP splits intranode / internode); the kernels
// ask the path's rules (transports.h: with_transport), never the transport code.
#pragma once

#include "epkit.h"

#include <limits>

namespace epkit {

struct Pairs {
  static constexpr int64_t kCode = kPairs;
  static constexpr const char* kName = "pairs";
  // After a row's payload: int32 t, int32 k, int32 j, float32 w (abi.h kPairsMeta*).
  static constexpr int64_t kMetaBytes = kPairsMetaBytes;
  // k and j travel as int32.
  static constexpr int64_t kMaxTopK = std::numeric_limits<int32_t>::max();
  static constexpr int64_t kMaxLocal = std::numeric_limits<int32_t>::max();
  static constexpr int64_t kTopKBits = std::numeric_limits<int32_t>::digits;
  static constexpr int64_t kLocalBits = std::numeric_limits<int32_t>::digits;
  // A row is its slot: no slot section, no unit places on the return path.
  static constexpr bool kSlotSection = false;
  static constexpr bool kUnitPlaces = false;
  // reduce_tokens: a used slot without a row is a dropped one (the routing is the caller's).
  static constexpr bool kKeptRouting = false;
  static constexpr const char* kSendMapCols = "pairs: one column per slot";
  static constexpr const char* kMissingRow = ": send_map sends a slot whose topk_idx is -1";

  // send_map [T, K]: a column per slot (slot k, its expert on rank d); recv_map [N, 1].
  static int64_t send_map_cols(int64_t K, int64_t /*R*/) { return K; }
  static int64_t send_map_col(int64_t k, int64_t /*d*/) { return k; }
  static int64_t recv_map_cols(int64_t /*K*/) { return 1; }

  // ---- the plan (epkit.h plan_exchange, cpu/plan.cpp) ----
  // Rows s -> d: the kept slots; the rows alone decide uniformity.
  static int64_t rows(int64_t /*tokens*/, int64_t slots) { return slots; }
  static bool same_slots(int64_t /*slots*/, int64_t /*slots00*/) { return true; }
  // The static exchange's rows per chunk for max_tokens tokens of `slots` slots at most.
  static int64_t static_rows(int64_t /*max_tokens*/, int64_t slots) { return slots; }
  static int64_t slot_cap(int64_t /*slotcap*/) { return -1; }
  static int64_t slot_section_bytes(int64_t /*nslots*/) { return 0; }

  // ---- unpack (cpu/unpack.cpp) ----
  static const uint8_t* open_slot_section(const uint8_t* sec, int64_t /*nslots*/,
                                          int64_t /*s*/) {
    return sec;
  }
  // A row carries no slot rows: it is its slot.
  static int64_t slots_in_row(const uint8_t* /*bytes*/, int64_t /*P*/) { return 0; }
  // The slot's k and weight: in the row's own metadata.
  static void slot_meta(const uint8_t* meta, const uint8_t* /*slot*/, int64_t* k, float* w) {
    *k = get<int32_t>(meta + kPairsMetaK);
    *w = get<float>(meta + kPairsMetaW);
  }

  // ---- the return path (cpu/combine.cpp) ----
  // A slot's row of y returns as is, in y's dtype: one unit per row.
  static at::ScalarType gather_dtype(at::ScalarType y) { return y; }
  static int64_t per(int64_t /*itemsize*/) { return 1; }
  static int64_t unit_of_row(int64_t r, const int64_t* /*first*/, int64_t /*per*/) { return r; }
  // An unused slot (topk_idx -1) has no row: its send_map entry must be -1.
  static bool unused_slot_ok(const int64_t* map_row, int64_t k) { return map_row[k] == -1; }
  // A destination rank's slots: each its own row (no shared unit, no partial).
  static int64_t group_unit(const int64_t* /*map_row*/, int64_t /*d*/, const int64_t* /*first*/,
                            int64_t /*per*/) {
    return 0;
  }
  static bool group_fits(int64_t /*at0*/, int64_t /*cnt*/, int64_t /*per*/, int64_t /*U*/) {
    return true;
  }
  static bool partial(int64_t /*cnt*/, int64_t /*per*/) { return false; }
  static int64_t unit_of_slot(const int64_t* map_row, int64_t k, int64_t /*at0*/,
                              int64_t /*q*/) {
    return map_row[k];
  }

  // ---- the weight gradients' return path (cpu/backward.cpp) ----
  // A slot's value is its row's only one.
  static int64_t slot_place(const int64_t* /*idx*/, int64_t /*k*/, int64_t /*d*/, int64_t /*E*/,
                            int64_t /*L*/) {
    return 0;
  }
};

}  // namespace epkit
