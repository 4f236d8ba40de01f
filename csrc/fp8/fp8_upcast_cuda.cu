// fp8 (e4m3fn) -> bf16/fp16/fp32 upcast on the GPU with 16-byte vector loads:
// each thread decodes 16 codes (one uint4) and writes them with vector stores.
// Results are the CPU kernels' bits (fp8_e4m3.h, half_rounding.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/half_rounding.h"
#include "fp8/fp8_e4m3.h"
#include "fp8/fp8_upcast_cuda.h"

namespace {

using pyext::float_to_bf16;
using pyext::float_to_fp16;
using pyext::fp8_e4m3_decode;

// decode(code) * s with the CPU path's NaN results: a NaN code keeps its own NaN, a NaN scale
// gives its own bits, quieted (GPU arithmetic would return the canonical NaN 0x7fffffff).
__device__ __forceinline__ float scaled(uint32_t code, float s) {
  if ((code & 0x7fu) == 0x7fu) return fp8_e4m3_decode(code);
  if (s != s) return __uint_as_float(__float_as_uint(s) | 0x400000u);
  return fp8_e4m3_decode(code) * s;
}

// fp8_e4m3_decode(code) for a code that is not NaN, with the hardware's fp16 -> fp32 conversion:
// the code's bits moved into fp16's layout are the fp16 number value / 256 (exponent bias 7
// against 15), subnormal codes included, and the conversion and the product are exact. (The
// decode stays exact under -ftz=true: the conversion is inline assembly, its results fp32 normals.)
__device__ __forceinline__ float decode_finite(uint32_t code) {
  const auto h = static_cast<unsigned short>(((code & 0x80u) << 8) | ((code & 0x7fu) << 7));
  return __half2float(__ushort_as_half(h)) * 256.0f;
}

// Whether a byte of w is a NaN code (its low 7 bits all set): adding 1 to such a byte's low 7
// bits, and to no other, carries into its top bit.
__device__ __forceinline__ bool has_nan_code(uint32_t w) {
  return ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
}

template <PyextDtype kOut>
__device__ __forceinline__ uint16_t narrow(float v) {
  return kOut == PYEXT_BF16 ? float_to_bf16(v) : float_to_fp16(v);
}

template <PyextDtype kOut>
__device__ __forceinline__ void store(void* dst, int64_t i, float v) {
  if (kOut == PYEXT_F32) static_cast<float*>(dst)[i] = v;
  else static_cast<uint16_t*>(dst)[i] = narrow<kOut>(v);
}

// Two values narrowed to kOut, a in the low half: by narrow (any value), or by the hardware's
// round-to-nearest-even conversion, which gives the same bits for every value but NaN.
template <PyextDtype kOut>
__device__ __forceinline__ uint32_t narrow2(float a, float b) {
  return narrow<kOut>(a) | (static_cast<uint32_t>(narrow<kOut>(b)) << 16);
}

template <PyextDtype kOut>
__device__ __forceinline__ uint32_t narrow2_hardware(float a, float b) {
  uint32_t bits;
  if constexpr (kOut == PYEXT_BF16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    memcpy(&bits, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(a, b);
    memcpy(&bits, &h, 4);
  }
  return bits;
}

// The 16 codes of chunk c (words, lowest byte first), each turned into a float by value(code),
// stored at dst's chunk c: kOut pairs packed by pack(a, b).
template <PyextDtype kOut, typename Value, typename Pack>
__device__ __forceinline__ void store16(void* dst, int64_t c, const uint32_t words[4], Value value, Pack pack) {
  if constexpr (kOut == PYEXT_F32) {
    float4* out = reinterpret_cast<float4*>(dst) + c * 4;
#pragma unroll
    for (int w = 0; w < 4; ++w)
      out[w] = make_float4(value(words[w] & 0xff), value((words[w] >> 8) & 0xff), value((words[w] >> 16) & 0xff),
                           value(words[w] >> 24));
  } else {
    uint32_t halves[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      halves[2 * w] = pack(value(words[w] & 0xff), value((words[w] >> 8) & 0xff));
      halves[2 * w + 1] = pack(value((words[w] >> 16) & 0xff), value(words[w] >> 24));
    }
    uint4* out = reinterpret_cast<uint4*>(dst) + c * 2;
    out[0] = make_uint4(halves[0], halves[1], halves[2], halves[3]);
    out[1] = make_uint4(halves[4], halves[5], halves[6], halves[7]);
  }
}

// Vector path: cols % 16 == 0 (or one scale), 16-byte aligned pointers. A chunk with no NaN code
// under a finite scale (every chunk of fp8_quantize's weights) has only finite products, or
// infinities from overflow, which the hardware narrows as narrow does; other chunks take the
// exact per-element path.
template <PyextDtype kOut>
__global__ void upcast_vec16(const uint4* __restrict__ src, void* __restrict__ dst, const float* __restrict__ scale,
                             int64_t chunks, int64_t chunks_per_row, int per_row) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = scale[per_row ? c / chunks_per_row : 0];
    const uint4 packed = src[c];
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
    if (fabsf(s) <= 3.40282347e38f &&
        !(has_nan_code(words[0]) | has_nan_code(words[1]) | has_nan_code(words[2]) | has_nan_code(words[3])))
      store16<kOut>(dst, c, words, [s](uint32_t code) { return decode_finite(code) * s; }, narrow2_hardware<kOut>);
    else
      store16<kOut>(dst, c, words, [s](uint32_t code) { return scaled(code, s); }, narrow2<kOut>);
  }
}

template <PyextDtype kOut>
__global__ void upcast_scalar(const uint8_t* __restrict__ src, void* __restrict__ dst, const float* __restrict__ scale,
                              int64_t n, int64_t cols, int per_row) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store<kOut>(dst, i, scaled(src[i], scale[per_row ? i / cols : 0]));
}

template <PyextDtype kOut>
cudaError_t launch(const uint8_t* src, void* dst, const float* scale, int64_t rows, int64_t cols, int per_row,
                   cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const bool aligned = (reinterpret_cast<uintptr_t>(src) % 16 == 0) && (reinterpret_cast<uintptr_t>(dst) % 16 == 0);
  const bool vec = aligned && n % 16 == 0 && (!per_row || cols % 16 == 0);
  const int64_t work = vec ? n / 16 : n;
  const unsigned blocks = static_cast<unsigned>(work < 65535LL * kThreads ? (work + kThreads - 1) / kThreads : 65535LL * 8);
  if (vec)
    upcast_vec16<kOut><<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(src), dst, scale, n / 16,
                                                       cols / 16, per_row);
  else
    upcast_scalar<kOut><<<blocks, kThreads, 0, stream>>>(src, dst, scale, n, cols, per_row);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t pyext_fp8_upcast_cuda(const uint8_t* src, void* dst, const float* scale, int64_t rows,
                                             int64_t cols, int per_row, PyextDtype out_type, cudaStream_t stream) {
  switch (out_type) {
    case PYEXT_BF16: return launch<PYEXT_BF16>(src, dst, scale, rows, cols, per_row, stream);
    case PYEXT_F16: return launch<PYEXT_F16>(src, dst, scale, rows, cols, per_row, stream);
    case PYEXT_F32: return launch<PYEXT_F32>(src, dst, scale, rows, cols, per_row, stream);
    default: return cudaErrorInvalidValue;
  }
}
