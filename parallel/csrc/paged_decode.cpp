// Decode attention on CPU over raylane's paged KV cache, reading each request's pages in place
// (`attention_backend: cpu_paged`; parallel/cpu_kernels.py builds it).
//
// One query token per request. Caches are [num_blocks, block_size, kv_heads, dim]: a token's keys
// for every KV head are one contiguous row, so a request's context is read block by block with one
// table lookup per block, nothing gathered or padded. Scores, softmax and the weighted sum are in
// float32 whatever the dtypes: queries and caches both float32 or both bfloat16, or float32 queries
// over a bfloat16 cache (`kv_cache_dtype: bfloat16` on a float32 model). Query head h reads KV head
// h / (heads / kv_heads), as in grouped-query attention.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "flush_denormals.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {  // the bit shift the compiler vectorizes
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct Shape {
  int64_t batch, heads, kv_heads, dim, block_size, width, window;
  float scale;
};

// Query heads sharing a KV head are attended together, up to this many: each key and value row is read
// once for all of them. A head's running weighted sum takes DIM floats of registers; four heads' spill
// from AVX2's sixteen registers, and were still faster than runs of two there when this was written.
constexpr int kMaxHeads = 4;

// Calls row(j, r) for the tokens [start, ctx) of a request, r pointing at token start + j's values of
// one KV head (`offset` into the cache's rows of `width` elements), block by block. While it reads a
// block it asks for the same rows of the next one: blocks are scattered over the cache, so the
// hardware prefetcher, which follows an address stream, starts cold at each block. One block ahead
// is far enough to hide the memory's latency on the benchmarked CPU.
template <typename C, typename Row>
inline void for_each_row(const C* cache, const int64_t* table, int64_t start, int64_t ctx, int64_t offset,
                         int64_t width, int64_t dim, const Shape& s, Row&& row) {
  const int64_t bs = s.block_size, bytes = dim * static_cast<int64_t>(sizeof(C));
  for (int64_t t0 = start - start % bs; t0 < ctx; t0 += bs) {
    const C* block = cache + table[t0 / bs] * bs * width + offset;
    const char* next =
        t0 + bs < ctx ? reinterpret_cast<const char*>(cache + table[t0 / bs + 1] * bs * width + offset) : nullptr;
    for (int64_t t = std::max(t0, start); t < std::min(t0 + bs, ctx); ++t) {
      if (next)
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(next + (t - t0) * width * sizeof(C) + b);
      row(t - start, block + (t - t0) * width);
    }
  }
}

// Query heads [h, h + G) of one request, all reading KV head `kv` (grouped-query attention), over its
// tokens [start, ctx). T: the queries' and output's dtype, C: the cache's. DIM > 0: the head size
// known at compile time, so the per-token loops unroll into registers (about twice as fast as a
// runtime bound on the benchmarked CPU); DIM == 0 runs one head at a time, its scaled query and running
// sum in `acc`.
template <typename T, typename C, int64_t DIM, int G>
void attend(const T* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t start, int64_t ctx,
            T* out, const Shape& s, int64_t kv, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t dim = DIM > 0 ? DIM : s.dim, row = s.kv_heads * dim;
  const int64_t n = ctx - start, offset = kv * dim;
  scores.resize(G * n);
  float query[G][DIM > 0 ? DIM : 1];
  if (DIM == 0) acc.resize(2 * dim);
  float* q0 = DIM > 0 ? query[0] : acc.data();
  for (int i = 0; i < G; ++i)
    for (int64_t d = 0; d < dim; ++d) q0[i * dim + d] = to_float(q[i * dim + d]) * s.scale;

  for_each_row(k_cache, table, start, ctx, offset, row, dim, s, [&](int64_t j, const C* key) {
    for (int i = 0; i < G; ++i) {
      const float* qi = q0 + i * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qi[d] * to_float(key[d]);
      scores[i * n + j] = dot;
    }
  });
  for (int i = 0; i < G; ++i) {
    float* si = scores.data() + i * n;
    float top = -INFINITY;
    for (int64_t j = 0; j < n; ++j) top = std::max(top, si[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      si[j] = exp_approx(si[j] - top);
      sum += si[j];
    }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) si[j] *= inv;
  }
  // The weighted sum of values, every head's running sum in registers over the whole context (DIM
  // known at compile time); each value row is read once for the G heads.
  float local[G][DIM > 0 ? DIM : 1];
  float* sum = DIM > 0 ? local[0] : acc.data() + dim;
  for (int64_t i = 0; i < G * dim; ++i) sum[i] = 0.f;
  for_each_row(v_cache, table, start, ctx, offset, row, dim, s, [&](int64_t j, const C* value) {
    for (int i = 0; i < G; ++i) {
      const float p = scores[i * n + j];
      float* si = sum + i * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) si[d] += p * to_float(value[d]);
    }
  });
  for (int64_t i = 0; i < G * dim; ++i) out[i] = static_cast<T>(sum[i]);
}

// Query heads [h0, h1) of request b, in runs of at most kMaxHeads sharing a KV head.
template <typename T, typename C, int64_t DIM>
void attend_heads(const T* q, const C* k_cache, const C* v_cache, const int64_t* table, int64_t ctx, T* out,
                  const Shape& s, int64_t h0, int64_t h1, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim;
  const int64_t start = s.window > 0 ? std::max<int64_t>(0, ctx - s.window) : 0;
  for (int64_t h = h0; h < h1;) {
    const int64_t kv = h / group;
    const int64_t count = DIM > 0 ? std::min<int64_t>({h1, (kv + 1) * group, h + kMaxHeads}) - h : 1;
    static_assert(kMaxHeads == 4, "one instance per run length");
    auto* run = count == 1   ? attend<T, C, DIM, 1>
                : count == 2 ? attend<T, C, DIM, 2>
                : count == 3 ? attend<T, C, DIM, 3>
                             : attend<T, C, DIM, 4>;
    run(q + h * dim, k_cache, v_cache, table, start, ctx, out + h * dim, s, kv, scores, acc);
    h += count;
  }
}

template <typename T, typename C, int64_t DIM>
void decode(const T* q, const C* k_cache, const C* v_cache, const int64_t* tables, const int64_t* lens, T* out,
            const Shape& s) {
  // A request's heads stay on one thread, unless there are fewer requests than threads: then each KV
  // head's query heads are a work item of their own.
  const int64_t splits = s.batch >= at::get_num_threads() ? 1 : s.kv_heads;
  const int64_t per_item = s.heads / splits;
  at::parallel_for(0, s.batch * splits, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;  // softmax weights of far-below-the-max scores would be denormals
    std::vector<float> scores, acc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, h0 = (item % splits) * per_item;
      attend_heads<T, C, DIM>(q + b * s.heads * s.dim, k_cache, v_cache, tables + b * s.width, lens[b],
                              out + b * s.heads * s.dim, s, h0, h0 + per_item, scores, acc);
    }
  });
}

template <typename T, typename C>
void dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out, const Shape& s) {
  auto* kernel = s.dim == 64 ? decode<T, C, 64> : s.dim == 128 ? decode<T, C, 128> : decode<T, C, 0>;
  kernel(q.data_ptr<T>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), block_tables.data_ptr<int64_t>(),
         context_lens.data_ptr<int64_t>(), out.data_ptr<T>(), s);
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [batch, heads, dim], caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "contiguous tensors");
  const auto q_type = q.scalar_type(), cache_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache_type, "both caches in one dtype");
  TORCH_CHECK((q_type == at::kFloat || q_type == at::kBFloat16) &&
                  (cache_type == q_type || cache_type == at::kBFloat16),
              "paged_decode runs float32 or bfloat16 queries over a cache of their dtype or bfloat16, not ",
              q_type, " over ", cache_type);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "int64 block tables and context lengths");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head shapes");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one row per request");
  // The kernel trusts the tables: check every request's context fits its row and names real blocks.
  const int64_t width = block_tables.size(1), blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * block_size, "context length ", lens[b], " of request ", b,
                " does not fit its ", width, " blocks");
    for (int64_t i = (window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0) / block_size;
         i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * width + i] >= 0 && tables[b * width + i] < blocks, "block ",
                  tables[b * width + i], " of request ", b, " is not in the cache");
  }
  auto out = at::empty_like(q);
  const Shape s{q.size(0),       q.size(1),          k_cache.size(2), q.size(2), k_cache.size(1),
                block_tables.size(1), window, static_cast<float>(scale)};
  if (q_type == at::kFloat && cache_type == at::kFloat)
    dispatch<float, float>(q, k_cache, v_cache, block_tables, context_lens, out, s);
  else if (q_type == at::kFloat)
    dispatch<float, c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, s);
  else
    dispatch<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, s);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylane_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylane_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
