// Paged decode attention on CPU, reading K/V blocks where they are in the cache.
//
// One task per (sequence, kv head), handed out dynamically: the GQA group's query heads are scored against each block of
// the sequence's block table (one contiguous block_size x head_dim tile per block and head), the
// scores get a float32 softmax, and V is accumulated block by block. Nothing is gathered or padded,
// so each byte of context is read once per step (the PyTorch reference copies it first).
// float32 and bfloat16 caches take the compiled-in fast path (bf16 rows widen to float32 as they are
// loaded, and every sum is float32); float16 takes the generic loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// each of the g rows of scores [g, ctx] into its softmax, in float32
inline void softmax_rows(float* scores, int64_t g, int64_t ctx) {
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * ctx;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < ctx; ++t) m = std::max(m, sj[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      sj[t] = kvtune::exp_approx(sj[t] - m);
      sum += sj[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < ctx; ++t) sj[t] *= inv;
  }
}

// W floats as one value, W the width of the CPU's vector registers (GCC/Clang vector extension;
// unaligned loads through memcpy). Wider than the registers is much slower, not just no faster: a
// 16-float value on an AVX2 CPU (Zen 3) made each K/V row and head cost ~120 cycles instead of ~35,
// mostly in the shuffles of the reduction below, which the compiler then lowers lane by lane.
#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;  // SSE, NEON
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// W bfloat16 values widened to float32: a bfloat16 is the high half of a float32's bits, so each
// widens exactly by a zero-extend and a 16-bit shift (vpmovzxwd + vpslld on AVX-512); the sums
// stay float32. Read this way, a bf16 cache costs half the bytes of a float32 one per row.
typedef uint16_t vh16 __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(W * sizeof(uint32_t))));
inline vf loadv(const c10::BFloat16* p) {
  vh16 h;
  std::memcpy(&h, p, sizeof h);
  const vu32 u = __builtin_convertvector(h, vu32) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// the G x D outputs of one task: float32 as is, bfloat16 rounded to nearest even
inline void store_out(float* out, const vf& v) { std::memcpy(out, &v, sizeof v); }
inline void store_out(c10::BFloat16* out, const vf& v) {
  for (int i = 0; i < W; ++i) out[i] = c10::BFloat16(v[i]);
}

inline float hsum(vf v) {
  float r = 0.f;
  for (int i = 0; i < W; ++i) r += v[i];
  return r;
}

// the next block's row is prefetched 256 bytes at a time (the adjacent-line prefetcher does the rest)
constexpr int PREFETCH_BYTES = 256;
template <typename E>
constexpr int PREFETCH_ELEMS = PREFETCH_BYTES / sizeof(E);

// body(t, row) for each of a sequence's ctx rows of one head's cache (row: D floats as D/W vectors),
// block by block through its table; each row prefetches the same row of the next block, and the
// last block's rows those of ``after``
template <int D, typename E, typename Body>
inline void for_each_row(const E* head, const E* after, const int64_t* table, int64_t ctx, int64_t bs,
                         Body&& body) {
  constexpr int C = D / W;
  const int64_t nb = (ctx + bs - 1) / bs;
  for (int64_t b = 0; b < nb; ++b) {
    const E* blk = head + table[b] * bs * D;
    const E* next = b + 1 < nb ? head + table[b + 1] * bs * D : after;
    const int64_t t0 = b * bs, tn = std::min(bs, ctx - t0);
    for (int64_t t = 0; t < tn; ++t) {
      for (int x = 0; x < D; x += PREFETCH_ELEMS<E>) __builtin_prefetch(next + t * D + x);
      vf row[C];
      for (int c = 0; c < C; ++c) row[c] = loadv(blk + t * D + W * c);
      body(t0 + t, row);
    }
  }
}

// The W horizontal sums of a[0..W-1] in one vector, in W-1 shuffle-and-add steps instead of W
// separate reductions (each a chain of log2(W) dependent steps). Each step folds two vectors into
// one, lane groups of 2S against each other (S = W/2, then W/4, ..., 1): lane l of the result
// takes, within its group of 2S lanes, the first S lanes' sum from x, the last S from y. Output
// lane l holds the sum of a[bitrev(l)] (log2(W) bits), so the caller stores vector k at bitrev(k).
constexpr int LOG2W = W == 16 ? 4 : W == 8 ? 3 : 2;
constexpr int bitrev(int i) {
  int r = 0;
  for (int b = 0; b < LOG2W; ++b) r |= ((i >> b) & 1) << (LOG2W - 1 - b);
  return r;
}
constexpr int fold_index(int s, int l) { return (l % (2 * s) < s ? 0 : W - s) + l; }

template <int S, std::size_t... L>
inline vf fold(vf x, vf y, std::index_sequence<L...>) {
  return __builtin_shufflevector(x, y, fold_index(S, L)...) + __builtin_shufflevector(x, y, (fold_index(S, L) + S)...);
}

template <int S = W / 2>
inline vf reduce_lanes(vf* a) {  // a[0..2S-1], overwritten
  for (int i = 0; i < S; ++i) a[i] = fold<S>(a[2 * i], a[2 * i + 1], std::make_index_sequence<W>{});
  if constexpr (S > 1) {
    return reduce_lanes<S / 2>(a);
  } else {
    return a[0];
  }
}

// the G heads' partial dot products with one K row (lane sums still to take), prefetching `ahead`
template <int G, int D, typename E>
inline void row_dots(const vf (&qv)[G][D / W], const E* row, const E* ahead, vf* dots) {
  constexpr int C = D / W;
  for (int x = 0; x < D; x += PREFETCH_ELEMS<E>) __builtin_prefetch(ahead + x);
  vf kv[C];
  for (int c = 0; c < C; ++c) kv[c] = loadv(row + W * c);
  for (int j = 0; j < G; ++j) {
    vf a = qv[j][0] * kv[0];
    for (int c = 1; c < C; ++c) a += qv[j][c] * kv[c];
    dots[j] = a;
  }
}

// One (sequence, kv head) task in float32 with the GQA group size G and head_dim D known at compile
// time: q, the accumulators and one K/V row live in registers (the generic loop below keeps its
// accumulators in memory: 1.4x slower on cache-resident contexts), and each row prefetches the row
// of the next block (blocks lie anywhere: the hardware prefetcher starts over at each one; 1.25x at
// 256 sequences of the benchmark's model, whose K/V do not fit in cache). Scores are made W at a
// time (W / G rows for each of the G heads), reduced together by reduce_lanes: the per-score
// reductions had made the kernel compute-bound even on contexts that stream from memory. E is the
// cache's element type: float32, or bfloat16 widened to float32 as it is loaded (all sums float32).
template <typename E, int G, int D>
inline void decode_task(const E* q, int64_t q_stride_h, const E* kh, const E* vh,
                        const int64_t* table, int64_t ctx, int64_t bs, float scale, float* scores, E* out) {
  static_assert(G <= W && D % W == 0, "a GQA group wider than a vector, or a head_dim not a multiple of it");
  constexpr int C = D / W;
  constexpr int NT = W / G;  // rows per group of W scores
  vf qv[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) qv[j][c] = loadv(q + j * q_stride_h + W * c) * scale;
  const int64_t nb = (ctx + bs - 1) / bs;
  const int64_t last = table[nb - 1];
  for (int64_t b = 0; b < nb; ++b) {
    const E* blk = kh + table[b] * bs * D;
    const E* next = b + 1 < nb ? kh + table[b + 1] * bs * D : vh + table[0] * bs * D;  // then V's first
    const int64_t t0 = b * bs, tn = std::min(bs, ctx - t0);
    int64_t t = 0;
    for (; t + NT <= tn; t += NT) {
      vf acc[W];
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) {
        vf dots[G];
        row_dots<G, D, E>(qv, blk + (t + i) * D, next + (t + i) * D, dots);
#pragma GCC unroll 16
        for (int j = 0; j < G; ++j) acc[bitrev(j * NT + i)] = dots[j];
      }
      const vf r = reduce_lanes(acc);
      for (int j = 0; j < G; ++j) std::memcpy(scores + j * ctx + t0 + t, reinterpret_cast<const float*>(&r) + j * NT,
                                              NT * sizeof(float));
    }
    for (; t < tn; ++t) {  // the block's last rows, fewer than NT
      vf dots[G];
      row_dots<G, D, E>(qv, blk + t * D, next + t * D, dots);
      for (int j = 0; j < G; ++j) scores[j * ctx + t0 + t] = hsum(dots[j]);
    }
  }
  softmax_rows(scores, G, ctx);
  vf acc[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = vf{};
  for_each_row<D, E>(vh, vh + last * bs * D, table, ctx, bs, [&](int64_t t, const vf* vv) {
    for (int j = 0; j < G; ++j) {
      const float p = scores[j * ctx + t];
      for (int c = 0; c < C; ++c) acc[j][c] += p * vv[c];
    }
  });
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) store_out(out + j * D + W * c, acc[j][c]);
}

template <typename E>
using Task = void (*)(const E*, int64_t, const E*, const E*, const int64_t*, int64_t, int64_t, float, float*, E*);

// the element types with a fast path (float16 takes the generic loop)
template <typename E>
constexpr bool kFastPath = std::is_same_v<E, float> || std::is_same_v<E, c10::BFloat16>;

// the compiled-in (G, D) cases (the GQA groups and head sizes of the Llama/Qwen family) that fit the
// vector width; nullptr: generic loop
template <typename E, int G, int D>
constexpr Task<E> task_if_fits() {
  if constexpr (G <= W && kFastPath<E>) {
    return &decode_task<E, G, D>;
  } else {
    return nullptr;
  }
}

template <typename E>
inline Task<E> fixed_task(int64_t g, int64_t d) {
#define KVTUNE_CASE(G, D) if (g == G && d == D) return task_if_fits<E, G, D>();
  KVTUNE_CASE(1, 64) KVTUNE_CASE(2, 64) KVTUNE_CASE(4, 64) KVTUNE_CASE(8, 64)
  KVTUNE_CASE(1, 128) KVTUNE_CASE(2, 128) KVTUNE_CASE(4, 128) KVTUNE_CASE(8, 128)
#undef KVTUNE_CASE
  return nullptr;
}

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
  [[maybe_unused]] const Task<scalar_t> fixed = fixed_task<scalar_t>(g, d);
#pragma omp parallel num_threads(static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks))))
  {
    std::vector<float> qf(g * d), acc(g * d), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t s = task % n, h = task / n;  // head-major: rows of one prompt share its K/V in cache
      const int64_t ctx = lens[s];
      if (ctx <= 0) {
        for (int64_t j = 0; j < g; ++j)
          for (int64_t x = 0; x < d; ++x) out[s * hq * d + (h * g + j) * d + x] = scalar_t(0);
        continue;
      }
      scores.resize(g * ctx);
      const int64_t* table = bt + s * bt_stride;
      const scalar_t* kh = kc + h * head_stride;
      const scalar_t* vh = vc + h * head_stride;
      if constexpr (kFastPath<scalar_t>) {
        if (fixed != nullptr) {
          fixed(q + s * q_stride_n + h * g * q_stride_h, q_stride_h, kh, vh, table, ctx, bs, scale,
                scores.data(), out + s * hq * d + h * g * d);
          continue;
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        const scalar_t* qp = q + s * q_stride_n + (h * g + j) * q_stride_h;
        for (int64_t x = 0; x < d; ++x) qf[j * d + x] = to_f(qp[x]) * scale;
      }
      const int64_t nb = (ctx + bs - 1) / bs;
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
      softmax_rows(scores.data(), g, ctx);
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

// The step's new k/v [T, hk, d] (rows may be strided, heads and d contiguous) into the caches
// [hk, num_blocks, bs, d] at slot_mapping[t] = block * bs + offset: one d-float copy per token and
// head. PyTorch's advanced-index assignment of the same took 0.3 ms a layer at 32 tokens.
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "write_kv: contiguous caches of one shape");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "write_kv: k/v [T, heads, d], heads contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "write_kv: k/v and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
              slot_mapping.size(0) == k.size(0), "write_kv: int64 slot_mapping [T]");
  const int64_t t_n = k.size(0), hk = k_cache.size(0), nblocks = k_cache.size(1), bs = k_cache.size(2),
                d = k_cache.size(3);
  TORCH_CHECK(k.size(1) == hk && k.size(2) == d, "write_kv: k/v heads or head_dim differ from the cache's");
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t nslots = nblocks * bs;
  for (int64_t t = 0; t < t_n; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "write_kv: slot ", sp[t], " outside the cache's ", nslots);
  const int64_t bytes = d * static_cast<int64_t>(k.element_size());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t es = k.element_size(), ks0 = k.stride(0) * es, vs0 = v.stride(0) * es;
  const int64_t head_bytes = nslots * bytes;
  // a copy of a few KiB per token: threads pay only from a few hundred tokens on
  at::parallel_for(0, t_n, 256, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const int64_t off = sp[t] * bytes;
      for (int64_t h = 0; h < hk; ++h) {
        std::memcpy(kc + h * head_bytes + off, kp + t * ks0 + h * bytes, bytes);
        std::memcpy(vc + h * head_bytes + off, vp + t * vs0 + h * bytes, bytes);
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a block-tabled KV cache");
  m.def("write_kv", &write_kv, "the step's new K/V into the paged caches at their slots");
}
