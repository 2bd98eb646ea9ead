// transport="dedup", the token-row path: one row per (token, destination rank with a kept slot),
// its metadata (t, n) after the payload, then the chunk's slot section: n slot rows (the slot
// word k << 24 | j, float32 w) per token row. Everything the kernels do differently for dedup is
// here or in cpu/dedup.cpp, beside pairs.h / cpu/pairs.cpp (the way DeepEP splits intranode /
// internode); the kernels ask the path's rules (transports.h: with_transport), never the code.
#pragma once

#include "epkit.h"

#include <algorithm>

namespace epkit {

struct Dedup {
  static constexpr int64_t kCode = kDedup;
  static constexpr const char* kName = "dedup";
  // After a row's payload: int32 t, int32 n (abi.h kDedupMeta*).
  static constexpr int64_t kMetaBytes = kDedupTokMeta;
  // k in the slot word's top 8 bits (the spec's limit 255), j in its low 24.
  static constexpr int64_t kMaxTopK = kDedupMaxTopK;
  static constexpr int64_t kMaxLocal = kDedupMaxLocal;
  static constexpr int64_t kTopKBits = 32 - kSlotKShift;
  static constexpr int64_t kLocalBits = kSlotKShift;
  static constexpr bool kSlotSection = true;
  // The return path places each token row's units (first); see combine.cpp.
  static constexpr bool kUnitPlaces = true;
  // reduce_tokens reads the *kept* routing: every used slot has its token row.
  static constexpr bool kKeptRouting = true;
  static constexpr const char* kSendMapCols = "dedup: one column per rank";
  static constexpr const char* kMissingRow = ": a kept slot whose token row send_map does not name";

  // send_map [T, R]: a column per destination rank; recv_map [N, K]: a token row's K slots.
  static int64_t send_map_cols(int64_t /*K*/, int64_t R) { return R; }
  static int64_t send_map_col(int64_t /*k*/, int64_t d) { return d; }
  static int64_t recv_map_cols(int64_t K) { return K; }

  // ---- the plan (epkit.h plan_exchange, cpu/plan.cpp) ----
  // Rows s -> d: the token rows (the words' tokens_per_rank); uniform needs the slots equal too.
  static int64_t rows(int64_t tokens, int64_t /*slots*/) { return tokens; }
  static bool same_slots(int64_t slots, int64_t slots00) { return slots == slots00; }
  // A token row needs a kept slot: at most min(max_tokens, slots) rows (0 when K = 0).
  static int64_t static_rows(int64_t max_tokens, int64_t slots) {
    return std::min(slots, max_tokens);
  }
  static int64_t slot_cap(int64_t slotcap) { return slotcap; }
  static int64_t slot_section_bytes(int64_t nslots) { return nslots * kSlotRowBytes; }

  // ---- unpack (cpu/unpack.cpp) ----
  // The static exchange opens the slot section with a header row carrying its count in-band.
  static const uint8_t* open_slot_section(const uint8_t* sec, int64_t nslots, int64_t s) {
    TORCH_CHECK(get<int64_t>(sec) == nslots, "epkit.unpack: slot section from rank ", s,
                " carries count ", get<int64_t>(sec), ", the plan says ", nslots);
    return sec + kSlotRowBytes;
  }
  static int64_t slots_in_row(const uint8_t* bytes, int64_t P) {
    return get<int32_t>(bytes + P + kDedupMetaN);
  }
  // The slot's k and weight: in its slot row (int32 slot word, float32 w).
  static void slot_meta(const uint8_t* /*meta*/, const uint8_t* slot, int64_t* k, float* w) {
    *k = slot_word_k(get<int32_t>(slot));
    *w = get<float>(slot + sizeof(int32_t));
  }

  // ---- the return path (cpu/combine.cpp) ----
  // A token row returns as its n rows of y (n <= per = 4 / itemsize) or its float32 partial.
  static at::ScalarType gather_dtype(at::ScalarType /*y*/) { return at::kFloat; }
  static int64_t per(int64_t itemsize) { return 4 / itemsize; }
  // Token row r's first unit: first[r] (the return path as it travels), else r * per.
  static int64_t unit_of_row(int64_t r, const int64_t* first, int64_t per) {
    return first ? first[r] : r * per;
  }
  static bool unused_slot_ok(const int64_t* /*map_row*/, int64_t /*k*/) { return true; }
  // A destination rank's kept slots share its token row's units: their rows, or the partial.
  static int64_t group_unit(const int64_t* map_row, int64_t d, const int64_t* first,
                            int64_t per) {
    return unit_of_row(map_row[d], first, per);
  }
  static bool group_fits(int64_t at0, int64_t cnt, int64_t per, int64_t U) {
    return at0 >= 0 && at0 + std::min(cnt, per) <= U;
  }
  static bool partial(int64_t cnt, int64_t per) { return cnt > per; }
  static int64_t unit_of_slot(const int64_t* /*map_row*/, int64_t /*k*/, int64_t at0,
                              int64_t q) {
    return at0 + q;
  }

  // ---- the weight gradients' return path (cpu/backward.cpp) ----
  // A slot's value follows its token row's first: its place among t's kept slots on d.
  static int64_t slot_place(const int64_t* idx, int64_t k, int64_t d, int64_t E, int64_t L) {
    return slot_rank(idx, k, d, E, L);
  }
};

}  // namespace epkit
