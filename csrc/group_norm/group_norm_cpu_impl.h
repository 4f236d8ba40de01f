// Body of the CPU GroupNorm kernels, included by group_norm_cpu_{scalar,avx2,avx512}.cpp, which
// compile it for their own targets. Each pass converts x to fp32 once, into a buffer (fp32 x is
// read in place), and GCC auto-vectorises the fp32 loops: sums go to kLanes independent partial
// sums (a reduction that vectorises without -ffast-math), SiLU uses the branch-free exp_f32. The
// AVX-512 unit's channels-last passes are written in intrinsics instead, reading x as it lies
// (group_norm_rows_avx512.h).
// Units that target F16C define PYEXT_GN_F16C and convert fp16 with it. Internal linkage, so
// that no unit's copy replaces another's at link time.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#ifdef PYEXT_GN_F16C
#include <immintrin.h>
#endif

#include "common/half_rounding.h"
#include "group_norm/group_norm_cpu.h"
#ifdef PYEXT_GN_AVX512
#include "group_norm/group_norm_rows_avx512.h"
#endif

namespace pyext::cpu {
namespace {

template <PyextDtype D> using Io = DtypeIo<D>;
template <PyextDtype D> using Elem = typename DtypeIo<D>::T;

// e^x over the whole float range, branch-free (every case computed, one selected) so that loops
// over it vectorise. Cephes' expf: n = round(x / ln2), r = x - n ln2 with ln2 in two parts
// (Cody-Waite), a degree-6 polynomial for e^r on |r| <= ln2 / 2, times 2^n: within 1 ulp. 2^n is
// applied as two normal powers of two so that subnormal results come out right. Above
// ln(FLT_MAX) the result is inf, below ln of half the least subnormal 0; NaN stays NaN.
inline float exp_f32(float x) {
  constexpr float kMax = 88.72283935546875f, kMin = -103.97207708f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  // Selects on the bits (mask_if, half_rounding.h): GCC keeps float ternaries here as branches.
  const uint32_t over = mask_if(x > kMax), under = mask_if(x < kMin);  // both 0 for NaN
  const float xc = bits_float(select_bits(over, float_bits(kMax), select_bits(under, float_bits(kMin), float_bits(x))));
  const float t = xc * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // n in [-150, 128] sits in t's low mantissa bits; unsigned arithmetic keeps a NaN's bits defined.
  const uint32_t ni = float_bits(t) - float_bits(kRound);
  const uint32_t half = static_cast<uint32_t>(static_cast<int32_t>(ni) >> 1);
  const float e = p * bits_float((half + 127u) << 23) * bits_float((ni - half + 127u) << 23);
  return bits_float(select_bits(over, 0x7f800000u, float_bits(e) & ~under));
}

// x * sigmoid(x) as torch computes it, x / (1 + e^-x): within 2.5 ulp where e^-x is finite, -0
// below -88.72 (e^-x overflows), NaN at -inf.
inline float silu(float v) { return v / (1.0f + exp_f32(-v)); }

// ----------------------------------------------------------------------------- conversions

// out[i] = x[i] + add in fp32: the values the statistics and the norm are of.
template <PyextDtype D>
inline void load_run(const Elem<D>* __restrict x, float* __restrict out, int64_t n, float add) {
  int64_t i = 0;
#ifdef PYEXT_GN_F16C
  if constexpr (D == PYEXT_F16)  // vcvtph2ps is exact, as fp16_to_float
    for (const __m256 a = _mm256_set1_ps(add); i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))), a));
#endif
  for (; i < n; ++i) out[i] = Io<D>::load(x[i]) + add;
}

template <PyextDtype D>
inline void store_run(const float* __restrict v, Elem<D>* __restrict y, int64_t n) {
  int64_t i = 0;
#ifdef PYEXT_GN_F16C
  if constexpr (D == PYEXT_F16)  // vcvtps2ph rounds to nearest even and quiets NaN, as float_to_fp16
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) y[i] = Io<D>::store(v[i]);
}

// y = compute(x) over n elements, as fp32: fp32 in place, other dtypes through buf (2n floats).
template <PyextDtype D, class Fn>
inline void through_fp32(const Elem<D>* x, Elem<D>* y, int64_t n, float* buf, Fn compute) {
  if constexpr (D == PYEXT_F32) {
    compute(x, y);
  } else {
    load_run<D>(x, buf, n, 0.0f);
    compute(buf, buf + n);
    store_run<D>(buf + n, y, n);
  }
}

// Scratch floats owned by one call (no std:: template instantiated under this unit's target).
struct Scratch {
  float* p;
  explicit Scratch(int64_t n) : p(new float[n]) {}
  ~Scratch() { delete[] p; }
};

// ----------------------------------------------------------------------------- moments

constexpr int kLanes = 32;  // 4 AVX2 or 2 AVX-512 accumulators; the same sums at every SIMD level

struct Lanes {
  float v[kLanes] = {};
  double total() const {
    double s = 0;
    for (float f : v) s += f;
    return s;
  }
};

inline double sum_run(const float* __restrict v, int64_t n) {
  Lanes sum;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) sum.v[l] += v[i + l];
  for (int l = 0; i + l < n; ++l) sum.v[l] += v[i + l];
  return sum.total();
}

// s1 += d, s2 += d * d with d = v[i] - m.
inline void add_deviations(Lanes& s1, Lanes& s2, const float* __restrict v, int64_t n, float m) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float d = v[i + l] - m;
      s1.v[l] += d;
      s2.v[l] += d * d;
    }
  for (int l = 0; i + l < n; ++l) {
    const float d = v[i + l] - m;
    s1.v[l] += d;
    s2.v[l] += d * d;
  }
}

// Moments from a first-pass mean m and the sums of d = v - m and d^2: the corrected two-pass
// algorithm (Chan, Golub & LeVeque), which cancels m's own error from both mean and m2.
inline Moments corrected(double count, float m, double s1, double s2) {
  return {count, m + s1 / count, s2 - s1 * s1 / count};
}

// Chan's pairwise merge.
inline Moments merge(const Moments& a, const Moments& b) {
  const double count = a.count + b.count, delta = b.mean - a.mean;
  return {count, a.mean + delta * (b.count / count), a.m2 + b.m2 + delta * delta * (a.count / count * b.count)};
}

// ----------------------------------------------------------------------------- pass 1: stats

// Channels-first: chunk k of group (n, g), a contiguous run of the group that may span planes.
// Its values x + shift (shift constant along each plane's part) go to a buffer, read twice there.
template <PyextDtype D>
void stats_cf(const GroupNormArgs& a, Moments* parts, int64_t begin, int64_t end) {
  const int64_t cg = a.C / a.G, len = cg * a.S;
  Scratch buf(std::min(len, a.chunk));
  for (int64_t item = begin; item < end; ++item) {
    const int64_t ng = item / a.chunks, first = item % a.chunks * a.chunk, last = std::min(len, first + a.chunk);
    const Elem<D>* x = static_cast<const Elem<D>*>(a.x) + ng * len;
    auto values = [&]() -> const float* {
      if constexpr (D == PYEXT_F32)
        if (!a.shift) return x + first;  // x itself
      const Elem<D>* shift = a.shift ? static_cast<const Elem<D>*>(a.shift) + ng * cg : nullptr;  // the group's
      for (int64_t i = first, plane = first / a.S; i < last; ++plane) {
        const int64_t stop = std::min(last, (plane + 1) * a.S);
        load_run<D>(x + i, buf.p + (i - first), stop - i, shift ? Io<D>::load(shift[plane]) : 0.0f);
        i = stop;
      }
      return buf.p;
    };
    const float* v = values();
    const int64_t count = last - first;
    const float m = static_cast<float>(sum_run(v, count) / static_cast<double>(count));
    Lanes s1, s2;
    add_deviations(s1, s2, v, count, m);
    parts[item] = corrected(static_cast<double>(count), m, s1.total(), s2.total());
  }
}

// The channels-last sums take kRows rows at a time, so that each per-channel sum is loaded and
// stored once per kRows elements; the order of the additions depends on the row count alone.
constexpr int64_t kRows = 4;

// acc[c] += v[r * C + c] over `rows` rows.
inline void add_columns(float* __restrict acc, const float* v, int64_t C, int64_t rows) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    const float *__restrict v0 = v + r * C, *__restrict v1 = v0 + C, *__restrict v2 = v1 + C, *__restrict v3 = v2 + C;
    for (int64_t c = 0; c < C; ++c) acc[c] += (v0[c] + v1[c]) + (v2[c] + v3[c]);
  }
  for (; r < rows; ++r) {
    const float* __restrict v0 = v + r * C;
    for (int64_t c = 0; c < C; ++c) acc[c] += v0[c];
  }
}

// s1[c] += d, s2[c] += d * d with d = (v[r * C + c] + add[c]) - m[c] over `rows` rows.
inline void add_column_deviations(float* __restrict s1, float* __restrict s2, const float* __restrict add,
                                  const float* __restrict m, const float* v, int64_t C, int64_t rows) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    const float *__restrict v0 = v + r * C, *__restrict v1 = v0 + C, *__restrict v2 = v1 + C, *__restrict v3 = v2 + C;
    for (int64_t c = 0; c < C; ++c) {
      const float d0 = (v0[c] + add[c]) - m[c], d1 = (v1[c] + add[c]) - m[c];
      const float d2 = (v2[c] + add[c]) - m[c], d3 = (v3[c] + add[c]) - m[c];
      s1[c] += (d0 + d1) + (d2 + d3);
      s2[c] += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
    }
  }
  for (; r < rows; ++r) {
    const float* __restrict v0 = v + r * C;
    for (int64_t c = 0; c < C; ++c) {
      const float d = (v0[c] + add[c]) - m[c];
      s1[c] += d;
      s2[c] += d * d;
    }
  }
}

// The moments of a block of `pixels` channels-last pixels, all groups at once, into parts[0..G),
// each value plus its channel's sh[c]: sums(col) adds each channel's values to col[c] (as
// add_columns), deviations(s1, s2, pivot) each channel's deviations from pivot[c] and their squares
// (as add_column_deviations, with sh). Per-channel sums run along the pixels (vectorised over
// channels), each group adds up its channels for a pivot, then the sums of deviations from it.
// work: 4C + G floats.
template <class Sums, class Deviations>
void block_moments(int64_t C, int64_t G, int64_t pixels, const float* sh, Sums sums, Deviations deviations,
                   float* work, Moments* parts) {
  const int64_t cg = C / G;
  float *col = work, *pivot = col + C, *s1 = pivot + C, *s2 = s1 + C, *gm = s2 + C;
  for (int64_t c = 0; c < C; ++c) col[c] = s1[c] = s2[c] = 0.0f;
  sums(col);
  const double count = static_cast<double>(pixels * cg);
  for (int64_t g = 0; g < G; ++g) {
    double s = 0;
    for (int64_t c = g * cg; c < (g + 1) * cg; ++c) s += col[c] + static_cast<double>(pixels) * sh[c];
    gm[g] = static_cast<float>(s / count);
    for (int64_t c = g * cg; c < (g + 1) * cg; ++c) pivot[c] = gm[g];
  }
  deviations(s1, s2, pivot);
  for (int64_t g = 0; g < G; ++g) {
    double t1 = 0, t2 = 0;
    for (int64_t c = g * cg; c < (g + 1) * cg; ++c) t1 += s1[c], t2 += s2[c];
    parts[g] = corrected(count, gm[g], t1, t2);
  }
}

// Channels-last: a block of rows of sample n (one contiguous run of pixels), with its shift. The
// AVX-512 unit reads the rows as they lie; the others through an fp32 copy of the block.
template <PyextDtype D>
void stats_cl(const GroupNormArgs& a, Moments* parts, int64_t begin, int64_t end) {
  const int64_t C = a.C;
#ifdef PYEXT_GN_AVX512
  constexpr int64_t copied = 0;
#else
  const int64_t copied = D == PYEXT_F32 ? 0 : a.chunk * C;
#endif
  Scratch scratch(5 * C + a.G + copied);  // shift, block_moments' work, the rows as fp32
  float *sh = scratch.p, *work = sh + C;
  [[maybe_unused]] float* rows_fp32 = work + 4 * C + a.G;  // (the AVX-512 unit reads the rows in place)
  for (int64_t item = begin; item < end; ++item) {
    const int64_t n = item / a.chunks, r0 = item % a.chunks * a.chunk, rows = std::min(a.chunk, a.S - r0);
    const Elem<D>* x = static_cast<const Elem<D>*>(a.x) + (n * a.S + r0) * C;
    const Elem<D>* shift = a.shift ? static_cast<const Elem<D>*>(a.shift) + n * C : nullptr;
    for (int64_t c = 0; c < C; ++c) sh[c] = shift ? Io<D>::load(shift[c]) : 0.0f;
#ifdef PYEXT_GN_AVX512
    block_moments(C, a.G, rows, sh, [&](float* col) { add_columns_avx512<D>(col, x, C, rows); },
                  [&](float* s1, float* s2, const float* pivot) {
                    add_column_deviations_avx512<D>(s1, s2, sh, pivot, x, C, rows);
                  }, work, parts + item * a.G);
#else
    const float* v = rows_fp32;
    if constexpr (D == PYEXT_F32) v = x;
    else load_run<D>(x, rows_fp32, rows * C, 0.0f);
    block_moments(C, a.G, rows, sh, [&](float* col) { add_columns(col, v, C, rows); },
                  [&](float* s1, float* s2, const float* pivot) {
                    add_column_deviations(s1, s2, sh, pivot, v, C, rows);
                  }, work, parts + item * a.G);
#endif
  }
}

// group_moments: a block of rows x cols pixels of a (cropped) channels-last sample, each row
// of the block a run (the rows of a crop are apart), no shift.
template <PyextDtype D>
void moments_cl(const MomentsArgs& a, Moments* parts, int64_t begin, int64_t end) {
  const int64_t C = a.C;
  Scratch scratch(5 * C + a.G + (D == PYEXT_F32 ? 0 : a.cols * C));  // zero shift, block_moments' work, a row
  float *zero = scratch.p, *work = zero + C, *row_fp32 = work + 4 * C + a.G;
  for (int64_t c = 0; c < C; ++c) zero[c] = 0.0f;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t n = item / (a.row_blocks * a.col_blocks), block_row = item / a.col_blocks % a.row_blocks;
    const int64_t h0 = block_row * a.rows, h1 = std::min(a.H, h0 + a.rows);
    const int64_t w0 = item % a.col_blocks * a.cols, width = std::min(a.W - w0, a.cols);
    auto row = [&](int64_t i) -> const float* {  // row h0 + i of the block, as fp32
      const Elem<D>* x = static_cast<const Elem<D>*>(a.x) + n * a.sample_stride + (h0 + i) * a.row_stride + w0 * C;
      if constexpr (D == PYEXT_F32) return x;
      load_run<D>(x, row_fp32, width * C, 0.0f);
      return row_fp32;
    };
    block_moments(C, a.G, (h1 - h0) * width, zero,
                  [&](float* col) {
                    for (int64_t i = 0; i < h1 - h0; ++i) add_columns(col, row(i), C, width);
                  },
                  [&](float* s1, float* s2, const float* pivot) {
                    for (int64_t i = 0; i < h1 - h0; ++i) add_column_deviations(s1, s2, zero, pivot, row(i), C, width);
                  }, work, parts + item * a.G);
  }
}

// ----------------------------------------------------------------------------- merge, fold

void merge_moments(const MomentsArgs& a, const Moments* parts, double* mean, double* m2) {
  const int64_t items = a.row_blocks * a.col_blocks;
  for (int64_t n = 0; n < a.N; ++n)
    for (int64_t g = 0; g < a.G; ++g) {
      Moments m = parts[n * items * a.G + g];
      for (int64_t k = 1; k < items; ++k) m = merge(m, parts[(n * items + k) * a.G + g]);
      mean[n * a.G + g] = m.mean;
      m2[n * a.G + g] = m.m2;
    }
}

template <PyextDtype D>
void finish(const GroupNormArgs& a, const Moments* parts, const ChannelParams& p) {
  const int64_t cg = a.C / a.G;
  for (int64_t n = 0; n < a.N; ++n)
    for (int64_t g = 0; g < a.G; ++g) {
      auto part = [&](int64_t k) {
        return a.channels_last ? parts[(n * a.chunks + k) * a.G + g] : parts[(n * a.G + g) * a.chunks + k];
      };
      Moments m = part(0);
      for (int64_t k = 1; k < a.chunks; ++k) m = merge(m, part(k));
      const double var = m.m2 / m.count;  // a negative rounding residue clamps to 0, NaN stays
      const double rstd = 1.0 / std::sqrt((var < 0 ? 0.0 : var) + a.eps);
      for (int64_t c = g * cg; c < (g + 1) * cg; ++c) {
        const int64_t j = n * a.C + c;
        const double w = a.weight ? load_elem(a.weight, c, a.weight_dtype) : 1.0;
        const double b = a.bias ? load_elem(a.bias, c, a.bias_dtype) : 0.0;
        const float hi = static_cast<float>(m.mean);
        const double scale = w * rstd;
        p.shift[j] = a.shift ? Io<D>::load(static_cast<const Elem<D>*>(a.shift)[j]) : 0.0f;
        p.mean_hi[j] = hi;
        p.scale[j] = static_cast<float>(scale);
        p.offset[j] = static_cast<float>(b - (m.mean - hi) * scale);
      }
    }
}

// ----------------------------------------------------------------------------- pass 2: apply

// One output value: the shift, the folded affine map, then the activation.
template <bool SILU>
inline float normalize(float v, float sh, float m, float s, float o) {
  const float y = ((v + sh) - m) * s + o;
  if constexpr (SILU) return silu(y);
  return y;
}

// A run of one channels-first plane: one set of constants.
template <bool SILU>
inline void normalize_run(const float* __restrict v, float* __restrict y, int64_t n, float sh, float m, float s,
                          float o) {
  for (int64_t i = 0; i < n; ++i) y[i] = normalize<SILU>(v[i], sh, m, s, o);
}

// One channels-last row: each channel its own constants.
template <bool SILU>
inline void normalize_row(const float* __restrict v, float* __restrict y, int64_t C, const float* __restrict sh,
                          const float* __restrict m, const float* __restrict s, const float* __restrict o) {
  for (int64_t c = 0; c < C; ++c) y[c] = normalize<SILU>(v[c], sh[c], m[c], s[c], o[c]);
}

template <PyextDtype D, bool SILU>
void apply(const GroupNormArgs& a, const ChannelParams& p, int64_t begin, int64_t end) {
  const Elem<D>* x = static_cast<const Elem<D>*>(a.x);
  Elem<D>* y = static_cast<Elem<D>*>(a.y);
  const bool in_place = D == PYEXT_F32;
  if (a.channels_last) {  // items are the stats' blocks of rows
#ifdef PYEXT_GN_AVX512
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / a.chunks, r0 = item % a.chunks * a.chunk, rows = std::min(a.chunk, a.S - r0);
      const int64_t at = (n * a.S + r0) * a.C, j = n * a.C;
      normalize_rows_avx512<D, SILU>(x + at, y + at, rows, a.C, p.shift + j, p.mean_hi + j, p.scale + j, p.offset + j);
    }
#else
    Scratch buf(in_place ? 0 : 2 * a.chunk * a.C);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / a.chunks, r0 = item % a.chunks * a.chunk, rows = std::min(a.chunk, a.S - r0);
      const int64_t at = (n * a.S + r0) * a.C, j = n * a.C;
      through_fp32<D>(x + at, y + at, rows * a.C, buf.p, [&](const float* v, float* out) {
        for (int64_t r = 0; r < rows; ++r)
          normalize_row<SILU>(v + r * a.C, out + r * a.C, a.C, p.shift + j, p.mean_hi + j, p.scale + j, p.offset + j);
      });
    }
#endif
    return;
  }
  const int64_t blocks = (a.S + a.apply_block - 1) / a.apply_block;
  Scratch buf(in_place ? 0 : 2 * std::min(a.S, a.apply_block));
  // items (plane, block) in order, counted without a division per item (small planes: many items)
  for (int64_t item = begin, plane = begin / blocks, b = begin % blocks; item < end; ++item) {
    const int64_t i0 = b * a.apply_block, len = std::min(a.S - i0, a.apply_block), at = plane * a.S + i0;
    through_fp32<D>(x + at, y + at, len, buf.p, [&](const float* v, float* out) {
      normalize_run<SILU>(v, out, len, p.shift[plane], p.mean_hi[plane], p.scale[plane], p.offset[plane]);
    });
    if (++b == blocks) b = 0, ++plane;
  }
}

template <PyextDtype D>
void stats(const GroupNormArgs& a, Moments* parts, int64_t begin, int64_t end) {
  a.channels_last ? stats_cl<D>(a, parts, begin, end) : stats_cf<D>(a, parts, begin, end);
}

template <PyextDtype D>
void apply_any(const GroupNormArgs& a, const ChannelParams& p, int64_t begin, int64_t end) {
  a.silu ? apply<D, true>(a, p, begin, end) : apply<D, false>(a, p, begin, end);
}

template <PyextDtype D>
GroupNormKernel kernel_of() {
  return {stats<D>, finish<D>, apply_any<D>, moments_cl<D>, merge_moments};
}

inline GroupNormKernel kernel_for(PyextDtype dtype) {
  switch (dtype) {
    case PYEXT_F16: return kernel_of<PYEXT_F16>();
    case PYEXT_BF16: return kernel_of<PYEXT_BF16>();
    default: return kernel_of<PYEXT_F32>();
  }
}

}  // namespace
}  // namespace pyext::cpu
