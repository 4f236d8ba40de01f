// erf(g / sqrt 2), the erf in gelu(g), on fp32 without exp or division. s = |g| sqrt 2 (twice
// |g / sqrt 2|), clamped below 8 (erf(4) rounds to 1 in fp32), falls in one of 8 segments of width 1:
// a degree-7 polynomial in v = s - floor(s) gives erf there. The coefficients are least-squares
// fits of erf(s / 2) (float64) on 400 Chebyshev nodes of each segment, rounded to fp32; evaluated in
// fp32 by Horner's rule the maximum absolute error is 8.1e-8 over the float range (torch's fp32
// erf: 6.0e-8), which the op's tests check. The SIMD units fetch a coefficient of every lane's
// segment with one permute per degree.
#pragma once
#include <cmath>
#include <cstdint>

namespace pyext::cpu {
namespace {

constexpr int kErfSegments = 8, kErfDegree = 7;
constexpr float kSqrt2 = 1.41421356237309505f;
constexpr float kErfClamp = 7.99999952f;  // the float below 8: floor(s) <= 7 without a second clamp

// kErfPoly[j][k]: the coefficient of v^j in segment k.
constexpr float kErfPoly[kErfDegree + 1][kErfSegments] = {
    {-1.080656453e-09f, 5.204998851e-01f, 8.427007794e-01f, 9.661051631e-01f, 9.953222871e-01f, 9.995930195e-01f, 9.999778867e-01f, 9.999992847e-01f},
    {5.641897321e-01f, 4.393913448e-01f, 2.075536549e-01f, 5.946515128e-02f, 1.033350918e-02f, 1.089141122e-03f, 6.962521002e-05f, 2.699521247e-06f},
    {-2.830399808e-06f, -1.098488197e-01f, -1.037750468e-01f, -4.459900782e-02f, -1.033383515e-02f, -1.361407340e-03f, -1.044118690e-04f, -4.720366178e-06f},
    {-4.699362442e-02f, -1.829944365e-02f, 1.728144474e-02f, 1.734504104e-02f, 6.030659191e-03f, 1.043612952e-03f, 9.841044084e-05f, 5.252801202e-06f},
    {-8.439356316e-05f, 1.140590385e-02f, 4.382089246e-03f, -2.790628234e-03f, -2.164036734e-03f, -5.383997341e-04f, -6.436185504e-05f, -4.092071777e-06f},
    {3.697047941e-03f, 3.166208917e-04f, -2.286490751e-03f, -4.607175651e-04f, 4.338251019e-04f, 1.903929515e-04f, 2.975349889e-05f, 2.245973292e-06f},
    {-1.825765066e-04f, -9.044132312e-04f, 2.194342669e-04f, 3.036315320e-04f, -2.370145376e-05f, -4.344574336e-05f, -9.024256542e-06f, -7.921202041e-07f},
    {-1.234638330e-04f, 1.397304295e-04f, 2.925867739e-05f, -4.635233927e-05f, -5.636929018e-06f, 4.967308541e-06f, 1.356223038e-06f, 1.339431748e-07f},
};

// erf(g / sqrt 2), at most 1 in magnitude. A NaN g takes the last segment (the caller's product
// with the NaN gate stays NaN).
inline float erf_of_gate(float g) {
  float s = std::fabs(g) * kSqrt2;
  s = s < kErfClamp ? s : kErfClamp;
  const int k = static_cast<int>(s);
  const float v = s - static_cast<float>(k);
  float p = kErfPoly[kErfDegree][k];
  for (int j = kErfDegree - 1; j >= 0; --j) p = p * v + kErfPoly[j][k];
  return std::copysign(p < 1.0f ? p : 1.0f, g);
}

// a * gelu(g), gelu exact (erf), in fp32.
inline float geglu_f32(float a, float g) {
  const float h = 0.5f * g;
  return a * (h + h * erf_of_gate(g));
}

}  // namespace
}  // namespace pyext::cpu
