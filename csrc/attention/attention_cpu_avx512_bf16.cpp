// AVX-512 + AVX512_BF16 flash attention for bf16 inputs: both products use
// vdpbf16ps (fp32 += a0*b0 + a1*b1 over bf16 pairs), twice the multiply rate of
// fp32 FMA, and k/v are packed as bf16 so they take half the cache.
//
// Packed layout per (batch, head):
//   K: [ceil(skv/16) stripes][d2/2 pairs][16 keys][2]   (d2 = d rounded up to even)
//      a vector = 16 keys x one (d, d+1) pair; q's pair is broadcast as one 32-bit lane.
//   V: [ceil(skv/2) key pairs][dv = round_up(d, 16)][2]
//      a vector = 16 output columns x one (j, j+1) key pair; p's pair is broadcast.
// Softmax probabilities are rounded to bf16 for p @ v (as FlashAttention does on
// GPUs); the running max, the row sums and the output accumulate in fp32.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include "attention/attention_cpu_vec_avx512.h"

namespace pyext::cpu {
namespace attn {
namespace {

constexpr int R = 8;   // query rows per register tile
constexpr int NC = 3;  // output vectors per p @ v tile: 24 accumulators

inline __m512 dot2(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

inline __mmask16 valid_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : static_cast<__mmask16>((1u << n) - 1);
}

// 2^x for x <= 0 to ~2e-6 relative (Taylor degree 5 on [-0.5, 0.5]): p is rounded to
// bf16 (2^-9) right after, so the two extra terms of the fp32 path buy nothing here.
// NaN stays NaN, and no denormal is made, as in VecAvx512::exp2.
inline __m512 exp2_bf16(__m512 x) {
  return VecAvx512::exp2_scaled(x, [](__m512 f) {
    __m512 p = _mm512_set1_ps(1.3333558e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-01f));
    return _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  });
}

// The scores of a stripe of keys from key j: a * c2 (+ bias_row[j...]), -inf past the valid
// keys. The bias row may end inside the stripe, so it is read under the valid-key mask.
template <bool kBias>
inline __m512 score(__m512 a, __m512 c2, __mmask16 ok, const float* bias_row, int64_t j) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  if constexpr (!kBias) return _mm512_mask_mul_ps(ninf, ok, a, c2);
  return _mm512_mask_mov_ps(ninf, ok, _mm512_fmadd_ps(a, c2, _mm512_maskz_loadu_ps(ok, bias_row + j)));
}

size_t packed_bytes(int64_t skv, int64_t d) {
  return static_cast<size_t>(round_up(skv, 16) * round_up(d, 2) + round_up(skv, 2) * round_up(d, 16)) * 2;
}

void pack(const void* k, int64_t ldk, const void* v, int64_t ldv, int64_t skv, int64_t d, PyextDtype, void* packed) {
  const uint16_t* ks = static_cast<const uint16_t*>(k);
  const uint16_t* vs = static_cast<const uint16_t*>(v);
  uint16_t* kp = static_cast<uint16_t*>(packed);
  const int64_t d2 = round_up(d, 2), dv = round_up(d, 16);
  uint16_t* vp = kp + round_up(skv, 16) * d2;
  for (int64_t j0 = 0; j0 < skv; j0 += 16)
    for (int64_t c = 0; c < d2; c += 2)
      for (int64_t l = 0; l < 16; ++l)
        for (int64_t e = 0; e < 2; ++e)
          kp[j0 * d2 + c * 16 + l * 2 + e] = (j0 + l < skv && c + e < d) ? ks[(j0 + l) * ldk + c + e] : 0;
  for (int64_t j = 0; j < round_up(skv, 2); j += 2)
    for (int64_t c = 0; c < dv; ++c)
      for (int64_t e = 0; e < 2; ++e)
        vp[j * dv + c * 2 + e] = (j + e < skv && c < d) ? vs[(j + e) * ldv + c] : 0;
}

// acc[r][n] = o * alpha + sum over key pairs of p[r][pair] . v[pair][c + 16n]
template <int N>
inline void pv_tile(const uint32_t* pb, int64_t npairs, const uint16_t* vp, int64_t dv, int64_t c, float* o,
                    const float* alpha) {
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dv + c + n * 16), a);
  }
  for (int64_t jp = 0; jp < npairs; ++jp) {
    __m512i vv[N];
    for (int n = 0; n < N; ++n) vv[n] = _mm512_loadu_si512(vp + (jp * dv + c + n * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512i p = _mm512_set1_epi32(static_cast<int>(pb[r * (kBlockKv / 2) + jp]));
      for (int n = 0; n < N; ++n) acc[r][n] = dot2(acc[r][n], p, vv[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(o + r * dv + c + n * 16, acc[r][n]);
}

// Scores in base 2 without a bias, natural with one: as in Fp32Attention::forward_impl.
template <bool kBias>
void forward_impl(const void* q, int64_t ldq, int64_t rows, const void* packed, int64_t skv, int64_t d, float scale,
                  const float* bias, int64_t bias_stride, PyextDtype t, void* out, int64_t ldo, float* lse,
                  const AttnCarry* carry) {
  const int64_t d2 = round_up(d, 2), dv = round_up(d, 16);
  const uint16_t* kp = static_cast<const uint16_t*>(packed);
  const uint16_t* vp = kp + round_up(skv, 16) * d2;
  const uint16_t* qs = static_cast<const uint16_t*>(q);
  const float c2 = kBias ? scale : scale * kLog2e;
  // Scratch: o (fp32, kPass x dv), s (fp32, R x block), q pairs (kPass) and p pairs (R), bf16 as uint32 lanes.
  thread_local Scratch buf;
  float* o = buf.get(static_cast<size_t>(kPass * dv + R * kBlockKv + kPass * d2 / 2 + R * kBlockKv / 2));
  float* s = o + kPass * dv;
  uint32_t* qall = reinterpret_cast<uint32_t*>(s + R * kBlockKv);
  uint32_t* pb = qall + kPass * d2 / 2;
  float m_all[kPass], l_all[kPass], alpha_all[kPass];

  // Up to kPass query rows share each block of keys (kept in L2) before the next block:
  // for long sequences with wide heads k/v do not fit in L2, and this divides their
  // memory traffic by kPass / R.
  for (int64_t r0 = 0; r0 < rows; r0 += kPass) {
    const int64_t nr = std::min<int64_t>(kPass, rows - r0), ng = (nr + R - 1) / R;
    uint16_t* qh = reinterpret_cast<uint16_t*>(qall);
    for (int64_t r = 0; r < ng * R; ++r)
      for (int64_t c = 0; c < d2; ++c) qh[r * d2 + c] = (r < nr && c < d) ? qs[(r0 + r) * ldq + c] : 0;
    carry_in(carry, r0, nr, ng * R, d, dv, o, m_all, l_all);

    for (int64_t j0 = 0; j0 < skv; j0 += kBlockKv) {
      const int64_t nc = std::min(kBlockKv, skv - j0), ncp = round_up(nc, 16);
      for (int64_t g = 0; g < ng; ++g) {
      const uint32_t* qb = qall + g * R * (d2 / 2);
      float* og = o + g * R * dv;
      float* m = m_all + g * R;
      float* l = l_all + g * R;
      float* alpha = alpha_all + g * R;
      // s = q k^T * c2 (+ bias), two stripes of 16 keys per pass: 16 accumulators.
      // Keys past skv get -inf, and the row max is taken on the way out of the registers.
      const __m512 vc2 = _mm512_set1_ps(c2), ninf = _mm512_set1_ps(-INFINITY);
      __m512 vmax[R];
      const float* brow[R] = {};  // rows past the end take the last row's bias and are never stored
      for (int r = 0; r < R; ++r) {
        vmax[r] = ninf;
        if constexpr (kBias) brow[r] = bias + (r0 + std::min<int64_t>(g * R + r, nr - 1)) * bias_stride + j0;
      }
      for (int64_t js = 0; js < ncp; js += 32) {
        const bool two = js + 16 < ncp;
        const __mmask16 ok0 = valid_lanes(nc - js), ok1 = valid_lanes(nc - js - 16);
        const uint16_t* k0 = kp + (j0 + js) * d2;
        const uint16_t* k1 = two ? k0 + 16 * d2 : k0;
        __m512 a0[R], a1[R];
        for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < d2 / 2; ++p) {
          const __m512i kv0 = _mm512_loadu_si512(k0 + p * 32), kv1 = _mm512_loadu_si512(k1 + p * 32);
          for (int r = 0; r < R; ++r) {
            const __m512i qp = _mm512_set1_epi32(static_cast<int>(qb[r * (d2 / 2) + p]));
            a0[r] = dot2(a0[r], qp, kv0);
            a1[r] = dot2(a1[r], qp, kv1);
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m512 x0 = score<kBias>(a0[r], vc2, ok0, brow[r], js);
          _mm512_storeu_ps(s + r * kBlockKv + js, x0);
          vmax[r] = _mm512_max_ps(vmax[r], x0);
          if (two) {
            const __m512 x1 = score<kBias>(a1[r], vc2, ok1, brow[r], js + 16);
            _mm512_storeu_ps(s + r * kBlockKv + js + 16, x1);
            vmax[r] = _mm512_max_ps(vmax[r], x1);
          }
        }
      }
      // Online softmax in fp32; p is rounded to bf16 pairs for the p @ v product.
      for (int r = 0; r < R; ++r) {
        float* sr = s + r * kBlockKv;
        const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax[r])), shift = softmax_shift(m_new);
        const float dm = m[r] - shift;
        alpha[r] = std::exp2(kBias ? dm * kLog2e : dm);
        m[r] = m_new;
        const __m512 vmn = _mm512_set1_ps(shift);
        __m512 sum = _mm512_setzero_ps();
        uint16_t* pr = reinterpret_cast<uint16_t*>(pb + r * (kBlockKv / 2));
        for (int64_t j = 0; j < ncp; j += 16) {
          __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sr + j), vmn);
          if constexpr (kBias) x = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
          const __m512 p = exp2_bf16(x);
          sum = _mm512_add_ps(sum, p);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(p));
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
      }
      // o = o * alpha + p @ v over key pairs; a pair past skv has p = 0 and v = 0.
      const int64_t npairs = (nc + 1) / 2;
      const uint16_t* vblk = vp + j0 * dv;
      int64_t c = 0;
      for (; c + NC * 16 <= dv; c += NC * 16) pv_tile<NC>(pb, npairs, vblk, dv, c, og, alpha);
      for (; c + 32 <= dv; c += 32) pv_tile<2>(pb, npairs, vblk, dv, c, og, alpha);
      for (; c < dv; c += 16) pv_tile<1>(pb, npairs, vblk, dv, c, og, alpha);
      }
    }
    carry_out(carry, r0, nr, d, dv, o, m_all, l_all, t, out, ldo, lse, kBias);
  }
}

void forward(const void* q, int64_t ldq, int64_t rows, const void* packed, int64_t skv, int64_t d, float scale,
             const float* bias, int64_t bias_stride, PyextDtype t, void* out, int64_t ldo, float* lse,
             const AttnCarry* carry) {
  (bias != nullptr ? forward_impl<true> : forward_impl<false>)(q, ldq, rows, packed, skv, d, scale, bias, bias_stride,
                                                               t, out, ldo, lse, carry);
}

}  // namespace
}  // namespace attn

AttnKernel attention_kernel_avx512_bf16dot() { return AttnKernel{attn::packed_bytes, attn::pack, attn::forward, attn::kPass}; }
}  // namespace pyext::cpu
#else
#include "attention/attention_cpu.h"
namespace pyext::cpu {
AttnKernel attention_kernel_avx512_bf16dot() { return attention_kernel_scalar(); }
}  // namespace pyext::cpu
#endif
