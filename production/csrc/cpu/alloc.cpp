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
#include "../epkit.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>

#include <cstdlib>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace epkit {
namespace {

constexpr size_t kHuge = size_t{1} << 21;  // 2 MiB: one transparent huge page

void huge_free(void* p) { std::free(p); }

struct HugePageAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    const size_t bytes = (n + kHuge - 1) / kHuge * kHuge;
    if (bytes == 0 || posix_memalign(&p, kHuge, bytes) != 0 || p == nullptr)
      TORCH_CHECK(bytes == 0, "epkit: out of memory allocating ", n, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (p != nullptr) madvise(p, bytes, MADV_HUGEPAGE);  // advice only: failure changes nothing
#endif
    return {p, p, &huge_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &huge_free; }
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

// The op: a fresh buffer on `like`'s device (epkit/workspace.py's fresh path, so buffers made
// in Python for the kernels to fill get the same huge pages).
Tensor empty_large_cpu(const Tensor& like, c10::SymIntArrayRef size, at::ScalarType dtype) {
  (void)like;
  for (const auto& s : size)
    TORCH_CHECK(s >= 0, "epkit.empty_large: size ", size, " has a negative dimension");
  return empty_large(C10_AS_INTARRAYREF_SLOW(size), dtype);
}

}  // namespace epkit
