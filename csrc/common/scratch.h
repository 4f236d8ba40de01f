// Per-thread scratch buffers that grow and are reused across calls (no allocation per call),
// 64-byte aligned for SIMD stores. Internal linkage, as in half_rounding.h: SIMD units include
// this under their own `#pragma GCC target`.
#pragma once
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace pyext::cpu {
namespace {

struct FreeDeleter {
  void operator()(const void* p) const { std::free(const_cast<void*>(p)); }
};

template <typename T>
using ScratchPtr = std::unique_ptr<T, FreeDeleter>;

// buf holding at least `bytes` (zero-filled when it grows, if `zero`).
template <typename T>
T* grow(ScratchPtr<T>& buf, size_t& capacity, size_t bytes, bool zero = false) {
  if (capacity < bytes) {
    buf.reset(static_cast<T*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
    if (!buf) throw std::bad_alloc();  // at::parallel_for rethrows it on the caller's thread
    capacity = bytes;
    if (zero) std::memset(buf.get(), 0, bytes);
  }
  return buf.get();
}

}  // namespace
}  // namespace pyext::cpu
