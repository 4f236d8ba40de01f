// The fp32-accumulating flash-attention algorithm, written once over a small
// vector-traits struct `V` (lanes kW, load/store/set1/fma/max/exp2, reductions)
// and included by each SIMD unit with its own target attributes. No torch here.
//
// Packed layout per (batch, head):
//   K: [ceil(skv / kW) stripes][d][kW]  fp32  - one vector holds kW keys' d-th value,
//      so q . k for kW keys is d broadcast-FMAs (no horizontal sums).
//   V: [skv][dv = round_up(d, kW)]       fp32  - rows zero-padded to whole vectors.
// Zero padding makes padded keys score 0; they are masked to -inf before softmax.
#pragma once
#include <algorithm>
#include <cmath>
#include <memory>

#include "attention/attention_cpu.h"
#include "common/half_rounding.h"

// Everything here has internal linkage: each SIMD unit gets its own copy compiled
// for its own target, so the linker can never hand an AVX-512 body to the scalar unit.
namespace pyext::cpu::attn {
namespace {

constexpr int64_t kBlockKv = 256;  // keys per online-softmax step: scores for R rows stay in L1
constexpr int64_t kPass = 64;      // query rows that share one pass over k/v (AttnKernel::query_block)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The online softmax subtracts the running max before exp2. While a row has seen only
// -inf scores (masked keys, or fp32 scores that overflowed), that max is -inf and
// exp2(-inf - -inf) would be NaN: subtracting 0 instead gives p = 0 and alpha = 0.
inline float softmax_shift(float running_max) { return running_max == -INFINITY ? 0.0f : running_max; }

// A pass of nr query rows (from row r0) starts from the carried o, m, l, or from nothing: o in
// scratch rows of dv columns (padding columns stay 0), `tile_rows` of them (whole tiles).
inline void carry_in(const AttnCarry* carry, int64_t r0, int64_t nr, int64_t tile_rows, int64_t d, int64_t dv,
                     float* o, float* m, float* l) {
  std::fill(o, o + tile_rows * dv, 0.0f);
  for (int64_t r = 0; r < tile_rows; ++r) m[r] = -INFINITY, l[r] = 0.0f;
  if (carry == nullptr || carry->first) return;
  for (int64_t r = 0; r < nr; ++r) {
    std::copy(carry->o + (r0 + r) * d, carry->o + (r0 + r + 1) * d, o + r * dv);
    m[r] = carry->m[r0 + r], l[r] = carry->l[r0 + r];
  }
}

// The end of a pass: carry o, m, l on to the next chunk, or normalise into out (type t) and
// write each row's log-sum-exp to lse (if not null). biased: the scores had a bias added and
// are in natural units (else base 2).
inline void carry_out(const AttnCarry* carry, int64_t r0, int64_t nr, int64_t d, int64_t dv, const float* o,
                      const float* m, const float* l, PyextDtype t, void* out, int64_t ldo, float* lse,
                      bool biased) {
  if (carry != nullptr && !carry->last) {
    for (int64_t r = 0; r < nr; ++r) {
      std::copy(o + r * dv, o + r * dv + d, carry->o + (r0 + r) * d);
      carry->m[r0 + r] = m[r], carry->l[r0 + r] = l[r];
    }
    return;
  }
  for (int64_t r = 0; r < nr; ++r) {
    // l = 0 only where every score is -inf (the row's max key adds exp2(0) = 1 otherwise). With
    // a bias that is a fully masked row: it attends to nothing and gives 0, as torch's SDPA
    // does, even where a masked key's v is NaN (o holds 0 * NaN then). Without a bias it is fp32
    // overflow, and 0 * (1 / 0) keeps softmax's NaN.
    if (biased && l[r] == 0.0f)
      for (int64_t c = 0; c < d; ++c) store_elem(out, (r0 + r) * ldo + c, 0.0f, t);
    else
      store_scaled_row(out, (r0 + r) * ldo, o + r * dv, 1.0f / l[r], d, t);
    if (lse != nullptr) lse[r0 + r] = (biased ? m[r] : m[r] * kLn2) + std::log(l[r]);  // -inf where l = 0
  }
}

// The scores of one query row and nc keys += that row's bias (natural units).
template <class V>
inline void add_bias(float* s, const float* bias, int64_t nc) {
  int64_t j = 0;
  for (; j + V::kW <= nc; j += V::kW) V::store(s + j, V::add(V::load(s + j), V::load(bias + j)));
  for (; j < nc; ++j) s[j] += bias[j];  // the bias row may end here: no whole-vector load past it
}

// Per-thread scratch that grows and is reused across calls (no allocation per block).
struct Scratch {
  std::unique_ptr<float[]> data;
  size_t size = 0;
  float* get(size_t n) {
    if (size < n) data.reset(new float[n]), size = n;
    return data.get();
  }
};

// R: query rows per register tile; NC: output vectors per p @ v register tile; KS: key stripes
// per q k^T register tile. R * KS and R * NC accumulators must hide the FMA latency.
template <class V, int R, int NC, int KS = 1>
struct Fp32Attention {
  using reg = typename V::reg;
  static constexpr int64_t W = V::kW;

  static size_t packed_bytes(int64_t skv, int64_t d) {
    return static_cast<size_t>(round_up(skv, W) * d + skv * round_up(d, W)) * sizeof(float);
  }

  // One dtype's pack: k and v read in memory order (a key's row at a time), the dtype's switch
  // outside the loops. At short sequences (SD's 256 tokens at head dim 160) packing is a
  // sizeable part of a call.
  template <PyextDtype D>
  static void pack_as(const void* k, int64_t ldk, const void* v, int64_t ldv, int64_t skv, int64_t d, void* packed) {
    using T = typename DtypeIo<D>::T;
    const T* kt = static_cast<const T*>(k);
    const T* vt = static_cast<const T*>(v);
    float* kp = static_cast<float*>(packed);
    float* vp = kp + round_up(skv, W) * d;
    const int64_t dv = round_up(d, W);
    for (int64_t j0 = 0; j0 < skv; j0 += W) {
      float* stripe = kp + j0 * d;  // [d][W]: lane l holds key j0 + l
      for (int64_t l = 0; l < W; ++l) {
        if (j0 + l < skv)
          for (int64_t c = 0; c < d; ++c) stripe[c * W + l] = DtypeIo<D>::load(kt[(j0 + l) * ldk + c]);
        else
          for (int64_t c = 0; c < d; ++c) stripe[c * W + l] = 0.0f;
      }
    }
    for (int64_t j = 0; j < skv; ++j) {
      for (int64_t c = 0; c < d; ++c) vp[j * dv + c] = DtypeIo<D>::load(vt[j * ldv + c]);
      std::fill(vp + j * dv + d, vp + (j + 1) * dv, 0.0f);
    }
  }

  static void pack(const void* k, int64_t ldk, const void* v, int64_t ldv, int64_t skv, int64_t d, PyextDtype t,
                   void* packed) {
    switch (t) {
      case PYEXT_BF16: return pack_as<PYEXT_BF16>(k, ldk, v, ldv, skv, d, packed);
      case PYEXT_F16: return pack_as<PYEXT_F16>(k, ldk, v, ldv, skv, d, packed);
      default: return pack_as<PYEXT_F32>(k, ldk, v, ldv, skv, d, packed);
    }
  }

  // s[r][n*W + l] = (q[r] . k[n*W + l]) * c2 for N stripes of W keys from `ks` (stripe n at
  // ks + n*W*d): each k vector loaded feeds R rows, each q broadcast N stripes.
  template <int N>
  static inline void qk_tile(const float* qf, int64_t d, const float* ks, float c2, float* s) {
    reg acc[R][N];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < N; ++n) acc[r][n] = V::zero();
    for (int64_t c = 0; c < d; ++c) {
      reg kv[N];
      for (int n = 0; n < N; ++n) kv[n] = V::load(ks + n * W * d + c * W);
      for (int r = 0; r < R; ++r) {
        const reg qb = V::set1(qf[r * d + c]);
        for (int n = 0; n < N; ++n) acc[r][n] = V::fma(qb, kv[n], acc[r][n]);
      }
    }
    const reg vc2 = V::set1(c2);
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < N; ++n) V::store(s + r * kBlockKv + n * W, V::mul(acc[r][n], vc2));
  }

  // o[r][c + n*W] = o * alpha[r] + sum_j p[r][j] * v[j][c + n*W] for n < N. The block's sum
  // starts from zero and o joins it at the end, so fp32 rounding grows with a block's length,
  // not with the whole row's.
  template <int N>
  static inline void pv_tile(const float* s, int64_t nc, const float* vp, int64_t dv, int64_t c, float* o,
                             const float* alpha) {
    reg acc[R][N];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < N; ++n) acc[r][n] = V::zero();
    for (int64_t j = 0; j < nc; ++j) {
      reg vv[N];
      for (int n = 0; n < N; ++n) vv[n] = V::load(vp + j * dv + c + n * W);
      for (int r = 0; r < R; ++r) {
        const reg p = V::set1(s[r * kBlockKv + j]);
        for (int n = 0; n < N; ++n) acc[r][n] = V::fma(p, vv[n], acc[r][n]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const reg a = V::set1(alpha[r]);
      for (int n = 0; n < N; ++n) {
        float* on = o + r * dv + c + n * W;
        V::store(on, V::fma(V::load(on), a, acc[r][n]));
      }
    }
  }

  // Without a bias the scores are kept in base 2 (scaled by log2e), so p = exp2(s - max) needs
  // no multiply. With one they stay natural and the exponent is scaled instead: log2e times a
  // mask of float's lowest value would overflow to -inf, and a row masked that way would
  // attend to nothing instead of (as softmax does) to every key alike. kBias is a template
  // argument so that the unbiased loops carry no bias code.
  template <bool kBias>
  static void forward_impl(const void* q, int64_t ldq, int64_t rows, const void* packed, int64_t skv, int64_t d,
                           float scale, const float* bias, int64_t bias_stride, PyextDtype t, void* out,
                           int64_t ldo, float* lse, const AttnCarry* carry) {
    const float* kp = static_cast<const float*>(packed);
    const float* vp = kp + round_up(skv, W) * d;
    const int64_t dv = round_up(d, W);
    const float c2 = kBias ? scale : scale * kLog2e;  // exp(x * scale) = exp2(x * scale * log2e)
    thread_local Scratch buf;
    constexpr int64_t kTileRows = round_up(kPass, R);  // a pass's last tile may run past its rows
    float* qall = buf.get(static_cast<size_t>(kTileRows * d + kTileRows * dv + R * kBlockKv));
    float* o = qall + kTileRows * d;
    float* s = o + kTileRows * dv;
    float m_all[kTileRows], l_all[kTileRows], alpha_all[kTileRows];

    // Up to kPass query rows share each block of keys (kept in L2) before the next block,
    // so k/v that outgrow L2 (fp32 packs, long sequences) are streamed kPass / R times less.
    for (int64_t r0 = 0; r0 < rows; r0 += kPass) {
      const int64_t nr = std::min(kPass, rows - r0), ng = (nr + R - 1) / R;
      // Rows past the end compute on zeros (and the last row's bias) and are never stored.
      for (int64_t r = 0; r < ng * R; ++r)
        for (int64_t c = 0; c < d; ++c) qall[r * d + c] = r < nr ? load_elem(q, (r0 + r) * ldq + c, t) : 0.0f;
      carry_in(carry, r0, nr, ng * R, d, dv, o, m_all, l_all);

      for (int64_t j0 = 0; j0 < skv; j0 += kBlockKv) {
        const int64_t nc = std::min(kBlockKv, skv - j0), ncp = round_up(nc, W);
        for (int64_t g = 0; g < ng; ++g) {
          const float* qf = qall + g * R * d;
          float* og = o + g * R * dv;
          float* m = m_all + g * R;
          float* l = l_all + g * R;
          float* alpha = alpha_all + g * R;
          // s = (q k^T) * c2, KS stripes of W keys at a time, then single stripes.
          int64_t js = 0;
          for (; js + KS * W <= ncp; js += KS * W) qk_tile<KS>(qf, d, kp + (j0 + js) * d, c2, s + js);
          for (; js < ncp; js += W) qk_tile<1>(qf, d, kp + (j0 + js) * d, c2, s + js);
          // Online softmax: new running max, rescale factor for what was accumulated, p = exp2(s - max).
          for (int r = 0; r < R; ++r) {
            float* sr = s + r * kBlockKv;
            if constexpr (kBias) {
              const int64_t row = r0 + std::min<int64_t>(g * R + r, nr - 1);
              add_bias<V>(sr, bias + row * bias_stride + j0, nc);
            }
            for (int64_t j = nc; j < ncp; ++j) sr[j] = -INFINITY;
            reg vm = V::set1(-INFINITY);
            for (int64_t j = 0; j < ncp; j += W) vm = V::max(vm, V::load(sr + j));
            const float m_new = std::max(m[r], V::reduce_max(vm)), shift = softmax_shift(m_new);
            const float dm = m[r] - shift;
            alpha[r] = std::exp2(kBias ? dm * kLog2e : dm);  // exp2(-inf) = 0 on the first block
            m[r] = m_new;
            const reg vmn = V::set1(shift);
            reg sum = V::zero();
            for (int64_t j = 0; j < ncp; j += W) {
              reg x = V::sub(V::load(sr + j), vmn);
              if constexpr (kBias) x = V::mul(x, V::set1(kLog2e));
              const reg p = V::exp2(x);
              V::store(sr + j, p);
              sum = V::add(sum, p);
            }
            l[r] = l[r] * alpha[r] + V::reduce_add(sum);
          }
          // o = o * alpha + p @ v
          int64_t c = 0;
          for (; c + NC * W <= dv; c += NC * W) pv_tile<NC>(s, nc, vp + j0 * dv, dv, c, og, alpha);
          for (; c < dv; c += W) pv_tile<1>(s, nc, vp + j0 * dv, dv, c, og, alpha);
        }
      }
      carry_out(carry, r0, nr, d, dv, o, m_all, l_all, t, out, ldo, lse, kBias);
    }
  }

  static void forward(const void* q, int64_t ldq, int64_t rows, const void* packed, int64_t skv, int64_t d,
                      float scale, const float* bias, int64_t bias_stride, PyextDtype t, void* out, int64_t ldo,
                      float* lse, const AttnCarry* carry) {
    (bias != nullptr ? forward_impl<true> : forward_impl<false>)(q, ldq, rows, packed, skv, d, scale, bias,
                                                                 bias_stride, t, out, ldo, lse, carry);
  }

  static AttnKernel kernel() { return AttnKernel{packed_bytes, pack, forward, kPass}; }
};

// 2^f for f in [-0.5, 0.5]: Taylor series of exp(f ln 2) to degree 7, relative error < 1e-8.
template <class V>
inline typename V::reg exp2_poly(typename V::reg f) {
  typename V::reg p = V::set1(1.5252734e-05f);
  p = V::fma(p, f, V::set1(1.5403530e-04f));
  p = V::fma(p, f, V::set1(1.3333558e-03f));
  p = V::fma(p, f, V::set1(9.6181291e-03f));
  p = V::fma(p, f, V::set1(5.5504109e-02f));
  p = V::fma(p, f, V::set1(2.4022651e-01f));
  p = V::fma(p, f, V::set1(6.9314718e-01f));
  return V::fma(p, f, V::set1(1.0f));
}

}  // namespace
}  // namespace pyext::cpu::attn
