// Torch glue for the CPU flash-attention kernels: torch.ops.pyext_C.attention and
// attention_paths; and attention_value_bounds, what the value check before torch's CPU SDPA
// reads. User-facing validation lives in pyext/ops/attention.py; the TORCH_CHECKs here guard
// the raw-pointer kernels against any caller.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/aminmax.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "attention/attention_cpu.h"
#include "common/brgemm.h"
#include "common/dtype_codes_torch.h"

namespace pyext::cpu {
namespace {

// Packed k/v per (batch, head) beyond which keys are packed and attended a chunk at a time
// (AttnCarry): the copy stays this size however long the sequence (a VAE's whole-image
// attention: 133,440 keys at 3840x2224), at the cost of a pass over each query block's
// running output per chunk. A chunk this size also stays in a core's L2 cache while every
// query block reads it, which makes long-key calls faster than one pack of all keys.
constexpr size_t kChunkBytes = size_t{1} << 20;
constexpr int64_t kChunkAlign = 256;  // keys: a chunk is whole blocks of the kernels' loops
// Minimum work (multiply-adds) per thread: smaller calls run on the calling thread, since waking
// a pool thread on a busy machine can cost milliseconds. An element packed (a load and a
// scattered store) counts as kPackWork of them: at 256 keys x 160 dims a head's pack is then one
// task, where at one multiply-add each 25 heads made one and the pack ran on one thread.
constexpr int64_t kMinWorkPerThread = int64_t{1} << 20;
constexpr int64_t kPackWork = 16;

int64_t grain(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(work_per_item, 1));
}

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// Kernel paths this process may use, fastest first, capped by PYEXT_CPU_SIMD; then the stand-ins
// of the amx path, never the automatic choice (the tests run them wherever the CPU can).
std::vector<std::string> available_paths() {
  std::vector<std::string> paths;
  const SimdLevel level = simd_level();
  if (level == SimdLevel::kAvx512 && cpu_has_avx512_bf16() && brgemm_amx_available()) paths.push_back("amx");
  if (level == SimdLevel::kAvx512 && cpu_has_avx512_bf16()) paths.push_back("avx512_bf16");
  if (level >= SimdLevel::kAvx512) paths.push_back("avx512");
  if (level >= SimdLevel::kAvx2) paths.push_back("avx2");
  paths.push_back("scalar");
  paths.push_back("brgemm_stand_in");
  if (level >= SimdLevel::kAvx512) paths.push_back("brgemm_stand_in_avx512");
  return paths;
}

bool bf16_only(const std::string& path) {
  return path == "amx" || path == "avx512_bf16" || path.rfind("brgemm_stand_in", 0) == 0;
}

// `path` empty = the fastest available for the dtype; otherwise that path or an error.
AttnKernel pick_kernel(const std::string& path, at::ScalarType dtype) {
  const std::vector<std::string> paths = available_paths();
  std::string use = path;
  if (use.empty())
    use = *std::find_if(paths.begin(), paths.end(), [&](const std::string& p) {
      return dtype == at::kBFloat16 || !bf16_only(p);  // (scalar takes every dtype)
    });
  TORCH_CHECK(std::find(paths.begin(), paths.end(), use) != paths.end(), "pyext attention: kernel path '", use,
              "' is not available on this CPU (PYEXT_CPU_SIMD may cap it); available: ", c10::Join(", ", paths));
  TORCH_CHECK(dtype == at::kBFloat16 || !bf16_only(use), "pyext attention: the ", use,
              " path takes bfloat16 inputs only");
  if (use == "amx") return attention_kernel_amx();
  if (use == "brgemm_stand_in") return attention_kernel_brgemm_stand_in();
  if (use == "brgemm_stand_in_avx512") return attention_kernel_brgemm_stand_in_avx512();
  if (use == "avx512_bf16") return attention_kernel_avx512_bf16dot();
  if (use == "avx512") return attention_kernel_avx512();
  if (use == "avx2") return attention_kernel_avx2();
  return attention_kernel_scalar();
}

// The bias as the kernels read it: fp32, unit stride along keys, and stride 0 along every dim
// it broadcasts over, so a (B, 1, 1, Skv) key-padding mask is never expanded in memory.
struct BiasView {
  at::Tensor t;              // keeps what `p` points into alive
  const float* p = nullptr;  // null: no bias
  int64_t stride[3] = {0, 0, 0};  // batch, head, query row
};

BiasView bias_view(const std::optional<at::Tensor>& bias, at::IntArrayRef full) {
  BiasView view;
  if (!bias.has_value()) return view;
  at::Tensor b = *bias;
  TORCH_CHECK(b.scalar_type() == at::kFloat, "pyext attention: bias must be float32, got ", b.scalar_type());
  TORCH_CHECK(b.device().is_cpu(), "pyext attention: bias must be on the CPU, got ", b.device());
  TORCH_CHECK(b.dim() == 4, "pyext attention: bias must be 4-D, got shape ", b.sizes());
  for (int64_t i = 0; i < 4; ++i)
    TORCH_CHECK(b.size(i) == full[i] || b.size(i) == 1, "pyext attention: bias of shape ", b.sizes(),
                " does not broadcast to (batch, heads, q length, kv length) ", full);
  // An expanded view's stride-0 dims shrink to size 1, so that making the key dim unit-stride
  // (below) copies only the bias's own values.
  for (int64_t i = 0; i < 3; ++i)
    if (b.stride(i) == 0 && b.size(i) > 1) b = b.narrow(i, 0, 1);
  if (b.size(3) != full[3]) b = b.expand({-1, -1, -1, full[3]});
  if (b.size(3) > 1 && b.stride(3) != 1) b = b.contiguous();
  view.t = b;
  view.p = b.data_ptr<float>();
  for (int64_t i = 0; i < 3; ++i) view.stride[i] = b.size(i) == 1 ? 0 : b.stride(i);
  return view;
}

// q, k or v as the kernels read it: rows of unit-stride head dims, each (batch, head) and row
// where its strides put it; a tensor whose head dim is strided is copied.
at::Tensor rows_in_place(const at::Tensor& t) { return t.stride(3) == 1 || t.size(3) == 1 ? t : t.contiguous(); }

// Elements from t's start to row `row` of head h of sample s.
int64_t row_offset(const at::Tensor& t, int64_t s, int64_t h, int64_t row) {
  return s * t.stride(0) + h * t.stride(1) + row * t.stride(2);
}

std::tuple<at::Tensor, at::Tensor> attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 double scale, c10::string_view path,
                                                 const std::optional<at::Tensor>& bias, bool return_lse) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "pyext attention: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "pyext attention: q, k, v must share one dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "pyext attention: k and v must have the same shape");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3),
              "pyext attention: q and k must agree in batch and head_dim");
  const PyextDtype type = dtype_code(q.scalar_type(), "pyext attention");
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), Sq = q.size(2), Skv = k.size(2), D = q.size(3);
  TORCH_CHECK(Hkv > 0 ? H % Hkv == 0 : H == 0, "pyext attention: q's heads (", H,
              ") must be a multiple of k and v's heads (", Hkv, ")");
  const BiasView bv = bias_view(bias, {B, H, Sq, Skv});
  // The output in q's layout where q is dense (empty_like's strides, which the op's fake kernel
  // promises), so diffusers' (B, S, H, D)-transposed heads come back without a copy.
  at::Tensor out = at::empty_like(q);
  if (out.stride(3) != 1) out = at::empty({B, H, Sq, D}, q.options());
  at::Tensor lse = return_lse ? at::empty({B, H, Sq}, q.options().dtype(at::kFloat))
                              : at::empty({0}, q.options().dtype(at::kFloat));
  if (B * H * Sq == 0) return {out, lse};
  TORCH_CHECK(D > 0, "pyext attention: head_dim is 0");
  TORCH_CHECK(Skv > 0, "pyext attention: k/v have zero length");
  const AttnKernel kernel = pick_kernel(std::string(path), q.scalar_type());
  const at::Tensor qc = rows_in_place(q), kc = rows_in_place(k), vc = rows_in_place(v);
  const int64_t esize = q.element_size(), BH = B * H, BHkv = B * Hkv, group = H / Hkv;
  // keys per chunk: as many whole blocks as fit kChunkBytes packed (at least one block)
  const int64_t chunk = std::min(Skv, kChunkAlign * std::max<int64_t>(
      1, static_cast<int64_t>(kChunkBytes / kernel.packed_bytes(kChunkAlign, D))));
  const size_t per_head = kernel.packed_bytes(chunk, D);
  at::Tensor packed = at::empty({static_cast<int64_t>(per_head) * BHkv}, q.options().dtype(at::kByte));
  at::Tensor carry_o, carry_ml;  // each query row's running output, max and sum between chunks
  if (chunk < Skv) {
    carry_o = at::empty({BH * Sq * D}, q.options().dtype(at::kFloat));
    carry_ml = at::empty({2 * BH * Sq}, q.options().dtype(at::kFloat));
  }
  const char* qp = static_cast<const char*>(qc.data_ptr());
  const char* kp = static_cast<const char*>(kc.data_ptr());
  const char* vp = static_cast<const char*>(vc.data_ptr());
  char* pp = static_cast<char*>(packed.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  float* lp = return_lse ? lse.data_ptr<float>() : nullptr;
  const int64_t qblock = kernel.query_block, nqb = (Sq + qblock - 1) / qblock;
  const float fscale = static_cast<float>(scale);
  for (int64_t j0 = 0; j0 < Skv; j0 += chunk) {
    const int64_t n = std::min(chunk, Skv - j0);
    at::parallel_for(0, BHkv, grain(n * D * kPackWork), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t s = i / Hkv, h = i % Hkv;
        kernel.pack(kp + row_offset(kc, s, h, j0) * esize, kc.stride(2), vp + row_offset(vc, s, h, j0) * esize,
                    vc.stride(2), n, D, type, pp + i * per_head);
      }
    });
    at::parallel_for(0, BH * nqb, grain(std::min(qblock, Sq) * n * D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const int64_t i = t / nqb, q0 = (t % nqb) * qblock, rows = std::min(qblock, Sq - q0);
        const int64_t row = i * Sq + q0;
        // query head h of sample s reads kv head h / group of that sample
        const int64_t s = i / H, h = i % H, ikv = s * Hkv + h / group;
        const float* bp = bv.p == nullptr ? nullptr
            : bv.p + s * bv.stride[0] + h * bv.stride[1] + q0 * bv.stride[2] + j0;
        AttnCarry carry{nullptr, nullptr, nullptr, j0 == 0, j0 + n == Skv};
        if (carry_o.defined()) {
          carry.o = carry_o.data_ptr<float>() + row * D;
          carry.m = carry_ml.data_ptr<float>() + row;
          carry.l = carry_ml.data_ptr<float>() + BH * Sq + row;
        }
        kernel.forward(qp + row_offset(qc, s, h, q0) * esize, qc.stride(2), rows, pp + ikv * per_head, n, D, fscale,
                       bp, bv.stride[2], type, op + row_offset(out, s, h, q0) * esize, out.stride(2),
                       lp == nullptr ? nullptr : lp + row, carry_o.defined() ? &carry : nullptr);
      }
    });
  }
  return {out, lse};
}

std::vector<std::string> attention_paths() { return available_paths(); }

// max |x| of a dense tensor's elements in memory order, NaN when one is NaN: a plain loop, which
// on a small tensor costs less than a reduction's set-up.
template <typename T>
double max_abs_dense(const T* p, int64_t n) {
  float m = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::fabs(static_cast<float>(p[i]));
    nan |= v != v;
    m = v > m ? v : m;
  }
  return nan ? std::nan("") : m;
}

// max |x| (NaN when x holds one). The order does not matter, so a permuted dense tensor (the
// (B, S, H, D) layout diffusers transposes to (B, H, S, D)) is read in memory order, several
// times faster than through its strides.
double max_abs(at::Tensor x) {
  if (!x.is_contiguous()) {
    std::vector<int64_t> order(x.dim());
    for (int64_t d = 0; d < x.dim(); ++d) order[d] = d;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
    at::Tensor dense = x.permute(order);
    if (dense.is_contiguous()) x = dense;
  }
  constexpr int64_t kLoopElems = int64_t{1} << 16;  // beyond this torch's threaded, vectorised reduction
  if (x.is_contiguous() && x.numel() <= kLoopElems) {
    switch (x.scalar_type()) {
      case at::kFloat: return max_abs_dense(x.const_data_ptr<float>(), x.numel());
      case at::kBFloat16: return max_abs_dense(x.const_data_ptr<at::BFloat16>(), x.numel());
      case at::kHalf: return max_abs_dense(x.const_data_ptr<at::Half>(), x.numel());
      default: break;
    }
  }
  const auto [low, high] = at::aminmax(x);
  const double lo = low.item<double>(), hi = high.item<double>();
  return std::isnan(lo) || std::isnan(hi) ? std::nan("") : std::max(-lo, hi);
}

// [max |q|, max |k|, max of the bias (-inf without one)] in one call: what bounds every score.
std::vector<double> attention_value_bounds(const at::Tensor& q, const at::Tensor& k,
                                           const std::optional<at::Tensor>& bias) {
  const bool has_bias = bias && bias->numel() > 0;
  return {max_abs(q), max_abs(k), has_bias ? bias->max().item<double>() : -INFINITY};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pyext_C, m) {
  // q (B, H, Sq, D); k, v (B, Hkv, Skv, D), H a multiple of Hkv; bias fp32, broadcastable to
  // (B, H, Sq, Skv), added to the scaled scores. Returns the output (B, H, Sq, D) and, with
  // return_lse, each row's fp32 log-sum-exp (B, H, Sq) (else an empty tensor).
  m.def("attention(Tensor q, Tensor k, Tensor v, float scale, str path='', Tensor? bias=None, "
        "bool return_lse=False) -> (Tensor, Tensor)");
  m.def("attention_paths() -> str[]", attention_paths);  // no tensor args: one kernel for every device
  m.def("attention_value_bounds(Tensor q, Tensor k, Tensor? bias=None) -> float[]");
}

TORCH_LIBRARY_IMPL(pyext_C, CPU, m) {
  m.impl("attention", attention_cpu);
  m.impl("attention_value_bounds", attention_value_bounds);
}

}  // namespace pyext::cpu
