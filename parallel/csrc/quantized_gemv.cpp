// Weight-only int4 and int8 products for decode-sized calls on x86 CPUs: the activations quantized
// to int8 per 32 inputs, products summed in int32 by AVX-512 VNNI / AVX-VNNI (vpdpbusd) or AVX2's
// vpmaddubsw, as llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products do (parallel/int4.py,
// parallel/quantization.py).
//
// int8 weights: [N, K] with one scale per output row (absmax / 127, so -127..127); a group's product
// x_scale * sum(w * x_q) is summed as |w| * (x_q with w's sign), vpdpbusd's unsigned x signed form.
//
// int4 weight layout, per output row: for each group of 32 inputs 16 bytes, byte j holding code j in its
// low nibble and code j + 16 in its high nibble; float16 scale and minimum per group, so that
// w = code * scale + minimum. A group's product is
//   scale * x_scale * sum(code * x_q) + minimum * x_scale * sum(x_q)
// with x ~= x_q * x_scale (x_q in -127..127). The minimum's term takes the quantized activations'
// sum, not the exact one: then the two terms' rounding errors cancel as they do in
// sum((code * scale + minimum) * x_q * x_scale); with the exact sum they did not (top-1 agreement
// with float32 on SmolLM2 93.6% instead of 97.2%).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define RAYLANE_HAS_GEMV 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 4;  // activation rows per pass over the weights

#ifdef RAYLANE_HAS_GEMV

inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  // u <= 127 (int4 codes, int8 magnitudes), s in -127..127: a pair's sum fits int16.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float half(const c10::Half h) { return _cvtsh_ss(h.x); }

inline float dot_half(const c10::Half* a, const float* b, int64_t count) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 ah = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    acc = _mm256_fmadd_ps(ah, _mm256_loadu_ps(b + i), acc);
  }
  float sum = hsum(acc);
  for (; i < count; ++i) sum += half(a[i]) * b[i];
  return sum;
}

inline __m256i unpack(const uint8_t* w) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

// Sums of code * x_q of two groups at once: `codes` is 32 bytes (groups g and g + 1, 16 each), its
// low nibbles codes 0-15 of each group, its high nibbles codes 16-31; `xq` the two groups'
// activations as `pair_activations` lays them out. The int32 lanes 0-3 hold group g's partial sums,
// 4-7 group g + 1's.
inline __m256i dot_pair(const uint8_t* codes, const int8_t* xq) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
  const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xa), hi, xb);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xa), hi, xb);
#else
  // codes <= 15, x_q in -127..127: two pairs' sums, 2 * 2 * 15 * 127, still fit int16.
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// Each pair of groups' 64 activations reordered as dot_pair reads them, against the nibbles: codes 0-15
// of both groups, then codes 16-31 of both. A last odd group keeps its order (the one-group path).
void pair_activations(std::vector<int8_t>& q, int64_t rows, int64_t k) {
  int8_t tmp[2 * kGroup];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g + 2 <= k / kGroup; g += 2) {
      int8_t* x = q.data() + r * k + g * kGroup;
      std::copy(x, x + 2 * kGroup, tmp);
      std::copy(tmp, tmp + 16, x);
      std::copy(tmp + 32, tmp + 48, x + 16);
      std::copy(tmp + 16, tmp + 32, x + 32);
      std::copy(tmp + 48, tmp + 64, x + 48);
    }
}

// Rows [n0, n1) of out[m, n] for M activation rows, the activations paired (pair_activations).
// Per row the groups' scales times the activations' are computed 8 at a time into `dd` first; two
// accumulators per activation row, alternate pairs of groups, so each multiply-add waits on the
// one two pairs back, not the last.
template <int M>
void rows_int4(const int8_t* xq, const float* xd, const float* xs, const uint8_t* codes, const c10::Half* scale,
               const c10::Half* minimum, float* out, int64_t k, int64_t n, int64_t n0, int64_t n1, float* dd) {
  const int64_t groups = k / kGroup;
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (int64_t row = n0; row < n1; ++row) {
    const uint8_t* w = codes + row * (k / 2);
    const c10::Half* ws = scale + row * groups;
    for (int m = 0; m < M; ++m) {
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8) {
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws + g)));
        _mm256_storeu_ps(dd + m * groups + g, _mm256_mul_ps(s, _mm256_loadu_ps(xd + m * groups + g)));
      }
      for (; g < groups; ++g) dd[m * groups + g] = half(ws[g]) * xd[m * groups + g];
    }
    __m256 acc[2][M];
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      for (int m = 0; m < M; ++m) {
        const __m256i dot = dot_pair(w + g * 16, xq + m * k + g * kGroup);
        const __m128 pair = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dd + m * groups + g)));
        const __m256 d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), spread);
        acc[(g >> 1) & 1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[(g >> 1) & 1][m]);
      }
    }
    if (g < groups) {
      const __m256i w0 = unpack(w + g * 16);
      for (int m = 0; m < M; ++m) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + g * kGroup));
        acc[0][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(w0, x0)), _mm256_set1_ps(dd[m * groups + g]),
                                    acc[0][m]);
      }
    }
    for (int m = 0; m < M; ++m)
      out[m * n + row] = hsum(_mm256_add_ps(acc[0][m], acc[1][m])) +
                         dot_half(minimum + row * groups, xs + m * groups, groups);
  }
}

// int8 weights: rows [n0, n1) of out[m, n].
template <int M>
void rows_int8(const int8_t* xq, const float* xd, const int8_t* weight, const float* scale, float* out, int64_t k,
               int64_t n, int64_t n0, int64_t n1) {
  const int64_t groups = k / kGroup;
  for (int64_t row = n0; row < n1; ++row) {
    const int8_t* w = weight + row * k;
    __m256 acc[2][M];
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kGroup));
      const __m256i magnitude = _mm256_sign_epi8(wq, wq);
      for (int m = 0; m < M; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + g * kGroup));
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(magnitude, _mm256_sign_epi8(x, wq)));
        acc[g & 1][m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(xd[m * groups + g]), acc[g & 1][m]);
      }
    }
    for (int m = 0; m < M; ++m) out[m * n + row] = hsum(_mm256_add_ps(acc[0][m], acc[1][m])) * scale[row];
  }
}

#endif

bool quantized_gemv_supported() {
#ifdef RAYLANE_HAS_GEMV
  return true;
#else
  return false;
#endif
}

// Activations quantized once per call: int8 per 32 inputs, with each group's scale and sum.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
};

Quantized quantize(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), groups = rows * k / kGroup;
  Quantized out{std::vector<int8_t>(rows * k), std::vector<float>(groups), std::vector<float>(groups)};
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < groups; ++i) {
    const float* src = xp + i * kGroup;
    float amax = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kGroup; ++j) {
      const auto q = static_cast<int8_t>(std::nearbyint(src[j] * inv));
      out.q[i * kGroup + j] = q;
      sum += q;
    }
    out.scale[i] = d;
    out.sum[i] = d * static_cast<float>(sum);
  }
  return out;
}

// Calls `kernel<M>(first row, M)` over passes of up to kMaxRows activation rows.
template <typename Kernel>
void passes(int64_t rows, Kernel kernel) {
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
    switch (std::min(kMaxRows, rows - m0)) {
      case 1: kernel(std::integral_constant<int, 1>{}, m0); break;
      case 2: kernel(std::integral_constant<int, 2>{}, m0); break;
      case 3: kernel(std::integral_constant<int, 3>{}, m0); break;
      default: kernel(std::integral_constant<int, 4>{}, m0); break;
    }
  }
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(quantized_gemv_supported(), "raylane's quantized kernels need an x86 CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] float32");
  TORCH_CHECK(x.size(1) % kGroup == 0, "K a multiple of 32");
}

// x [M, K] float32; codes [N, K / 2] uint8; scale, minimum [N, K / 32] float16 -> [M, N] float32.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& minimum) {
  check_x(x);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: uint8");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && minimum.scalar_type() == at::kHalf && scale.is_contiguous() &&
                  minimum.is_contiguous(),
              "float16 scales");
  const int64_t k = x.size(1), n = codes.size(0), groups = k / kGroup;
  TORCH_CHECK(codes.size(1) * 2 == k && scale.size(0) == n && scale.size(1) == groups &&
                  minimum.sizes() == scale.sizes(),
              "shapes");
  auto out = at::empty({x.size(0), n}, x.options());
#ifdef RAYLANE_HAS_GEMV
  Quantized xq = quantize(x);
  pair_activations(xq.q, x.size(0), k);
  const auto* wc = codes.data_ptr<uint8_t>();
  const auto* ws = scale.data_ptr<c10::Half>();
  const auto* wm = minimum.data_ptr<c10::Half>();
  float* o = out.data_ptr<float>();
  passes(x.size(0), [&](auto rows_here, int64_t m0) {
    constexpr int M = decltype(rows_here)::value;
    at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
      std::vector<float> dd(M * groups);
      rows_int4<M>(xq.q.data() + m0 * k, xq.scale.data() + m0 * groups, xq.sum.data() + m0 * groups, wc, ws,
                   wm, o + m0 * n, k, n, n0, n1, dd.data());
    });
  });
#endif
  return out;
}

// x [M, K] float32; weight [N, K] int8 (-127..127); scale [N] float32 -> [M, N] float32.
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  check_x(x);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight: [N, K] int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == weight.size(0),
              "scale: [N] float32");
  const int64_t k = x.size(1), n = weight.size(0), groups = k / kGroup;
  auto out = at::empty({x.size(0), n}, x.options());
#ifdef RAYLANE_HAS_GEMV
  const Quantized xq = quantize(x);
  const auto* w = weight.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  passes(x.size(0), [&](auto rows_here, int64_t m0) {
    constexpr int M = decltype(rows_here)::value;
    at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
      rows_int8<M>(xq.q.data() + m0 * k, xq.scale.data() + m0 * groups, w, s, o + m0 * n, k, n, n0, n1);
    });
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylane_cpu, m) {
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scale, Tensor minimum) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("quantized_gemv_supported() -> bool", &quantized_gemv_supported);
}
TORCH_LIBRARY_IMPL(raylane_cpu, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int8_gemv", &int8_gemv);
}
