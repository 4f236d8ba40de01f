#include "common/block_pool.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <list>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

namespace pyext::pool {
namespace {

constexpr size_t kPage = 4096;
// Smaller tensors stay with torch's own allocator: malloc serves them from its heap without
// faults, at any mmap threshold of 64 KiB or more.
constexpr size_t kMinBytes = size_t{64} << 10;

// Blocks come in size classes an eighth of a power of two apart (then whole pages), so tiles a
// few pixels apart in size share their blocks. A tensor touches only its own bytes of the block:
// the rest of the class costs address space, not memory.
size_t size_class(size_t n) {
  size_t top = size_t{1} << (63 - __builtin_clzll(n));
  size_t step = top >= 8 * kPage ? top / 8 : kPage;
  size_t bytes = (n + step - 1) / step * step;
  return (bytes + kPage - 1) / kPage * kPage;
}

struct Block {
  void* ptr;
  size_t bytes;
};

// Blocks are torch's own (c10::alloc_cpu) and handed out as simple data pointers, so whichever
// allocator frees one later, the pool's or torch's (free_cpu, after the scope), frees it right:
// oneDNN allocates raw memory through torch's CPU allocator and may free it at any time.
class BlockPool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    size_t bytes = n < kMinBytes ? 0 : size_class(n);
    void* ptr;
    std::list<Block> freed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (caps_.empty() || bytes == 0) return c10::GetDefaultCPUAllocator()->allocate(n);
      Block got = take(bytes, freed);
      if (got.ptr != nullptr) {  // a hit: one lock
        handed_[got.ptr] = got.bytes;
        return {got.ptr, got.ptr, &BlockPool::release, c10::Device(c10::DeviceType::CPU)};
      }
    }
    for (const Block& b : freed) c10::free_cpu(b.ptr);  // outside the lock, as the new block's allocation
    ptr = c10::alloc_cpu(bytes);  // throws torch's out-of-memory error
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!caps_.empty()) handed_[ptr] = bytes;  // else the scope closed meanwhile: free_cpu frees it
    }
    return {ptr, ptr, &BlockPool::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &BlockPool::release; }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  bool open(size_t cache_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (caps_.empty()) {
      // Only in place of torch's default allocator: memory it handed out may come back through
      // the pool's raw deleter, which frees what it does not know with free_cpu.
      if (c10::GetCPUAllocator() != c10::GetDefaultCPUAllocator()) return false;
      c10::SetCPUAllocator(this, /*priority=*/0);  // the default one is registered at priority 0
      if (c10::GetCPUAllocator() != this) return false;
      hits_ = misses_ = 0;
    }
    caps_.insert(cache_bytes);
    return true;
  }

  void close() {
    std::list<Block> freed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (caps_.empty()) return;
      caps_.erase(std::prev(caps_.end()));
      evict_over(caps_.empty() ? 0 : *caps_.rbegin(), freed);
      if (caps_.empty()) {
        // Blocks still in use are freed with free_cpu, by the pool or by torch: forgetting them
        // means no stale entry can claim an address that malloc hands out again later.
        handed_.clear();
        if (c10::GetCPUAllocator() == this) c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), 0);
      }
    }
    for (const Block& b : freed) c10::free_cpu(b.ptr);
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {!caps_.empty(), cached_, hits_, misses_};
  }

  static BlockPool& instance() {
    static BlockPool* pool = new BlockPool();  // never destroyed: tensors may outlive everything
    return *pool;
  }

 private:
  // The smallest cached block of this size class or up to a quarter larger: a smaller tensor
  // touches only its own pages, but the block keeps the pages it had (a bound of twice the size
  // raised the SD decode's peak by 12%). If there is none: {nullptr, bytes}, and as many bytes of
  // the oldest cached blocks go to `freed`, to be freed before new memory is taken, so the pool
  // and the tensors in use never hold more than the tensors in use held at their peak (under mu_).
  Block take(size_t bytes, std::list<Block>& freed) {
    auto it = by_size_.lower_bound(bytes);
    if (it == by_size_.end() || it->first > bytes + bytes / 4) {
      ++misses_;
      evict_over(cached_ > bytes ? cached_ - bytes : 0, freed);
      return {nullptr, bytes};
    }
    Block block = *it->second;
    lru_.erase(it->second);
    by_size_.erase(it);
    cached_ -= block.bytes;
    ++hits_;
    return block;
  }

  // The deleter of every block, on whatever thread frees it; also the raw deleter for memory
  // that torch's allocator handed out before the scope (not a block: free_cpu).
  static void release(void* ptr) {
    std::list<Block> freed;
    instance().keep(ptr, freed);
    for (const Block& b : freed) c10::free_cpu(b.ptr);
  }

  // Caches a block, the oldest ones making room; outside a scope, or larger than the cache, it
  // is freed. (free_cpu runs outside the lock: freeing large blocks takes a while.)
  void keep(void* ptr, std::list<Block>& freed) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handed_.find(ptr);
    if (it == handed_.end()) {
      freed.push_back({ptr, 0});
      return;
    }
    Block block{ptr, it->second};
    handed_.erase(it);
    size_t cap = caps_.empty() ? 0 : *caps_.rbegin();
    if (block.bytes > cap) {
      freed.push_back(block);
      return;
    }
    evict_over(cap - block.bytes, freed);
    lru_.push_back(block);
    by_size_.emplace(block.bytes, std::prev(lru_.end()));
    cached_ += block.bytes;
  }

  // Moves the oldest cached blocks to `freed` until at most `limit` bytes stay (under mu_).
  void evict_over(size_t limit, std::list<Block>& freed) {
    while (cached_ > limit) {
      const Block& oldest = lru_.front();
      for (auto it = by_size_.lower_bound(oldest.bytes); it != by_size_.end() && it->first == oldest.bytes; ++it) {
        if (it->second == lru_.begin()) {
          by_size_.erase(it);
          break;
        }
      }
      cached_ -= oldest.bytes;
      freed.splice(freed.end(), lru_, lru_.begin());
    }
  }

  std::mutex mu_;
  std::multiset<size_t> caps_;                 // cache_bytes of each open scope
  std::unordered_map<void*, size_t> handed_;  // blocks in use: their size class
  std::list<Block> lru_;                       // cached blocks, oldest first
  std::multimap<size_t, std::list<Block>::iterator> by_size_;
  size_t cached_ = 0, hits_ = 0, misses_ = 0;
};

}  // namespace

bool open(size_t cache_bytes) { return BlockPool::instance().open(cache_bytes); }
void close() { BlockPool::instance().close(); }
Stats stats() { return BlockPool::instance().stats(); }

}  // namespace pyext::pool
