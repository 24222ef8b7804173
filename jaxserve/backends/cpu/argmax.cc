// Greedy sampling's reduction on the CPU as an XLA FFI custom call:
//
//   Argmax  x f32[R, V] -> (ids i32[R], max f32[R])   the lowest index among equal maxima
//
// XLA's CPU top_k(x, 1) and argmax take many times longer than the one read of the logits the
// reduction needs (a large batch's logits are tens of MB, every greedy step): this reads each
// row once with 16 (AVX-512) or 8 (AVX2) running (max, index) lanes and runs rows in parallel.

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The lanes' (max, index) pairs -> the maximum and its lowest index.
inline void ReduceLanes(const float* m, const int32_t* k, int lanes, float* best,
                        int64_t* best_i) {
  *best = m[0];
  *best_i = k[0];
  for (int l = 1; l < lanes; ++l) {
    if (m[l] > *best || (m[l] == *best && k[l] < *best_i)) {
      *best = m[l];
      *best_i = k[l];
    }
  }
}

// Each lane keeps its first strict maximum; ties across lanes go to the lower index.
void ArgmaxRow(const float* x, int64_t n, int32_t* id, float* value) {
  int64_t i = 0;
  float best = -__builtin_inff();
  int64_t best_i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vmax = _mm512_loadu_ps(x);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = _mm512_add_epi32(vidx, _mm512_set1_epi32(16));
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
      cur = _mm512_add_epi32(cur, step);
    }
    alignas(64) float m[16];
    alignas(64) int32_t k[16];
    _mm512_store_ps(m, vmax);
    _mm512_store_si512(k, vidx);
    ReduceLanes(m, k, 16, &best, &best_i);
  }
#elif defined(__AVX2__)
  // 8 lanes, the comparison as a lane mask that blends values and indices (the compiler leaves
  // the scalar loop below, which carries an index with its maximum, scalar).
  if (n >= 8) {
    __m256 vmax = _mm256_loadu_ps(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = _mm256_add_epi32(vidx, _mm256_set1_epi32(8));
    const __m256i step = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
      vmax = _mm256_blendv_ps(vmax, v, gt);
      vidx = _mm256_blendv_epi8(vidx, cur, _mm256_castps_si256(gt));
      cur = _mm256_add_epi32(cur, step);
    }
    alignas(32) float m[8];
    alignas(32) int32_t k[8];
    _mm256_store_ps(m, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(k), vidx);
    ReduceLanes(m, k, 8, &best, &best_i);
  }
#endif
  for (; i < n; ++i) {
    if (x[i] > best) {
      best = x[i];
      best_i = i;
    }
  }
  *id = static_cast<int32_t>(best_i);
  *value = best;
}

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> ids,
                  ffi::ResultBuffer<ffi::F32> values) {
  const auto d = x.dimensions();
  if (d.size() != 2 || d[1] == 0 || ids->element_count() != static_cast<size_t>(d[0]) ||
      values->element_count() != static_cast<size_t>(d[0])) {
    return ffi::Error::InvalidArgument("argmax: x [R, V > 0] -> ids [R], values [R]");
  }
  const int64_t rows = d[0], n = d[1];
  const float* xp = x.typed_data();
  int32_t* ip = ids->typed_data();
  float* vp = values->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A row is ~200 KB: below a few rows handing work to another thread costs more than it saves.
  const int64_t num_chunks = rows < 4 ? 1 : std::min(rows, 4 * threads);
  const int64_t per = (rows + num_chunks - 1) / num_chunks;
  jaxserve::RunChunks(pool, num_chunks, [=](int64_t c) {
    for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
      ArgmaxRow(xp + r * n, n, ip + r, vp + r);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveArgmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
