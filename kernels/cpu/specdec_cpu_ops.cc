// CPU kernels for small-batch decoding, as paddle custom operators (AVX2 + FMA + F16C, own thread pool).
//
// Each has a reference twin in reference.py, and tests/kernels runs both on the same inputs.
//   skinny_matmul(x[M,K], w[N/16,K,16]) -> [M,N]   weight-streaming GEMM for small M
//   rms_matmul(x, w, eps) -> rms_norm(x) @ w
//   matmul_add(x, w, residual) -> residual + x @ w
//   rms_matmul_swiglu(x, w, eps) -> silu(h @ gate) * (h @ up), h = rms_norm(x), with gate and up
//       interleaved in the panels: panel p holds gate columns 8p..8p+7, then up columns 8p..8p+7
//   rms_norm(x[M,K], eps) -> [M,K]                 x / sqrt(mean(x^2) + eps) (gain folded elsewhere)
//   rope_attention(qkv, cache, cos, sin, ctx, heads, kv_heads) -> [T, heads*D]
//       RoPE on the new rows' q/k heads, k/v written into the cache at positions ctx.., then
//       causal attention of the T rows over positions [0, ctx + t]. Keys are cached in transposed tiles of 8 positions.
#include "paddle/extension.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// A tiny pool for the parallel loops of these kernels. Unlike an OpenMP parallel region, a loop
// never waits for a worker that has not started: the caller claims chunks itself, and workers
// that wake up late find nothing left. On a busy machine (another process on the other core) an
// OpenMP barrier would wait a whole scheduler time slice for the descheduled thread, every call.
class WorkPool {
 public:
  struct Job {
    const std::function<void(int64_t)>* fn;
    int64_t total;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };

  static WorkPool& get() {
    static WorkPool pool;
    return pool;
  }

  // Runs fn(0) .. fn(chunks - 1), in any order, on the caller and the workers.
  void parallel_for(int64_t chunks, const std::function<void(int64_t)>& fn) {
    if (workers_.empty() || chunks <= 1) {
      for (int64_t i = 0; i < chunks; ++i) fn(i);
      return;
    }
    Job job;
    job.fn = &fn;
    job.total = chunks;
    current_.store(&job, std::memory_order_release);
    if (sleeping_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    work(job);
    while (job.done.load(std::memory_order_acquire) < job.total) _mm_pause();
    // A worker may have picked up the job pointer just before it was cleared: wait it out. The
    // store and the loads are sequentially consistent (as are the worker's increment and load),
    // so either the worker sees nullptr or this loop sees the worker (Dekker's handshake).
    current_.store(nullptr, std::memory_order_seq_cst);
    while (active_.load(std::memory_order_seq_cst) > 0) _mm_pause();
  }

  ~WorkPool() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

 private:
  WorkPool() {
    int threads = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("SPECDEC_NUM_THREADS")) threads = std::atoi(env);
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }

  static void work(Job& job) {
    int64_t i;
    while ((i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.total) {
      (*job.fn)(i);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    while (!stop_.load(std::memory_order_relaxed)) {
      active_.fetch_add(1, std::memory_order_seq_cst);
      Job* job = current_.load(std::memory_order_seq_cst);
      if (job != nullptr) work(*job);
      active_.fetch_sub(1, std::memory_order_acq_rel);
      if (job != nullptr) {
        _mm_pause();  // all its chunks are claimed; look again shortly
        continue;
      }
      // Spin a little (the next kernel call is usually microseconds away), then sleep.
      bool found = false;
      for (int spin = 0; spin < 20000 && !found; ++spin) {
        _mm_pause();
        found = current_.load(std::memory_order_acquire) != nullptr;
      }
      if (found) continue;
      std::unique_lock<std::mutex> lock(mutex_);
      sleeping_.fetch_add(1);
      wake_.wait(lock, [this] { return current_.load() != nullptr || stop_.load(); });
      sleeping_.fetch_sub(1);
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<Job*> current_{nullptr};
  std::atomic<int> active_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
};

constexpr int kPanel = 16;  // columns per weight panel: two AVX2 registers

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// exp for 8 lanes (Cephes-style range reduction + degree-5 polynomial, ~1 ulp on [-87, 88]).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// silu(g) * u = g / (1 + exp(-g)) * u
inline __m256 swiglu8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

enum class Epilogue { kStore, kAddResidual, kSwiglu };

// acc[m, 0:16] = sum_k x[m, k] * panel[k, 0:16] for MB rows; the panel streams through once.
// Then: kStore writes 16 columns, kAddResidual writes residual + acc, kSwiglu writes 8 columns
// silu(acc[0:8]) * acc[8:16].
template <int MB, Epilogue E, typename W>
inline void panel_rows(const float* x, int64_t K, const W* panel, float* out, int64_t ld_out,
                       const float* residual) {
  __m256 acc0[MB], acc1[MB];
  for (int m = 0; m < MB; ++m) { acc0[m] = _mm256_setzero_ps(); acc1[m] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    // Software prefetch ~2 KB ahead: the hardware prefetcher stops at page boundaries.
    if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 64) * kPanel), _MM_HINT_T0);
    const __m256 w0 = load8(panel + k * kPanel);
    const __m256 w1 = load8(panel + k * kPanel + 8);
    for (int m = 0; m < MB; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      acc0[m] = _mm256_fmadd_ps(xb, w0, acc0[m]);
      acc1[m] = _mm256_fmadd_ps(xb, w1, acc1[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    float* o = out + m * ld_out;
    if constexpr (E == Epilogue::kSwiglu) {
      _mm256_storeu_ps(o, swiglu8(acc0[m], acc1[m]));
    } else if constexpr (E == Epilogue::kAddResidual) {
      const float* r = residual + m * ld_out;
      _mm256_storeu_ps(o, _mm256_add_ps(acc0[m], _mm256_loadu_ps(r)));
      _mm256_storeu_ps(o + 8, _mm256_add_ps(acc1[m], _mm256_loadu_ps(r + 8)));
    } else {
      _mm256_storeu_ps(o, acc0[m]);
      _mm256_storeu_ps(o + 8, acc1[m]);
    }
  }
}

template <Epilogue E, typename W>
void skinny_matmul_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t panels, float* out,
                        const float* residual) {
  const int64_t cols = E == Epilogue::kSwiglu ? kPanel / 2 : kPanel;  // output columns per panel
  const int64_t ld_out = panels * cols;
  // Chunks of a few panels: enough of them to balance two or more threads.
  const int64_t per_chunk = std::max<int64_t>(1, panels / 32);
  const int64_t chunks = (panels + per_chunk - 1) / per_chunk;
  WorkPool::get().parallel_for(chunks, [&](int64_t chunk) {
  for (int64_t p = chunk * per_chunk; p < std::min(panels, (chunk + 1) * per_chunk); ++p) {
    const W* panel = w + p * K * kPanel;
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      const float* xr = x + m0 * K;
      const int64_t offset = m0 * ld_out + p * cols;
      float* o = out + offset;
      const float* r = residual ? residual + offset : nullptr;
      switch (std::min<int64_t>(6, M - m0)) {
        case 1: panel_rows<1, E>(xr, K, panel, o, ld_out, r); break;
        case 2: panel_rows<2, E>(xr, K, panel, o, ld_out, r); break;
        case 3: panel_rows<3, E>(xr, K, panel, o, ld_out, r); break;
        case 4: panel_rows<4, E>(xr, K, panel, o, ld_out, r); break;
        case 5: panel_rows<5, E>(xr, K, panel, o, ld_out, r); break;
        default: panel_rows<6, E>(xr, K, panel, o, ld_out, r); break;
      }
    }
  }
  });
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

namespace {

// x / sqrt(mean(x^2) + eps), row by row, into out (which may be a scratch buffer).
void rms_rows(const float* x, int64_t M, int64_t K, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    const float scale = 1.0f / std::sqrt(dot(row, row, K) / static_cast<float>(K) + eps);
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = row[k] * scale;
  }
}

template <Epilogue E>
paddle::Tensor run_matmul(const paddle::Tensor& x, const float* x_data, const paddle::Tensor& w,
                          const float* residual) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "x must be float32");
  PD_CHECK(w.shape().size() == 3 && w.shape()[2] == kPanel, "w must be [N/16, K, 16] panels");
  const int64_t M = x.shape()[0], K = x.shape()[1], panels = w.shape()[0];
  PD_CHECK(w.shape()[1] == K, "inner dimensions differ");
  const int64_t cols = E == Epilogue::kSwiglu ? panels * kPanel / 2 : panels * kPanel;
  auto out = paddle::empty({M, cols}, paddle::DataType::FLOAT32, x.place());
  if (w.dtype() == paddle::DataType::FLOAT16) {
    skinny_matmul_impl<E>(x_data, M, K, reinterpret_cast<const uint16_t*>(w.data<paddle::float16>()), panels,
                          out.data<float>(), residual);
  } else {
    PD_CHECK(w.dtype() == paddle::DataType::FLOAT32, "w must be float16 or float32");
    skinny_matmul_impl<E>(x_data, M, K, w.data<float>(), panels, out.data<float>(), residual);
  }
  return out;
}

std::vector<float> normalized(const paddle::Tensor& x, float eps) {
  const int64_t M = x.shape()[0], K = x.shape()[1];
  std::vector<float> h(M * K);
  rms_rows(x.data<float>(), M, K, eps, h.data());
  return h;
}

}  // namespace

std::vector<paddle::Tensor> SkinnyMatmul(const paddle::Tensor& x, const paddle::Tensor& w) {
  return {run_matmul<Epilogue::kStore>(x, x.data<float>(), w, nullptr)};
}

std::vector<paddle::Tensor> RmsMatmul(const paddle::Tensor& x, const paddle::Tensor& w, float eps) {
  const std::vector<float> h = normalized(x, eps);
  return {run_matmul<Epilogue::kStore>(x, h.data(), w, nullptr)};
}

std::vector<paddle::Tensor> MatmulAdd(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& residual) {
  PD_CHECK(residual.shape()[0] == x.shape()[0] && residual.shape()[1] == w.shape()[0] * kPanel,
           "matmul_add: residual must be [M, N]");
  return {run_matmul<Epilogue::kAddResidual>(x, x.data<float>(), w, residual.data<float>())};
}

std::vector<paddle::Tensor> RmsMatmulSwiglu(const paddle::Tensor& x, const paddle::Tensor& w, float eps) {
  const std::vector<float> h = normalized(x, eps);
  return {run_matmul<Epilogue::kSwiglu>(x, h.data(), w, nullptr)};
}

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, float eps) {
  const int64_t K = x.shape().back();
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  rms_rows(x.data<float>(), x.numel() / K, K, eps, out.data<float>());
  return {out};
}

std::vector<paddle::Tensor> RopeAttention(const paddle::Tensor& qkv, const paddle::Tensor& cache,
                                          const paddle::Tensor& cos, const paddle::Tensor& sin,
                                          int64_t ctx, int64_t heads, int64_t kv_heads) {
  // cache: [2*kv_heads, capacity, D] of storage, laid out as kv_heads blocks of keys in tiles of
  // 8 positions transposed ([capacity/8, D, 8]: the scores of 8 positions come out of 8-wide
  // FMAs over contiguous memory, no horizontal sums), then kv_heads blocks of values
  // ([capacity, D]). capacity must be a multiple of 8.
  const int64_t T = qkv.shape()[0];
  const int64_t D = cache.shape()[2];
  const int64_t capacity = cache.shape()[1];
  const int64_t width = (heads + 2 * kv_heads) * D;
  PD_CHECK(qkv.numel() == T * width, "rope_attention: qkv must be [T, (heads + 2*kv_heads) * D]");
  PD_CHECK(cache.shape()[0] == 2 * kv_heads, "rope_attention: cache must be [2*kv_heads, capacity, D]");
  PD_CHECK(capacity % 8 == 0 && D % 8 == 0, "rope_attention: capacity and D must be multiples of 8");
  PD_CHECK(ctx + T <= capacity, "rope_attention: positions exceed the cache capacity");
  PD_CHECK(ctx + T <= cos.shape()[0], "rope_attention: positions exceed the RoPE table");
  const float* in = qkv.data<float>();
  // The cache is updated in place: it is the backend's own buffer, never part of a graph.
  float* kv = const_cast<float*>(cache.data<float>());
  const float* cos_t = cos.data<float>();
  const float* sin_t = sin.data<float>();
  const int64_t group = heads / kv_heads;

  std::vector<float> q(T * heads * D), k(D);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = in + t * width;
    const int64_t pos = ctx + t;
    const float* c = cos_t + pos * D;
    const float* s = sin_t + pos * D;
    for (int64_t h = 0; h < heads; ++h) rope(row + h * D, c, s, D, q.data() + (t * heads + h) * D);
    for (int64_t h = 0; h < kv_heads; ++h) {
      rope(row + (heads + h) * D, c, s, D, k.data());
      float* tile = kv + h * capacity * D + (pos / 8) * D * 8 + pos % 8;
      for (int64_t d = 0; d < D; ++d) tile[d * 8] = k[d];
      std::copy_n(row + (heads + kv_heads + h) * D, D, kv + ((kv_heads + h) * capacity + pos) * D);
    }
  }

  auto out = paddle::empty({T, heads * D}, paddle::DataType::FLOAT32, qkv.place());
  float* op = out.data<float>();
  const int64_t span = (ctx + T + 7) / 8 * 8;  // positions any row of this call can see, padded
  WorkPool::get().parallel_for(heads, [&](int64_t h) {
    const int64_t kvh = h / group;
    const float* keys_t = kv + kvh * capacity * D;
    const float* values = kv + (kv_heads + kvh) * capacity * D;
    std::vector<float> scores(T * span);
    // Scores of each query row against 4 tiles of 8 positions at a time (4 independent FMA chains).
    for (int64_t t = 0; t < T; ++t) {
      const float* qv = q.data() + (t * heads + h) * D;
      float* sc = scores.data() + t * span;
      int64_t j = 0;
      for (; j + 32 <= span; j += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        const float* tile = keys_t + j * D;
        for (int64_t d = 0; d < D; ++d) {
          const __m256 qd = _mm256_broadcast_ss(qv + d);
          a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(tile + d * 8), a0);
          a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(tile + 8 * D + d * 8), a1);
          a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(tile + 16 * D + d * 8), a2);
          a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(tile + 24 * D + d * 8), a3);
        }
        _mm256_storeu_ps(sc + j, a0);
        _mm256_storeu_ps(sc + j + 8, a1);
        _mm256_storeu_ps(sc + j + 16, a2);
        _mm256_storeu_ps(sc + j + 24, a3);
      }
      for (; j < span; j += 8) {
        __m256 a0 = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; ++d)
          a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(qv + d), _mm256_loadu_ps(keys_t + j * D + d * 8), a0);
        _mm256_storeu_ps(sc + j, a0);
      }
    }
    std::vector<float> acc(D);
    for (int64_t t = 0; t < T; ++t) {
      float* sc = scores.data() + t * span;
      const int64_t visible = ctx + t + 1;
      float best = -INFINITY;
      for (int64_t j = 0; j < visible; ++j) best = std::max(best, sc[j]);
      const __m256 vbest = _mm256_set1_ps(best);
      float total = 0.f;
      int64_t j = 0;
      for (; j + 8 <= visible; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vbest));
        _mm256_storeu_ps(sc + j, e);
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, e);
        for (int l = 0; l < 8; ++l) total += lanes[l];
      }
      for (; j < visible; ++j) {
        sc[j] = std::exp(sc[j] - best);
        total += sc[j];
      }
      if (D == 64) {  // the common head size: eight accumulators that stay in registers
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < visible; ++jj) {
          const __m256 p = _mm256_set1_ps(sc[jj]);
          const float* v = values + jj * 64;
          for (int i = 0; i < 8; ++i) r[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), r[i]);
        }
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc.data() + 8 * i, r[i]);
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t jj = 0; jj < visible; ++jj) {
          const __m256 p = _mm256_set1_ps(sc[jj]);
          const float* v = values + jj * D;
          for (int64_t i = 0; i < D; i += 8)
            _mm256_storeu_ps(acc.data() + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc.data() + i)));
        }
      }
      float* o = op + t * heads * D + h * D;
      const float inv = 1.f / total;
      for (int64_t i = 0; i < D; ++i) o[i] = acc[i] * inv;
    }
  });
  return {out};
}

PD_BUILD_OP(specdec_skinny_matmul)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(SkinnyMatmul));

PD_BUILD_OP(specdec_rms_matmul)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsMatmul));

PD_BUILD_OP(specdec_matmul_add)
    .Inputs({"X", "W", "Residual"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(MatmulAdd));

PD_BUILD_OP(specdec_rms_matmul_swiglu)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsMatmulSwiglu));

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
