// CPU kernels for small-batch decoding, as paddle custom operators (AVX2 + FMA + F16C, OpenMP).
//
// Each has a reference twin in reference.py, and tests/kernels runs both on the same inputs.
//   skinny_matmul(x[M,K], w[N/16,K,16]) -> [M,N]   weight-streaming GEMM for small M
//   rms_norm(x[M,K], eps) -> [M,K]                 x / sqrt(mean(x^2) + eps) (gain folded elsewhere)
//   rope_attention(qkv, cache, cos, sin, ctx, heads, kv_heads) -> [T, heads*D]
//       RoPE on the new rows' q/k heads, k/v written into the cache at positions ctx.., then
//       causal attention of the T rows over positions [0, ctx + t].
#include "paddle/extension.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kPanel = 16;  // columns per weight panel: two AVX2 registers

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// out[m, 0:16] = sum_k x[m, k] * panel[k, 0:16] for MB rows; the panel streams through once.
template <int MB, typename W>
inline void panel_rows(const float* x, int64_t K, const W* panel, float* out, int64_t N) {
  __m256 acc0[MB], acc1[MB];
  for (int m = 0; m < MB; ++m) { acc0[m] = _mm256_setzero_ps(); acc1[m] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = load8(panel + k * kPanel);
    const __m256 w1 = load8(panel + k * kPanel + 8);
    for (int m = 0; m < MB; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      acc0[m] = _mm256_fmadd_ps(xb, w0, acc0[m]);
      acc1[m] = _mm256_fmadd_ps(xb, w1, acc1[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm256_storeu_ps(out + m * N, acc0[m]);
    _mm256_storeu_ps(out + m * N + 8, acc1[m]);
  }
}

template <typename W>
void skinny_matmul_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t panels, float* out) {
  const int64_t N = panels * kPanel;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const W* panel = w + p * K * kPanel;
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      const float* xr = x + m0 * K;
      float* o = out + m0 * N + p * kPanel;
      switch (std::min<int64_t>(6, M - m0)) {
        case 1: panel_rows<1>(xr, K, panel, o, N); break;
        case 2: panel_rows<2>(xr, K, panel, o, N); break;
        case 3: panel_rows<3>(xr, K, panel, o, N); break;
        case 4: panel_rows<4>(xr, K, panel, o, N); break;
        case 5: panel_rows<5>(xr, K, panel, o, N); break;
        default: panel_rows<6>(xr, K, panel, o, N); break;
      }
    }
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = x * cos + roll(x, D/2) * sin_signed (rotate-half RoPE), for one head vector.
inline void rope(const float* x, const float* cos, const float* sin, int64_t D, float* y) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    y[i] = x[i] * cos[i] + x[i + half] * sin[i];
    y[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
  }
}

}  // namespace

std::vector<paddle::Tensor> SkinnyMatmul(const paddle::Tensor& x, const paddle::Tensor& w) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "skinny_matmul: x must be float32");
  PD_CHECK(w.shape().size() == 3 && w.shape()[2] == kPanel, "skinny_matmul: w must be [N/16, K, 16]");
  const int64_t M = x.shape()[0], K = x.shape()[1], panels = w.shape()[0];
  PD_CHECK(w.shape()[1] == K, "skinny_matmul: inner dimensions differ");
  auto out = paddle::empty({M, panels * kPanel}, paddle::DataType::FLOAT32, x.place());
  if (w.dtype() == paddle::DataType::FLOAT16) {
    skinny_matmul_impl(x.data<float>(), M, K, reinterpret_cast<const uint16_t*>(w.data<paddle::float16>()),
                       panels, out.data<float>());
  } else {
    PD_CHECK(w.dtype() == paddle::DataType::FLOAT32, "skinny_matmul: w must be float16 or float32");
    skinny_matmul_impl(x.data<float>(), M, K, w.data<float>(), panels, out.data<float>());
  }
  return {out};
}

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, float eps) {
  const int64_t K = x.shape().back();
  const int64_t M = x.numel() / K;
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    const float scale = 1.0f / std::sqrt(dot(row, row, K) / static_cast<float>(K) + eps);
    for (int64_t k = 0; k < K; ++k) op[m * K + k] = row[k] * scale;
  }
  return {out};
}

std::vector<paddle::Tensor> RopeAttention(const paddle::Tensor& qkv, const paddle::Tensor& cache,
                                          const paddle::Tensor& cos, const paddle::Tensor& sin,
                                          int64_t ctx, int64_t heads, int64_t kv_heads) {
  const int64_t T = qkv.shape()[0];
  const int64_t D = cache.shape()[2];
  const int64_t capacity = cache.shape()[1];
  const int64_t width = (heads + 2 * kv_heads) * D;
  PD_CHECK(qkv.numel() == T * width, "rope_attention: qkv must be [T, (heads + 2*kv_heads) * D]");
  PD_CHECK(cache.shape()[0] == 2 * kv_heads, "rope_attention: cache must be [2*kv_heads, capacity, D]");
  PD_CHECK(ctx + T <= capacity, "rope_attention: positions exceed the cache capacity");
  PD_CHECK(ctx + T <= cos.shape()[0], "rope_attention: positions exceed the RoPE table");
  const float* in = qkv.data<float>();
  // The cache is updated in place: it is the backend's own buffer, never part of a graph.
  float* kv = const_cast<float*>(cache.data<float>());
  const float* cos_t = cos.data<float>();
  const float* sin_t = sin.data<float>();
  const int64_t group = heads / kv_heads;

  std::vector<float> q(T * heads * D);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = in + t * width;
    const float* c = cos_t + (ctx + t) * D;
    const float* s = sin_t + (ctx + t) * D;
    for (int64_t h = 0; h < heads; ++h) rope(row + h * D, c, s, D, q.data() + (t * heads + h) * D);
    for (int64_t h = 0; h < kv_heads; ++h) {
      rope(row + (heads + h) * D, c, s, D, kv + (h * capacity + ctx + t) * D);
      std::copy_n(row + (heads + kv_heads + h) * D, D, kv + ((kv_heads + h) * capacity + ctx + t) * D);
    }
  }

  auto out = paddle::empty({T, heads * D}, paddle::DataType::FLOAT32, qkv.place());
  float* op = out.data<float>();
#pragma omp parallel
  {
    std::vector<float> scores(ctx + T);
    std::vector<float> acc(D);
#pragma omp for collapse(2) schedule(static)
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t kvh = h / group;
        const float* keys = kv + kvh * capacity * D;
        const float* values = kv + (kv_heads + kvh) * capacity * D;
        const float* qv = q.data() + (t * heads + h) * D;
        const int64_t visible = ctx + t + 1;
        float best = -INFINITY;
        for (int64_t j = 0; j < visible; ++j) {
          scores[j] = dot(qv, keys + j * D, D);
          best = std::max(best, scores[j]);
        }
        float total = 0.f;
        for (int64_t j = 0; j < visible; ++j) {
          scores[j] = std::exp(scores[j] - best);
          total += scores[j];
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < visible; ++j) {
          const __m256 p = _mm256_set1_ps(scores[j]);
          const float* v = values + j * D;
          int64_t i = 0;
          for (; i + 8 <= D; i += 8) _mm256_storeu_ps(acc.data() + i, _mm256_fmadd_ps(p, load8(v + i), load8(acc.data() + i)));
          for (; i < D; ++i) acc[i] += scores[j] * v[i];
        }
        float* o = op + t * heads * D + h * D;
        const float inv = 1.f / total;
        for (int64_t i = 0; i < D; ++i) o[i] = acc[i] * inv;
      }
    }
  }
  return {out};
}

PD_BUILD_OP(specdec_skinny_matmul)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(SkinnyMatmul));

PD_BUILD_OP(specdec_rms_norm)
    .Inputs({"X"})
    .Outputs({"Out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNorm));

PD_BUILD_OP(specdec_rope_attention)
    .Inputs({"QKV", "Cache", "Cos", "Sin"})
    .Outputs({"Out"})
    .Attrs({"ctx: int64_t", "heads: int64_t", "kv_heads: int64_t"})
    .SetKernelFn(PD_KERNEL(RopeAttention));
