// The decoder's elementwise steps fused into one pass each, on CPU in float32: RMSNorm, RoPE
// (rotate-half, in place on the q/k heads of the fused qkv output) and SiLU(gate) * up.
//
// Why: in PyTorch each is 4-8 ops, each a full pass over [tokens, hidden] with a fresh tensor;
// at a 2048-token step they took ~9% of the step (bench/step_profile.py --top). Numerics follow
// model/ops.py's PyTorch path (itself transformers') up to float32 summation order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "vec_math.h"

namespace {

// Rows per task so that each task has ~64K elements: waking the second thread (a futex with
// GOMP_SPINCOUNT=0) costs more than a few thousand elements of work, as in a 32-row decode step.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_elems)); }

// out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)); x rows may be strided, out contiguous
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "rms_norm: float32 [tokens, hidden]");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous() && w.numel() == x.size(1), "rms_norm: layout");
  const int64_t n = x.size(0), h = x.size(1), xs = x.stride(0);
  auto out = torch::empty({n, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n, grain(h), [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* r = xp + t * xs;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += r[i] * r[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + e);
      float* o = op + t * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = wp[i] * (r[i] * inv);
    }
  });
  return out;
}

// x [tokens, heads, d] (a view: rows strided, heads and d contiguous), cos/sin [tokens, d/2]:
// (x1, x2) <- (x1 c - x2 s, x2 c + x1 s) in place, pairs (i, i + d/2)
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat, "rope_: float32 [tokens, heads, d]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "rope_: heads and head_dim contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat &&
              cos.size(0) == x.size(0) && 2 * cos.size(1) == x.size(2), "rope_: cos/sin [tokens, d/2]");
  const int64_t n = x.size(0), nh = x.size(1), d = x.size(2), half = d / 2, xs = x.stride(0);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, n, grain(nh * d), [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t hh = 0; hh < nh; ++hh) {
        float* x1 = xp + t * xs + hh * d;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], bb = x2[i];
          x1[i] = a * c[i] - bb * s[i];
          x2[i] = bb * c[i] + a * s[i];
        }
      }
    }
  });
}

// gate_up [tokens, 2 * inter] -> silu(gate) * up [tokens, inter]
torch::Tensor silu_and_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == torch::kFloat && gu.stride(1) == 1 && gu.size(1) % 2 == 0,
              "silu_and_mul: float32 [tokens, 2 * inter]");
  const int64_t n = gu.size(0), m = gu.size(1) / 2, gs = gu.stride(0);
  auto out = torch::empty({n, m}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain(2 * m), [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* g = gp + t * gs;
      const float* u = g + m;
      float* o = op + t * m;
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) o[i] = g[i] / (1.f + kvtune::exp_approx(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  m.def("rope_", &rope_, "rotate-half RoPE in place");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up");
}
