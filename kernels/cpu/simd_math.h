// Vector math shared by the CPU kernels (AVX2 + FMA).
#pragma once

#include <immintrin.h>

#include <cstdlib>
#include <cstring>

namespace specdec_cpu {

// SPECDEC_CPU_ISA: "avx2" forces the portable kernels, "avx512" the AVX-512 VNNI ones without
// AMX tiles; unset (or anything else), the best the CPU has. Read at every call (an environment
// lookup: callers read it once a kernel call, not in inner loops), so a test can switch paths.
inline bool isa_is(const char* name) {
  const char* isa = std::getenv("SPECDEC_CPU_ISA");
  return isa != nullptr && std::strcmp(isa, name) == 0;
}

// SPECDEC_PREFETCH: "nta" prefetches the weights the quantized kernels stream non-temporally
// (only a Zen 5 gets it; elsewhere it cost up to 2.7x); unset or anything else ("l2"), into L2
// (T1 hint). Read once, when the library loads: specdec.kernels.cpu.load_cpu_ops sets it for
// the CPU before that (prefetch_hint_for says which CPU gets which, and why), so inner loops
// test a flag that never changes.
inline const bool kPrefetchNonTemporal = [] {
  const char* hint = std::getenv("SPECDEC_PREFETCH");
  return hint != nullptr && std::strcmp(hint, "nta") == 0;
}();

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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")
// exp8 on 16 lanes for the AVX-512 paths: the same operations lane by lane, so the same floats
// (keep the two in step).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// swiglu8 on 16 lanes (below): the same operations lane by lane, so the same floats.
inline __m512 swiglu16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}
#pragma GCC pop_options

// silu(g) * u = g / (1 + exp(-g)) * u
inline __m256 swiglu8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace specdec_cpu
