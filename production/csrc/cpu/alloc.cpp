// Large CPU outputs on transparent huge pages.
//
// glibc maps every allocation above its mmap threshold (32 MiB at most) afresh and unmaps it on
// free, so a kernel's large output is fresh pages on every call, and the first touch of each
// 4 KiB page is a fault: at the default bench workload 13 ms for a 33.5 MB expert_x, about what
// the exchange that fills it costs (docs/benchmarks.md, "out fresh"). 2 MiB-aligned memory with
// MADV_HUGEPAGE faults once per 2 MiB (about 3 ms for the same buffer, measured with torch's
// THP_MEM_ALLOC_ENABLE, which does this for every allocation of a process). Here only epkit's
// own large outputs and send buffers take it; where the kernel refuses huge pages (THP "never")
// madvise is a no-op and the memory behaves as before. Bytes are unchanged either way.
//
// Freed blocks are kept for the next allocation of about their size (BlockCache, at most
// kCacheBlocks = 4 blocks and kCacheBytes = 256 MiB, oldest evicted first), as CUDA's caching
// allocator keeps device memory: a training step allocates the same few large outputs every
// step (expert_x, grad_expert_y), and a reused block has no page to fault in at all.
// epkit::release_cache() (Dispatcher.release()) returns them to the system.
#include "../epkit.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>

#include <cstdlib>
#include <mutex>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace epkit {
namespace {

constexpr size_t kHuge = size_t{1} << 21;  // 2 MiB: one transparent huge page

constexpr size_t kCacheBlocks = 4;  // a step's large outputs: expert_x, grad_expert_y, two [T, H]
constexpr size_t kCacheBytes = size_t{256} << 20;

struct Block {
  void* p;
  size_t bytes;
};

class BlockCache {
 public:
  // A kept block of at least `bytes` and at most a quarter more (the smallest such), or null.
  void* take(size_t bytes, size_t* got) {
    std::lock_guard<std::mutex> lock(mu_);
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i)
      if (free_[i].bytes >= bytes && free_[i].bytes <= bytes + bytes / 4 &&
          (best == free_.size() || free_[i].bytes < free_[best].bytes))
        best = i;
    if (best == free_.size()) return nullptr;
    const Block b = free_[best];
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
    held_ -= b.bytes;
    *got = b.bytes;
    return b.p;
  }
  void put(Block b) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (b.bytes > kCacheBytes) {
        evicted.push_back(b);
      } else {
        while (!free_.empty() && (free_.size() >= kCacheBlocks || held_ + b.bytes > kCacheBytes)) {
          evicted.push_back(free_.front());
          held_ -= free_.front().bytes;
          free_.erase(free_.begin());
        }
        free_.push_back(b);
        held_ += b.bytes;
      }
    }
    for (const Block& e : evicted) std::free(e.p);
  }
  int64_t bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(held_);
  }
  int64_t release() {
    std::vector<Block> all;
    {
      std::lock_guard<std::mutex> lock(mu_);
      all.swap(free_);
      held_ = 0;
    }
    int64_t freed = 0;
    for (const Block& e : all) {
      freed += static_cast<int64_t>(e.bytes);
      std::free(e.p);
    }
    return freed;
  }
  ~BlockCache() { release(); }

 private:
  std::mutex mu_;
  std::vector<Block> free_;  // oldest first
  size_t held_ = 0;
};

BlockCache& cache() {
  static BlockCache* c = new BlockCache();  // never destroyed: blocks may be freed at exit
  return *c;
}

void block_free(void* ctx) {
  Block* b = static_cast<Block*>(ctx);
  cache().put(*b);
  delete b;
}

struct HugePageAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const size_t bytes = (n + kHuge - 1) / kHuge * kHuge;
    if (bytes == 0) return {nullptr, nullptr, nullptr, c10::Device(c10::DeviceType::CPU)};
    size_t got = 0;
    void* p = cache().take(bytes, &got);
    if (p == nullptr) {
      got = bytes;
      TORCH_CHECK(posix_memalign(&p, kHuge, bytes) == 0 && p != nullptr,
                  "epkit: out of memory allocating ", n, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
      madvise(p, bytes, MADV_HUGEPAGE);  // advice only: failure changes nothing
#endif
    }
    return {p, new Block{p, got}, &block_free, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

HugePageAllocator huge_allocator;

}  // namespace

Tensor empty_large(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  if (static_cast<size_t>(numel) * c10::elementSize(dtype) < kHuge)
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  return at::detail::empty_generic(sizes, &huge_allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   dtype, std::nullopt);
}

// The op: the kept blocks returned to the system; their bytes.
int64_t release_cache() { return cache().release(); }

// The op: the bytes of the kept blocks now (the bench reports them beside the workspace).
int64_t cached_bytes() { return cache().bytes(); }

// The op: a fresh buffer on `like`'s device (production/workspace.py's fresh path, so buffers made
// in Python for the kernels to fill get the same huge pages).
Tensor empty_large_cpu(const Tensor& like, c10::SymIntArrayRef size, at::ScalarType dtype) {
  (void)like;
  for (const auto& s : size)
    TORCH_CHECK(s >= 0, "epkit.empty_large: size ", size, " has a negative dimension");
  return empty_large(C10_AS_INTARRAYREF_SLOW(size), dtype);
}

}  // namespace epkit
