// The kernels' transport table: a transport code resolved once, at an op's entry, to its path
// (pairs.h: slot rows; dedup.h: token rows), whose rules the kernels then ask. hier is not a
// kernel path: it runs dedup's kernels and moves its two stages in Python (production/hier.py).
#pragma once

#include "dedup.h"
#include "pairs.h"

namespace epkit {

inline bool transport_known(int64_t transport) {
  return transport == Pairs::kCode || transport == Dedup::kCode;
}

inline void check_transport(const char* op, int64_t transport) {
  TORCH_CHECK(transport_known(transport), op, ": transport must be ", Pairs::kCode, " (",
              Pairs::kName, ") or ", Dedup::kCode, " (", Dedup::kName, "), got ", transport);
}

// f(Pairs{}) or f(Dedup{}) for the code (checked): the one place a code picks a path, as
// AT_DISPATCH picks a dtype.
template <typename F>
decltype(auto) with_transport(const char* op, int64_t transport, F&& f) {
  check_transport(op, transport);
  if (transport == Pairs::kCode) return f(Pairs{});
  return f(Dedup{});
}

}  // namespace epkit
