// Weight-only quantized CPU kernels, as paddle custom operators: the matmuls compute on GGML
// blocks as stored (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; quant_formats.h; Q4_0, Q4_1,
// Q5_0, Q5_1 and Q8_0 with their bytes regrouped: "interleaved" in groups of 16 rows, the rows
// left over "split" (Q4_0, Q4_1, Q8_0) or as stored (Q5_0, Q5_1)),
// never on a dequantized copy.
//
// Activations are quantized to int8 per 32 elements (scale = max|x| / 127, round to nearest
// even), per 256 for Q4_K, Q5_K and Q6_K, as llama.cpp does, and each weight sub-block is
// multiplied with integer dot products:
// AVX2's maddubs + madd everywhere, AVX-512 VNNI's dpbusd where the CPU has it, and for Q4_K and
// Q6_K matmuls of 32 rows or more AMX tile multiplies where the CPU has AMX-INT8 (chosen at run
// time; SPECDEC_CPU_ISA=avx2 or avx512 forces the lesser paths). Every path computes a row's
// output bit for bit the same (quant_matmul.inc). reference.py holds the numpy twins.
//
// A quantized weight [N, K] is a uint8 tensor holding its rows back to back and an int64
// layout [S, 4]: segments of rows (type, rows, byte offset, bytes per row), so that q, k and v
// (or gate and up) stored in different formats still make one matmul.
//   q_matmul(x, gain, w, layout, epilogue, eps, normalize) -> [M, N]
//       h @ w^T with h = x, or rms_norm(x) * gain when normalize; epilogue [2, N] (a scale and a
//       bias per output column) or empty
//   q_layer_tail(attn, x, wo, lo, gain, wgu, lgu, wd, ld, eps) -> [M, H]: the rest of a decoder
//       layer after attention: x1 = x + attn @ wo^T, h = rms_norm(x1) * gain,
//       [g | u] = h @ wgu^T, x1 + (silu(g) * u) @ wd^T
//   q_layer_tail_qkv(..., next_gain, wqkv, lqkv, epilogue, eps) -> (that, the next layer's
//       q_matmul(that, next_gain, wqkv, lqkv, epilogue, eps, normalize)): two layers' work
//       between two attention calls, in one call
//   q_embedding(ids, w, layout, cols) -> [T, cols]: rows of a quantized table, dequantized
//   q_register_layers(layers, width) -> handle; q_decoder_layers(x, qkv, caches, cos, sin, meta,
//       handle, heads, kv_heads, eps) -> [T, H]: every decoder layer of a model in one call
//       (attention and q_layer_tail_qkv per layer)
//   q_register_draft_head(operands, ...) -> handle; q_draft_head(hidden, cache, cos, sin, meta,
//       handle, ids, rows, ...) -> (out, logits): q_draft_input, attention, q_layer_tail_head
//   q_release(handle): forgets a handle's weights
#include "paddle/extension.h"
#include "paged_attention.h"
#include "quant_formats.h"
#include "simd_math.h"
#include "work_pool.h"

#include <cpuid.h>
#include <immintrin.h>
#include <malloc.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <vector>

namespace {

// A prompt's matmuls allocate megabytes (a [rows, 2 * inner] gate/up output, paddle's output
// tensors). glibc serves such blocks with fresh mmaps and returns them at free, so every call
// paid a page fault per 4 KiB touched, most of a prompt's matmul time in a VM
// (docs/benchmarks/llamacpp.md#one-quantized-matmul-benchmarksbench_quant_matmulpy).
// Blocks up to 32 MiB come from the heap instead, and the heap keeps up to 256 MiB it no longer
// uses, so that the next call reuses the same pages. Set once, when the kernels load.
const bool kHeapReuse = [] {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  return true;
}();

// The most bytes of a decoder layer's gate/up output at once: below the mmap threshold.
constexpr int64_t kMlpChunkBytes = 30 << 20;

using specdec_cpu::Format;
using specdec_cpu::half_at;
using specdec_cpu::hsum8;
using specdec_cpu::isa_is;
using specdec_cpu::load32;
using specdec_cpu::q6k_values;
using specdec_cpu::SubBlock;
using specdec_cpu::swiglu8;
using specdec_cpu::with_format;
using specdec_cpu::WorkPool;

// Allocates on 64-byte boundaries: the kernels load activation rows 32 and 64 bytes at a time,
// and a load that straddles two cache lines costs two.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  // resize(n) leaves new elements uninitialized (every buffer of these kernels is written whole
  // before it is read): zeroing a verify step's activation buffers cost about 1% of its pass.
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// What one matmul's weight segments read of its activations (needs_of).
struct ActivationNeeds {
  bool per32 = false;   // q, d, sum: every format but Q4_K, Q5_K and Q6_K
  bool pairs = false;   // split Q4_0 / Q4_1
  bool biased = false;  // split Q8_0 under VNNI
  bool per256 = false;  // Q4_K, Q5_K, Q6_K: q256, d256t and sum16
  bool columns256 = false;  // interleaved Q4_K / Q6_K under VNNI, tiles of 3+ rows: q256t, sum32t, offset16t
};

// max |x[i]| over the n (a multiple of 8) floats of x.
inline float abs_max(const float* x, int64_t n) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// The sum of the 32 int8s of q8.
inline int sum_of_int8s(__m256i q8) {
  const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
}

// in[0:32] * inverse rounded half to even (the MXCSR default) to int8, in order.
inline __m256i pack32(const float* in, float inverse) {
  const __m256 scale = _mm256_set1_ps(inverse);
  __m256i q32[4];
  for (int i = 0; i < 4; ++i) q32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(in + 8 * i), scale));
  const __m256i q16 = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// out[0:32] = pack32(in, inverse); returns the sum of those int8s.
inline int quantize32(const float* in, float inverse, int8_t* out) {
  const __m256i q8 = pack32(in, inverse);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), q8);
  return sum_of_int8s(q8);
}

// The blocks [first, last) of one row quantized one at a time (abs_max, quantize32): the scale
// of block j into d[j], the sum of its dequantized values into sum[j].
void quantize_blocks(const float* x, int64_t first, int64_t last, int8_t* q, float* d, float* sum) {
  for (int64_t j = first; j < last; ++j) {
    const float* in = x + j * 32;
    const float scale = abs_max(in, 32) / 127.f;
    const int total = quantize32(in, scale != 0.f ? 1.f / scale : 0.f, q + j * 32);
    d[j] = scale;
    sum[j] = scale * static_cast<float>(total);
  }
}

// Lane i of the result: op over the 8 lanes of v[(i % 4) * 2 + i / 4] (a transposed reduction
// of 8 vectors in 7 shuffle pairs, against 3 shuffles a vector reduced alone).
template <typename Op>
inline __m256 reduce_each8(const __m256* v, Op op) {
  __m256 halves[4], quarters[2];
  for (int i = 0; i < 4; ++i)
    halves[i] = op(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20), _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)
    quarters[i] = op(_mm256_unpacklo_ps(halves[2 * i], halves[2 * i + 1]), _mm256_unpackhi_ps(halves[2 * i], halves[2 * i + 1]));
  return op(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(quarters[0]), _mm256_castps_pd(quarters[1]))),
            _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(quarters[0]), _mm256_castps_pd(quarters[1]))));
}

// One row's blocks of 32 quantized as quantize_blocks does it, 8 blocks at a time: their
// maxima and int8 sums reduced together (reduce_each8), their scales divided as one vector;
// the same int8s, scales and sums (a division lane by lane rounds as the scalar one does; the
// sums are of integers). A row of 18 blocks took 210 time-stamp cycles instead of 340, one of
// 48 blocks 535 instead of 900 (2026-12-07, Zen 4).
void quantize_row(const float* x, int64_t blocks, int8_t* q, float* d, float* sum) {
  const auto max = [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); };
  const auto add = [](__m256 a, __m256 b) {
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
  };
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  int64_t j0 = 0;
  for (; j0 + 8 <= blocks; j0 += 8) {
    __m256 v[8];  // block b's at v[(b % 4) * 2 + b / 4], so that reduce_each8 puts it in lane b
    for (int b = 0; b < 8; ++b) {
      const float* in = x + 32 * (j0 + b);
      __m256 amax = _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(in));
      for (int i = 1; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(in + 8 * i)));
      v[(b % 4) * 2 + b / 4] = amax;
    }
    const __m256 scale = _mm256_div_ps(reduce_each8(v, max), _mm256_set1_ps(127.f));
    const __m256 nonzero = _mm256_cmp_ps(scale, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    alignas(32) float inverses[8];
    _mm256_store_ps(inverses, _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.f), scale), nonzero));
    _mm256_storeu_ps(d + j0, scale);
    for (int b = 0; b < 8; ++b) {
      const __m256i q8 = pack32(x + 32 * (j0 + b), inverses[b]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * (j0 + b)), q8);
      v[(b % 4) * 2 + b / 4] =
          _mm256_castsi256_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1)));
    }
    _mm256_storeu_ps(sum + j0, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_castps_si256(reduce_each8(v, add)))));
  }
  quantize_blocks(x, j0, blocks, q, d, sum);
}

// Whether activations are quantized and SwiGLU runs on 512-bit vectors: the CPU has AVX-512
// (F, BW, VL, DQ) and SPECDEC_CPU_ISA (read at every call) does not force "avx2".
bool wide_activations() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return supported && !isa_is("avx2");
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
// Lane i of the result: op over the 16 lanes of v[(i % 4) * 4 + i / 4] (a transposed
// reduction of 16 vectors in 15 shuffle pairs, against 4 shuffles a vector reduced alone).
template <typename Op>
inline __m512 reduce_each16(const __m512* v, Op op) {
  __m512 halves[8], quarters[4];
  for (int i = 0; i < 8; ++i)
    halves[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    quarters[i] = op(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                     _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  const __m512 a = op(_mm512_unpacklo_ps(quarters[0], quarters[1]), _mm512_unpackhi_ps(quarters[0], quarters[1]));
  const __m512 b = op(_mm512_unpacklo_ps(quarters[2], quarters[3]), _mm512_unpackhi_ps(quarters[2], quarters[3]));
  return op(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
}

// One row's blocks of 32 quantized as quantize_blocks does it (for finite activations the same
// int8s, scales and sums at any width: a maximum, a product and its rounding, the saturation to
// int8, a division lane by lane, integer sums), 16 blocks at a time: their maxima and int8 sums
// reduced together (reduce_each16), their scales divided as one vector; the blocks left over
// one by one. A verify step quantizes its few rows on one thread, between the matmuls: a row of
// 18 blocks took 220 time-stamp cycles instead of 340, one of 48 blocks 560 instead of 890
// (2026-12-07, Zen 4).
__attribute__((noinline)) void quantize_row_zmm(const float* x, int64_t blocks, int8_t* q, float* d, float* sum) {
  const auto max = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto add = [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  const __m512i low8 = _mm512_set1_epi32(-128), high8 = _mm512_set1_epi32(127);
  int64_t j0 = 0;
  for (; j0 + 16 <= blocks; j0 += 16) {
    __m512 v[16];  // block b's values at v[(b % 4) * 4 + b / 4], so that reduce_each16 puts it in lane b
    for (int b = 0; b < 16; ++b) {
      const float* in = x + 32 * (j0 + b);
      v[(b % 4) * 4 + b / 4] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(in)), _mm512_abs_ps(_mm512_loadu_ps(in + 16)));
    }
    const __m512 scale = _mm512_div_ps(reduce_each16(v, max), _mm512_set1_ps(127.f));
    const __m512 inverse =
        _mm512_maskz_div_ps(_mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.f), scale);
    alignas(64) float inverses[16];
    _mm512_store_ps(inverses, inverse);
    _mm512_storeu_ps(d + j0, scale);
    for (int b = 0; b < 16; ++b) {
      const float* in = x + 32 * (j0 + b);
      const __m512 by = _mm512_set1_ps(inverses[b]);
      const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(in), by));
      const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(in + 16), by));
      const __m256i q8 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(lo)),
                                                 _mm512_cvtsepi32_epi8(hi), 1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * (j0 + b)), q8);
      const __m512i saturated = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(lo, low8), high8),
                                                 _mm512_min_epi32(_mm512_max_epi32(hi, low8), high8));
      v[(b % 4) * 4 + b / 4] = _mm512_castsi512_ps(saturated);
    }
    const __m512i totals = _mm512_castps_si512(reduce_each16(v, add));
    _mm512_storeu_ps(sum + j0, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(totals)));
  }
  quantize_blocks(x, j0, blocks, q, d, sum);
}

// a[0:n] = silu(g) * u as swiglu8 computes it, 16 lanes at a time (n: a multiple of 16).
__attribute__((noinline)) void swiglu_row_zmm(const float* g, const float* u, float* a, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(a + i, specdec_cpu::swiglu16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
}
#pragma GCC pop_options

// How the kernels split M activation rows into tiles of at most `max_tile` rows (every weight
// block unpacked once serves a tile): tiles = ceil(M / max_tile) of even sizes, the first ones a
// row larger; the rows of tile `tile`, which starts at row m0.
inline int64_t tile_rows(int64_t M, int64_t m0, int64_t tiles, int64_t tile) {
  return (M - m0) / (tiles - tile) + ((M - m0) % (tiles - tile) != 0);
}

// The tiles of the AVX-512 VNNI kernels (their kMaxTile), which the column-major activations
// (QuantizedRows::q256t) are laid out for, and the fewest rows of a tile that reads them.
constexpr int64_t kColumnTile = 8;
constexpr int64_t kColumnTileMinRows = 3;

// Activation rows quantized to int8 (scale = max|x| / 127 per block), each representation
// built only when `needs` asks for it:
//   per32: q [M, K] in element order, blocks of 32, with per block its scale d and the sum of
//     its dequantized values (for formats with a min), [M, ld] with ld the block count rounded
//     up to 8 (zeros past the end, so that eight blocks load as a vector);
//   pairs: the order split Q4 rows want: per pair of blocks (A, B), A[0:16] B[0:16] A[16:32]
//     B[16:32];
//   biased: q + 128 as unsigned bytes (split Q8_0 rows, whose signed weights take the other
//     operand of the dot product);
//   per256 (Q4_K, Q5_K, Q6_K): the rows quantized with one scale per 256 (q256 [M, K]), the scales
//     transposed (d256t [K / 256, ldt], ldt = M rounded up to 16, plus 16; zeros past M, so
//     that 8 or 16 rows' scales load as a vector) and the int16 sum of each 16 of q256 (sum16
//     [M, K / 16]: Q4_K's mins, Q6_K's -32);
//   columns256: the same per-256 data tile by tile for the 512-bit interleaved Q4_K / Q6_K
//     kernels (q256t, sum32t, offset16t below).
// A matmul whose weight is all Q4_K, Q5_K and Q6_K (a Q4_K_M file's) builds per256 alone (q, d and
// sum stay null).
struct QuantizedRows {
  int64_t M = 0, K = 0, blocks = 0, ld = 0, ldt = 0;
  const int8_t* q = nullptr;
  const int8_t* pairs = nullptr;
  const uint8_t* biased = nullptr;
  const int8_t* q256 = nullptr;
  const float* d256t = nullptr;
  const int16_t* sum16 = nullptr;
  // The same per-256 activations tile by tile, column-major in each tile (kColumnTile), for the
  // 512-bit interleaved Q4_K / Q6_K kernels' tiles of more than 2 rows: a tile's rows at one
  // chunk are adjacent, one pointer reaches them all (8 row pointers would take the general
  // registers the kernel needs), and a tile's data is contiguous. The 4-byte chunks of q256
  // (chunk c of row m0 + r of the tile of R rows at m0: q256t[m0 * K / 4 + c * R + r]), the two
  // 16-sums of each 32 elements as one int32 (sum32t, as load_int(sum16 + 2j) reads them; at
  // m0 * K / 32 + j * R + r) and -32 times each 16-sum (offset16t: Q6_K's offset; at
  // m0 * K / 16 + g * R + r).
  const int32_t* q256t = nullptr;
  const int32_t* sum32t = nullptr;
  const int32_t* offset16t = nullptr;
  const float* d = nullptr;
  const float* sum = nullptr;
  AlignedVector<int8_t> q_store, pair_store;
  AlignedVector<uint8_t> biased_store;
  std::vector<int16_t> sum16_store;
  AlignedVector<int32_t> q256t_store, sum32t_store, offset16t_store;
  AlignedVector<int8_t> q256_store;
  AlignedVector<float> d256t_store;
  std::vector<float> d_store, sum_store;

  QuantizedRows(const float* x, int64_t rows, int64_t cols, const ActivationNeeds& needs)
      : M(rows), K(cols), blocks(cols / 32), ld((cols / 32 + 7) / 8 * 8), ldt((rows + 15) / 16 * 16 + 16) {
    if (needs.per32) quantize_per_32(x);
    if (needs.pairs) pair_blocks();
    if (needs.biased) bias();
    if (needs.per256) {
      quantize_per_256(x);
      sum_sixteens();
      if (needs.columns256) columns_per_256();
    }
  }

 private:
  void quantize_per_32(const float* x);
  void columns_per_256();
  void pair_blocks();
  void bias();
  void quantize_per_256(const float* x);
  void sum_sixteens();
};

// fn(m) for every activation row m: on the work pool for a prompt's rows, inline for a decode
// or verify step's few (where waking the pool would cost more than the work).
template <typename Fn>
void for_each_row(int64_t M, Fn&& fn) {
  if (M < 16) {
    for (int64_t m = 0; m < M; ++m) fn(m);
    return;
  }
  WorkPool::get().parallel_for(M, [&](int64_t m) { fn(m); });
}

void QuantizedRows::quantize_per_32(const float* x) {
  q_store.resize(M * K);
  d_store.assign(M * ld, 0.f);
  sum_store.assign(M * ld, 0.f);
  const bool wide = wide_activations();
  for_each_row(M, [&](int64_t m) {
    if (wide) return quantize_row_zmm(x + m * K, blocks, q_store.data() + m * K, &d_store[m * ld], &sum_store[m * ld]);
    quantize_row(x + m * K, blocks, q_store.data() + m * K, &d_store[m * ld], &sum_store[m * ld]);
  });
  q = q_store.data();
  d = d_store.data();
  sum = sum_store.data();
}

void QuantizedRows::pair_blocks() {
  pair_store.resize(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j + 1 < blocks; j += 2) {
      const int8_t* a = q + m * K + 32 * j;
      int8_t* out = pair_store.data() + m * K + 32 * j;
      std::memcpy(out, a, 16);
      std::memcpy(out + 16, a + 32, 16);
      std::memcpy(out + 32, a + 16, 16);
      std::memcpy(out + 48, a + 48, 16);
    }
  pairs = pair_store.data();
}

void QuantizedRows::bias() {
  biased_store.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) biased_store[i] = static_cast<uint8_t>(q[i] + 128);
  biased = biased_store.data();
}

void QuantizedRows::quantize_per_256(const float* x) {
  q256_store.resize(M * K);
  d256t_store.assign((K / 256) * ldt, 0.f);
  for_each_row(M, [&](int64_t m) {
    for (int64_t b = 0; b < K / 256; ++b) {
      const float* in = x + m * K + 256 * b;
      const float scale = abs_max(in, 256) / 127.f, inverse = scale != 0.f ? 1.f / scale : 0.f;
      for (int j = 0; j < 8; ++j) quantize32(in + 32 * j, inverse, q256_store.data() + m * K + 256 * b + 32 * j);
      d256t_store[b * ldt + m] = scale;
    }
  });
  q256 = q256_store.data();
  d256t = d256t_store.data();
}

void QuantizedRows::sum_sixteens() {
  sum16_store.resize(M * K / 16);
  for (int64_t i = 0; i < M * K / 16; ++i) {
    int total = 0;
    for (int j = 0; j < 16; ++j) total += q256[16 * i + j];
    sum16_store[i] = static_cast<int16_t>(total);  // |total| <= 16 * 127
  }
  sum16 = sum16_store.data();
}

void QuantizedRows::columns_per_256() {
  const int64_t chunks = K / 4, pairs = K / 32, groups = K / 16;
  q256t_store.resize(chunks * M);
  sum32t_store.resize(pairs * M);
  offset16t_store.resize(groups * M);
  const int64_t tiles = (M + kColumnTile - 1) / kColumnTile;
  for (int64_t tile = 0, m0 = 0; tile < tiles; ++tile) {
    const int64_t R = tile_rows(M, m0, tiles, tile);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      for (int64_t c = 0; c < chunks; ++c) std::memcpy(&q256t_store[m0 * chunks + c * R + r], q256 + m * K + 4 * c, 4);
      for (int64_t j = 0; j < pairs; ++j) std::memcpy(&sum32t_store[m0 * pairs + j * R + r], sum16 + m * groups + 2 * j, 4);
      for (int64_t g = 0; g < groups; ++g) offset16t_store[m0 * groups + g * R + r] = -32 * sum16[m * groups + g];
    }
    m0 += R;
  }
  q256t = q256t_store.data();
  sum32t = sum32t_store.data();
  offset16t = offset16t_store.data();
}

struct WeightSegment {
  int type;
  int64_t first_row, rows, row_bytes;
  const uint8_t* data;
};

struct QuantWeight {
  int64_t rows = 0;
  std::vector<WeightSegment> segments;
};

// Weight rows per work item of a matmul's parallel loop: runs of about kItemBytes of weights
// (a multiple of 16 rows: interleaved segments are computed in whole groups of 16), two to
// eight per thread (a few more where rounding down to 16 rows, or a segment's end, cuts an
// extra one). Long runs stream contiguous memory (what the prefetchers follow best) and keep
// the claims on the shared counter few; more than one per thread lets a thread that runs
// faster take the work of one that runs slower (a VM's steal time; figures in
// docs/benchmarks/llamacpp.md#work-items-sized-by-weight-bytes-2026-12-03-evening). Small matrices
// (the default model's, but its LM head) keep two per thread.
constexpr int64_t kItemBytes = 256 * 1024;

int64_t rows_per_item(const QuantWeight& w, int64_t threads) {
  int64_t bytes = 0;
  for (const WeightSegment& seg : w.segments) bytes += seg.rows * seg.row_bytes;
  const int64_t items = threads * std::clamp<int64_t>(bytes / (kItemBytes * threads), 2, 8);
  return std::max<int64_t>(16, (w.rows + items - 1) / items / 16 * 16);
}

struct Epilogue {
  const float* scale = nullptr;
  const float* bias = nullptr;
  const float* residual = nullptr;  // [M, N], same layout as the output
};

bool is_interleaved(int type) {
  return type == specdec_cpu::kQ4_0I || type == specdec_cpu::kQ4_1I || type == specdec_cpu::kQ8_0I ||
         type == specdec_cpu::kQ5_0I || type == specdec_cpu::kQ5_1I || type == specdec_cpu::kQ4_KI ||
         type == specdec_cpu::kQ6_KI;
}

int64_t block_elems(int type) {
  if (type == specdec_cpu::kQ4_0S || type == specdec_cpu::kQ4_1S || type == specdec_cpu::kQ8_0S) return 32;
  if (type == specdec_cpu::kQ4_KI || type == specdec_cpu::kQ6_KI) return 256;
  if (is_interleaved(type)) return 32;
  int64_t elems = 0;
  with_format(type, [&](auto format) { elems = decltype(format)::kElems; });
  return elems;
}

int64_t block_bytes(int type) {
  if (type == specdec_cpu::kQ4_0S || type == specdec_cpu::kQ4_0I) return 18;
  if (type == specdec_cpu::kQ4_1S || type == specdec_cpu::kQ4_1I) return 20;
  if (type == specdec_cpu::kQ8_0S || type == specdec_cpu::kQ8_0I) return 34;
  if (type == specdec_cpu::kQ5_0I) return 22;
  if (type == specdec_cpu::kQ5_1I) return 24;
  if (type == specdec_cpu::kQ4_KI) return 144;
  if (type == specdec_cpu::kQ6_KI) return 210;
  int64_t bytes = 0;
  with_format(type, [&](auto format) { bytes = decltype(format)::kBytes; });
  return bytes;
}

bool is_split(int type) {
  return type == specdec_cpu::kQ4_0S || type == specdec_cpu::kQ4_1S || type == specdec_cpu::kQ8_0S;
}

// Row `lane` of an interleaved K-quant group (Layout: InterleavedQ4K or InterleavedQ6K, of
// format Type), dequantized into out[0:K] through its stored blocks.
template <class Layout, int Type>
void dequantize_interleaved_k(const uint8_t* group, int lane, int64_t K, float* out) {
  using F = specdec_cpu::Format<Type>;
  alignas(32) uint8_t block[F::kBytes];
  for (int64_t b = 0; b < K / F::kElems; ++b) {
    Layout::gather_block(group, lane, b, block);
    specdec_cpu::dequantize_row<F>(block, F::kElems, out + F::kElems * b);
  }
}

// Row `row` of a segment, dequantized into out[0:K].
void dequantize_row(const WeightSegment& seg, int64_t row, int64_t K, float* out) {
  const uint8_t* data = seg.data + row * seg.row_bytes;
  if (seg.type == specdec_cpu::kQ4_0S) return specdec_cpu::SplitQ4<false>::dequantize_row(data, K, out);
  if (seg.type == specdec_cpu::kQ4_1S) return specdec_cpu::SplitQ4<true>::dequantize_row(data, K, out);
  if (seg.type == specdec_cpu::kQ8_0S) return specdec_cpu::dequantize_split_q8_row(data, K, out);
  if (is_interleaved(seg.type)) {
    const uint8_t* group = seg.data + row / 16 * 16 * seg.row_bytes;
    const int lane = static_cast<int>(row % 16);
    if (seg.type == specdec_cpu::kQ4_KI)
      return dequantize_interleaved_k<specdec_cpu::InterleavedQ4K, specdec_cpu::kQ4_K>(group, lane, K, out);
    if (seg.type == specdec_cpu::kQ6_KI)
      return dequantize_interleaved_k<specdec_cpu::InterleavedQ6K, specdec_cpu::kQ6_K>(group, lane, K, out);
    if (seg.type == specdec_cpu::kQ4_0I) return specdec_cpu::Interleaved<specdec_cpu::kQ4_0I>::dequantize_row(group, lane, K, out);
    if (seg.type == specdec_cpu::kQ4_1I) return specdec_cpu::Interleaved<specdec_cpu::kQ4_1I>::dequantize_row(group, lane, K, out);
    if (seg.type == specdec_cpu::kQ5_0I) return specdec_cpu::Interleaved<specdec_cpu::kQ5_0I>::dequantize_row(group, lane, K, out);
    if (seg.type == specdec_cpu::kQ5_1I) return specdec_cpu::Interleaved<specdec_cpu::kQ5_1I>::dequantize_row(group, lane, K, out);
    return specdec_cpu::Interleaved<specdec_cpu::kQ8_0I>::dequantize_row(group, lane, K, out);
  }
  with_format(seg.type, [&](auto format) { specdec_cpu::dequantize_row<decltype(format)>(data, K, out); });
}

// Reads and checks a weight's layout against K, the row length the caller multiplies with.
QuantWeight parse_weight(const paddle::Tensor& data, const paddle::Tensor& layout, int64_t K, const char* what) {
  PD_CHECK(data.dtype() == paddle::DataType::UINT8, what, ": weight data must be uint8");
  PD_CHECK(layout.dtype() == paddle::DataType::INT64 && layout.shape().size() == 2 && layout.shape()[1] == 4, what,
           ": layout must be int64 [segments, 4]");
  QuantWeight w;
  const int64_t* rows = layout.data<int64_t>();
  const uint8_t* base = data.data<uint8_t>();
  for (int64_t s = 0; s < layout.shape()[0]; ++s) {
    const int type = static_cast<int>(rows[4 * s]);
    const int64_t count = rows[4 * s + 1], offset = rows[4 * s + 2], row_bytes = rows[4 * s + 3];
    const int64_t elems = block_elems(type);
    PD_CHECK(elems > 0, what, ": unsupported block type ", type);
    PD_CHECK(type == specdec_cpu::kQ8_0S || !is_split(type) || K % 64 == 0, what,
             ": split Q4 rows need a multiple of 64 elements");
    PD_CHECK(!is_interleaved(type) || count % 16 == 0, what, ": interleaved rows come in groups of 16");
    PD_CHECK(K % elems == 0 && row_bytes == K / elems * block_bytes(type), what, ": rows of type ", type,
             " do not hold ", K, " elements");
    // Split rows read up to 16 bytes past a row's scales (lanes then discarded): the data
    // carries that much slack after its last row.
    PD_CHECK(offset >= 0 && count >= 0 && offset + count * row_bytes + (is_split(type) ? 16 : 0) <= data.numel(),
             what, ": segment beyond the data");
    w.segments.push_back({type, w.rows, count, row_bytes, base + offset});
    w.rows += count;
  }
  return w;
}

// The 8-lane int8 dot product of each instruction set: lane i = sum of a[4i..4i+3] * b[4i..4i+3],
// a unsigned, b signed.
struct Avx2Dot {
  static constexpr bool kWide = false;  // maddubs saturates pair sums at 16 bits
  static constexpr int kMaxTile = 4;    // rows per tile (quant_matmul.inc)
  static inline __m256i dot(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
  }
  // acc + pairwise sums of a * b over 16-bit lanes, into 8 int32 lanes.
  static inline __m256i dot16(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
};

namespace avx2 {
using Dot = Avx2Dot;
#include "quant_matmul.inc"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
struct VnniDot {
  static constexpr bool kWide = true;
  static constexpr int kMaxTile = 8;
  static inline __m256i dot(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }
  static inline __m256i dot16(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
};

namespace vnni {
using Dot = VnniDot;
#define SPECDEC_ZMM_KERNELS
#include "quant_matmul.inc"
#undef SPECDEC_ZMM_KERNELS
}  // namespace vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
namespace amx {
#include "quant_matmul_amx.inc"
}  // namespace amx
#pragma GCC pop_options

bool use_vnni() {
  if (isa_is("avx2")) return false;
  static const bool supported = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bw");
  return supported;
}

// AMX-TILE and AMX-INT8 in CPUID, their state enabled by the OS (XCR0 bits 17 and 18), and
// this process allowed to use it (Linux asks for that once: arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_ready() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE, for xgetbv
  unsigned xcr0_low = 0, xcr0_high = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if ((xcr0_low & (3u << 17)) != (3u << 17)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Rows from which a Q4_K/Q6_K matmul runs on AMX tiles: below, the dot-product kernels (whose
// tiles of up to 8 rows read each weight block once) are as fast, and packing the weights into
// tiles would not pay for itself. On 2 cores of an Intel Xeon (2026-12-07) Qwen2.5-Coder-1.5B's
// forward of 16 rows took 161 ms on tiles and 133 on the group kernels, 24 rows 201 and 183,
// 32 rows 220 and 233, 48 rows 280 and 340 (interleaved Q4_K groups taken by the tiles as they
// stand, amx::q4k_columns_panel; gathered back row by row first, 48 rows took 301).
constexpr int64_t kAmxMinRows = 32;

bool use_amx(int64_t M) {
  if (M < kAmxMinRows || isa_is("avx512") || !use_vnni()) return false;
  static const bool ready = amx_ready();
  return ready;
}

bool has_tile_segments(const QuantWeight& w) {
  for (const WeightSegment& seg : w.segments)
    if (amx::tile_type(seg.type)) return true;
  return false;
}

// What the kernels of w's segments read of the activations (see QuantizedRows).
ActivationNeeds needs_of(const QuantWeight& w, bool vnni, int64_t M) {
  ActivationNeeds needs;
  for (const WeightSegment& seg : w.segments) {
    const bool per256 = seg.type == specdec_cpu::kQ4_K || seg.type == specdec_cpu::kQ5_K || seg.type == specdec_cpu::kQ6_K ||
                        seg.type == specdec_cpu::kQ4_KI || seg.type == specdec_cpu::kQ6_KI;
    needs.per32 = needs.per32 || !per256;
    needs.pairs = needs.pairs || seg.type == specdec_cpu::kQ4_0S || seg.type == specdec_cpu::kQ4_1S;
    needs.biased = needs.biased || (vnni && (seg.type == specdec_cpu::kQ8_0S || seg.type == specdec_cpu::kQ8_0I));
    needs.per256 = needs.per256 || per256;
    // (stored Q6_K rows: their prompt rows run on the interleaved kernel, quant_matmul.inc)
    needs.columns256 = needs.columns256 || (vnni && M >= kColumnTileMinRows &&
                                            (seg.type == specdec_cpu::kQ4_KI || seg.type == specdec_cpu::kQ6_KI ||
                                             (seg.type == specdec_cpu::kQ6_K && M >= vnni::kGroupQ6KFromRows)));
  }
  return needs;
}

void matmul(const float* x, int64_t M, int64_t K, const QuantWeight& w, const Epilogue& epi, float* out) {
  const bool vnni = use_vnni();
  const QuantizedRows rows(x, M, K, needs_of(w, vnni, M));
  if (use_amx(M) && has_tile_segments(w))
    amx::matmul(rows, w, epi, out);
  else if (vnni)
    vnni::matmul(rows, w, epi, out);
  else
    avx2::matmul(rows, w, epi, out);
}

// The sum of x[k]^2 over the K floats of x, in double precision: four chains of four lanes
// (element k in lane k % 16), added pairwise at the end. A float's square is exact in a
// double, so this differs from the plain sum in order only. The plain sum was one serial chain
// of double adds, about 1 us a row of the default model: with 2 norms a layer, 0.1 ms of a
// 6-row verify pass spent on one core (2026-12-06, Zen 5).
inline double sum_of_squares(const float* x, int64_t K) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    for (int j = 0; j < 4; ++j) {
      const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + k + 4 * j));
      acc[j] = _mm256_fmadd_pd(v, v, acc[j]);
    }
  const __m256d both = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
  const __m128d half = _mm_add_pd(_mm256_castpd256_pd128(both), _mm256_extractf128_pd(both, 1));
  double total = _mm_cvtsd_f64(_mm_add_sd(half, _mm_unpackhi_pd(half, half)));
  for (; k < K; ++k) total += static_cast<double>(x[k]) * x[k];
  return total;
}

// rms_norm(x) * gain, row by row.
AlignedVector<float> normalized(const float* x, int64_t M, int64_t K, const float* gain, float eps) {
  AlignedVector<float> h(M * K);
  for_each_row(M, [&](int64_t m) {
    const float* row = x + m * K;
    const float scale = 1.0f / std::sqrt(static_cast<float>(sum_of_squares(row, K) / K) + eps);
    for (int64_t k = 0; k < K; ++k) h[m * K + k] = row[k] * scale * (gain ? gain[k] : 1.f);
  });
  return h;
}

void check_rows(const paddle::Tensor& x, const char* what) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && x.shape().size() == 2, what, ": must be float32 [M, K]");
  PD_CHECK(x.shape()[1] % 32 == 0, what, ": the row length must be a multiple of 32");
}

}  // namespace

namespace {

// A decoder layer's weights after attention (o, the MLP norm's gain, gate/up, down), read and
// checked against the attention's width A and the hidden size H.
struct LayerTailWeights {
  QuantWeight o, gate_up, down;
  const float* gain;
  int64_t I;  // the MLP's inner size
};

LayerTailWeights parse_layer_tail(const paddle::Tensor& wo, const paddle::Tensor& lo, const paddle::Tensor& gain,
                                  const paddle::Tensor& wgu, const paddle::Tensor& lgu, const paddle::Tensor& wd,
                                  const paddle::Tensor& ld, int64_t A, int64_t H) {
  PD_CHECK(gain.numel() == H, "q_layer_tail: gain must be [H]");
  LayerTailWeights w;
  w.o = parse_weight(wo, lo, A, "q_layer_tail: o");
  w.gate_up = parse_weight(wgu, lgu, H, "q_layer_tail: gate_up");
  PD_CHECK(w.o.rows == H && w.gate_up.rows % 2 == 0, "q_layer_tail: weight shapes");
  w.I = w.gate_up.rows / 2;
  PD_CHECK(w.I % 32 == 0, "q_layer_tail: the inner size must be a multiple of 32");
  w.down = parse_weight(wd, ld, w.I, "q_layer_tail: down");
  PD_CHECK(w.down.rows == H, "q_layer_tail: down must have H rows");
  w.gain = gain.data<float>();
  return w;
}

// The rest of a decoder layer after attention, into out [M, H] (see q_layer_tail), from attn
// [M, A] and the layer's input x [M, H].
void layer_tail(const float* attn, const float* x, int64_t M, int64_t A, int64_t H, const LayerTailWeights& w,
                float eps, float* out) {
  const int64_t I = w.I;
  AlignedVector<float> x1(M * H);  // the o matmul writes it whole
  Epilogue residual;
  residual.residual = x;
  matmul(attn, M, A, w.o, residual, x1.data());
  const AlignedVector<float> h = normalized(x1.data(), M, H, w.gain, eps);
  // The MLP in chunks of rows whose [rows, 2I] gate/up output stays below the heap's mmap
  // threshold (kHeapReuse): a long prompt's would otherwise be fresh pages, faulted in and
  // zeroed at every layer. Rows are independent: the chunks give the same floats.
  const int64_t chunk = std::max<int64_t>(8, kMlpChunkBytes / (2 * I * static_cast<int64_t>(sizeof(float))) / 8 * 8);
  const int64_t rows = std::min(M, chunk);
  std::unique_ptr<float[]> both(new float[rows * 2 * I]), act(new float[rows * I]);  // no zero fill
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    const int64_t n = std::min(rows, M - m0);
    matmul(h.data() + m0 * H, n, H, w.gate_up, Epilogue{}, both.get());
    const bool wide = wide_activations();
    for_each_row(n, [&](int64_t m) {
      const float* g = both.get() + m * 2 * I;
      float* a = act.get() + m * I;
      if (wide) return swiglu_row_zmm(g, g + I, a, I);
      for (int64_t i = 0; i < I; i += 8)
        _mm256_storeu_ps(a + i, swiglu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(g + I + i)));
    });
    residual.residual = x1.data() + m0 * H;
    matmul(act.get(), n, I, w.down, residual, out + m0 * H);
  }
}

// layer_tail on paddle tensors.
void layer_tail(const paddle::Tensor& attn, const paddle::Tensor& x, const paddle::Tensor& wo, const paddle::Tensor& lo,
                const paddle::Tensor& gain, const paddle::Tensor& wgu, const paddle::Tensor& lgu,
                const paddle::Tensor& wd, const paddle::Tensor& ld, float eps, float* out) {
  check_rows(attn, "q_layer_tail: attn");
  check_rows(x, "q_layer_tail: x");
  const int64_t M = x.shape()[0], H = x.shape()[1], A = attn.shape()[1];
  PD_CHECK(attn.shape()[0] == M, "q_layer_tail: attn and x rows differ");
  const LayerTailWeights w = parse_layer_tail(wo, lo, gain, wgu, lgu, wd, ld, A, H);
  layer_tail(attn.data<float>(), x.data<float>(), M, A, H, w, eps, out);
}

// A projection with its epilogue (a scale and a bias per output column, or none), read and
// checked against its input's row length K.
struct Projection {
  QuantWeight weight;
  Epilogue epi;
};

Projection parse_projection(const paddle::Tensor& w, const paddle::Tensor& layout, const paddle::Tensor& epilogue,
                            int64_t K) {
  Projection p;
  p.weight = parse_weight(w, layout, K, "q_matmul");
  if (epilogue.numel() > 0) {
    PD_CHECK(epilogue.numel() == 2 * p.weight.rows, "q_matmul: epilogue must be [2, N]");
    p.epi.scale = epilogue.data<float>();
    p.epi.bias = p.epi.scale + p.weight.rows;
  }
  return p;
}

// out [M, N] = h @ w^T with the epilogue, h = x [M, K], or rms_norm(x) * gain (gain may be
// null: no gain) when `normalize`.
void project(const float* x, int64_t M, int64_t K, const QuantWeight& w, const Epilogue& epi, const float* gain,
             bool normalize, float eps, float* out) {
  if (normalize) {
    const AlignedVector<float> h = normalized(x, M, K, gain, eps);
    matmul(h.data(), M, K, w, epi, out);
  } else {
    matmul(x, M, K, w, epi, out);
  }
}

// q_matmul on paddle tensors: x [M, K] (normalized first, with gain, when `normalize`).
paddle::Tensor q_matmul(const paddle::Tensor& x, const paddle::Tensor& gain, const paddle::Tensor& w,
                        const paddle::Tensor& layout, const paddle::Tensor& epilogue, float eps, bool normalize) {
  check_rows(x, "q_matmul: x");
  const int64_t M = x.shape()[0], K = x.shape()[1];
  const Projection p = parse_projection(w, layout, epilogue, K);
  if (normalize && gain.numel() > 0) PD_CHECK(gain.numel() == K, "q_matmul: gain must be [K]");
  auto out = paddle::empty({M, p.weight.rows}, paddle::DataType::FLOAT32, x.place());
  project(x.data<float>(), M, K, p.weight, p.epi, gain.numel() > 0 ? gain.data<float>() : nullptr, normalize, eps,
          out.data<float>());
  return out;
}

}  // namespace

std::vector<paddle::Tensor> QMatmul(const paddle::Tensor& x, const paddle::Tensor& gain, const paddle::Tensor& w,
                                    const paddle::Tensor& layout, const paddle::Tensor& epilogue, float eps,
                                    bool normalize) {
  return {q_matmul(x, gain, w, layout, epilogue, eps, normalize)};
}

std::vector<paddle::Tensor> QLayerTail(const paddle::Tensor& attn, const paddle::Tensor& x, const paddle::Tensor& wo,
                                       const paddle::Tensor& lo, const paddle::Tensor& gain,
                                       const paddle::Tensor& wgu, const paddle::Tensor& lgu,
                                       const paddle::Tensor& wd, const paddle::Tensor& ld, float eps) {
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  layer_tail(attn, x, wo, lo, gain, wgu, lgu, wd, ld, eps, out.data<float>());
  return {out};
}

std::vector<paddle::Tensor> QLayerTailQkv(const paddle::Tensor& attn, const paddle::Tensor& x,
                                          const paddle::Tensor& wo, const paddle::Tensor& lo,
                                          const paddle::Tensor& gain, const paddle::Tensor& wgu,
                                          const paddle::Tensor& lgu, const paddle::Tensor& wd,
                                          const paddle::Tensor& ld, const paddle::Tensor& next_gain,
                                          const paddle::Tensor& wqkv, const paddle::Tensor& lqkv,
                                          const paddle::Tensor& epilogue, float eps) {
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  layer_tail(attn, x, wo, lo, gain, wgu, lgu, wd, ld, eps, out.data<float>());
  return {out, q_matmul(out, next_gain, wqkv, lqkv, epilogue, eps, true)};
}

// Operands per layer in `layers` of q_register_layers: o (data, layout), mlp_gain, gate_up
// (data, layout), down (data, layout), then the layer's input side: attn_gain, qkv (data,
// layout) and the qkv epilogue.
constexpr size_t kLayerOperands = 11;

namespace {

// One decoder layer of a stack (q_register_layers), its weights read once.
struct StackLayer {
  LayerTailWeights tail;  // after attention
  Projection qkv;         // the layer's q/k/v from its input
  const float* attn_gain;
};

// Weights read once, by handle (q_register_layers, q_register_draft_head). Each item holds
// pointers into tensors its caller keeps alive until q_release. Handles are unique across
// registries: one of another kind is an error, not a misread.
std::atomic<int64_t> next_handle{1};

template <typename T>
class Registry {
 public:
  int64_t add(std::shared_ptr<const T> item) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t handle = next_handle++;
    items_[handle] = std::move(item);
    return handle;
  }
  std::shared_ptr<const T> find(const paddle::Tensor& handle, const char* what) {
    PD_CHECK(handle.dtype() == paddle::DataType::INT64 && handle.numel() == 1, what, ": bad handle");
    return find(handle.data<int64_t>()[0], what);
  }
  std::shared_ptr<const T> find(int64_t handle, const char* what) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = items_.find(handle);
    PD_CHECK(found != items_.end(), what, ": no such handle (released?)");
    return found->second;
  }
  bool erase(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    return items_.erase(handle) > 0;
  }

 private:
  std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<const T>> items_;
};

Registry<std::vector<StackLayer>> stacks;

paddle::Tensor handle_tensor(int64_t handle) {
  auto out = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  out.data<int64_t>()[0] = handle;
  return out;
}

// The layer after attention and the next input side, from kLayerOperands tensors at w.
StackLayer parse_stack_layer(const paddle::Tensor* w, int64_t width, const char* what) {
  const int64_t H = w[2].numel();
  StackLayer layer;
  layer.tail = parse_layer_tail(w[0], w[1], w[2], w[3], w[4], w[5], w[6], width, H);
  PD_CHECK(w[7].numel() == H, what, ": attn_gain must be [H]");
  layer.attn_gain = w[7].data<float>();
  layer.qkv = parse_projection(w[8], w[9], w[10], H);
  return layer;
}

}  // namespace

// Reads a model's decoder layers (kLayerOperands tensors each, in `layers`) once, for
// q_decoder_layers, and returns its handle (int64 [1]). One handle instead of 11 tensors a layer
// at every step: paddle checks every tensor of a call, about 0.3 us each, which cost the
// default model's 30 layers 100 us of each forward pass (2026-12-05, AMD Zen 5). `width`: the
// attention's output width, heads * head_dim.
std::vector<paddle::Tensor> QRegisterLayers(const std::vector<paddle::Tensor>& layers, int64_t width) {
  PD_CHECK(!layers.empty() && layers.size() % kLayerOperands == 0, "q_register_layers: ", kLayerOperands,
           " operands per layer");
  auto stack = std::make_shared<std::vector<StackLayer>>();
  for (size_t i = 0; i < layers.size(); i += kLayerOperands)
    stack->push_back(parse_stack_layer(layers.data() + i, width, "q_register_layers"));
  return {handle_tensor(stacks.add(std::move(stack)))};
}

namespace {

// The stack's layers from the first layer's input x [T, H] and its q/k/v: per layer the paged
// attention over caches[i] (the cpu backend's call), then the layer's tail with the next
// layer's input side. Returns the last layer's output, before the final norm.
paddle::Tensor run_layers(const std::vector<StackLayer>& stack, const paddle::Tensor& x, const paddle::Tensor& qkv,
                          const std::vector<paddle::Tensor>& caches, const paddle::Tensor& cos,
                          const paddle::Tensor& sin, const paddle::Tensor& meta, int64_t heads, int64_t kv_heads,
                          float eps, const char* what) {
  const size_t L = caches.size();
  PD_CHECK(L == stack.size(), what, ": one cache per layer");
  check_rows(x, what);
  if (L == 0) return x;
  const int64_t M = x.shape()[0], H = x.shape()[1];
  PD_CHECK(qkv.dtype() == paddle::DataType::FLOAT32 && qkv.shape().size() == 2 && qkv.shape()[0] == M, what,
           ": qkv must be float32 [M, width], M as x's rows");
  // Checked once for every layer: each cache, each layer's widths, then the metadata.
  int64_t widest_qkv = 0;
  for (size_t i = 0; i < L; ++i) {
    const int64_t width = i == 0 ? qkv.shape()[1] : stack[i].qkv.weight.rows;
    check_attention_layer(caches[i], caches.front(), width, heads, kv_heads);
    PD_CHECK(stack[i].tail.o.rows == H, what, ": shapes");
    widest_qkv = std::max(widest_qkv, width);
  }
  const AttentionBatch batch = read_attention_batch(meta, M, caches.front(), cos);
  const int64_t A = heads * caches.front().shape()[3];
  PD_CHECK(A % 32 == 0, what, ": the attention's width (heads x head size) must be a multiple of 32");
  // Buffers for every layer: its attention, its output (two, taking turns: a layer reads the
  // one before's), the next layer's q/k/v.
  std::vector<float> attn(M * A), next_qkv(M * widest_qkv);
  paddle::Tensor outs[2] = {paddle::empty({M, H}, paddle::DataType::FLOAT32, x.place()),
                            paddle::empty({M, H}, paddle::DataType::FLOAT32, x.place())};
  const float* h = x.data<float>();
  const float* q = qkv.data<float>();
  for (size_t i = 0;; ++i) {
    const StackLayer& layer = stack[i];
    attend_layer(batch, q, caches[i], cos, sin, heads, kv_heads, attn.data());
    float* out = outs[i % 2].data<float>();
    layer_tail(attn.data(), h, M, A, H, layer.tail, eps, out);
    if (i + 1 == L) return outs[i % 2];
    const StackLayer& next = stack[i + 1];
    project(out, M, H, next.qkv.weight, next.qkv.epi, next.attn_gain, true, eps, next_qkv.data());
    h = out;
    q = next_qkv.data();
  }
}

}  // namespace

// Every decoder layer of a quantized model in one call (the stack `handle` of
// q_register_layers), from the first layer's input x [T, H] and its q/k/v: per layer the paged
// attention over caches[i] (the cpu backend's call), then q_layer_tail_qkv with the next
// layer's input side (q_layer_tail for the last). The same computations, in the same order,
// as the loop over layers made one paddle dispatch at a time (two per layer, some 15 us each
// on a CPU: a seventh of the default model's 1-row forward pass). Returns the last layer's
// output, before the final norm.
std::vector<paddle::Tensor> QDecoderLayers(const paddle::Tensor& x, const paddle::Tensor& qkv,
                                           const std::vector<paddle::Tensor>& caches, const paddle::Tensor& cos,
                                           const paddle::Tensor& sin, const paddle::Tensor& meta,
                                           const paddle::Tensor& handle, int64_t heads, int64_t kv_heads, float eps) {
  const std::shared_ptr<const std::vector<StackLayer>> stack = stacks.find(handle, "q_decoder_layers");
  return {run_layers(*stack, x, qkv, caches, cos, sin, meta, heads, kv_heads, eps, "q_decoder_layers")};
}

namespace {

// Rows id[0..T) of a quantized table, dequantized into out [T, cols].
void embed_rows(const QuantWeight& table, const int64_t* id, int64_t T, int64_t cols, float* out, const char* what) {
  for (int64_t t = 0; t < T; ++t) {
    PD_CHECK(id[t] >= 0 && id[t] < table.rows, what, ": token id out of range");
    for (const WeightSegment& seg : table.segments)
      if (id[t] >= seg.first_row && id[t] < seg.first_row + seg.rows)
        dequantize_row(seg, id[t] - seg.first_row, cols, out + t * cols);
  }
}

// A one-layer draft head's input (q_draft_input): x [T, H] = hidden_proj(n_h(hidden)) +
// embed_proj(n_e(embeds)), n_e and n_h RMSNorms with their gains where `normalize_*` (a gain
// may be null: none).
void draft_input(const float* embeds, int64_t E, const float* hidden, int64_t Hh, int64_t T,
                 const QuantWeight& embed_proj, const float* embed_gain, bool normalize_embed,
                 const QuantWeight& hidden_proj, const float* hidden_gain, bool normalize_hidden, float eps, float* x) {
  std::vector<float> from_embeds(T * embed_proj.rows);
  project(embeds, T, E, embed_proj, Epilogue{}, embed_gain, normalize_embed, eps, from_embeds.data());
  Epilogue sum;  // the hidden projection plus the embeddings' one: the add of the separate calls
  sum.residual = from_embeds.data();
  project(hidden, T, Hh, hidden_proj, sum, hidden_gain, normalize_hidden, eps, x);
}

// An LM head's logits [rows, V]: rms_norm(out[rows]) * gain (gain may be null) @ head^T, of
// out [T, H] (a draft head's, in q_layer_tail_head and q_draft_head; the model's, in q_forward).
paddle::Tensor head_logits(const paddle::Tensor& out, const std::vector<int64_t>& rows, const QuantWeight& head,
                           const float* gain, float eps, const char* what) {
  const int64_t T = out.shape()[0], H = out.shape()[1], R = static_cast<int64_t>(rows.size());
  std::vector<float> picked(R * H);
  for (int64_t r = 0; r < R; ++r) {
    PD_CHECK(rows[r] >= 0 && rows[r] < T, what, ": row out of range");
    std::copy_n(out.data<float>() + rows[r] * H, H, picked.data() + r * H);
  }
  auto logits = paddle::empty({R, head.rows}, paddle::DataType::FLOAT32, out.place());
  if (R > 0) project(picked.data(), R, H, head, Epilogue{}, gain, true, eps, logits.data<float>());
  return logits;
}

}  // namespace

std::vector<paddle::Tensor> QEmbedding(const paddle::Tensor& ids, const paddle::Tensor& w, const paddle::Tensor& layout,
                                       int64_t cols) {
  PD_CHECK(ids.dtype() == paddle::DataType::INT64, "q_embedding: ids must be int64");
  const QuantWeight table = parse_weight(w, layout, cols, "q_embedding");
  const int64_t T = ids.numel();
  auto out = paddle::empty({T, cols}, paddle::DataType::FLOAT32, w.place());
  embed_rows(table, ids.data<int64_t>(), T, cols, out.data<float>(), "q_embedding");
  return {out};
}

// The input of a one-layer draft head and its layer's q/k/v, in one call (one paddle dispatch
// instead of five): x = We . n_e(e) + Wh . n_h(hidden), where e is rows `ids` of the quantized
// `table` (E = embed_cols; or `embeds` [T, E] when the table is empty) and n_e, n_h are RMSNorms with their
// gains (when normalize_embed / normalize_hidden; an empty gain is 1); then qkv as q_matmul
// with attn_gain and the epilogue. The same float operations as those calls made one by one.
std::vector<paddle::Tensor> QDraftInput(const paddle::Tensor& embeds, const paddle::Tensor& table,
                                        const paddle::Tensor& table_layout, const paddle::Tensor& hidden,
                                        const paddle::Tensor& embed_gain, const paddle::Tensor& we,
                                        const paddle::Tensor& le, const paddle::Tensor& hidden_gain,
                                        const paddle::Tensor& wh, const paddle::Tensor& lh,
                                        const paddle::Tensor& attn_gain, const paddle::Tensor& wqkv,
                                        const paddle::Tensor& lqkv, const paddle::Tensor& epilogue,
                                        const std::vector<int64_t>& ids, int64_t embed_cols, float eps,
                                        bool normalize_embed, bool normalize_hidden) {
  check_rows(hidden, "q_draft_input: hidden");
  const int64_t T = hidden.shape()[0], Hh = hidden.shape()[1];
  std::vector<float> gathered;
  const float* e = nullptr;
  int64_t E = 0;
  if (table.numel() > 0) {
    PD_CHECK(static_cast<int64_t>(ids.size()) == T, "q_draft_input: one id per hidden row");
    E = embed_cols;
    const QuantWeight t = parse_weight(table, table_layout, E, "q_draft_input: table");
    gathered.resize(T * E);
    embed_rows(t, ids.data(), T, E, gathered.data(), "q_draft_input");
    e = gathered.data();
  } else {
    check_rows(embeds, "q_draft_input: embeds");
    PD_CHECK(embeds.shape()[0] == T, "q_draft_input: embeds and hidden rows differ");
    E = embeds.shape()[1];
    e = embeds.data<float>();
  }
  const QuantWeight embed_proj = parse_weight(we, le, E, "q_draft_input: embed_proj");
  const QuantWeight hidden_proj = parse_weight(wh, lh, Hh, "q_draft_input: hidden_proj");
  PD_CHECK(embed_proj.rows == hidden_proj.rows, "q_draft_input: the projections' outputs differ");
  const auto gain = [](const paddle::Tensor& g, int64_t K, bool normalize) -> const float* {
    if (normalize && g.numel() > 0) PD_CHECK(g.numel() == K, "q_draft_input: a gain's size");
    return g.numel() > 0 ? g.data<float>() : nullptr;
  };
  auto x = paddle::empty({T, embed_proj.rows}, paddle::DataType::FLOAT32, hidden.place());
  draft_input(e, E, hidden.data<float>(), Hh, T, embed_proj, gain(embed_gain, E, normalize_embed), normalize_embed,
              hidden_proj, gain(hidden_gain, Hh, normalize_hidden), normalize_hidden, eps, x.data<float>());
  return {x, q_matmul(x, attn_gain, wqkv, lqkv, epilogue, eps, true)};
}

// A decoder layer's tail (q_layer_tail) and a normalized projection of some of its output rows
// (a draft head's final norm and LM head over the rows that draft), in one call: returns the
// layer's output [T, H] and rms_norm(out[rows]) * head_gain @ W^T, [len(rows), N].
std::vector<paddle::Tensor> QLayerTailHead(const paddle::Tensor& attn, const paddle::Tensor& x,
                                           const paddle::Tensor& wo, const paddle::Tensor& lo,
                                           const paddle::Tensor& gain, const paddle::Tensor& wgu,
                                           const paddle::Tensor& lgu, const paddle::Tensor& wd,
                                           const paddle::Tensor& ld, const paddle::Tensor& head_gain,
                                           const paddle::Tensor& wh, const paddle::Tensor& lh,
                                           const std::vector<int64_t>& rows, float eps) {
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  layer_tail(attn, x, wo, lo, gain, wgu, lgu, wd, ld, eps, out.data<float>());
  const int64_t H = x.shape()[1];
  const QuantWeight head = parse_weight(wh, lh, H, "q_layer_tail_head: head");
  if (head_gain.numel() > 0) PD_CHECK(head_gain.numel() == H, "q_layer_tail_head: head_gain must be [H]");
  return {out, head_logits(out, rows, head, head_gain.numel() > 0 ? head_gain.data<float>() : nullptr, eps,
                           "q_layer_tail_head")};
}

namespace {

// A one-layer draft head read once (q_register_draft_head): q_draft_input's operands (the
// target's quantized embedding table, the two projections and their norms), a decoder layer,
// and an LM head with its norm.
struct DraftHead {
  QuantWeight table;
  int64_t embed_cols, hidden_cols;
  QuantWeight embed_proj, hidden_proj;
  const float* embed_gain;   // null: no norm of the embedding
  const float* hidden_gain;  // null: no norm of the hidden state
  StackLayer layer;
  QuantWeight lm_head;
  const float* head_gain;  // null: no gain in the LM head's norm
};

Registry<DraftHead> draft_heads;

// Operands of q_register_draft_head: table (data, layout), embed_gain, embed_proj (data,
// layout), hidden_gain, hidden_proj (data, layout), a layer's kLayerOperands, head_gain, the
// LM head (data, layout). An empty gain: no norm (no gain, for the LM head).
constexpr size_t kDraftHeadOperands = 8 + kLayerOperands + 3;

}  // namespace

// Reads a draft head once for q_draft_head and returns its handle.
std::vector<paddle::Tensor> QRegisterDraftHead(const std::vector<paddle::Tensor>& w, int64_t embed_cols,
                                               int64_t hidden_cols, int64_t width) {
  const char* what = "q_register_draft_head";
  PD_CHECK(w.size() == kDraftHeadOperands, what, ": ", kDraftHeadOperands, " operands");
  auto head = std::make_shared<DraftHead>();
  head->embed_cols = embed_cols;
  head->hidden_cols = hidden_cols;
  head->table = parse_weight(w[0], w[1], embed_cols, what);
  head->embed_proj = parse_weight(w[3], w[4], embed_cols, what);
  head->hidden_proj = parse_weight(w[6], w[7], hidden_cols, what);
  PD_CHECK(head->embed_proj.rows == head->hidden_proj.rows, what, ": the projections' outputs differ");
  const auto gain = [&](const paddle::Tensor& g, int64_t size) -> const float* {
    if (g.numel() == 0) return nullptr;
    PD_CHECK(g.numel() == size, what, ": a gain's size");
    return g.data<float>();
  };
  head->embed_gain = gain(w[2], embed_cols);
  head->hidden_gain = gain(w[5], hidden_cols);
  head->layer = parse_stack_layer(w.data() + 8, width, what);
  const int64_t H = head->embed_proj.rows;
  PD_CHECK(head->layer.tail.o.rows == H, what, ": the layer's size differs from the projections'");
  head->head_gain = gain(w[8 + kLayerOperands], H);
  head->lm_head = parse_weight(w[9 + kLayerOperands], w[10 + kLayerOperands], H, what);
  return {handle_tensor(draft_heads.add(std::move(head)))};
}

namespace {

// A draft head's forward over T rows `hidden` [T, hidden_cols] with one token id each: its input
// (q_draft_input), the paged attention over its cache layer (`batch`, checked), the layer's
// tail, then the LM head over `rows` of the output: out [T, H], logits [R, V]. What q_draft_head
// computes, and specdec_draft_head_start on the pool's worker.
void draft_head_forward(const DraftHead& head, const AttentionBatch& batch, const float* hidden, int64_t T,
                        const int64_t* ids, const int64_t* rows, int64_t R, const paddle::Tensor& cache,
                        const paddle::Tensor& cos, const paddle::Tensor& sin, int64_t heads, int64_t kv_heads,
                        float eps, float* out, float* logits) {
  const StackLayer& layer = head.layer;
  const int64_t E = head.embed_cols, H = head.embed_proj.rows, width = layer.qkv.weight.rows;
  const int64_t A = heads * cache.shape()[3];
  std::vector<float> embeds(T * E), x(T * H), qkv(T * width), attn(T * A), picked(R * H);
  embed_rows(head.table, ids, T, E, embeds.data(), "draft head");
  draft_input(embeds.data(), E, hidden, head.hidden_cols, T, head.embed_proj, head.embed_gain,
              head.embed_gain != nullptr, head.hidden_proj, head.hidden_gain, head.hidden_gain != nullptr, eps,
              x.data());
  project(x.data(), T, H, layer.qkv.weight, layer.qkv.epi, layer.attn_gain, true, eps, qkv.data());
  attend_layer(batch, qkv.data(), cache, cos, sin, heads, kv_heads, attn.data());
  layer_tail(attn.data(), x.data(), T, A, H, layer.tail, eps, out);
  for (int64_t r = 0; r < R; ++r) std::copy_n(out + rows[r] * H, H, picked.data() + r * H);
  if (R > 0) project(picked.data(), R, H, head.lm_head, Epilogue{}, head.head_gain, true, eps, logits);
}

}  // namespace

// A draft head's forward in one call: q_draft_input (ids: the tokens, one per hidden row), the
// paged attention over its cache layer, q_layer_tail_head over `rows`. The same computations,
// in the same order, as those three calls: (out [T, H], logits [rows, V]).
std::vector<paddle::Tensor> QDraftHead(const paddle::Tensor& hidden, const paddle::Tensor& cache,
                                       const paddle::Tensor& cos, const paddle::Tensor& sin,
                                       const paddle::Tensor& meta, const paddle::Tensor& handle,
                                       const std::vector<int64_t>& ids, const std::vector<int64_t>& rows,
                                       int64_t heads, int64_t kv_heads, float eps) {
  const std::shared_ptr<const DraftHead> head = draft_heads.find(handle, "q_draft_head");
  check_rows(hidden, "q_draft_head: hidden");
  const int64_t T = hidden.shape()[0], H = head->embed_proj.rows, R = static_cast<int64_t>(rows.size());
  PD_CHECK(hidden.shape()[1] == head->hidden_cols, "q_draft_head: hidden must be [T, ", head->hidden_cols, "]");
  PD_CHECK(static_cast<int64_t>(ids.size()) == T, "q_draft_head: one id per hidden row");
  for (int64_t r : rows) PD_CHECK(r >= 0 && r < T, "q_draft_head: row out of range");
  check_attention_layer(cache, cache, head->layer.qkv.weight.rows, heads, kv_heads);
  const AttentionBatch batch = read_attention_batch(meta, T, cache, cos);
  auto out = paddle::empty({T, H}, paddle::DataType::FLOAT32, hidden.place());
  auto logits = paddle::empty({R, head->lm_head.rows}, paddle::DataType::FLOAT32, hidden.place());
  draft_head_forward(*head, batch, hidden.data<float>(), T, ids.data(), rows.data(), R, cache, cos, sin, heads,
                     kv_heads, eps, out.data<float>(), logits.data<float>());
  return {out, logits};
}

namespace {

// A draft head bound to the cache layer it attends over (q_bind_draft_head): what every
// background forward of it reads besides its rows. It keeps the tensors alive.
struct DraftHeadBinding {
  std::shared_ptr<const DraftHead> head;
  paddle::Tensor cache, cos, sin;
  int64_t heads, kv_heads;
  float eps;
};

Registry<DraftHeadBinding> draft_head_bindings;

// A draft head's forward started by specdec_draft_head_start, running on the pool's worker
// while the caller goes on (specdec_draft_head_finish waits for it).
struct PendingDraftHead {
  specdec_cpu::BackgroundTask task;
};

std::mutex pending_mutex;
std::map<int64_t, std::unique_ptr<PendingDraftHead>> pending_heads;

// Copies what fails into `message` (at most size - 1 bytes and a NUL).
void write_message(const std::string& text, char* message, int64_t size) {
  if (message == nullptr || size <= 0) return;
  const size_t n = std::min(static_cast<size_t>(size - 1), text.size());
  std::memcpy(message, text.data(), n);
  message[n] = '\0';
}

}  // namespace

// Binds the draft head `handle` (q_register_draft_head) to the cache layer `cache` it attends
// over, with the RoPE tables and the attention's shape, for specdec_draft_head_start. Returns
// the binding's handle (released with q_release).
std::vector<paddle::Tensor> QBindDraftHead(const paddle::Tensor& handle, const paddle::Tensor& cache,
                                           const paddle::Tensor& cos, const paddle::Tensor& sin, int64_t heads,
                                           int64_t kv_heads, float eps) {
  const char* what = "q_bind_draft_head";
  auto binding = std::make_shared<DraftHeadBinding>();
  binding->head = draft_heads.find(handle, what);
  check_attention_layer(cache, cache, binding->head->layer.qkv.weight.rows, heads, kv_heads);
  PD_CHECK(cos.dtype() == paddle::DataType::FLOAT32 && sin.dtype() == paddle::DataType::FLOAT32 &&
               cos.shape() == sin.shape() && cos.shape().size() == 2 && cos.shape()[1] == cache.shape()[3],
           what, ": cos and sin must be float32 [positions, D]");
  binding->cache = cache;
  binding->cos = cos;
  binding->sin = sin;
  binding->heads = heads;
  binding->kv_heads = kv_heads;
  binding->eps = eps;
  return {handle_tensor(draft_head_bindings.add(std::move(binding)))};
}

// q_draft_head's work for a bound head, started on the pool's worker (the same computations in
// the same order, so the same floats: a loop's split into chunks never changes a result): rows
// `hidden` [T, hidden_cols] with one token id each, the cache layer's metadata `meta` (B rows of
// `meta_columns` int32, as the cpu attention backend packs it), into out [T, H] and logits
// [R, V] (rows `rows` of out through the LM head). Everything is checked here, on the caller;
// `ids`, `rows` and `meta` are copied, while `hidden`, `out` and `logits` must stay alive, and
// out and logits unread, until specdec_draft_head_finish(ticket) returns. `ticket`: the caller's
// number for the work, not in use. Returns 0, or 1 with the reason in `message`. A plain C
// function, called through ctypes: paddle's dispatch of an operator costs 100 us or more on the
// caches a forward pass has just flushed, as much as the head's own work.
extern "C" int specdec_draft_head_start(int64_t binding_handle, const float* hidden, int64_t T, int64_t hidden_cols,
                                        const int64_t* ids, const int64_t* rows, int64_t R, const int32_t* meta,
                                        int64_t B, int64_t meta_columns, float* out, float* logits, int64_t ticket,
                                        char* message, int64_t size) {
  try {
    const char* what = "draft_head_start";
    std::shared_ptr<const DraftHeadBinding> binding = draft_head_bindings.find(binding_handle, what);
    const DraftHead& head = *binding->head;
    PD_CHECK(T > 0 && hidden_cols == head.hidden_cols, what, ": hidden must be [T, ", head.hidden_cols, "]");
    for (int64_t t = 0; t < T; ++t) PD_CHECK(ids[t] >= 0 && ids[t] < head.table.rows, what, ": token id out of range");
    for (int64_t r = 0; r < R; ++r) PD_CHECK(rows[r] >= 0 && rows[r] < T, what, ": row out of range");
    auto batch = std::make_shared<const AttentionBatch>(
        read_attention_batch(meta, B, meta_columns, T, binding->cache, binding->cos));
    auto pending = std::make_unique<PendingDraftHead>();
    pending->task.fn = [binding, batch, hidden, out, logits, T, R, ids = std::vector<int64_t>(ids, ids + T),
                        rows = std::vector<int64_t>(rows, rows + R)] {
      draft_head_forward(*binding->head, *batch, hidden, T, ids.data(), rows.data(), R, binding->cache, binding->cos,
                         binding->sin, binding->heads, binding->kv_heads, binding->eps, out, logits);
    };
    specdec_cpu::BackgroundTask* task = &pending->task;
    {
      std::lock_guard<std::mutex> lock(pending_mutex);
      PD_CHECK(pending_heads.count(ticket) == 0, what, ": ticket ", ticket, " is in use");
      pending_heads[ticket] = std::move(pending);
    }
    specdec_cpu::WorkPool::get().start_background(task);
    return 0;
  } catch (const std::exception& e) {
    write_message(e.what(), message, size);
    return 1;
  }
}

// Waits for the draft head started with `ticket` (specdec_draft_head_start) and forgets it.
// Returns 0 when it ran, 1 when it failed (the reason in `message`), -1 for an unknown ticket.
extern "C" int specdec_draft_head_finish(int64_t ticket, char* message, int64_t size) {
  std::unique_ptr<PendingDraftHead> pending;
  {
    std::lock_guard<std::mutex> lock(pending_mutex);
    auto found = pending_heads.find(ticket);
    if (found == pending_heads.end()) return -1;
    pending = std::move(found->second);
    pending_heads.erase(found);
  }
  specdec_cpu::WorkPool::get().finish_background(&pending->task);
  if (pending->task.error.empty()) return 0;
  write_message(pending->task.error, message, size);
  return 1;
}

namespace {

// A whole model read once (q_register_model): its layer stack, the embedding table, the final
// norm's gain and the LM head.
struct ModelWeights {
  std::shared_ptr<const std::vector<StackLayer>> stack;
  QuantWeight embedding, lm_head;
  int64_t hidden;
  const float* final_norm;
};

Registry<ModelWeights> models;

}  // namespace

// Reads a model's ends once for q_forward, around the stack of q_register_layers (`stack`):
// the embedding table (data, layout), the final norm's gain [H] and the LM head (data,
// layout), which may be the embedding's tensors (tied). Returns its handle.
std::vector<paddle::Tensor> QRegisterModel(const paddle::Tensor& stack, const paddle::Tensor& table,
                                           const paddle::Tensor& table_layout, const paddle::Tensor& final_norm,
                                           const paddle::Tensor& head, const paddle::Tensor& head_layout) {
  const char* what = "q_register_model";
  auto model = std::make_shared<ModelWeights>();
  model->stack = stacks.find(stack, what);
  model->hidden = final_norm.numel();
  PD_CHECK(!model->stack->empty() && model->stack->front().tail.o.rows == model->hidden, what,
           ": final_norm must be [H]");
  model->final_norm = final_norm.data<float>();
  model->embedding = parse_weight(table, table_layout, model->hidden, what);
  model->lm_head = parse_weight(head, head_layout, model->hidden, what);
  return {handle_tensor(models.add(std::move(model)))};
}

// A quantized model's forward pass in one call: the embedding of `ids`, the first layer's
// q/k/v, every layer (q_decoder_layers' computations) and the final norm and LM head over the
// rows `logit_rows`. The same computations, in the same order, as q_embedding, q_matmul,
// q_decoder_layers and q_matmul (after a gather of the rows) called one by one: each call
// costs a paddle dispatch (15-30 us on a CPU) and the ids a host-to-tensor copy, together
// 0.2 ms, 8% of the default model's 1-row pass (2026-12-06, AMD Zen 5). Returns (the last
// layer's output [T, H], before the final norm; logits [len(logit_rows), V]).
std::vector<paddle::Tensor> QForward(const std::vector<paddle::Tensor>& caches, const paddle::Tensor& cos,
                                     const paddle::Tensor& sin, const paddle::Tensor& meta,
                                     const paddle::Tensor& handle, const std::vector<int64_t>& ids,
                                     const std::vector<int64_t>& logit_rows, int64_t heads, int64_t kv_heads,
                                     float eps) {
  const std::shared_ptr<const ModelWeights> model = models.find(handle, "q_forward");
  const int64_t T = static_cast<int64_t>(ids.size()), H = model->hidden;
  PD_CHECK(T > 0, "q_forward: no tokens");
  auto x = paddle::empty({T, H}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  embed_rows(model->embedding, ids.data(), T, H, x.data<float>(), "q_forward");
  const StackLayer& first = model->stack->front();
  auto qkv = paddle::empty({T, first.qkv.weight.rows}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  project(x.data<float>(), T, H, first.qkv.weight, first.qkv.epi, first.attn_gain, true, eps, qkv.data<float>());
  const paddle::Tensor out = run_layers(*model->stack, x, qkv, caches, cos, sin, meta, heads, kv_heads, eps,
                                        "q_forward");
  return {out, head_logits(out, logit_rows, model->lm_head, model->final_norm, eps, "q_forward")};
}

// Forgets what q_register_layers, q_register_draft_head or q_register_model read (its tensors
// may then be freed).
std::vector<paddle::Tensor> QRelease(const paddle::Tensor& handle) {
  PD_CHECK(handle.dtype() == paddle::DataType::INT64 && handle.numel() == 1, "q_release: bad handle");
  const int64_t id = handle.data<int64_t>()[0];
  PD_CHECK(stacks.erase(id) || draft_heads.erase(id) || models.erase(id) || draft_head_bindings.erase(id),
           "q_release: no such handle");
  return {handle};
}

PD_BUILD_OP(specdec_q_matmul)
    .Inputs({"X", "Gain", "W", "Layout", "Epilogue"})
    .Outputs({"Out"})
    .Attrs({"eps: float", "normalize: bool"})
    .SetKernelFn(PD_KERNEL(QMatmul));

PD_BUILD_OP(specdec_q_layer_tail)
    .Inputs({"Attn", "X", "Wo", "Lo", "Gain", "Wgu", "Lgu", "Wd", "Ld"})
    .Outputs({"Out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(QLayerTail));

PD_BUILD_OP(specdec_q_layer_tail_qkv)
    .Inputs({"Attn", "X", "Wo", "Lo", "Gain", "Wgu", "Lgu", "Wd", "Ld", "NextGain", "Wqkv", "Lqkv", "Epilogue"})
    .Outputs({"Out", "Qkv"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(QLayerTailQkv));

PD_BUILD_OP(specdec_q_register_layers)
    .Inputs({paddle::Vec("Layers")})
    .Outputs({"Handle"})
    .Attrs({"width: int64_t"})
    .SetKernelFn(PD_KERNEL(QRegisterLayers));

PD_BUILD_OP(specdec_q_release)
    .Inputs({"Handle"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(QRelease));

PD_BUILD_OP(specdec_q_register_draft_head)
    .Inputs({paddle::Vec("Operands")})
    .Outputs({"Handle"})
    .Attrs({"embed_cols: int64_t", "hidden_cols: int64_t", "width: int64_t"})
    .SetKernelFn(PD_KERNEL(QRegisterDraftHead));

PD_BUILD_OP(specdec_q_draft_head)
    .Inputs({"Hidden", "Cache", "Cos", "Sin", "Meta", "Handle"})
    .Outputs({"Out", "Logits"})
    .Attrs({"ids: std::vector<int64_t>", "rows: std::vector<int64_t>", "heads: int64_t", "kv_heads: int64_t",
            "eps: float"})
    .SetKernelFn(PD_KERNEL(QDraftHead));

PD_BUILD_OP(specdec_q_bind_draft_head)
    .Inputs({"Handle", "Cache", "Cos", "Sin"})
    .Outputs({"Binding"})
    .Attrs({"heads: int64_t", "kv_heads: int64_t", "eps: float"})
    .SetKernelFn(PD_KERNEL(QBindDraftHead));

PD_BUILD_OP(specdec_q_register_model)
    .Inputs({"Stack", "Table", "TableLayout", "FinalNorm", "Head", "HeadLayout"})
    .Outputs({"Handle"})
    .SetKernelFn(PD_KERNEL(QRegisterModel));

PD_BUILD_OP(specdec_q_forward)
    .Inputs({paddle::Vec("Caches"), "Cos", "Sin", "Meta", "Handle"})
    .Outputs({"Hidden", "Logits"})
    .Attrs({"ids: std::vector<int64_t>", "logit_rows: std::vector<int64_t>", "heads: int64_t", "kv_heads: int64_t",
            "eps: float"})
    .SetKernelFn(PD_KERNEL(QForward));

PD_BUILD_OP(specdec_q_decoder_layers)
    .Inputs({"X", "Qkv", paddle::Vec("Caches"), "Cos", "Sin", "Meta", "Handle"})
    .Outputs({"Out"})
    .Attrs({"heads: int64_t", "kv_heads: int64_t", "eps: float"})
    .SetKernelFn(PD_KERNEL(QDecoderLayers));

PD_BUILD_OP(specdec_q_draft_input)
    .Inputs({"Embeds", "Table", "TableLayout", "Hidden", "EmbedGain", "We", "Le", "HiddenGain", "Wh", "Lh", "AttnGain",
             "Wqkv", "Lqkv", "Epilogue"})
    .Outputs({"X", "Qkv"})
    .Attrs({"ids: std::vector<int64_t>", "embed_cols: int64_t", "eps: float", "normalize_embed: bool",
            "normalize_hidden: bool"})
    .SetKernelFn(PD_KERNEL(QDraftInput));

PD_BUILD_OP(specdec_q_layer_tail_head)
    .Inputs({"Attn", "X", "Wo", "Lo", "Gain", "Wgu", "Lgu", "Wd", "Ld", "HeadGain", "Wh", "Lh"})
    .Outputs({"Out", "Logits"})
    .Attrs({"rows: std::vector<int64_t>", "eps: float"})
    .SetKernelFn(PD_KERNEL(QLayerTailHead));

PD_BUILD_OP(specdec_q_embedding)
    .Inputs({"Ids", "W", "Layout"})
    .Outputs({"Out"})
    .Attrs({"cols: int64_t"})
    .SetKernelFn(PD_KERNEL(QEmbedding));
