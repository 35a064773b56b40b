// CPU kernels for small-batch decoding, as paddle custom operators (AVX2 + FMA + F16C, own thread pool).
//
// Each has a reference twin in reference.py, and tests/kernels runs both on the same inputs.
//   skinny_matmul(x[M,K], w[N/16,K,16]) -> [M,N]   weight-streaming GEMM for small M
//   rms_matmul(x, w, eps) -> rms_norm(x) @ w
//   matmul_add(x, w, residual) -> residual + x @ w
//   rms_matmul_swiglu(x, w, eps) -> silu(h @ gate) * (h @ up), h = rms_norm(x), with gate and up
//       interleaved in the panels: panel p holds gate columns 8p..8p+7, then up columns 8p..8p+7
//   rms_norm(x[M,K], eps) -> [M,K]                 x / sqrt(mean(x^2) + eps) (gain folded elsewhere)
//   paged_attention(qkv, cache, cos, sin, block_tables, cu_seqlens_q, context_lens, heads, kv_heads)
//       -> [T, heads*D]: for a packed batch of requests, RoPE on the new rows' q/k heads, k/v
//       written into the paged cache at positions context_lens[b].., then causal attention of
//       each request's rows over its own positions [0, context + t]. Keys are cached in
//       transposed tiles of 8 positions; the cache is float32 or float16 (computation is float32).
//       Its score, softmax and value passes run 16 floats wide where the CPU has AVX-512, with the same
//       floats out as the AVX2 passes.
#include "paddle/extension.h"
#include "paged_attention.h"
#include "simd_math.h"
#include "work_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <memory>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace {

using specdec_cpu::WorkPool;
using specdec_cpu::exp8;
using specdec_cpu::hsum8;
using specdec_cpu::swiglu8;

constexpr int kPanel = 16;  // columns per weight panel: two AVX2 registers

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

enum class Epilogue { kStore, kAddResidual, kSwiglu };

// acc[m, 0:16] = sum_k x[m, k] * panel[k, 0:16] for MB rows; the panel streams through once.
// Then: kStore writes 16 columns, kAddResidual writes residual + acc, kSwiglu writes 8 columns
// silu(acc[0:8]) * acc[8:16].
template <int MB, Epilogue E, typename W>
inline void panel_rows(const float* x, int64_t K, const W* panel, float* out, int64_t ld_out,
                       const float* residual) {
  __m256 acc0[MB], acc1[MB];
#pragma GCC unroll 6
  for (int m = 0; m < MB; ++m) { acc0[m] = _mm256_setzero_ps(); acc1[m] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    // Software prefetch ~2 KB ahead: the hardware prefetcher stops at page boundaries.
    if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 64) * kPanel), _MM_HINT_T0);
    const __m256 w0 = load8(panel + k * kPanel);
    const __m256 w1 = load8(panel + k * kPanel + 8);
#pragma GCC unroll 6  // without it GCC keeps acc0/acc1 in memory for MB >= 4 (2.7x slower)
    for (int m = 0; m < MB; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      acc0[m] = _mm256_fmadd_ps(xb, w0, acc0[m]);
      acc1[m] = _mm256_fmadd_ps(xb, w1, acc1[m]);
    }
  }
#pragma GCC unroll 6
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
    // Row tiles of at most 6, as even as possible (8 rows: 4 + 4, not 6 + 2: a tile of few
    // rows spends most of its time loading the panel).
    const int64_t tiles = (M + 5) / 6;
    for (int64_t tile = 0, m0 = 0; tile < tiles; ++tile) {
      const int64_t tile_rows = (M - m0) / (tiles - tile) + ((M - m0) % (tiles - tile) != 0);
      const float* xr = x + m0 * K;
      const int64_t offset = m0 * ld_out + p * cols;
      float* o = out + offset;
      const float* r = residual ? residual + offset : nullptr;
      m0 += tile_rows;
      switch (tile_rows) {
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

// y = x * cos + roll(x, D/2) * sin_signed (rotate-half RoPE), for one head vector; 8 lanes at a
// time while they last.
inline void rope(const float* x, const float* cos, const float* sin, int64_t D, float* y) {
  const int64_t half = D / 2;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + i + half);
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(hi, _mm256_loadu_ps(sin + i), _mm256_mul_ps(lo, _mm256_loadu_ps(cos + i))));
    _mm256_storeu_ps(y + i + half, _mm256_fmadd_ps(lo, _mm256_loadu_ps(sin + i + half),
                                                   _mm256_mul_ps(hi, _mm256_loadu_ps(cos + i + half))));
  }
  for (; i < half; ++i) {
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

// Paged cache of one layer: [num_blocks, 2*kv_heads, block_size, D] of T (float, or uint16_t
// holding IEEE half floats). In each block, the kv_heads key pages are stored in transposed tiles
// of 8 positions ([block_size/8, D, 8]: the scores of 8 positions come out of 8-wide FMAs over
// contiguous memory, no horizontal sums), then the kv_heads value pages ([block_size, D]).
template <typename T>
struct PagedCache {
  T* data;
  int64_t kv_heads, block_size, D;
  const T* key_tile(int32_t block, int64_t kvh, int64_t pos) const {  // pos: a multiple of 8
    return data + ((block * 2 * kv_heads + kvh) * block_size + (pos % block_size) / 8 * 8) * D;
  }
  T* key_slot(int32_t block, int64_t kvh, int64_t pos) const {  // element d sits at [d * 8]
    const int64_t off = pos % block_size;
    return data + ((block * 2 * kv_heads + kvh) * block_size + off / 8 * 8) * D + off % 8;
  }
  T* value_page(int32_t block, int64_t kvh) const {
    return data + ((block * 2 * kv_heads + kv_heads + kvh) * block_size) * D;
  }
};

inline void store_elem(float* p, float x) { *p = x; }
inline void store_elem(uint16_t* p, float x) { *p = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

// out[0:n] = in[0:n], rounded to half floats when T is uint16_t.
inline void store_row(float* out, const float* in, int64_t n) { std::copy_n(in, n, out); }
inline void store_row(uint16_t* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) store_elem(out + i, in[i]);
}

// A key's D elements into its slot of a transposed tile (element d at slot[8 d]), rounded to half
// floats when T is uint16_t: rounded 8 at a time (one instruction), then stored one by one.
inline void store_key(float* slot, const float* k, int64_t D) {
  for (int64_t d = 0; d < D; ++d) slot[d * 8] = k[d];
}
inline void store_key(uint16_t* slot, const float* k, int64_t D) {
  alignas(16) uint16_t half[8];
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    _mm_store_si128(reinterpret_cast<__m128i*>(half), _mm256_cvtps_ph(_mm256_loadu_ps(k + d), _MM_FROUND_TO_NEAREST_INT));
    for (int i = 0; i < 8; ++i) slot[(d + i) * 8] = half[i];
  }
  for (; d < D; ++d) store_elem(slot + d * 8, k[d]);
}

// Asks for bytes [p, p + n) in cache ahead of use: the cache's pages are scattered blocks, whose
// starts the hardware prefetcher cannot guess.
// Hint: _MM_HINT_T0 (level 1) unless told otherwise.
template <int Hint = _MM_HINT_T0>
inline void prefetch_bytes(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < n; off += 64) _mm_prefetch(c + off, static_cast<_mm_hint>(Hint));
}

// Asks for `count` regions of `bytes` each in the core's L2 (the T1 hint), all at once: a
// chunk's keys and values (16 KB each in a float16 cache with heads of 64) at the chunk's start.
// The level-1 prefetches below pull them on from L2 as a pass goes; from L2 the misses do not
// queue behind the level-1 miss buffers. In the default model's 1-row pass (2026-12-06, Zen 4)
// attention over 300 positions took 0.51 ms instead of 0.69 (AVX2 path: 0.54 against 0.87),
// over 1000 positions 1.56 instead of 2.10 (1.90 against 2.55); at 6 rows 1.19 instead of 1.29
// over 300 (AVX2 path: 1.21 against 1.51).
template <typename T>
inline void prefetch_to_l2(const T* const* regions, int64_t count, int64_t bytes) {
  for (int64_t i = 0; i < count; ++i) prefetch_bytes<_MM_HINT_T1>(regions[i], bytes);
}

// Prefetches `count` regions of `lines` cache lines each a few lines at a time, spread over the
// `steps` steps of a pass (step() at each). Issued all at once before a pass over key tiles, a
// group's keys and values (16 KB in a float16 cache with heads of 64) filled the core's miss
// buffers and held up the pass's arithmetic until they drained; spread, the loads stream in
// while it computes.
class SpreadPrefetch {
 public:
  SpreadPrefetch() = default;
  SpreadPrefetch(const char* const* regions, int count, int64_t lines, int64_t steps)
      : regions_(regions), count_(count), lines_(lines), per_step_((count * lines + steps - 1) / steps) {}
  void step() {
    for (int64_t k = 0; k < per_step_ && region_ < count_; ++k) {
      _mm_prefetch(regions_[region_] + 64 * line_, _MM_HINT_T0);
      if (++line_ == lines_) line_ = 0, ++region_;
    }
  }

 private:
  const char* const* regions_ = nullptr;
  int count_ = 0, region_ = 0;
  int64_t lines_ = 0, line_ = 0, per_step_ = 0;
};

// Queries per attention work item: at most 6 on AVX2 (12 accumulators over 2 key tiles in its 16
// registers), 9 on AVX-512 (18 over 2 pairs of tiles in its 32). A verify step of 6 rows with
// 3 query heads per KV head (the default model) then makes 6 work items, 3 per thread, not 9;
// there its 30 layers' attention took 1.00 ms instead of 1.22 (2026-12-06, Zen 5). On AVX2
// blocks of 9 (one key tile at a time) were 11% slower for 16 rows and more.
constexpr int kQueryBlock = 9;      // AVX-512's, the largest block
constexpr int kQueryBlockAvx2 = 6;
constexpr int64_t kMaxHeadDim = 256;  // the largest head the attention takes (check_attention_layer)
inline int64_t query_block(bool wide) { return wide ? kQueryBlock : kQueryBlockAvx2; }

// scores[m * ld + 8 * i + j] = q_m . key_j for the N queries and TT key tiles from tile i (8
// positions each, transposed: element d of position j at tile[d * 8 + j % 8]). N * TT
// accumulators stay in registers; every loaded tile feeds N FMAs.
template <int N, int TT, typename T>
inline void score_tiles(const float* qt, const T* const* tiles, int64_t i, int64_t D, float* scores,
                        int64_t ld) {
  __m256 acc[N][TT];
#pragma GCC unroll 9
  for (int m = 0; m < N; ++m)
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[m][t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 k[TT];
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) k[t] = load8(tiles[i + t] + d * 8);
#pragma GCC unroll 9
    for (int m = 0; m < N; ++m) {
      const __m256 qd = _mm256_broadcast_ss(qt + d * N + m);
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) acc[m][t] = _mm256_fmadd_ps(qd, k[t], acc[m][t]);
    }
  }
#pragma GCC unroll 9
  for (int m = 0; m < N; ++m)
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) _mm256_storeu_ps(scores + m * ld + 8 * (i + t), acc[m][t]);
}

// The same passes on AVX-512 (where the CPU has it and SPECDEC_CPU_ISA is not "avx2"): twice
// the floats per instruction, and the same floats out, bit for bit. A score still sums q_d *
// key_d over d in order from zero (a 16-wide vector holds two tiles' 8 positions at the same
// d), and a value column still sums over the positions in order.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")

// The 8 positions of tile a at element d, then tile b's (a, b: a tile's row d).
inline __m512 load_tile_pair(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
inline __m512 load_tile_pair(const uint16_t* a, const uint16_t* b) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// score_tiles for TP pairs of key tiles from tile i: N * TP 16-wide accumulators. `ahead`:
// what to prefetch meanwhile, a step of it at each d.
template <int N, int TP, typename T>
void score_tile_pairs_zmm(const float* qt, const T* const* tiles, int64_t i, int64_t D, float* scores,
                          int64_t ld, SpreadPrefetch ahead = {}) {
  __m512 acc[N][TP];
#pragma GCC unroll 9
  for (int m = 0; m < N; ++m)
#pragma GCC unroll 4
    for (int t = 0; t < TP; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    ahead.step();
    __m512 k[TP];
#pragma GCC unroll 4
    for (int t = 0; t < TP; ++t) k[t] = load_tile_pair(tiles[i + 2 * t] + d * 8, tiles[i + 2 * t + 1] + d * 8);
#pragma GCC unroll 9
    for (int m = 0; m < N; ++m) {
      const __m512 qd = _mm512_set1_ps(qt[d * N + m]);
#pragma GCC unroll 4
      for (int t = 0; t < TP; ++t) acc[m][t] = _mm512_fmadd_ps(qd, k[t], acc[m][t]);
    }
  }
#pragma GCC unroll 9
  for (int m = 0; m < N; ++m)
#pragma GCC unroll 4
    for (int t = 0; t < TP; ++t) _mm512_storeu_ps(scores + m * ld + 8 * (i + 2 * t), acc[m][t]);
}

// block_values_pass over the 16W columns from c.
template <int N, int W, typename T>
void block_values_pass_zmm(const float* probs, int64_t ld, int64_t first, int64_t last, const PagedCache<T>& kv,
                           const int32_t* table, int64_t kvh, int64_t c, float* const* outs) {
  const int64_t bs = kv.block_size, D = kv.D;
  __m512 acc[N][W];
#pragma GCC unroll 9
  for (int m = 0; m < N; ++m)
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) acc[m][w] = _mm512_setzero_ps();
  for (int64_t start = first; start < last; start = (start / bs + 1) * bs) {
    const int64_t stop = std::min(last, (start / bs + 1) * bs);
    const T* v = kv.value_page(table[start / bs], kvh) + (start % bs) * D + c;
    const float* p = probs + start - first;
    for (int64_t j = start; j < stop; ++j, v += D, ++p) {
      __m512 vw[W];
#pragma GCC unroll 4
      for (int w = 0; w < W; ++w) vw[w] = load16(v + 16 * w);
#pragma GCC unroll 9
      for (int m = 0; m < N; ++m) {
        const __m512 pm = _mm512_set1_ps(p[m * ld]);
#pragma GCC unroll 4
        for (int w = 0; w < W; ++w) acc[m][w] = _mm512_fmadd_ps(pm, vw[w], acc[m][w]);
      }
    }
  }
#pragma GCC unroll 9
  for (int m = 0; m < N; ++m)
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(outs[m] + c + 16 * w, acc[m][w]);
}

// exp_row's max over sc[0:j], j the last multiple of 16 within `visible` (stored in *end).
float row_max_zmm(const float* sc, int64_t visible, int64_t* end) {
  __m512 max16 = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= visible; j += 16) max16 = _mm512_max_ps(max16, _mm512_loadu_ps(sc + j));
  *end = j;
  return _mm512_reduce_max_ps(max16);
}

// exp_row's exponentials of sc[0:j] in place, j as in row_max_zmm, their lanes added to *sum8
// 8 positions at a time in the order exp_row adds them; returns j.
int64_t row_exp_zmm(float* sc, int64_t visible, float best, __m256* sum8) {
  const __m512 vbest = _mm512_set1_ps(best);
  int64_t j = 0;
  for (; j + 16 <= visible; j += 16) {
    const __m512 e = specdec_cpu::exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), vbest));
    _mm512_storeu_ps(sc + j, e);
    *sum8 = _mm256_add_ps(*sum8, _mm512_castps512_ps256(e));
    *sum8 = _mm256_add_ps(*sum8, _mm512_extractf32x8_ps(e, 1));
  }
  return j;
}

#pragma GCC pop_options

// Whether the attention passes run on AVX-512: the CPU has it, and SPECDEC_CPU_ISA (read at
// every call, as the quantized kernels read it) does not force "avx2".
inline bool attention_uses_zmm() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return supported && !specdec_cpu::isa_is("avx2");
}

// scores[m * tiles * 8 + j] = q_m . key_j for the n queries and every position of `num_tiles`
// key tiles. Tiles go TT at a time, TT chosen so that the N * TT accumulators, the TT tiles and
// a broadcast query fit the 16 AVX2 registers (at least 8 accumulators: FMA latency x 2 ports);
// on AVX-512 TP pairs of tiles at a time, N * TP of its 32 registers accumulating.
// It prefetches the keys and the values ahead (value_rows[i]: the 8 value rows of tile i's
// positions, read by the values pass next): a cache block's pages are scattered, so the
// hardware prefetcher cannot guess where the next one starts. On AVX2 a group prefetches the
// group two ahead before its pass; on AVX-512 a group's pass prefetches the next group as it
// goes (SpreadPrefetch: 1.01x at 1 row over 300 positions, 1.04x over 1000, 2026-12-06, Zen 5;
// on AVX2, forced on the same machine, 6-row steps were 2-3% slower with it).
template <int N, typename T>
void block_scores(const float* const* queries, const T* const* tiles, const T* const* value_rows,
                  int64_t num_tiles, int64_t D, float* scores, bool wide) {
  // The queries transposed, element d of query m at qt[d * N + m]: the kernels' broadcasts then
  // address one array (nine query pointers took the general registers, and the tile pointers
  // went through vector registers at every step).
  float qt[kQueryBlock * kMaxHeadDim];
  for (int m = 0; m < N; ++m)
    for (int64_t d = 0; d < D; ++d) qt[d * N + m] = queries[m][d];
  constexpr int TT = N == 1 ? 8 : (N == 2 ? 4 : (N == 3 ? 3 : (N <= 6 ? 2 : 1)));
  constexpr int TP = N <= 6 ? 4 : 2;
  const int64_t ld = num_tiles * 8, tile_bytes = 8 * D * sizeof(T);
  for (int64_t t = 0; t < std::min<int64_t>(num_tiles, wide ? 2 * TP : 2 * TT); ++t) {
    prefetch_bytes(tiles[t], tile_bytes);
    prefetch_bytes(value_rows[t], tile_bytes);
  }
  int64_t i = 0;
  if (wide) {
    const char* next_group[2 * 2 * TP];  // its key tiles and value rows
    for (; i + 2 * TP <= num_tiles; i += 2 * TP) {
      int count = 0;
      for (int64_t t = i + 2 * TP; t < std::min(num_tiles, i + 4 * TP); ++t) {
        next_group[count++] = reinterpret_cast<const char*>(tiles[t]);
        next_group[count++] = reinterpret_cast<const char*>(value_rows[t]);
      }
      score_tile_pairs_zmm<N, TP>(qt, tiles, i, D, scores, ld,
                                  SpreadPrefetch(next_group, count, tile_bytes / 64, D));
    }
    for (; i + 2 <= num_tiles; i += 2) score_tile_pairs_zmm<N, 1>(qt, tiles, i, D, scores, ld);
  }
  for (; i + TT <= num_tiles; i += TT) {
    for (int64_t t = i + 2 * TT; t < std::min(num_tiles, i + 3 * TT); ++t) {
      prefetch_bytes(tiles[t], tile_bytes);
      prefetch_bytes(value_rows[t], tile_bytes);
    }
    score_tiles<N, TT>(qt, tiles, i, D, scores, ld);
  }
  for (; i < num_tiles; ++i) score_tiles<N, 1>(qt, tiles, i, D, scores, ld);
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Turns sc[0:visible] into exp(sc[j] - max) in place, zeroes sc[visible:padded_end] (so that a
// query can share a value pass with queries that see more positions), and returns the max and
// the sum of the exponentials: a chunk's part of a softmax (-inf and 0 when visible <= 0).
// `wide`: the first multiple of 16 positions on AVX-512, the same floats.
void exp_row(float* sc, int64_t visible, int64_t padded_end, float* max_out, float* sum_out, bool wide) {
  visible = std::max<int64_t>(visible, 0);
  __m256 max8 = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  if (wide) max8 = _mm256_set1_ps(row_max_zmm(sc, visible, &j));
  for (; j + 8 <= visible; j += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(sc + j));
  float best = hmax8(max8);
  for (; j < visible; ++j) best = std::max(best, sc[j]);
  const __m256 vbest = _mm256_set1_ps(best);
  __m256 sum8 = _mm256_setzero_ps();
  j = wide ? row_exp_zmm(sc, visible, best, &sum8) : 0;
  for (; j + 8 <= visible; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vbest));
    _mm256_storeu_ps(sc + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = hsum8(sum8);
  for (; j < visible; ++j) {
    sc[j] = std::exp(sc[j] - best);
    total += sc[j];
  }
  std::fill(sc + visible, sc + padded_end, 0.f);
  *max_out = best;
  *sum_out = total;
}

// outs[m][c:c+8W] = sum_j probs[m * ld + j - first] * value_j[c:c+8W] for the N queries of a
// block, over positions first .. last-1 and the 8W columns from c. Each value row is read once
// for all N queries (a query's own pass would read the head's whole value page again); N * W
// accumulators stay in registers, with the W value vectors or the N broadcast probabilities,
// whichever are fewer (16 AVX2 registers: 3 x 4 accumulators, 3 broadcasts and a value row's 8
// columns; with the 4 value vectors instead, 17, one spilled).
template <int N, int W, typename T>
void block_values_pass(const float* probs, int64_t ld, int64_t first, int64_t last, const PagedCache<T>& kv,
                       const int32_t* table, int64_t kvh, int64_t c, float* const* outs) {
  const int64_t bs = kv.block_size, D = kv.D;
  __m256 acc[N][W];
#pragma GCC unroll 9
  for (int m = 0; m < N; ++m)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) acc[m][w] = _mm256_setzero_ps();
  for (int64_t start = first; start < last; start = (start / bs + 1) * bs) {
    const int64_t stop = std::min(last, (start / bs + 1) * bs);
    const T* v = kv.value_page(table[start / bs], kvh) + (start % bs) * D + c;
    const float* p = probs + start - first;
    for (int64_t j = start; j < stop; ++j, v += D, ++p) {
      if constexpr (N < W) {
        __m256 pm[N];
#pragma GCC unroll 9
        for (int m = 0; m < N; ++m) pm[m] = _mm256_broadcast_ss(p + m * ld);
#pragma GCC unroll 8
        for (int w = 0; w < W; ++w) {
          const __m256 vw = load8(v + 8 * w);
#pragma GCC unroll 9
          for (int m = 0; m < N; ++m) acc[m][w] = _mm256_fmadd_ps(pm[m], vw, acc[m][w]);
        }
      } else {
        __m256 vw[W];
#pragma GCC unroll 8
        for (int w = 0; w < W; ++w) vw[w] = load8(v + 8 * w);
#pragma GCC unroll 9
        for (int m = 0; m < N; ++m) {
          const __m256 pm = _mm256_broadcast_ss(p + m * ld);
#pragma GCC unroll 8
          for (int w = 0; w < W; ++w) acc[m][w] = _mm256_fmadd_ps(pm, vw[w], acc[m][w]);
        }
      }
    }
  }
#pragma GCC unroll 9
  for (int m = 0; m < N; ++m)
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(outs[m] + c + 8 * w, acc[m][w]);
}

// All D columns of block_values_pass: passes of 8W columns (W chosen so that N * W <= 12
// accumulators; on AVX-512 16 WZ columns, N * WZ <= 24), then 8-column passes for what is left
// of D.
template <int N, typename T>
void block_values(const float* probs, int64_t ld, int64_t first, int64_t last, const PagedCache<T>& kv,
                  const int32_t* table, int64_t kvh, float* const* outs, bool wide) {
  constexpr int W = N == 1 ? 8 : (N <= 3 ? 4 : (N <= 6 ? 2 : 1));
  constexpr int WZ = N <= 6 ? 4 : 2;
  int64_t c = 0;
  if (wide) {
    for (; c + 16 * WZ <= kv.D; c += 16 * WZ) block_values_pass_zmm<N, WZ>(probs, ld, first, last, kv, table, kvh, c, outs);
    for (; c + 16 <= kv.D; c += 16) block_values_pass_zmm<N, 1>(probs, ld, first, last, kv, table, kvh, c, outs);
  }
  for (; c + 8 * W <= kv.D; c += 8 * W) block_values_pass<N, W>(probs, ld, first, last, kv, table, kvh, c, outs);
  for (; c < kv.D; c += 8) block_values_pass<N, 1>(probs, ld, first, last, kv, table, kvh, c, outs);
}

// Positions per attention chunk. A query's softmax is computed chunk by chunk (positions
// [0, kChunk), [kChunk, 2 kChunk), ...) and the chunks combined in order, whatever else is in
// the batch: a query's output is the same floats alone, in a verify step or in a batch. Chunks
// of one query block can run on different threads when blocks are too few to share out (one
// request decoding: as many blocks as KV heads).
constexpr int64_t kChunk = 128;

// One chunk's part of a query's attention: the max score, the sum of exp(score - max) and
// out[0:D] = sum_j exp(score_j - max) value_j over the positions it sees in the chunk.
struct ChunkPart {
  float max, sum;
  float* out;
};

// The chunk [first, last) of a block of n queries of one KV head (queries[i]; query i sees
// positions below visible[i]; last is the chunk's end or the block's last visible position).
template <typename T>
void attend_chunk(const float* const* queries, const int64_t* visible, int64_t n, int64_t first, int64_t last,
                  const PagedCache<T>& kv, const int32_t* table, int64_t kvh, ChunkPart* parts, bool wide) {
  const int64_t D = kv.D, bs = kv.block_size;
  const int64_t num_tiles = (last - first + 7) / 8;
  const T* tiles[kChunk / 8];
  const T* value_rows[kChunk / 8];
  for (int64_t i = 0; i < num_tiles; ++i) {
    const int64_t pos = first + i * 8;
    tiles[i] = kv.key_tile(table[pos / bs], kvh, pos);
    value_rows[i] = kv.value_page(table[pos / bs], kvh) + (pos % bs) * D;
  }
  prefetch_to_l2(tiles, num_tiles, 8 * D * static_cast<int64_t>(sizeof(T)));
  prefetch_to_l2(value_rows, num_tiles, 8 * D * static_cast<int64_t>(sizeof(T)));
  float scores[kQueryBlock * kChunk];
  switch (n) {
    case 1: block_scores<1>(queries, tiles, value_rows, num_tiles, D, scores, wide); break;
    case 2: block_scores<2>(queries, tiles, value_rows, num_tiles, D, scores, wide); break;
    case 3: block_scores<3>(queries, tiles, value_rows, num_tiles, D, scores, wide); break;
    case 4: block_scores<4>(queries, tiles, value_rows, num_tiles, D, scores, wide); break;
    case 5: block_scores<5>(queries, tiles, value_rows, num_tiles, D, scores, wide); break;
    case 6: block_scores<6>(queries, tiles, value_rows, num_tiles, D, scores, wide); break;
    case 7: block_scores<7>(queries, tiles, value_rows, num_tiles, D, scores, wide); break;
    case 8: block_scores<8>(queries, tiles, value_rows, num_tiles, D, scores, wide); break;
    default: block_scores<9>(queries, tiles, value_rows, num_tiles, D, scores, wide); break;
  }
  const int64_t ld = num_tiles * 8;
  float* outs[kQueryBlock];
  for (int64_t i = 0; i < n; ++i) {
    exp_row(scores + i * ld, std::min(visible[i], last) - first, last - first, &parts[i].max, &parts[i].sum, wide);
    outs[i] = parts[i].out;
  }
  switch (n) {
    case 1: block_values<1>(scores, ld, first, last, kv, table, kvh, outs, wide); break;
    case 2: block_values<2>(scores, ld, first, last, kv, table, kvh, outs, wide); break;
    case 3: block_values<3>(scores, ld, first, last, kv, table, kvh, outs, wide); break;
    case 4: block_values<4>(scores, ld, first, last, kv, table, kvh, outs, wide); break;
    case 5: block_values<5>(scores, ld, first, last, kv, table, kvh, outs, wide); break;
    case 6: block_values<6>(scores, ld, first, last, kv, table, kvh, outs, wide); break;
    case 7: block_values<7>(scores, ld, first, last, kv, table, kvh, outs, wide); break;
    case 8: block_values<8>(scores, ld, first, last, kv, table, kvh, outs, wide); break;
    default: block_values<9>(scores, ld, first, last, kv, table, kvh, outs, wide); break;
  }
}

// out[0:D] = the softmax-weighted values of one query from its chunks' parts, in chunk order.
void combine_chunks(const ChunkPart* parts, int64_t stride, int64_t chunks, int64_t D, float* out) {
  float best = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) best = std::max(best, parts[c * stride].max);
  float total = 0.f;
  float weight[64];  // chunks of one query: at most 64 (8192 positions); more go in a vector
  std::vector<float> more(chunks > 64 ? chunks : 0);
  float* w = chunks > 64 ? more.data() : weight;
  for (int64_t c = 0; c < chunks; ++c) {
    const ChunkPart& part = parts[c * stride];
    w[c] = part.sum > 0.f ? std::exp(part.max - best) : 0.f;
    total += w[c] * part.sum;
  }
  for (int64_t c = 0; c < chunks; ++c) w[c] /= total;
  std::fill(out, out + D, 0.f);
  for (int64_t c = 0; c < chunks; ++c) {
    if (w[c] == 0.f) continue;
    const __m256 wc = _mm256_set1_ps(w[c]);
    const float* o = parts[c * stride].out;
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wc, _mm256_loadu_ps(o + d), _mm256_loadu_ps(out + d)));
  }
}

// A buffer of paged_attention_impl kept by its thread between calls, its contents left as the
// last call left them: the layers of a decode step then allocate and zero nothing (a layer's
// queries, blocks and chunk parts took about 1.3 us of allocating and freeing, 2026-12-06,
// Zen 4). One grown past kKeptBytes (a long prompt's queries) is freed when its call ends.
// Slot tells apart the buffers of one element type that a call holds at once.
constexpr size_t kKeptBytes = 1 << 20;

template <typename X, int Slot>
class KeptBuffer {
 public:
  explicit KeptBuffer(size_t n) : v_(storage()) { v_.resize(n); }
  ~KeptBuffer() {
    if (v_.capacity() * sizeof(X) > kKeptBytes) std::vector<X>().swap(v_);
  }
  KeptBuffer(const KeptBuffer&) = delete;
  KeptBuffer& operator=(const KeptBuffer&) = delete;
  X* data() { return v_.data(); }
  X* begin() { return v_.data(); }
  X* end() { return v_.data() + v_.size(); }
  X& operator[](size_t i) { return v_[i]; }

 private:
  static std::vector<X>& storage() {
    thread_local std::vector<X> kept;
    return kept;
  }
  std::vector<X>& v_;
};

// The attention of attend_layer over a cache of T (float or half).
template <typename T>
void paged_attention_impl(const float* in, T* cache_data, const float* cos_t, const float* sin_t,
                          const int32_t* tables, const int32_t* cu, const int32_t* ctx, int64_t T_rows,
                          int64_t B, int64_t max_blocks, int64_t bs, int64_t D, int64_t heads, int64_t kv_heads,
                          float* op) {
  const int64_t width = (heads + 2 * kv_heads) * D;
  const PagedCache<T> kv{cache_data, kv_heads, bs, D};
  const int64_t group = heads / kv_heads;
  const bool wide = attention_uses_zmm();  // read once a call: SPECDEC_CPU_ISA is an environment lookup
  const int64_t qb = query_block(wide);

  // RoPE on the new rows; keys and values into their cache slots. Rows go in parallel (not
  // requests: a verify step's or a prompt's rows all belong to one request), 8 or more a work
  // item: a verify step's few rows stay on the caller, where waking the pool cost more.
  KeptBuffer<float, 0> q(T_rows * heads * D);
  KeptBuffer<int64_t, 0> request_of(T_rows);
  for (int64_t b = 0; b < B; ++b) std::fill(request_of.begin() + cu[b], request_of.begin() + cu[b + 1], b);
  const int64_t rows_per_chunk = std::max<int64_t>(8, T_rows / 64);
  WorkPool::get().parallel_for((T_rows + rows_per_chunk - 1) / rows_per_chunk, [&](int64_t chunk) {
    std::vector<float> k(D);
    for (int64_t t = chunk * rows_per_chunk; t < std::min(T_rows, (chunk + 1) * rows_per_chunk); ++t) {
      const int64_t b = request_of[t];
      const float* row = in + t * width;
      const int64_t pos = ctx[b] + t - cu[b];
      const int32_t block = tables[b * max_blocks + pos / bs];
      const float* c = cos_t + pos * D;
      const float* s = sin_t + pos * D;
      for (int64_t h = 0; h < heads; ++h) rope(row + h * D, c, s, D, q.data() + (t * heads + h) * D);
      for (int64_t h = 0; h < kv_heads; ++h) {
        rope(row + (heads + h) * D, c, s, D, k.data());
        T* slot = kv.key_slot(block, h, pos);
        store_key(slot, k.data(), D);
        store_row(kv.value_page(block, h) + (pos % bs) * D, row + (heads + kv_heads + h) * D, D);
      }
    }
  });

  // The queries of one request and one KV head (its rows x the `group` heads that share the
  // head, row-major) go in blocks of up to query_block(wide). A block's scores come out of one pass
  // over the key tiles of a chunk, so keys are read once per block (not once per query head)
  // and every loaded tile feeds several FMAs.
  KeptBuffer<int64_t, 1> first_block(B + 1);  // blocks of request b: [first_block[b], first_block[b+1])
  first_block[0] = 0;
  for (int64_t b = 0; b < B; ++b)
    first_block[b + 1] = first_block[b] + kv_heads * (((cu[b + 1] - cu[b]) * group + qb - 1) / qb);
  struct Block {
    int64_t kvh, n, chunks, first_row;
    const int32_t* table;
    const float* queries[kQueryBlock];
    int64_t visible[kQueryBlock];
    float* outs[kQueryBlock];
  };
  const auto describe = [&](int64_t index) {
    Block blk;
    const int64_t b = std::upper_bound(first_block.begin(), first_block.end(), index) - first_block.begin() - 1;
    const int64_t rows = cu[b + 1] - cu[b];
    const int64_t blocks_per_head = (rows * group + qb - 1) / qb;
    blk.kvh = (index - first_block[b]) / blocks_per_head;
    const int64_t q0 = (index - first_block[b]) % blocks_per_head * qb;  // first query of the block
    blk.n = std::min<int64_t>(qb, rows * group - q0);
    blk.table = tables + b * max_blocks;
    for (int64_t i = 0; i < blk.n; ++i) {
      const int64_t r = (q0 + i) / group, h = blk.kvh * group + (q0 + i) % group;
      blk.queries[i] = q.data() + ((cu[b] + r) * heads + h) * D;
      blk.visible[i] = ctx[b] + r + 1;  // query i sees positions 0 .. ctx + its row
      blk.outs[i] = op + (cu[b] + r) * heads * D + h * D;
    }
    blk.chunks = (blk.visible[blk.n - 1] + kChunk - 1) / kChunk;
    return blk;
  };
  const auto attend = [&](const Block& blk, int64_t chunk, ChunkPart* parts) {
    const int64_t first = chunk * kChunk, last = std::min(first + kChunk, blk.visible[blk.n - 1]);
    attend_chunk(blk.queries, blk.visible, blk.n, first, last, kv, blk.table, blk.kvh, parts, wide);
  };
  const int64_t num_blocks = first_block[B];
  if (num_blocks >= 2 * WorkPool::get().threads()) {  // enough blocks: a work item is a block
    WorkPool::get().parallel_for(num_blocks, [&](int64_t index) {
      const Block blk = describe(index);
      // Not zeroed: the values pass writes every column of every part.
      const std::unique_ptr<float[]> outs(new float[blk.chunks * blk.n * D]);
      const std::unique_ptr<ChunkPart[]> parts(new ChunkPart[blk.chunks * blk.n]);
      for (int64_t c = 0; c < blk.chunks; ++c) {
        for (int64_t i = 0; i < blk.n; ++i) parts[c * blk.n + i].out = outs.get() + (c * blk.n + i) * D;
        attend(blk, c, parts.get() + c * blk.n);
      }
      for (int64_t i = 0; i < blk.n; ++i) combine_chunks(parts.get() + i, blk.n, blk.chunks, D, blk.outs[i]);
    });
    return;
  }
  // Few blocks (a request or two decoding): a work item is one chunk of a block, then each
  // query's chunks are combined.
  KeptBuffer<Block, 0> blocks(num_blocks);
  KeptBuffer<int64_t, 2> first_part(num_blocks + 1);
  KeptBuffer<int64_t, 3> first_item(num_blocks + 1);
  first_part[0] = first_item[0] = 0;
  for (int64_t index = 0; index < num_blocks; ++index) {
    blocks[index] = describe(index);
    first_item[index + 1] = first_item[index] + blocks[index].chunks;
    first_part[index + 1] = first_part[index] + blocks[index].chunks * blocks[index].n;
  }
  KeptBuffer<float, 1> outs(first_part[num_blocks] * D);
  KeptBuffer<ChunkPart, 0> parts(first_part[num_blocks]);
  for (int64_t i = 0; i < first_part[num_blocks]; ++i) parts[i].out = outs.data() + i * D;
  WorkPool::get().parallel_for(first_item[num_blocks], [&](int64_t item) {
    const int64_t index = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const Block& blk = blocks[index];
    const int64_t chunk = item - first_item[index];
    attend(blk, chunk, parts.data() + first_part[index] + chunk * blk.n);
  });
  for (int64_t index = 0; index < num_blocks; ++index) {
    const Block& blk = blocks[index];
    for (int64_t i = 0; i < blk.n; ++i)
      combine_chunks(parts.data() + first_part[index] + i, blk.n, blk.chunks, D, blk.outs[i]);
  }
}

AttentionBatch read_attention_batch(const paddle::Tensor& meta, int64_t rows, const paddle::Tensor& cache,
                                    const paddle::Tensor& cos) {
  PD_CHECK(meta.dtype() == paddle::DataType::INT32 && meta.shape().size() == 2 && meta.shape()[1] >= 2,
           "paged_attention: metadata must be int32 [B, 2 + max_blocks]");
  return read_attention_batch(meta.data<int32_t>(), meta.shape()[0], meta.shape()[1], rows, cache, cos);
}

AttentionBatch read_attention_batch(const int32_t* packed, int64_t B, int64_t columns, int64_t rows,
                                    const paddle::Tensor& cache, const paddle::Tensor& cos) {
  PD_CHECK(B >= 0 && columns >= 2, "paged_attention: metadata must be int32 [B, 2 + max_blocks]");
  PD_CHECK(cache.shape().size() == 4, "paged_attention: cache must be [blocks, 2*kv_heads, block_size, D]");
  AttentionBatch batch;
  const int64_t max_blocks = columns - 2;
  const int64_t num_blocks = cache.shape()[0], bs = cache.shape()[2];
  batch.rows = rows;
  batch.requests = B;
  batch.max_blocks = max_blocks;
  batch.tables.resize(B * max_blocks);
  batch.cu.resize(B + 1);
  batch.ctx.resize(B);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = packed + b * (2 + max_blocks);
    batch.cu[b] = row[0];
    batch.ctx[b] = row[1];
    std::copy_n(row + 2, max_blocks, batch.tables.data() + b * max_blocks);
  }
  batch.cu[B] = static_cast<int32_t>(rows);
  const int32_t* tables = batch.tables.data();
  const int32_t* cu = batch.cu.data();
  const int32_t* ctx = batch.ctx.data();
  PD_CHECK(cu[0] == 0, "paged_attention: the first request's rows must start at row 0");
  for (int64_t b = 0; b < B; ++b)
    PD_CHECK(cu[b] <= cu[b + 1] && ctx[b] >= 0, "paged_attention: rows must be in request order");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t end = ctx[b] + cu[b + 1] - cu[b];
    PD_CHECK(end <= max_blocks * bs, "paged_attention: positions exceed the block table");
    PD_CHECK(end <= cos.shape()[0], "paged_attention: positions exceed the RoPE table");
    for (int64_t i = 0; i < (end + bs - 1) / bs; ++i)
      PD_CHECK(tables[b * max_blocks + i] >= 0 && tables[b * max_blocks + i] < num_blocks,
               "paged_attention: block id out of range");
  }
  return batch;
}

void check_attention_layer(const paddle::Tensor& cache, const paddle::Tensor& like, int64_t qkv_width,
                           int64_t heads, int64_t kv_heads) {
  PD_CHECK(cache.shape() == like.shape(), "paged_attention: every layer's cache must have the same shape");
  PD_CHECK(cache.shape().size() == 4 && cache.shape()[1] == 2 * kv_heads,
           "paged_attention: cache must be [blocks, 2*kv_heads, block_size, D]");
  const int64_t bs = cache.shape()[2], D = cache.shape()[3];
  PD_CHECK(qkv_width == (heads + 2 * kv_heads) * D, "paged_attention: qkv must be [T, (heads + 2*kv_heads) * D]");
  PD_CHECK(bs > 0 && D > 0 && bs % 8 == 0 && D % 8 == 0, "paged_attention: block_size and D must be multiples of 8");
  PD_CHECK(D <= kMaxHeadDim, "paged_attention: heads of more than ", kMaxHeadDim, " elements are not supported");
  PD_CHECK(cache.dtype() == paddle::DataType::FLOAT32 || cache.dtype() == paddle::DataType::FLOAT16,
           "paged_attention: the cache must be float32 or float16");
}

void attend_layer(const AttentionBatch& batch, const float* qkv, const paddle::Tensor& cache,
                  const paddle::Tensor& cos, const paddle::Tensor& sin, int64_t heads, int64_t kv_heads, float* out) {
  const int64_t bs = cache.shape()[2], D = cache.shape()[3];
  const auto run = [&](auto* cache_data) {
    paged_attention_impl(qkv, cache_data, cos.data<float>(), sin.data<float>(), batch.tables.data(),
                         batch.cu.data(), batch.ctx.data(), batch.rows, batch.requests, batch.max_blocks, bs, D,
                         heads, kv_heads, out);
  };
  // The cache is updated in place: it is the backend's own buffer, never part of a graph.
  if (cache.dtype() == paddle::DataType::FLOAT16)
    run(reinterpret_cast<uint16_t*>(const_cast<paddle::float16*>(cache.data<paddle::float16>())));
  else
    run(const_cast<float*>(cache.data<float>()));
}

// `meta` int32 [B, 2 + max_blocks]: per request its first packed row (cu_seqlens_q[b]), its
// context length, then its block table (specdec.kernels.cpu.packing.pack_attention_metadata):
// one tensor for the metadata, so that a step makes one host copy of it rather than three.
std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& qkv, const paddle::Tensor& cache,
                                           const paddle::Tensor& cos, const paddle::Tensor& sin,
                                           const paddle::Tensor& meta, int64_t heads, int64_t kv_heads) {
  const int64_t T = qkv.shape()[0];
  PD_CHECK(cache.shape().size() == 4, "paged_attention: cache must be [blocks, 2*kv_heads, block_size, D]");
  const int64_t width = (heads + 2 * kv_heads) * cache.shape()[3];
  PD_CHECK(qkv.numel() == T * width, "paged_attention: qkv must be [T, (heads + 2*kv_heads) * D]");
  check_attention_layer(cache, cache, width, heads, kv_heads);
  const AttentionBatch batch = read_attention_batch(meta, T, cache, cos);
  auto out = paddle::empty({T, heads * cache.shape()[3]}, paddle::DataType::FLOAT32, qkv.place());
  attend_layer(batch, qkv.data<float>(), cache, cos, sin, heads, kv_heads, out.data<float>());
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

PD_BUILD_OP(specdec_paged_attention)
    .Inputs({"QKV", "Cache", "Cos", "Sin", "Meta"})
    .Outputs({"Out"})
    .Attrs({"heads: int64_t", "kv_heads: int64_t"})
    .SetKernelFn(PD_KERNEL(PagedAttention));
