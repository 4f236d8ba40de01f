// A scoped pool for torch's large CPU tensors: while a scope is open, blocks freed are kept
// for the next tensors of about their size instead of going back to the OS.
//
// Why: a tiled run allocates the same few tile-sized tensors over and over. Each fresh large
// allocation is new pages, and every page costs a fault on first touch; where malloc hands large
// blocks back to the OS at once (glibc with a low mmap threshold, musl), the faults take as long
// as the convolutions. The pool keeps at most `cache_bytes` of freed blocks, and frees all of
// them when the last scope closes.
#pragma once

#include <cstddef>

namespace pyext::pool {

struct Stats {
  bool open;
  size_t cached_bytes;  // freed blocks kept for reuse
  size_t hits;          // allocations served from them since the outermost scope opened
  size_t misses;        // allocations that took new memory in that time
};

// Opens a scope (scopes nest: the widest cache_bytes of the open ones applies). Returns false,
// and changes nothing, where torch's CPU allocator is not its default one, or could not be
// replaced (another one was set with a higher priority).
bool open(size_t cache_bytes);
// Closes a scope; the last one frees the cache and puts back the allocator it replaced.
void close();
Stats stats();

}  // namespace pyext::pool
