// bf16 pairs into the VNNI layout brgemm takes, in plain C++: the portable twins of
// common/pairs_avx512.h, which write the same words.
#pragma once
#include <cstdint>

namespace pyext::cpu {

// dst[p * ld_dst + r] = the pair (src[r * ld_src + 2p], src[r * ld_src + 2p + 1]) for `rows` rows
// and `pairs` pairs (the first element in the low half).
inline void transpose_pairs(const uint16_t* src, int64_t rows, int64_t pairs, int64_t ld_src, uint32_t* dst,
                            int64_t ld_dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < pairs; ++p)
      dst[p * ld_dst + r] = src[r * ld_src + 2 * p] | static_cast<uint32_t>(src[r * ld_src + 2 * p + 1]) << 16;
}

// dst[c] = the pair (a[c], b[c]) for n columns: two rows interleaved.
inline void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t n, uint32_t* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = a[c] | static_cast<uint32_t>(b[c]) << 16;
}

}  // namespace pyext::cpu
