// Flash attention for bf16 inputs with both products on a brgemm micro-kernel (common/brgemm.h:
// torch's oneDNN brgemm on AMX, or the stand-in), written once and included by the unit of each
// ISA with its own target attributes. No torch here.
//
// Packed layout per (batch, kv head), bf16, zero-padded, in the VNNI pair layout brgemm takes:
//   K^T: [blocks of kBrgemmKeys keys][dp / 2 pairs of head dims][kt_ld keys][2]   (dp = d rounded up to even)
//   V:   [skv_p / 2 pairs of keys][dv columns][2]                                (dv = d rounded up to 16)
// with skv_p = skv rounded up to 32. A pass of up to kBrgemmRows query rows takes the keys a block
// at a time: S = q K^T on brgemm (fp32), the online softmax in fp32 on the unit's vectors, P rounded
// to bf16 (as flash attention does on GPUs), then O = O * alpha + P V on brgemm, accumulating into O.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention/attention_cpu.h"
#include "attention/attention_cpu_impl.h"
#include "common/brgemm.h"
#include "common/scratch.h"

namespace pyext::cpu::attn {
namespace {

constexpr int64_t kKeyAlign = 32;
// Query rows per pass (and per parallel task: AttnKernel::query_block) and keys per online-softmax
// step: each block of K^T and V feeds twice the fp32 kernels' rows into the micro-kernel, which also
// takes half as many calls per score; a pass's scores (256 KiB fp32) and probabilities stay in L2.
// Measured on an AMX CPU against (rows x keys) 64 x 256, 64 x 512, 64 x 1024 and 256 x 512 at
// bench.attention's shapes.
constexpr int64_t kBrgemmRows = 128;
constexpr int64_t kBrgemmKeys = 512;

inline int64_t key_stride(int64_t skv) { return round_up(skv, kKeyAlign); }

// K^T is stored a block of kBrgemmKeys keys at a time, so that a block's pair rows are read
// kt_ld keys apart rather than all the keys': a stride of 16 KiB at 4096 keys puts every row of a
// micro-kernel's B tile in one L1 set. The 16 extra keys keep the stride off a power of two.
inline int64_t kt_ld(int64_t skv) { return std::min(kBrgemmKeys, key_stride(skv)) + 16; }
inline int64_t kt_blocks(int64_t skv) { return (skv + kBrgemmKeys - 1) / kBrgemmKeys; }

inline size_t brgemm_packed_bytes(int64_t skv, int64_t d) {
  const int64_t dp = round_up(d, 2);
  return static_cast<size_t>(kt_blocks(skv) * dp * kt_ld(skv) + key_stride(skv) * round_up(d, 16)) * 2;
}

// A VNNI pair: lo in the low half (the first of the two elements in memory).
inline uint32_t vnni_pair(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16; }

// K's rows a block of keys at a time as columns of pair words, V's rows two at a time interleaved:
// V::transpose_pairs and V::interleave_rows (the unit's vectors, or plain loops).
template <class V>
inline void brgemm_pack(const void* k, int64_t ldk, const void* v, int64_t ldv, int64_t skv, int64_t d, PyextDtype,
                        void* packed) {
  const uint16_t* ks = static_cast<const uint16_t*>(k);
  const uint16_t* vs = static_cast<const uint16_t*>(v);
  const int64_t sp = key_stride(skv), dp = round_up(d, 2), dv = round_up(d, 16), ld = kt_ld(skv), half = d / 2;
  uint32_t* kt = static_cast<uint32_t*>(packed);  // [block][dp / 2][ld] pairs
  uint32_t* vp = kt + kt_blocks(skv) * (dp / 2) * ld;  // [sp / 2][dv] pairs
  for (int64_t b = 0; b < kt_blocks(skv); ++b) {
    uint32_t* kb = kt + b * (dp / 2) * ld;
    const int64_t j0 = b * kBrgemmKeys, keys = std::min(kBrgemmKeys, skv - j0);
    V::transpose_pairs(ks + j0 * ldk, keys, half, ldk, kb, ld);
    if (d % 2)
      for (int64_t jj = 0; jj < keys; ++jj) kb[half * ld + jj] = vnni_pair(ks[(j0 + jj) * ldk + d - 1], 0);
    for (int64_t c2 = 0; c2 < dp / 2; ++c2) std::fill(kb + c2 * ld + keys, kb + (c2 + 1) * ld, 0u);  // padding keys
  }
  for (int64_t j2 = 0; j2 < sp / 2; ++j2) {
    uint32_t* out = vp + j2 * dv;
    const int64_t j = 2 * j2;
    if (j + 1 < skv) {
      V::interleave_rows(vs + j * ldv, vs + (j + 1) * ldv, d, out);
    } else if (j < skv) {
      for (int64_t c = 0; c < d; ++c) out[c] = vnni_pair(vs[j * ldv + c], 0);
    } else {
      std::fill(out, out + d, 0u);
    }
    std::fill(out + d, out + dv, 0u);
  }
}

// One row's nc scores in place to the softmax's units, c2 * s (+ the bias row), each rounded once and
// stored; the scores after them to the next whole vector -inf. Returns their max.
template <class V, bool kBias>
inline float scale_scores(float* s, const float* bias, int64_t nc, float c2) {
  const typename V::reg c = V::set1(c2);
  typename V::reg mv = V::set1(-INFINITY);
  int64_t j = 0;
  for (; j + V::kW <= nc; j += V::kW) {
    typename V::reg x = kBias ? V::fma(V::load(s + j), c, V::load(bias + j)) : V::mul(V::load(s + j), c);
    V::store(s + j, x);
    mv = V::max(mv, x);
  }
  if (j < nc) {  // the ragged last vector: the bias row may end at nc, so no whole-vector load of it
    for (int64_t i = j; i < nc; ++i) s[i] = kBias ? std::fma(s[i], c2, bias[i]) : s[i] * c2;
    std::fill(s + nc, s + j + V::kW, -INFINITY);
    mv = V::max(mv, V::load(s + j));
  }
  return V::reduce_max(mv);
}

// p = 2^(s - shift) for base-2 scores (natural ones: times log2e) over whole vectors, rounded to
// bf16 into p for the second product. Returns the sum of the unrounded p.
template <class V, bool kBias>
inline float exponentiate(const float* s, uint16_t* p, int64_t nc, float shift) {
  const typename V::reg sh = V::set1(shift), log2e = V::set1(kLog2e);
  typename V::reg sum = V::zero();
  for (int64_t j = 0; j < nc; j += V::kW) {
    typename V::reg x = V::sub(V::load(s + j), sh);
    if constexpr (kBias) x = V::mul(x, log2e);
    x = V::exp2(x);
    V::store_bf16(p + j, x);
    sum = V::add(sum, x);
  }
  return V::reduce_add(sum);
}

// V: the vector traits the softmax runs on (attention_cpu_impl.h); MK: the micro-kernel
// (common/brgemm.h); RELEASE ends this thread's use of it.
template <class V, BrgemmBf16 MK, void (*RELEASE)()>
void brgemm_forward(const void* q, int64_t ldq, int64_t rows, const void* packed, int64_t skv, int64_t d,
                    float scale, const float* bias, int64_t bias_stride, PyextDtype, void* out, int64_t ldo, float* lse,
                    const AttnCarry* carry) {
  const uint16_t* qs = static_cast<const uint16_t*>(q);
  const int64_t dp = round_up(d, 2), dv = round_up(d, 16), ld = kt_ld(skv);
  const uint16_t* kt = static_cast<const uint16_t*>(packed);
  const uint16_t* vp = kt + kt_blocks(skv) * dp * ld;
  // q rows and the scratch on 64-byte lines: a micro-kernel tile row across two lines costs two.
  const int64_t ldqb = round_up(dp, 32);
  thread_local ScratchPtr<float> buf;
  thread_local size_t cap = 0;
  // Score and probability rows as long as a block's keys, and 16 more: rows a power of two apart
  // put a row's loads and the last row's stores on the same 4 KiB offsets.
  const int64_t lds = round_up(std::min(skv, kBrgemmKeys), 16) + 16;
  float* o = grow(buf, cap, static_cast<size_t>(kBrgemmRows * dv + kBrgemmRows * lds + (kBrgemmRows * ldqb + kBrgemmRows * lds) / 2) * 4);
  float* s = o + kBrgemmRows * dv;                                    // kBrgemmRows x lds scores
  uint16_t* qb = reinterpret_cast<uint16_t*>(s + kBrgemmRows * lds);  // kBrgemmRows x ldqb
  uint16_t* pb = qb + kBrgemmRows * ldqb;                              // kBrgemmRows x lds probabilities
  float m_all[kBrgemmRows], l_all[kBrgemmRows], m_block[kBrgemmRows];
  // As in the fp32 kernels: without a bias the scores are kept in base 2 (scaled by scale * log2e),
  // with one in natural units, the exponent scaled instead. Either way each score is scaled once and
  // stored, so the row's max is one of the stored values and its exponent exactly 0: scaling inside
  // the exponent's fused multiply-add instead rounds differently from the max, by as much as the
  // max's own rounding error, which at scores of 1e20 makes every p 0 or inf.
  const bool biased = bias != nullptr;
  const float c2 = biased ? scale : scale * kLog2e;
  for (int64_t r0 = 0; r0 < rows; r0 += kBrgemmRows) {
    const int64_t nr = std::min(kBrgemmRows, rows - r0);
    for (int64_t r = 0; r < nr; ++r) {
      std::memcpy(qb + r * ldqb, qs + (r0 + r) * ldq, d * sizeof(uint16_t));
      if (dp > d) qb[r * ldqb + d] = 0;  // an odd d's pair partner
    }
    carry_in(carry, r0, nr, nr, d, dv, o, m_all, l_all);
    for (int64_t j0 = 0; j0 < skv; j0 += kBrgemmKeys) {
      const int64_t nc = std::min(kBrgemmKeys, skv - j0), ncp = round_up(nc, 2);
      MK(nr, nc, dp, ldqb, ld, lds, false, qb, kt + (j0 / kBrgemmKeys) * dp * ld, s);
      // Every row's max first, then every row's exponentials: each row's exponentials wait on its
      // max's horizontal reduction, and rows apart in the loop overlap where one loop did both.
      for (int64_t r = 0; r < nr; ++r) {
        float* sr = s + r * lds;
        const float* br = biased ? bias + (r0 + r) * bias_stride + j0 : nullptr;
        m_block[r] = biased ? scale_scores<V, true>(sr, br, nc, c2) : scale_scores<V, false>(sr, br, nc, c2);
      }
      for (int64_t r = 0; r < nr; ++r) {
        const float* sr = s + r * lds;
        const float m_new = std::max(m_all[r], m_block[r]), shift = softmax_shift(m_new);
        const float dm = m_all[r] - shift;  // 0 while the max stands; -inf on the first block (alpha 0)
        const float alpha = dm == 0.0f ? 1.0f : dm == -INFINITY ? 0.0f : std::exp2(biased ? dm * kLog2e : dm);
        m_all[r] = m_new;
        uint16_t* pr = pb + r * lds;
        const float sum = biased ? exponentiate<V, true>(sr, pr, nc, shift) : exponentiate<V, false>(sr, pr, nc, shift);
        for (int64_t j = round_up(nc, V::kW); j < ncp; ++j) pr[j] = 0;  // a key pair's padding (1-lane vectors)
        l_all[r] = l_all[r] * alpha + sum;
        if (alpha != 1.0f) {
          float* orow = o + r * dv;
          for (int64_t j = 0; j < dv; j += V::kW) V::store(orow + j, V::mul(V::load(orow + j), V::set1(alpha)));
        }
      }
      MK(nr, d, ncp, lds, dv, dv, true, pb, vp + (j0 / 2) * dv * 2, o);
    }
    carry_out(carry, r0, nr, d, dv, o, m_all, l_all, PYEXT_BF16, out, ldo, lse, biased);
  }
  RELEASE();
}

}  // namespace
}  // namespace pyext::cpu::attn
