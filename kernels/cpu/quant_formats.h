// The GGML block formats the quantized kernels compute on as stored (the layouts of ggml's
// ggml-common.h), unpacked 32 elements at a time for integer dot products.
//
// A weight row of K elements is K / kElems blocks of kBytes each; a block unpacks into kSub
// sub-blocks of 32 elements. In a sub-block, element i is  scale[i / 4] * q[i] + min:  q holds
// 32 signed 8-bit values in element order and scale has one float per group of 4 elements (the
// groups an int8 dot product sums into one 32-bit lane), so that formats whose scales change
// every 16 elements (Q6_K) fit the same kernel.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace specdec_cpu {

// ggml's type ids (enum ggml_type), as GGUF files store them, and layouts of our own: Q4_0,
// Q4_1 and Q8_0 rows "split" (kQ4_0S, kQ4_1S, kQ8_0S): the same bytes as the row's stored
// blocks, moved so that a row is [the quants of every block][every d][every m (Q4_1)], all in
// block order. Two neighbouring Q4 blocks' nibbles (one Q8_0 block's int8s) then fill one
// 32-byte vector and eight blocks' scales one vector: nothing is dequantized or rounded.
// And the same formats "interleaved" (kQ4_0I, kQ4_1I, kQ8_0I) in groups of 16 rows: per block
// (Interleaved, below), the 16 rows' quants 4 bytes at a time, row after row, then their 16 d,
// then their 16 m (Q4_1): a 64-byte vector holds 4 bytes of each of the 16 rows, one lane a row,
// so that an int8 dot product against 4 activations (broadcast) advances 16 outputs at once.
// Q5_0 and Q5_1 interleave the same way (kQ5_0I, kQ5_1I), their fifth bits after the nibbles:
// each row's 32 bits of qh, one lane a row, reordered (Interleaved, below).
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kQ4_0S = 102, kQ4_1S = 103, kQ8_0S = 108,
  kQ4_0I = 202, kQ4_1I = 203, kQ5_0I = 206, kQ5_1I = 207, kQ8_0I = 208, kQ4_KI = 212, kQ6_KI = 214,
};

struct SubBlock {
  __m256i q;
  __m256 scale;
  float min;
};

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes -> 32 values: the low nibbles (elements 0..15), then the high nibbles (16..31).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

// The 32 bits at p (little-endian), one byte each: 0xFF where bit i is set, 0 where not (byte i
// of the result: bit i).
inline __m256i bytes_from_bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  // Byte i takes byte i / 8 of the word; OR-ing every bit but bit i % 8 leaves all ones exactly
  // where bit i was set.
  const __m256i bytes = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1));
}

// 16 nibble bytes and 32 fifth bits (qh, little-endian): the 32 5-bit values 0..31, element i
// = nibble i (low nibbles, then high nibbles) + 16 * bit i of qh.
inline __m256i fives32(const uint8_t* qs, const uint8_t* qh) {
  return _mm256_or_si256(nibbles16(qs), _mm256_and_si256(bytes_from_bits32(qh), _mm256_set1_epi8(0x10)));
}

// Q4_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <int Type>
struct Format;

// Q8_0: {half d; int8 q[32]}: d * q.
template <>
struct Format<kQ8_0> {
  static constexpr int kElems = 32, kBytes = 34, kSub = 1;
  static constexpr bool kHasMin = false;
  static inline void unpack(const uint8_t* b, SubBlock* out) {
    out[0] = {load32(b + 2), _mm256_set1_ps(half_at(b)), 0.f};
  }
};

// Q4_0: {half d; uint8 nibbles[16]}: d * (nibble - 8).
template <>
struct Format<kQ4_0> {
  static constexpr int kElems = 32, kBytes = 18, kSub = 1;
  static constexpr bool kHasMin = false;
  static inline void unpack(const uint8_t* b, SubBlock* out) {
    out[0] = {_mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8)), _mm256_set1_ps(half_at(b)), 0.f};
  }
};

// Q4_1: {half d; half m; uint8 nibbles[16]}: d * nibble + m.
template <>
struct Format<kQ4_1> {
  static constexpr int kElems = 32, kBytes = 20, kSub = 1;
  static constexpr bool kHasMin = true;
  static inline void unpack(const uint8_t* b, SubBlock* out) {
    out[0] = {nibbles16(b + 4), _mm256_set1_ps(half_at(b)), half_at(b + 2)};
  }
};

// Q5_0: {half d; uint8 qh[4]; uint8 nibbles[16]}: d * (nibble + 16 * bit - 16), bit i of qh
// (little-endian) the fifth bit of element i.
template <>
struct Format<kQ5_0> {
  static constexpr int kElems = 32, kBytes = 22, kSub = 1;
  static constexpr bool kHasMin = false;
  static inline void unpack(const uint8_t* b, SubBlock* out) {
    out[0] = {_mm256_sub_epi8(fives32(b + 6, b + 2), _mm256_set1_epi8(16)), _mm256_set1_ps(half_at(b)), 0.f};
  }
};

// Q5_1: {half d; half m; uint8 qh[4]; uint8 nibbles[16]}: d * (nibble + 16 * bit) + m.
template <>
struct Format<kQ5_1> {
  static constexpr int kElems = 32, kBytes = 24, kSub = 1;
  static constexpr bool kHasMin = true;
  static inline void unpack(const uint8_t* b, SubBlock* out) {
    out[0] = {fives32(b + 8, b + 4), _mm256_set1_ps(half_at(b)), half_at(b + 2)};
  }
};

// Bit j (0..7) of each byte of v at bit 4 (0x10), every other bit 0: the fifth bit of a Q5_K
// value (16-bit shifts, whose bits carried across bytes the mask drops).
inline __m256i fifth_bit(__m256i v, int j) {
  const __m256i moved = j <= 4 ? _mm256_slli_epi16(v, 4 - j) : _mm256_srli_epi16(v, j - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

// Q4_K (Five = false) and Q5_K sub-blocks: d * sc_j * q - dmin * m_j with Q4_K's 6-bit sc_j,
// m_j; 32 bytes of nibbles hold sub-blocks 2k (low nibbles) and 2k+1 (high nibbles); Q5_K
// adds a fifth bit, bit j of qh[l] for element l of sub-block j (ggml's dequantize_row_q5_K).
template <bool Five>
inline void unpack_k_nibbles(const uint8_t* b, SubBlock* out) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + (Five ? 48 : 16);
  const __m256i qh = Five ? load32(b + 16) : _mm256_setzero_si256();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int k = 0; k < 4; ++k) {
    const __m256i bytes = load32(qs + 32 * k);
    __m256i low = _mm256_and_si256(bytes, mask), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    if constexpr (Five) {
      low = _mm256_or_si256(low, fifth_bit(qh, 2 * k));
      high = _mm256_or_si256(high, fifth_bit(qh, 2 * k + 1));
    }
    int sc, m;
    scale_min_k4(2 * k, scales, &sc, &m);
    out[2 * k] = {low, _mm256_set1_ps(d * sc), -dmin * m};
    scale_min_k4(2 * k + 1, scales, &sc, &m);
    out[2 * k + 1] = {high, _mm256_set1_ps(d * sc), -dmin * m};
  }
}

// Q4_K: {half d; half dmin; uint8 scales[12]; uint8 nibbles[128]}: 8 sub-blocks of 32.
template <>
struct Format<kQ4_K> {
  static constexpr int kElems = 256, kBytes = 144, kSub = 8;
  static constexpr bool kHasMin = true;
  static inline void unpack(const uint8_t* b, SubBlock* out) { unpack_k_nibbles<false>(b, out); }
};

// Q5_K: {half d; half dmin; uint8 scales[12]; uint8 qh[32]; uint8 nibbles[128]}: Q4_K's
// sub-blocks with a fifth bit, values 0..31.
template <>
struct Format<kQ5_K> {
  static constexpr int kElems = 256, kBytes = 176, kSub = 8;
  static constexpr bool kHasMin = true;
  static inline void unpack(const uint8_t* b, SubBlock* out) { unpack_k_nibbles<true>(b, out); }
};

// The 256 6-bit values of a Q6_K super-block, unsigned (0..63), as 8 vectors of 32 in element
// order (the low 4 bits in ql, the high 2 in qh, as ggml's dequantize_row_q6_K reads them).
inline void q6k_values(const uint8_t* b, __m256i* q) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  for (int n = 0; n < 2; ++n) {
    const __m256i low0 = load32(ql + 64 * n), low1 = load32(ql + 64 * n + 32), high = load32(qh + 32 * n);
    q[4 * n] = _mm256_or_si256(_mm256_and_si256(low0, m4), _mm256_slli_epi16(_mm256_and_si256(high, m2), 4));
    q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(low1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2), m2), 4));
    q[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 4), m2), 4));
    q[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 6), m2), 4));
  }
}

// Q6_K: {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d}: 6-bit values, each
// d * scale * (q - 32) with a scale per 16 elements: sub-block s uses scales 2s and 2s + 1.
template <>
struct Format<kQ6_K> {
  static constexpr int kElems = 256, kBytes = 210, kSub = 8;
  static constexpr bool kHasMin = false;
  static inline void unpack(const uint8_t* b, SubBlock* out) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    __m256i q[8];
    q6k_values(b, q);
    for (int s = 0; s < 8; ++s)
      out[s] = {_mm256_sub_epi8(q[s], _mm256_set1_epi8(32)),
                _mm256_set_m128(_mm_set1_ps(d * sc[2 * s + 1]), _mm_set1_ps(d * sc[2 * s])), 0.f};
  }
};

// Split rows: K / 32 blocks, 16 + 2 (+ 2 with a min) bytes each, regrouped (see QType).
template <bool HasMin>
struct SplitQ4 {
  static constexpr int kElems = 32, kBytes = HasMin ? 20 : 18;
  // One row of K elements dequantized into out[0:K].
  static inline void dequantize_row(const uint8_t* row, int64_t K, float* out) {
    const int64_t blocks = K / 32;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* qs = row + 16 * b;
      const float d = half_at(row + 16 * blocks + 2 * b);
      const float m = HasMin ? half_at(row + 18 * blocks + 2 * b) : -8.f * d;
      for (int i = 0; i < 16; ++i) {
        out[32 * b + i] = d * (qs[i] & 0xF) + m;
        out[32 * b + 16 + i] = d * (qs[i] >> 4) + m;
      }
    }
  }
};

// Split Q8_0 rows: [32 int8 of every block][every d].
inline void dequantize_split_q8_row(const uint8_t* row, int64_t K, float* out) {
  const int64_t blocks = K / 32;
  const int8_t* q = reinterpret_cast<const int8_t*>(row);
  for (int64_t b = 0; b < blocks; ++b) {
    const float d = half_at(row + 32 * blocks + 2 * b);
    for (int i = 0; i < 32; ++i) out[32 * b + i] = d * q[32 * b + i];
  }
}

// Interleaved groups of 16 rows (see QType): per block of 32 elements, kQuantBytes of quants
// (chunk c of 64 bytes: bytes 4c..4c+3 of each row's block, row after row), for Q5 kHighBytes
// of fifth bits, 16 halves d, and for Q4_1 / Q5_1 16 halves m: kBlockBytes, 16 times the
// format's block. Q4 / Q5 byte i holds element i (low nibble) and element i + 16 (high
// nibble), as in ggml's blocks. A 64-byte chunk c unpacks into two vectors of 4 elements a
// row: w[c] (low nibbles: elements 4c..4c+3) and w[4 + c] (high: 16 + 4c..16 + 4c + 3), so
// vector t holds elements 4t + i (i = 0..3) of each row. Q5's fifth bits: 4 bytes a row, row
// after row, reordered so that bit t of byte i is the fifth bit of element 4t + i (qh bit 4t + i
// in ggml's order): vector t's fifth bits are then bit t of every byte, one shift and a mask
// (fifth_bits) away from bit 4.
template <int Type>
struct Interleaved {
  static constexpr bool kQ8 = Type == kQ8_0I, kQ5 = Type == kQ5_0I || Type == kQ5_1I;
  static constexpr bool kHasMin = Type == kQ4_1I || Type == kQ5_1I;
  static constexpr int kQuantBytes = kQ8 ? 512 : 256;
  static constexpr int kHighBytes = kQ5 ? 64 : 0;
  static constexpr int kScaleBytes = kQuantBytes + kHighBytes;  // where the 16 d start
  static constexpr int kBlockBytes = kScaleBytes + (kHasMin ? 64 : 32);
  // What a value without a min is offset by, in steps of d: Q4_0's -8, Q5_0's -16.
  static constexpr float kOffset = kQ8 ? 0.f : (kQ5 ? -16.f : -8.f);
  // Row `lane` (0..15) of a group of K-element rows dequantized into out[0:K].
  static inline void dequantize_row(const uint8_t* group, int lane, int64_t K, float* out) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* block = group + b * kBlockBytes;
      const float d = half_at(block + kScaleBytes + 2 * lane);
      const float m = kHasMin ? half_at(block + kScaleBytes + 32 + 2 * lane) : kOffset * d;
      float* o = out + 32 * b;
      for (int c = 0; c < kQuantBytes / 64; ++c)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = block[64 * c + 4 * lane + i];
          if (kQ8) {
            o[4 * c + i] = d * static_cast<int8_t>(byte);
          } else {
            const int high = kQ5 ? block[kQuantBytes + 4 * lane + i] : 0;
            o[4 * c + i] = d * ((byte & 0xF) | (((high >> c) & 1) << 4)) + m;
            o[16 + 4 * c + i] = d * ((byte >> 4) | (((high >> (4 + c)) & 1) << 4)) + m;
          }
        }
    }
  }
};

// Q4_K interleaved in groups of 16 rows (kQ4_KI): per super-block of 256 elements, 2304 bytes
// (16 times Q4_K's 144): the 16 rows' 128 bytes of nibbles 4 bytes at a time (chunk c of 64
// bytes: bytes 4c..4c+3 of every row, row after row; so a 64-byte vector holds one row per
// 32-bit lane), then the 16 rows' 12 bytes of 6-bit scales and mins as three 32-bit words (word
// w of every row, row after row: 3 x 64 bytes), then the 16 d, then the 16 dmin. Chunk c =
// 8p + t holds, in its low nibbles, elements 64p + 4t..4t+3 of each row (sub-block 2p), in its
// high nibbles elements 64p + 32 + 4t.. (sub-block 2p + 1), as ggml's nibble bytes do.
struct InterleavedQ4K {
  static constexpr int kQuantBytes = 2048, kScaleWords = 2048, kD = 2240, kDmin = 2272, kBlockBytes = 2304;
  // Row `lane` (0..15)'s stored Q4_K block of super-block `b` of the group, into block[144].
  static inline void gather_block(const uint8_t* group, int lane, int64_t b, uint8_t* block) {
    const uint8_t* g = group + b * kBlockBytes;
    std::memcpy(block, g + kD + 2 * lane, 2);
    std::memcpy(block + 2, g + kDmin + 2 * lane, 2);
    for (int w = 0; w < 3; ++w) std::memcpy(block + 4 + 4 * w, g + kScaleWords + 64 * w + 4 * lane, 4);
    for (int c = 0; c < 32; ++c) std::memcpy(block + 16 + 4 * c, g + 64 * c + 4 * lane, 4);
  }
};

// Q6_K interleaved in groups of 16 rows (kQ6_KI): per super-block of 256 elements, 3360 bytes
// (16 times Q6_K's 210): the 16 rows' 128 bytes of low nibbles (ql) 4 bytes at a time (chunk c
// of 64 bytes: bytes 4c..4c+3 of every row, row after row), then their 64 bytes of high bits
// (qh) the same way, their 16 int8 scales as four 32-bit words (word w of every row, row after
// row), then the 16 d. As ggml's bytes: ql chunk 16n + 8h + u holds elements 128n + 32h + 4u..
// (low nibbles) and 128n + 64 + 32h + 4u.. (high nibbles); qh chunk 8n + u holds, in bit pairs
// 0-1, 2-3, 4-5, 6-7, the high bits of elements 128n + 4u.., +32, +64, +96; element e has scale e / 16.
struct InterleavedQ6K {
  static constexpr int kQh = 2048, kScaleWords = 3072, kD = 3328, kBlockBytes = 3360;
  // Row `lane` (0..15)'s stored Q6_K block of super-block `b` of the group, into block[210].
  static inline void gather_block(const uint8_t* group, int lane, int64_t b, uint8_t* block) {
    const uint8_t* g = group + b * kBlockBytes;
    for (int c = 0; c < 32; ++c) std::memcpy(block + 4 * c, g + 64 * c + 4 * lane, 4);
    for (int c = 0; c < 16; ++c) std::memcpy(block + 128 + 4 * c, g + kQh + 64 * c + 4 * lane, 4);
    for (int w = 0; w < 4; ++w) std::memcpy(block + 192 + 4 * w, g + kScaleWords + 64 * w + 4 * lane, 4);
    std::memcpy(block + 208, g + kD + 2 * lane, 2);
  }
  // The inverse: row `lane`'s stored Q6_K block (block[210]) into super-block `b` of the group.
  static inline void scatter_block(const uint8_t* block, int lane, int64_t b, uint8_t* group) {
    uint8_t* g = group + b * kBlockBytes;
    for (int c = 0; c < 32; ++c) std::memcpy(g + 64 * c + 4 * lane, block + 4 * c, 4);
    for (int c = 0; c < 16; ++c) std::memcpy(g + kQh + 64 * c + 4 * lane, block + 128 + 4 * c, 4);
    for (int w = 0; w < 4; ++w) std::memcpy(g + kScaleWords + 64 * w + 4 * lane, block + 192 + 4 * w, 4);
    std::memcpy(g + kD + 2 * lane, block + 208, 2);
  }
};

// Calls fn(Format<T>{}) for the format of `type`; false if the type is not one of these.
template <typename Fn>
inline bool with_format(int type, Fn&& fn) {
  switch (type) {
    case kQ4_0: fn(Format<kQ4_0>{}); return true;
    case kQ4_1: fn(Format<kQ4_1>{}); return true;
    case kQ5_0: fn(Format<kQ5_0>{}); return true;
    case kQ5_1: fn(Format<kQ5_1>{}); return true;
    case kQ8_0: fn(Format<kQ8_0>{}); return true;
    case kQ4_K: fn(Format<kQ4_K>{}); return true;
    case kQ5_K: fn(Format<kQ5_K>{}); return true;
    case kQ6_K: fn(Format<kQ6_K>{}); return true;
    default: return false;
  }
}

// One row of K elements of a weight in format F, dequantized into out[0:K].
template <typename F>
inline void dequantize_row(const uint8_t* row, int64_t K, float* out) {
  SubBlock sub[F::kSub];
  alignas(32) int8_t q[32];
  alignas(32) float scale[8];
  for (int64_t b = 0; b < K / F::kElems; ++b) {
    F::unpack(row + b * F::kBytes, sub);
    for (int s = 0; s < F::kSub; ++s) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), sub[s].q);
      _mm256_store_ps(scale, sub[s].scale);
      float* o = out + b * F::kElems + s * 32;
      for (int i = 0; i < 32; ++i) o[i] = scale[i / 4] * q[i] + sub[s].min;
    }
  }
}

}  // namespace specdec_cpu
