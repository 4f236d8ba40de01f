// Portable build of the GEGLU kernel: one element at a time (also the SIMD units' tails).
#include "common/half_rounding.h"
#include "geglu/geglu_cpu.h"
#include "geglu/geglu_erf.h"

namespace pyext::cpu {
namespace {

template <PyextDtype D>
void span(const GegluArgs& a, int64_t row, int64_t begin, int64_t end) {
  using Io = DtypeIo<D>;
  const auto* x = static_cast<const typename Io::T*>(a.x) + row * a.x_stride;
  auto* y = static_cast<typename Io::T*>(a.y) + row * a.D;
  for (int64_t j = begin; j < end; ++j) y[j] = Io::store(geglu_f32(Io::load(x[j]), Io::load(x[a.D + j])));
}

}  // namespace

GegluSpan geglu_span_scalar(PyextDtype dtype) {
  switch (dtype) {
    case PYEXT_F16: return span<PYEXT_F16>;
    case PYEXT_BF16: return span<PYEXT_BF16>;
    default: return span<PYEXT_F32>;
  }
}

}  // namespace pyext::cpu
