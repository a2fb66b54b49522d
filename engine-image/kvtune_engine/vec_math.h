// Math the compiler can vectorize, shared by the engine's C++ kernels (../native.py builds them).
//
// Why: the kernels are built with -fno-finite-math-only (their softmax relies on infinities), and
// then GCC calls scalar expf once per element instead of a vector variant: SiLU-and-mul ran 2.7x
// slower than torch's own, and exp took ~40% of the paged-decode kernel.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvtune {

// exp(x) in float32 within ~1 ulp (Cephes' expf polynomial after x = n ln2 + r, |r| <= ln2/2), no
// libm call, so loops under `omp simd` vectorize. 0 below -87.34 (the normal range), +inf above
// 88.376 (where the true value is within 30% of FLT_MAX).
inline float exp_approx(float x) {
  const float xc = std::min(std::max(x, -87.3365f), 88.3762626f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  // two fma steps: -ffast-math could fold two plain products into one, which costs ~40 ulp
  float r = std::fma(n, -0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3365f ? 0.f : x > 88.3762626f ? HUGE_VALF : p * scale;
}

}  // namespace kvtune
