// Flash attention for bf16 inputs with both products on a brgemm micro-kernel (common/brgemm.h:
// torch's oneDNN brgemm on AMX, or the stand-in), written once and included by the unit of each
// ISA with its own target attributes. No torch here.
//
// Packed layout per (batch, kv head), bf16, zero-padded, in the VNNI pair layout brgemm takes:
//   K^T: [dp / 2 pairs of head dims][skv_p keys][2]     (dp = d rounded up to even)
//   V:   [skv_p / 2 pairs of keys][dv columns][2]        (dv = d rounded up to 16)
// with skv_p = skv rounded up to 32. A pass of up to kPass query rows takes the keys kBlockKv at a
// time: S = q K^T on brgemm (fp32), the online softmax in fp32 on the unit's vectors, P rounded to bf16 (as flash
// attention does on GPUs), then O = O * alpha + P V on brgemm, accumulating into O.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention/attention_cpu.h"
#include "attention/attention_cpu_impl.h"
#include "common/brgemm.h"

namespace pyext::cpu::attn {
namespace {

constexpr int64_t kKeyAlign = 32;

inline int64_t key_stride(int64_t skv) { return round_up(skv, kKeyAlign); }

inline size_t brgemm_packed_bytes(int64_t skv, int64_t d) {
  const int64_t sp = key_stride(skv);
  return static_cast<size_t>(round_up(d, 2) * sp + sp * round_up(d, 16)) * 2;
}

inline void brgemm_pack(const void* k, const void* v, int64_t skv, int64_t d, PyextDtype, void* packed) {
  const uint16_t* ks = static_cast<const uint16_t*>(k);
  const uint16_t* vs = static_cast<const uint16_t*>(v);
  const int64_t sp = key_stride(skv), dp = round_up(d, 2), dv = round_up(d, 16);
  uint16_t* kt = static_cast<uint16_t*>(packed);
  uint16_t* vp = kt + dp * sp;
  for (int64_t c2 = 0; c2 < dp / 2; ++c2)
    for (int64_t j = 0; j < sp; ++j)
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t c = 2 * c2 + e;
        kt[(c2 * sp + j) * 2 + e] = j < skv && c < d ? ks[j * d + c] : 0;
      }
  for (int64_t j2 = 0; j2 < sp / 2; ++j2)
    for (int64_t c = 0; c < dv; ++c)
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t j = 2 * j2 + e;
        vp[(j2 * dv + c) * 2 + e] = j < skv && c < d ? vs[j * d + c] : 0;
      }
}

// V: the vector traits the softmax runs on (attention_cpu_impl.h); MK: the micro-kernel
// (common/brgemm.h); RELEASE ends this thread's use of it.
template <class V, BrgemmBf16 MK, void (*RELEASE)()>
void brgemm_forward(const void* q, int64_t rows, const void* packed, int64_t skv, int64_t d, float scale,
                    const float* bias, int64_t bias_stride, PyextDtype, void* out, float* lse, const AttnCarry* carry) {
  const uint16_t* qs = static_cast<const uint16_t*>(q);
  const int64_t sp = key_stride(skv), dp = round_up(d, 2), dv = round_up(d, 16);
  const uint16_t* kt = static_cast<const uint16_t*>(packed);
  const uint16_t* vp = kt + dp * sp;
  thread_local Scratch buf;
  float* scratch = buf.get(static_cast<size_t>(kPass * dv + kPass * kBlockKv + (kPass * dp + kPass * kBlockKv) / 2 + 64));
  float* o = scratch;                      // kPass x dv
  float* s = o + kPass * dv;               // kPass x kBlockKv scores
  uint16_t* qb = reinterpret_cast<uint16_t*>(s + kPass * kBlockKv);  // kPass x dp
  uint16_t* pb = qb + kPass * dp;          // kPass x kBlockKv probabilities
  float m_all[kPass], l_all[kPass];
  const bool biased = bias != nullptr;
  // Without a bias and with a positive scale, the max and the exponent take the scale in their
  // multiply (unit = scale); else one pass first stores the scaled, biased scores (unit = 1).
  const bool scaled_here = biased || !(scale > 0.0f);
  const float unit = scaled_here ? 1.0f : scale;
  for (int64_t r0 = 0; r0 < rows; r0 += kPass) {
    const int64_t nr = std::min(kPass, rows - r0);
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t c = 0; c < dp; ++c) qb[r * dp + c] = c < d ? qs[(r0 + r) * d + c] : 0;
    carry_in(carry, r0, nr, nr, d, dv, o, m_all, l_all);
    for (int64_t j0 = 0; j0 < skv; j0 += kBlockKv) {
      const int64_t nc = std::min(kBlockKv, skv - j0), ncp = round_up(nc, 2);
      MK(nr, nc, dp, dp, sp, kBlockKv, false, qb, kt + j0 * 2, s);
      const int64_t ncv = round_up(nc, V::kW);  // whole vectors: the scores past nc are -inf
      for (int64_t r = 0; r < nr; ++r) {
        float* sr = s + r * kBlockKv;
        int64_t j = 0;
        if (scaled_here) {  // natural-units scores, with the bias, stored for the exp pass
          for (; j + V::kW <= nc; j += V::kW) V::store(sr + j, V::mul(V::load(sr + j), V::set1(scale)));
          for (; j < nc; ++j) sr[j] *= scale;
          if (biased) add_bias<V>(sr, bias + (r0 + r) * bias_stride + j0, nc);
        }
        std::fill(sr + nc, sr + ncv, -INFINITY);
        typename V::reg mv = V::set1(-INFINITY);
        for (j = 0; j < ncv; j += V::kW) mv = V::max(mv, V::load(sr + j));
        const float m_new = std::max(m_all[r], V::reduce_max(mv) * unit);
        const float shift = softmax_shift(m_new);
        // alpha = 0 on the first block (m = -inf), 1 while the max stands.
        const float alpha = m_new == m_all[r] ? 1.0f : std::exp2((m_all[r] - shift) * kLog2e);
        m_all[r] = m_new;
        // p = 2^(s * unit * log2(e) - shift * log2(e)), rounded to bf16 for the second product.
        typename V::reg sv = V::zero();
        const typename V::reg c = V::set1(unit * kLog2e), sh = V::set1(-shift * kLog2e);
        uint16_t* pr = pb + r * kBlockKv;
        for (j = 0; j < ncv; j += V::kW) {
          const typename V::reg p = V::exp2(V::fma(V::load(sr + j), c, sh));
          V::store_bf16(pr + j, p);
          sv = V::add(sv, p);
        }
        for (j = ncv; j < ncp; ++j) pr[j] = 0;
        l_all[r] = l_all[r] * alpha + V::reduce_add(sv);
        if (alpha != 1.0f) {
          float* orow = o + r * dv;
          for (j = 0; j < dv; j += V::kW) V::store(orow + j, V::mul(V::load(orow + j), V::set1(alpha)));
        }
      }
      MK(nr, d, ncp, kBlockKv, dv, dv, true, pb, vp + (j0 / 2) * dv * 2, o);
    }
    if (carry != nullptr && !carry->last) {
      carry_out(carry, r0, nr, d, dv, o, m_all, l_all, PYEXT_BF16, out, lse, true);
      continue;
    }
    for (int64_t r = 0; r < nr; ++r) {
      // l = 0 where every score is -inf: with a bias a fully masked row (0, whatever v holds);
      // without one, fp32 overflow, and 0 * (1 / 0) keeps softmax's NaN.
      if (biased && l_all[r] == 0.0f)
        for (int64_t c = 0; c < d; ++c) store_elem(out, (r0 + r) * d + c, 0.0f, PYEXT_BF16);
      else
        store_scaled_row(out, (r0 + r) * d, o + r * dv, 1.0f / l_all[r], d, PYEXT_BF16);
      if (lse != nullptr) lse[r0 + r] = m_all[r] + std::log(l_all[r]);
    }
  }
  RELEASE();
}

}  // namespace
}  // namespace pyext::cpu::attn
