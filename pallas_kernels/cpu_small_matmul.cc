// Matmuls of a few rows (single-stream and small-batch decode) as XLA FFI custom calls, with
// weights stored [out, in] so that each output is one contiguous dot product:
//
//   SmallMatmulF32       y f32[M, N] = x f32[M, K] @ w f32[N, K]^T
//   SmallMatmulInt8      y f32[M, N] = (x f32[M, K] @ q i8[N, K]^T) * scale f32[N]
//
// At a few rows a step's time is the time to stream its weights. XLA's CPU dot read SmolLM2's
// 30 layers of f32 projections in 18.8 ms at one row and 39 at eight (these kernels: 14.8 and
// 28.9); for int8 at more than one row it converts the whole weight to a float32 copy first
// (over 100 ms), where these convert each weight in registers, once for all rows. Output
// columns are split over XLA's intra-op thread pool.

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
// 16 lanes of float32: AVX-512 intrinsics (GCC's generic vectors turned the int8 widening into
// scalar code).
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
// Portable 16 lanes (correct everywhere; fast only where the compiler vectorises it).
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
inline Vec Fma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < 16; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline float Sum(Vec a) {
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += a.v[i];
  return s;
}
#endif

// Columns [n, n + kC) of (x @ w^T) * scale for w [N, K] (float or int8) and kM rows of x:
// each weight is converted once and used by all kM rows; kM * kC accumulators of 16 lanes
// stay in registers.
template <int kM, int kC, typename W>
inline void DotBlock(const float* x, const W* w, const float* scale, float* y, int64_t k_dim,
                     int64_t n_dim, int64_t n) {
  const int64_t k_vec = k_dim / 16 * 16;
  Vec acc[kM][kC];
  for (int m = 0; m < kM; ++m) {
    for (int c = 0; c < kC; ++c) acc[m][c] = Zero();
  }
  for (int64_t k = 0; k < k_vec; k += 16) {
    Vec wv[kC];
    for (int c = 0; c < kC; ++c) wv[c] = Load(w + (n + c) * k_dim + k);
    for (int m = 0; m < kM; ++m) {
      const Vec xv = Load(x + m * k_dim + k);
      for (int c = 0; c < kC; ++c) acc[m][c] = Fma(xv, wv[c], acc[m][c]);
    }
  }
  for (int m = 0; m < kM; ++m) {
    for (int c = 0; c < kC; ++c) {
      float s = Sum(acc[m][c]);
      for (int64_t k = k_vec; k < k_dim; ++k) {
        s += x[m * k_dim + k] * static_cast<float>(w[(n + c) * k_dim + k]);
      }
      y[m * n_dim + n + c] = scale != nullptr ? s * scale[n + c] : s;
    }
  }
}

template <int kM, typename W>
void DotColumns(const float* x, const W* w, const float* scale, float* y, int64_t k_dim,
                int64_t n_dim, int64_t n0, int64_t n1) {
  constexpr int kC = kM >= 8 ? 1 : 8 / kM;
  int64_t n = n0;
  for (; n + kC <= n1; n += kC) DotBlock<kM, kC>(x, w, scale, y, k_dim, n_dim, n);
  for (; n < n1; ++n) DotBlock<kM, 1>(x, w, scale, y, k_dim, n_dim, n);
}

// Runs fn(n0, n1) over column chunks (multiples of 16) on the caller and the pool's threads.
// `work` is rows x weight bytes: under 256 KB of it, handing work to another thread costs more
// than it saves.
template <typename F>
void ForColumns(ffi::ThreadPool& pool, int64_t n_dim, int64_t work, F fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t num_chunks = work < (256 << 10) ? 1 : std::min<int64_t>(2 * threads, n_dim / 16);
  if (num_chunks <= 1) {
    fn(0, n_dim);
    return;
  }
  const int64_t per = (n_dim / num_chunks + 15) / 16 * 16;
  jaxserve::RunChunks(pool, num_chunks, [fn, per, n_dim, num_chunks](int64_t c) {
    const int64_t n0 = std::min(n_dim, c * per);
    const int64_t n1 = c + 1 == num_chunks ? n_dim : std::min(n_dim, (c + 1) * per);
    if (n0 < n1) fn(n0, n1);
  });
}

constexpr int64_t kBlockRows = 8;

// Calls body.template operator()<kM>() for the compile-time row count M (1..kBlockRows).
template <typename Body>
void DispatchRows(int64_t m, Body body) {
  switch (m) {
    case 1: body.template operator()<1>(); break;
    case 2: body.template operator()<2>(); break;
    case 3: body.template operator()<3>(); break;
    case 4: body.template operator()<4>(); break;
    case 5: body.template operator()<5>(); break;
    case 6: body.template operator()<6>(); break;
    case 7: body.template operator()<7>(); break;
    case 8: body.template operator()<8>(); break;
    default: break;
  }
}

// y = (x @ w^T) * scale (scale may be null) over the pool: row blocks of kBlockRows over column
// blocks of ~128 KB of weights, so the weights that later row blocks read again come from L2.
template <typename W>
void RunDot(ffi::ThreadPool& pool, const float* xp, const W* wp, const float* sp, float* yp,
            int64_t m, int64_t k, int64_t n) {
  ForColumns(pool, n, m * k * n * static_cast<int64_t>(sizeof(W)), [=](int64_t n0, int64_t n1) {
    const int64_t cols = std::max<int64_t>(16, (128 << 10) / (k * sizeof(W)) / 16 * 16);
    for (int64_t c0 = n0; c0 < n1; c0 += cols) {
      const int64_t c1 = std::min(n1, c0 + cols);
      for (int64_t r = 0; r < m; r += kBlockRows) {
        const float* xr = xp + r * k;
        float* yr = yp + r * n;
        DispatchRows(std::min(kBlockRows, m - r), [&]<int kM>() {
          DotColumns<kM, W>(xr, wp, sp, yr, k, n, c0, c1);
        });
      }
    }
  });
}

ffi::Error SmallMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("small matmul: x [M, K] @ w [N, K]^T");
  }
  RunDot<float>(pool, x.typed_data(), w.typed_data(), nullptr, y->typed_data(), xd[0], xd[1],
                wd[0]);
  return ffi::Error::Success();
}

ffi::Error SmallMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                           ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || xd[1] != qd[1] ||
      scale.element_count() != static_cast<size_t>(qd[0])) {
    return ffi::Error::InvalidArgument("small matmul: x [M, K] @ q [N, K]^T * scale [N]");
  }
  RunDot<int8_t>(pool, x.typed_data(), q.typed_data(), scale.typed_data(), y->typed_data(),
                 xd[0], xd[1], qd[0]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmulF32, SmallMatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmulInt8, SmallMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
