// The plan: everything a rank must know to allocate and move tokens, derived from the
// all-gathered count words [R, 8 + E + R]. Identical arithmetic on every rank, so every rank
// agrees on the error to raise and on every count. dedup's token rows s -> d are the words'
// tokens_per_rank; when capacity dropped a slot (kDroppedAny) epkit.count_exchange gathers the
// kept token rows once more, writes them there and plans again (docs/design.md).
#include "../checks.h"

#include <algorithm>

namespace epkit {

namespace {
using reason::kDtypeMismatch, reason::kHiddenMismatch, reason::kTopkMismatch;
constexpr int64_t kMaxWordCount = int64_t(1) << 48;  // a count beyond this overflows the sums
}

namespace {

// One function (about 100 lines) on purpose: it writes the plan's words in layout order
// (header, kept counts, sections, offsets, chunks), each block reading the running sums of
// the ones before; split, a dozen of those values would travel between the pieces. Path: the
// transport's rules (pairs.h, dedup.h): what a row s -> d is, the row and slot bytes.
template <typename Path>
Tensor plan_path(const Tensor& words_in, int64_t rank, int64_t E, int64_t align,
                 int64_t capacity, int64_t exchange, int64_t max_tokens) {
  const Tensor words = words_in.contiguous();
  const int64_t R = words.size(0), L = E / R, W = words.size(1);
  const PlanOffsets o(R, E);
  Tensor plan = at::zeros({o.size}, at::kLong);
  int64_t* p = plan.data_ptr<int64_t>();
  const int64_t* g = words.data_ptr<int64_t>();
  auto row = [&](int64_t s) { return g + s * W; };

  p[kRanks] = R; p[kLocalExperts] = L; p[kExperts] = E; p[kTransport] = Path::kCode;
  p[kCapacity] = capacity; p[kAlign] = align; p[kStaticCap] = -1;

  // 1. The error, if any: the lowest rank whose own checks failed; else the lowest rank whose
  //    H, x dtype or K (in that order) differs from rank 0's (reference/validate.py).
  auto fail = [&](int64_t s, int64_t code, int64_t a, int64_t b) {
    p[kErrCode] = code; p[kErrA] = a; p[kErrB] = b; p[kErrRank] = s;
    return plan;
  };
  for (int64_t s = 0; s < R; ++s)
    if (row(s)[kWordErrorCode] != 0)
      return fail(s, row(s)[kWordErrorCode], row(s)[kWordErrorA], row(s)[kWordErrorB]);
  const int64_t* r0 = row(0);
  for (int64_t s = 1; s < R; ++s) {
    const int64_t* r = row(s);
    const int64_t H = kWordHidden, X = kWordXDtype, K = kWordTopK;
    if (r[H] != r0[H]) return fail(s, kHiddenMismatch, r[H], r0[H]);
    if (r[X] != r0[X]) return fail(s, kDtypeMismatch, r[X], r0[X]);
    if (r[K] != r0[K]) return fail(s, kTopkMismatch, r[K], r0[K]);
  }
  // The agreed K within the transport's wire format (a slot row's k: 8 bits under dedup),
  // named for rank 0 as the reference's transport does.
  if (r0[kWordTopK] > Path::kMaxTopK)
    return fail(0, reason::kTopkTooLarge, r0[kWordTopK], Path::kMaxTopK);
  // No rank's words carry an error: the options are used from here on.
  check_plan_options(E, R, align, capacity, exchange, max_tokens);
  TORCH_CHECK(r0[kWordHidden] >= 0 && r0[kWordTopK] >= 0 &&
                  payload_known(r0[kWordPayload]),
              "epkit.plan: words of rank 0 "
              "carry hidden ", r0[kWordHidden], ", topk ", r0[kWordTopK], ", payload ",
              r0[kWordPayload]);
  p[kTopK] = row(0)[kWordTopK];

  // 2. Kept slots per (source, expert): capacity keeps the first C in (source, token) order.
  auto cnt = [&](int64_t s, int64_t e) { return row(s)[kWordHeader + e]; };
  auto tpr = [&](int64_t s, int64_t d) { return row(s)[kWordHeader + E + d]; };
  std::vector<int64_t> kept(R * E), prefix(E, 0);
  int64_t dropped_any = 0;
  for (int64_t s = 0; s < R; ++s)
    for (int64_t e = 0; e < E; ++e) {
      const int64_t c = cnt(s, e);
      TORCH_CHECK(c >= 0 && c <= kMaxWordCount, "epkit.plan: words of rank ", s, " count ", c,
                  " slots for expert ", e);
      const int64_t k = capacity < 0 ? c : std::clamp<int64_t>(capacity - prefix[e], 0, c);
      kept[s * E + e] = k;
      dropped_any |= k != c;
      prefix[e] += c;
    }
  p[kDroppedAny] = dropped_any;

  // 3. Rows (and dedup slot rows) from s to d, for every pair: uniformity and the padded
  //    chunks need all of them.
  auto slots = [&](int64_t s, int64_t d) {
    int64_t n = 0;
    for (int64_t j = 0; j < L; ++j) n += kept[s * E + d * L + j];
    return n;
  };
  auto rows = [&](int64_t s, int64_t d) { return Path::rows(tpr(s, d), slots(s, d)); };
  int64_t maxrows = 0, maxslots = 0, uniform = 1, S = 0, N = 0;
  p[kNonUniformRank] = -1;
  for (int64_t s = 0; s < R; ++s)
    for (int64_t d = 0; d < R; ++d)
      TORCH_CHECK(tpr(s, d) >= 0 && tpr(s, d) <= kMaxWordCount, "epkit.plan: words of rank ", s,
                  " count ", tpr(s, d), " tokens for rank ", d);
  const int64_t rows00 = rows(0, 0), slots00 = slots(0, 0);
  for (int64_t s = 0; s < R; ++s)
    for (int64_t d = 0; d < R; ++d) {
      const int64_t n = rows(s, d), sl = slots(s, d);
      const bool same = n == rows00 && Path::same_slots(sl, slots00);
      if (!same && uniform) p[kNonUniformRank] = s;
      uniform &= same;
      maxrows = std::max(maxrows, n);
      maxslots = std::max(maxslots, sl);
      if (s == rank) { p[o.send_counts + d] = n; p[o.send_slots + d] = sl; S += n; }
      if (d == rank) { p[o.recv_counts + s] = n; p[o.recv_slots + s] = sl; N += n; }
    }

  // 4. This rank's experts: kept and dropped counts, padded offsets, kept per source.
  int64_t M = 0;
  for (int64_t j = 0; j < L; ++j) {
    p[o.offsets + j] = M;
    M += plan_expert(p, o, g, W, kept.data(), R, E, L, rank, j, align);
  }
  p[o.offsets + L] = M;
  for (int64_t e = 0; e < E; ++e) p[o.own_kept + e] = kept[rank * E + e];

  p[kSendRows] = S; p[kRecvRows] = N; p[kExpertRows] = M;
  p[kUniform] = uniform; p[kMaxChunk] = maxrows;

  plan_exchange<Path>(p, o, R, L, row(0), exchange, max_tokens, align, uniform, maxrows,
                      maxslots);
  return plan;
}

}  // namespace

Tensor plan_cpu(const Tensor& words, int64_t rank, int64_t E, int64_t align, int64_t capacity,
                int64_t transport, int64_t exchange, int64_t max_tokens) {
  check_plan_args(words, rank, E, transport, exchange);
  return with_transport("epkit.plan", transport, [&](auto path) {
    return plan_path<decltype(path)>(words, rank, E, align, capacity, exchange, max_tokens);
  });
}

}  // namespace epkit
