// Flash attention for bf16 inputs with both products on a brgemm micro-kernel (common/brgemm.h:
// torch's oneDNN brgemm on AMX, or the stand-in), written once and included by the unit of each
// ISA with its own target attributes. No torch here.
//
// Packed layout per (batch, kv head), bf16, zero-padded, in the VNNI pair layout brgemm takes:
//   K^T: [dp / 2 pairs of head dims][skv_p keys][2]     (dp = d rounded up to even)
//   V:   [skv_p / 2 pairs of keys][dv columns][2]        (dv = d rounded up to 16)
// with skv_p = skv rounded up to 32. A pass of up to kPass query rows takes the keys kBlockKv at a
// time: S = q K^T on brgemm (fp32), the online softmax in fp32, P rounded to bf16 (as flash
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

// 2^x for x <= 0 (NaN stays NaN) to ~1e-7 relative, exp2_poly's series: plain float code the
// compiler vectorises for the unit's ISA. 0 below -126 (p is rounded to bf16 after).
inline float exp2_neg(float x) {
  const float c = std::max(x, -127.0f), n = std::nearbyint(c), f = c - n;
  float p = 1.5252734e-05f;
  p = p * f + 1.5403530e-04f;
  p = p * f + 1.3333558e-03f;
  p = p * f + 9.6181291e-03f;
  p = p * f + 5.5504109e-02f;
  p = p * f + 2.4022651e-01f;
  p = p * f + 6.9314718e-01f;
  p = p * f + 1.0f;
  const int32_t e = x != x ? 1 : static_cast<int32_t>(n) + 127;  // (no float-to-int cast of NaN)
  const float y = e <= 0 ? 0.0f : p * bits_float(static_cast<uint32_t>(e) << 23);
  return x != x ? x : y;
}

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

// MK: the micro-kernel (common/brgemm.h); RELEASE ends this thread's use of it.
template <BrgemmBf16 MK, void (*RELEASE)()>
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
  for (int64_t r0 = 0; r0 < rows; r0 += kPass) {
    const int64_t nr = std::min(kPass, rows - r0);
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t c = 0; c < dp; ++c) qb[r * dp + c] = c < d ? qs[(r0 + r) * d + c] : 0;
    carry_in(carry, r0, nr, nr, d, dv, o, m_all, l_all);
    for (int64_t j0 = 0; j0 < skv; j0 += kBlockKv) {
      const int64_t nc = std::min(kBlockKv, skv - j0), ncp = round_up(nc, 2);
      MK(nr, nc, dp, dp, sp, kBlockKv, false, qb, kt + j0 * 2, s);
      for (int64_t r = 0; r < nr; ++r) {
        float* sr = s + r * kBlockKv;
        const float* br = biased ? bias + (r0 + r) * bias_stride + j0 : nullptr;
        float mx = -INFINITY;
        for (int64_t j = 0; j < nc; ++j) {
          const float v = sr[j] * scale + (br ? br[j] : 0.0f);
          sr[j] = v;
          mx = std::max(mx, v);
        }
        const float m_new = std::max(m_all[r], mx), shift = softmax_shift(m_new);
        const float alpha = exp2_neg((m_all[r] - shift) * kLog2e);  // 0 on the first block
        m_all[r] = m_new;
        float sum = 0.0f;
        uint16_t* pr = pb + r * ncp;
        for (int64_t j = 0; j < nc; ++j) {
          const float p = exp2_neg((sr[j] - shift) * kLog2e);
          sum += p;
          pr[j] = float_to_bf16(p);
        }
        if (ncp > nc) pr[nc] = 0;
        l_all[r] = l_all[r] * alpha + sum;
        float* orow = o + r * dv;
        for (int64_t c = 0; c < d; ++c) orow[c] *= alpha;
      }
      MK(nr, d, ncp, ncp, dv, dv, true, pb, vp + (j0 / 2) * dv * 2, o);
    }
    if (carry != nullptr && !carry->last) {
      carry_out(carry, r0, nr, d, dv, o, m_all, l_all, PYEXT_BF16, out, lse, true);
      continue;
    }
    for (int64_t r = 0; r < nr; ++r) {
      // l = 0 where every score is -inf: with a bias a fully masked row (0, whatever v holds);
      // without one, fp32 overflow, and 0 * (1 / 0) keeps softmax's NaN.
      const bool nothing = biased && l_all[r] == 0.0f;
      const float inv = 1.0f / l_all[r];
      for (int64_t c = 0; c < d; ++c)
        store_elem(out, (r0 + r) * d + c, nothing ? 0.0f : o[r * dv + c] * inv, PYEXT_BF16);
      if (lse != nullptr) lse[r0 + r] = m_all[r] + std::log(l_all[r]);
    }
  }
  RELEASE();
}

}  // namespace
}  // namespace pyext::cpu::attn
