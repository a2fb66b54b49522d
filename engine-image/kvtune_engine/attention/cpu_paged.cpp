// Paged decode attention on CPU, reading K/V blocks where they are in the cache.
//
// One task per (sequence, kv head), handed out dynamically: the GQA group's query heads are scored against each block of
// the sequence's block table (one contiguous block_size x head_dim tile per block and head), the
// scores get a float32 softmax, and V is accumulated block by block. Nothing is gathered or padded,
// so each byte of context is read once per step (the PyTorch reference copies it first).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename scalar_t>
void decode_kernel(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* bt,
                   const int32_t* lens, scalar_t* out, int64_t n, int64_t hq, int64_t hk,
                   int64_t nblocks, int64_t bs, int64_t d, int64_t bt_stride, int64_t q_stride_n,
                   int64_t q_stride_h, float scale) {
  const int64_t g = hq / hk;
  const int64_t head_stride = nblocks * bs * d;  // cache [hk, nblocks, bs, d], contiguous
  // dynamic scheduling: contexts differ by 10x within a step, and a static split of the (sequence,
  // head) tasks leaves one thread waiting for the other (3-4% of the kernel at 256 sequences)
  const int64_t tasks = n * hk;
#pragma omp parallel num_threads(static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks))))
  {
    std::vector<float> qf(g * d), acc(g * d), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t s = task / hk, h = task % hk;
      const int64_t ctx = lens[s];
      if (ctx <= 0) {
        for (int64_t j = 0; j < g; ++j)
          for (int64_t x = 0; x < d; ++x) out[s * hq * d + (h * g + j) * d + x] = scalar_t(0);
        continue;
      }
      for (int64_t j = 0; j < g; ++j) {
        const scalar_t* qp = q + s * q_stride_n + (h * g + j) * q_stride_h;
        for (int64_t x = 0; x < d; ++x) qf[j * d + x] = to_f(qp[x]) * scale;
      }
      scores.resize(g * ctx);
      const int64_t nb = (ctx + bs - 1) / bs;
      const int64_t* table = bt + s * bt_stride;
      const scalar_t* kh = kc + h * head_stride;
      const scalar_t* vh = vc + h * head_stride;
      // scores[j * ctx + t] = q_j . k_t
      for (int64_t b = 0; b < nb; ++b) {
        const scalar_t* kb = kh + table[b] * bs * d;
        const int64_t t0 = b * bs, tn = std::min(bs, ctx - t0);
        for (int64_t t = 0; t < tn; ++t) {
          const scalar_t* kt = kb + t * d;
          for (int64_t j = 0; j < g; ++j) {
            const float* qj = qf.data() + j * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t x = 0; x < d; ++x) dot += qj[x] * to_f(kt[x]);
            scores[j * ctx + t0 + t] = dot;
          }
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        float* sj = scores.data() + j * ctx;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < ctx; ++t) m = std::max(m, sj[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          sj[t] = std::exp(sj[t] - m);
          sum += sj[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) sj[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < nb; ++b) {
        const scalar_t* vb = vh + table[b] * bs * d;
        const int64_t t0 = b * bs, tn = std::min(bs, ctx - t0);
        for (int64_t t = 0; t < tn; ++t) {
          const scalar_t* vt = vb + t * d;
          for (int64_t j = 0; j < g; ++j) {
            const float p = scores[j * ctx + t0 + t];
            float* aj = acc.data() + j * d;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) aj[x] += p * to_f(vt[x]);
          }
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        scalar_t* op = out + s * hq * d + (h * g + j) * d;
        for (int64_t x = 0; x < d; ++x) op[x] = static_cast<scalar_t>(acc[j * d + x]);
      }
    }
  }
}

// q [N, hq, d] (rows may be strided), k/v cache [hk, num_blocks, bs, d] contiguous,
// block_tables int64 [N, max_blocks], context_lens int32 [N] -> out [N, hq, d] contiguous.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.stride(1) == 1,
              "block_tables: int64 with contiguous rows");
  auto lens = context_lens.to(torch::kInt32).contiguous();
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hk = k_cache.size(0), nblocks = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hk == 0, "head_dim or GQA group mismatch");
  TORCH_CHECK(block_tables.size(0) == n && lens.size(0) == n, "one block table and length per sequence");
  auto out = torch::empty({n, hq, d}, q.options());
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
                            lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), n, hq, hk, nblocks,
                            bs, d, block_tables.stride(0), q.stride(0), q.stride(1),
                            static_cast<float>(scale));
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a block-tabled KV cache");
}
