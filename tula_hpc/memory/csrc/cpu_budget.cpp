// The CPU device budget: every CPU tensor allocation is counted and refused beyond the limit, with
// PyTorch's own out-of-memory error (the CPU counterpart of capping the CUDA caching allocator).
// Built once by torch.utils.cpp_extension (tula_hpc/memory/device_budget.py) and driven through the C functions below.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace {

// Every CPU tensor allocation goes through here: counted, and refused beyond the limit.
class BudgetAllocator final : public c10::Allocator {
 public:
  std::atomic<int64_t> limit{INT64_MAX}, used{0}, peak{0}, failed_at{0};

  c10::DataPtr allocate(size_t nbytes) override {
    const int64_t size = static_cast<int64_t>(nbytes);
    if (size == 0) return {nullptr, nullptr, &Release, c10::Device(c10::DeviceType::CPU)};
    const int64_t now = used.fetch_add(size) + size;
    if (now > limit.load()) {
      used.fetch_sub(size);
      failed_at.store(now);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "DefaultCPUAllocator: can't allocate memory: you tried to allocate ",
                       nbytes, " bytes beyond the device memory budget");
    }
    for (int64_t seen = peak.load(); now > seen && !peak.compare_exchange_weak(seen, now);) {
    }
    void* data = c10::GetDefaultCPUAllocator()->raw_allocate(nbytes);
    {
      std::lock_guard<std::mutex> guard(mutex);
      sizes[data] = size;
    }
    return {data, data, &Release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  static void Release(void* data);

  std::mutex mutex;
  std::unordered_map<void*, int64_t> sizes;
};

BudgetAllocator allocator;

void BudgetAllocator::Release(void* data) {
  if (data == nullptr) return;
  int64_t size;
  {
    std::lock_guard<std::mutex> guard(allocator.mutex);
    auto found = allocator.sizes.find(data);
    size = found->second;
    allocator.sizes.erase(found);
  }
  allocator.used.fetch_sub(size);
  c10::GetDefaultCPUAllocator()->raw_deallocate(data);
}

}  // namespace

extern "C" {
void tula_install() { c10::SetCPUAllocator(&allocator, /*priority=*/100); }
void tula_set_limit(int64_t limit) { allocator.limit.store(limit); }
int64_t tula_used() { return allocator.used.load(); }
int64_t tula_peak() { return allocator.peak.load(); }
int64_t tula_failed_at() { return allocator.failed_at.load(); }
void tula_reset_peak() { allocator.peak.store(allocator.used.load()); }
}
