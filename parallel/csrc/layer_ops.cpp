// A decoder layer's small float32 ops fused for eager steps on CPU (models/layers.py, models/decoder.py):
// RMSNorm, the residual add with the RMSNorm after it, SiLU(gate) * up, and rotary embedding in place.
//
// In eager mode each of these is several torch ops (RMSNorm: pow, mean, add, rsqrt, mul, mul), each a
// dispatch from Python and a pass over memory; a decode step of a small model spends more time there
// than in its matmuls. torch.compile fuses them itself, so compiled graphs keep torch's ops.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "flush_denormals.h"
#include "vector_math.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

// Rows per task: one row of a decode step is too little work to hand to another thread.
constexpr int64_t kGrain = 16;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), name, " must be contiguous float32");
}

// y = x * rsqrt(mean(x^2) + eps) * weight over one row of `width`, as models/layers.py RMSNorm computes it.
inline void norm_row(const float* x, const float* weight, float* y, int64_t width, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < width; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) y[i] = weight[i] * (x[i] * inv);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t width = weight.numel();
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == width, "rms_norm: x's last dimension must be weight's size");
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.numel() / width, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * width, wp, yp + r * width, width, eps);
  });
  return y;
}

// (x + delta, rms_norm(x + delta)): a layer's residual add and the norm that reads its result.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  check_rows(weight, "weight");
  const int64_t width = weight.numel();
  TORCH_CHECK(x.sizes() == delta.sizes() && x.size(-1) == width, "add_rms_norm: shapes differ");
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, x.numel() / width, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* s = sp + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) s[i] = xp[r * width + i] + dp[r * width + i];
      norm_row(s, wp, yp + r * width, width, eps);
    }
  });
  return {sum, y};
}

// [rows, 2 * n] (gate | up) -> [rows, n]: silu(gate) * up, the gated MLP's activation.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must be [rows, 2 * n]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor y = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t r0, int64_t r1) {
    const FlushDenormals flush;  // see flush_denormals.h: this loop made denormals in discarded lanes
    for (int64_t r = r0; r < r1; ++r) {
      const float *gate = gp + r * 2 * n, *up = gate + n;
      float* out = yp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + exp_approx(-gate[i])) * up[i];
    }
  });
  return y;
}

// Rotates x [rows, heads, dim] in place (rows may be strided, as views of a fused QKV output are):
// x[i] * cos[i] - x[i + dim/2] * sin[i] for the first half, x[i] * cos[i] + x[i - dim/2] * sin[i] for
// the second (rotate_half, as models/layers.py apply_rotary). cos, sin: [rows, dim].
void rotate(at::Tensor& x, const float* cos, const float* sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: q and k must be float32 [rows, heads, dim] with contiguous heads");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2, stride = x.stride(0);
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *c = cos + r * dim, *s = sin + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + r * stride + h * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) % 2 == 0, "rotary: cos, sin [rows, dim]");
  TORCH_CHECK(q.size(0) == cos.size(0) && k.size(0) == cos.size(0), "rotary: one cos/sin row per token");
  TORCH_CHECK(q.size(2) == cos.size(1) && k.size(2) == cos.size(1), "rotary: the whole head is rotated");
  rotate(q, cos.data_ptr<float>(), sin.data_ptr<float>());
  rotate(k, cos.data_ptr<float>(), sin.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(raylane_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(raylane_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
}
