// Weight-only quantized CPU kernels, as paddle custom operators: the matmuls compute on GGML
// blocks as stored (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; quant_formats.h), never on a dequantized copy.
//
// Activations are quantized to int8 per 32 elements (scale = max|x| / 127, round to nearest
// even), as llama.cpp does, and each weight sub-block is multiplied with integer dot products:
// AVX2's maddubs + madd everywhere, AVX-512 VNNI's dpbusd where the CPU has it (chosen at run
// time; SPECDEC_CPU_ISA=avx2 forces the portable path). reference.py holds the numpy twins.
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
//   q_embedding(ids, w, layout, cols) -> [T, cols]: rows of a quantized table, dequantized
#include "paddle/extension.h"
#include "quant_formats.h"
#include "simd_math.h"
#include "work_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using specdec_cpu::Format;
using specdec_cpu::hsum8;
using specdec_cpu::SubBlock;
using specdec_cpu::swiglu8;
using specdec_cpu::with_format;
using specdec_cpu::WorkPool;

// Activation rows quantized to int8 in blocks of 32: q [M, K], and per block its scale d and
// the sum of its dequantized values (for formats with a min).
struct QuantizedRows {
  int64_t M = 0, K = 0, blocks = 0;
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const float* sum = nullptr;
  std::vector<int8_t> q_store;
  std::vector<float> d_store, sum_store;

  QuantizedRows(const float* x, int64_t rows, int64_t cols) : M(rows), K(cols), blocks(cols / 32) {
    q_store.resize(M * K);
    d_store.resize(M * blocks);
    sum_store.resize(M * blocks);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t j = 0; j < blocks; ++j) {
        const float* in = x + m * K + j * 32;
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(in[i]));
        const float scale = amax / 127.f;
        const float inverse = scale != 0.f ? 1.f / scale : 0.f;
        int8_t* out = q_store.data() + (m * blocks + j) * 32;
        int total = 0;
        for (int i = 0; i < 32; ++i) {
          out[i] = static_cast<int8_t>(std::nearbyint(in[i] * inverse));
          total += out[i];
        }
        d_store[m * blocks + j] = scale;
        sum_store[m * blocks + j] = scale * static_cast<float>(total);
      }
    }
    q = q_store.data();
    d = d_store.data();
    sum = sum_store.data();
  }
};

struct WeightSegment {
  int type;
  int64_t first_row, rows, row_bytes;
  const uint8_t* data;
};

struct QuantWeight {
  int64_t rows = 0;
  std::vector<WeightSegment> segments;
};

struct Epilogue {
  const float* scale = nullptr;
  const float* bias = nullptr;
  const float* residual = nullptr;  // [M, N], same layout as the output
};

int64_t block_elems(int type) {
  int64_t elems = 0;
  with_format(type, [&](auto format) { elems = decltype(format)::kElems; });
  return elems;
}

int64_t block_bytes(int type) {
  int64_t bytes = 0;
  with_format(type, [&](auto format) { bytes = decltype(format)::kBytes; });
  return bytes;
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
    PD_CHECK(K % elems == 0 && row_bytes == K / elems * block_bytes(type), what, ": rows of type ", type,
             " do not hold ", K, " elements");
    PD_CHECK(offset >= 0 && count >= 0 && offset + count * row_bytes <= data.numel(), what,
             ": segment beyond the data");
    w.segments.push_back({type, w.rows, count, row_bytes, base + offset});
    w.rows += count;
  }
  return w;
}

// The 8-lane int8 dot product of each instruction set: lane i = sum of a[4i..4i+3] * b[4i..4i+3],
// a unsigned, b signed.
struct Avx2Dot {
  static inline __m256i dot(__m256i a, __m256i b) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
  }
};

namespace avx2 {
using Dot = Avx2Dot;
#include "quant_matmul.inc"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
struct VnniDot {
  static inline __m256i dot(__m256i a, __m256i b) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b); }
};

namespace vnni {
using Dot = VnniDot;
#include "quant_matmul.inc"
}  // namespace vnni
#pragma GCC pop_options

bool use_vnni() {
  const char* isa = std::getenv("SPECDEC_CPU_ISA");
  if (isa != nullptr && std::strcmp(isa, "avx2") == 0) return false;
  static const bool supported = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bw");
  return supported;
}

void matmul(const float* x, int64_t M, int64_t K, const QuantWeight& w, const Epilogue& epi, float* out) {
  const QuantizedRows rows(x, M, K);
  if (use_vnni())
    vnni::matmul(rows, w, epi, out);
  else
    avx2::matmul(rows, w, epi, out);
}

// rms_norm(x) * gain, row by row.
std::vector<float> normalized(const float* x, int64_t M, int64_t K, const float* gain, float eps) {
  std::vector<float> h(M * K);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    double squares = 0;
    for (int64_t k = 0; k < K; ++k) squares += static_cast<double>(row[k]) * row[k];
    const float scale = 1.0f / std::sqrt(static_cast<float>(squares / K) + eps);
    for (int64_t k = 0; k < K; ++k) h[m * K + k] = row[k] * scale * (gain ? gain[k] : 1.f);
  }
  return h;
}

void check_rows(const paddle::Tensor& x, const char* what) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && x.shape().size() == 2, what, ": must be float32 [M, K]");
  PD_CHECK(x.shape()[1] % 32 == 0, what, ": the row length must be a multiple of 32");
}

}  // namespace

std::vector<paddle::Tensor> QMatmul(const paddle::Tensor& x, const paddle::Tensor& gain, const paddle::Tensor& w,
                                    const paddle::Tensor& layout, const paddle::Tensor& epilogue, float eps,
                                    bool normalize) {
  check_rows(x, "q_matmul: x");
  const int64_t M = x.shape()[0], K = x.shape()[1];
  const QuantWeight weight = parse_weight(w, layout, K, "q_matmul");
  Epilogue epi;
  if (epilogue.numel() > 0) {
    PD_CHECK(epilogue.numel() == 2 * weight.rows, "q_matmul: epilogue must be [2, N]");
    epi.scale = epilogue.data<float>();
    epi.bias = epi.scale + weight.rows;
  }
  if (normalize && gain.numel() > 0) PD_CHECK(gain.numel() == K, "q_matmul: gain must be [K]");
  auto out = paddle::empty({M, weight.rows}, paddle::DataType::FLOAT32, x.place());
  if (normalize) {
    const std::vector<float> h = normalized(x.data<float>(), M, K, gain.numel() > 0 ? gain.data<float>() : nullptr, eps);
    matmul(h.data(), M, K, weight, epi, out.data<float>());
  } else {
    matmul(x.data<float>(), M, K, weight, epi, out.data<float>());
  }
  return {out};
}

std::vector<paddle::Tensor> QLayerTail(const paddle::Tensor& attn, const paddle::Tensor& x, const paddle::Tensor& wo,
                                       const paddle::Tensor& lo, const paddle::Tensor& gain,
                                       const paddle::Tensor& wgu, const paddle::Tensor& lgu,
                                       const paddle::Tensor& wd, const paddle::Tensor& ld, float eps) {
  check_rows(attn, "q_layer_tail: attn");
  check_rows(x, "q_layer_tail: x");
  const int64_t M = x.shape()[0], H = x.shape()[1], A = attn.shape()[1];
  PD_CHECK(attn.shape()[0] == M, "q_layer_tail: attn and x rows differ");
  PD_CHECK(gain.numel() == H, "q_layer_tail: gain must be [H]");
  const QuantWeight o = parse_weight(wo, lo, A, "q_layer_tail: o");
  const QuantWeight gate_up = parse_weight(wgu, lgu, H, "q_layer_tail: gate_up");
  PD_CHECK(o.rows == H && gate_up.rows % 2 == 0, "q_layer_tail: weight shapes");
  const int64_t I = gate_up.rows / 2;
  PD_CHECK(I % 32 == 0, "q_layer_tail: the inner size must be a multiple of 32");
  const QuantWeight down = parse_weight(wd, ld, I, "q_layer_tail: down");
  PD_CHECK(down.rows == H, "q_layer_tail: down must have H rows");

  std::vector<float> x1(M * H);
  Epilogue residual;
  residual.residual = x.data<float>();
  matmul(attn.data<float>(), M, A, o, residual, x1.data());
  const std::vector<float> h = normalized(x1.data(), M, H, gain.data<float>(), eps);
  std::vector<float> both(M * 2 * I);
  matmul(h.data(), M, H, gate_up, Epilogue{}, both.data());
  std::vector<float> act(M * I);
  for (int64_t m = 0; m < M; ++m) {
    const float* g = both.data() + m * 2 * I;
    float* a = act.data() + m * I;
    for (int64_t i = 0; i < I; i += 8)
      _mm256_storeu_ps(a + i, swiglu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(g + I + i)));
  }
  auto out = paddle::empty({M, H}, paddle::DataType::FLOAT32, x.place());
  residual.residual = x1.data();
  matmul(act.data(), M, I, down, residual, out.data<float>());
  return {out};
}

std::vector<paddle::Tensor> QEmbedding(const paddle::Tensor& ids, const paddle::Tensor& w, const paddle::Tensor& layout,
                                       int64_t cols) {
  PD_CHECK(ids.dtype() == paddle::DataType::INT64, "q_embedding: ids must be int64");
  const QuantWeight table = parse_weight(w, layout, cols, "q_embedding");
  const int64_t T = ids.numel();
  const int64_t* id = ids.data<int64_t>();
  auto out = paddle::empty({T, cols}, paddle::DataType::FLOAT32, w.place());
  float* o = out.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    PD_CHECK(id[t] >= 0 && id[t] < table.rows, "q_embedding: token id out of range");
    for (const WeightSegment& seg : table.segments) {
      if (id[t] < seg.first_row || id[t] >= seg.first_row + seg.rows) continue;
      const uint8_t* row = seg.data + (id[t] - seg.first_row) * seg.row_bytes;
      with_format(seg.type, [&](auto format) {
        specdec_cpu::dequantize_row<decltype(format)>(row, cols, o + t * cols);
      });
    }
  }
  return {out};
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

PD_BUILD_OP(specdec_q_embedding)
    .Inputs({"Ids", "W", "Layout"})
    .Outputs({"Out"})
    .Attrs({"cols: int64_t"})
    .SetKernelFn(PD_KERNEL(QEmbedding));
