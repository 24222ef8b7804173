// The matmul's SIMD vocabulary per instruction set: a vector of float32 lanes (16 on AVX-512,
// 8 on AVX2+FMA, a portable 16-lane struct elsewhere), its loads (float32; int8, 4-bit levels
// and float16 widened), broadcasts, FMAs, partial loads and stores, and prefetches.

#ifndef JAXSERVE_CPU_VEC_H_
#define JAXSERVE_CPU_VEC_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace jaxserve::vec {

// An IEEE half's value (the int8 scales and offsets are float16; finite by quantize.py).
inline float HalfToFloat(uint16_t h) {
  const int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  const float v = std::ldexp(static_cast<float>(exponent == 0 ? mantissa : mantissa | 0x400),
                             std::max(exponent, 1) - 25);
  return (h & 0x8000) != 0 ? -v : v;
}

#if defined(__AVX512F__)
// 16 lanes of float32 (GCC's generic vectors turned the int8 widening into scalar code).
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec LoadHalf(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 bytes of 4-bit levels: their low nibbles (one k) into lo, their high nibbles (the next) into hi.
inline void LoadNibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline Vec Broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline __mmask16 Lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}
// The first n (<= 16) lanes; masked-off lanes are neither read nor written.
inline Vec LoadFirst(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(Lanes(n), p); }
inline void StoreFirst(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, Lanes(n), v); }
#elif defined(__AVX2__) && defined(__FMA__)
// 8 lanes of float32 in 16 registers (AMD Zen, Intel before AVX-512).
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Load(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
inline Vec LoadHalf(const uint16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float v[8];
  for (int i = 0; i < 8; ++i) v[i] = HalfToFloat(p[i]);
  return _mm256_load_ps(v);
#endif
}
// 8 bytes of 4-bit levels: their low nibbles (one k) into lo, their high nibbles (the next) into hi.
inline void LoadNibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline Vec Broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256i Lanes(int64_t n) {
  const int32_t k = static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// The first n (<= 8) lanes; masked-off lanes are neither read nor written.
inline Vec LoadFirst(const float* p, int64_t n) { return _mm256_maskload_ps(p, Lanes(n)); }
inline void StoreFirst(float* p, Vec v, int64_t n) { _mm256_maskstore_ps(p, Lanes(n), v); }
#else
// Portable 16 lanes (correct everywhere; fast only where the compiler vectorises it).
constexpr int kLanes = 16;
struct Vec {
  float v[16];
};
inline Vec Zero() { return Vec{}; }
template <typename T>
inline Vec Load(const T* p) {
  Vec r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline Vec LoadHalf(const uint16_t* p) {
  Vec r;
  for (int i = 0; i < 16; ++i) r.v[i] = HalfToFloat(p[i]);
  return r;
}
inline void LoadNibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  for (int i = 0; i < 16; ++i) lo.v[i] = p[i] & 15, hi.v[i] = p[i] >> 4;
}
inline Vec Broadcast(float x) {
  Vec r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
inline Vec Fma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < 16; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline Vec LoadFirst(const float* p, int64_t n) {
  Vec r{};
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) r.v[i] = p[i];
  return r;
}
inline void StoreFirst(float* p, Vec v, int64_t n) {
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) p[i] = v.v[i];
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
template <typename W>
inline void Prefetch(const W* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}
inline void PrefetchL2(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
#else
template <typename W>
inline void Prefetch(const W*) {}
inline void PrefetchL2(const char*) {}
#endif

}  // namespace jaxserve::vec

#endif  // JAXSERVE_CPU_VEC_H_
