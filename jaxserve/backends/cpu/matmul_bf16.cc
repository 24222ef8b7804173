// The CPU backend's bfloat16 matmul on AMX tiles, as an XLA FFI custom call:
//
//   MatmulBf16        y f32[M, N] = bf16(x f32[M, K]) @ W      w bf16 bits u16[T, Kp / 2, 16, 2]
//   ExpertMatmulBf16  the same for a mixture's experts stacked u16[E, T, Kp / 2, 16, 2], the rows
//                     of x in groups (expert_matmul.cc's ExpertMatmulF32, on AMX tiles)
//
// Tile t holds output columns [16 t, 16 t + 16) of the [K, N] weight, zero past N and past K up
// to Kp (a multiple of 32), in the pair layout TDPBF16PS reads: row i of a 32-deep slice holds
// (W[2i][n], W[2i + 1][n]) for its 16 columns n. x is rounded to bf16 (nearest even) once per
// call into a zero-padded [Mp, Kp] copy laid out in A tiles; the products accumulate in f32. One
// instruction multiplies a 16 x 32 slice of x by a 32 x 16 slice of W, an order of magnitude
// more FLOPs a cycle than AVX-512 f32 FMAs (scripts/cpu_peaks.py measures both), so prompt
// tokens cost a fraction of the f32 kernel's time, and the half-size weights stream twice as
// fast.
//
// JaxserveAmxBf16Available() says whether this build has AMX and the kernel granted this
// process the tile state (Linux asks for it once per process with arch_prctl).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define JAXSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "expert_groups.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 16;   // output columns per weight tile
constexpr int64_t kDepth = 32;  // k per tile product
constexpr int64_t kRows = 16;   // rows of x per tile product
namespace expert_groups = jaxserve::expert_groups;

#if defined(JAXSERVE_AMX)
bool AmxGranted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: f32 accumulators for 2 x 2 blocks of 16 x 16; 4-5: two 16 x 32 slices of x;
// 6-7: two 32 x 16 slices of W. Every tile is 16 rows of 64 bytes.
void ConfigureTiles() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// x f32[m, k] -> bf16, rounded to nearest even, zero-padded to [mp, kp], in A tiles: the 16 x 32
// slice of row block b and k chunk c is the kilobyte at ((b * kp / 32) + c) * 512, so a tile
// load reads one contiguous kilobyte, not 16 lines a row apart (strided tile loads cost a large
// share of the time at prefill sizes). Writes rows [r0, r1) of the [mp, kp] copy.
void RoundRows(const float* x, int64_t m, int64_t k, uint16_t* out, int64_t kp, int64_t r0,
               int64_t r1) {
  const int64_t chunks = kp / kDepth;
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* row = out + (r / kRows) * chunks * kRows * kDepth + (r % kRows) * kDepth;
    const float* src = x + r * k;
    for (int64_t c = 0; c < kp; c += kDepth) {
      uint16_t* dst = row + (c / kDepth) * kRows * kDepth;
      if (r >= m) {
        _mm512_storeu_si512(dst, _mm512_setzero_si512());
        continue;
      }
      const __mmask16 lo = _cvtu32_mask16(c + 16 <= k ? 0xFFFF : c >= k ? 0 : (1u << (k - c)) - 1);
      const __mmask16 hi = _cvtu32_mask16(
          c + 32 <= k ? 0xFFFF : c + 16 >= k ? 0 : (1u << (k - c - 16)) - 1);
      const __m512 a = _mm512_maskz_loadu_ps(lo, src + c);
      const __m512 b = _mm512_maskz_loadu_ps(hi, src + c + 16);
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));  // a first, then b
    }
  }
}

// Copies the valid part of a block's accumulators (tmp: [row block][col tile][16][16]) to y.
void Store(const float* tmp, int64_t r, int64_t t0, int64_t m, int64_t n, bool two_rows,
           bool two_cols, float* y) {
  for (int rb = 0; rb < (two_rows ? 2 : 1); ++rb) {
    for (int cb = 0; cb < (two_cols ? 2 : 1); ++cb) {
      const float* acc = tmp + (2 * rb + cb) * 256;
      const int64_t col = (t0 + cb) * kCols, cols = std::min(kCols, n - col);
      for (int64_t i = 0; i < kRows && r + rb * kRows + i < m; ++i) {
        std::memcpy(y + (r + rb * kRows + i) * n + col, acc + i * kCols, cols * sizeof(float));
      }
    }
  }
}

// y[rows r.., columns of tiles t0 (and t0 + 1 if two)] for 16 or 32 rows of the rounded x:
// stored straight into y where the whole block is valid, else through tmp.
template <bool kTwoRows, bool kTwoCols>
void Block(const uint16_t* xb, int64_t kp, const uint16_t* w, int64_t t0, int64_t r,
           float* tmp, float* y, int64_t m, int64_t n) {
  _tile_zero(0);
  if constexpr (kTwoCols) _tile_zero(1);
  if constexpr (kTwoRows) _tile_zero(2);
  if constexpr (kTwoRows && kTwoCols) _tile_zero(3);
  const int64_t tile_elems = kp / 2 * kCols * 2;
  const uint16_t* w0 = w + t0 * tile_elems;
  const uint16_t* w1 = w0 + tile_elems;
  const uint16_t* x0 = xb + (r / kRows) * kp * kRows;  // row block r / 16, k chunk 0
  const uint16_t* x1 = x0 + kp * kRows;
  for (int64_t k = 0; k < kp; k += kDepth) {
    _tile_loadd(4, x0 + k * kRows, 64);
    _tile_loadd(6, w0 + k * kCols, 64);  // 16 pair rows of 16 columns x 2 from row k / 2
    if constexpr (kTwoRows) _tile_loadd(5, x1 + k * kRows, 64);
    if constexpr (kTwoCols) _tile_loadd(7, w1 + k * kCols, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kTwoCols) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRows) _tile_dpbf16ps(2, 5, 6);
    if constexpr (kTwoRows && kTwoCols) _tile_dpbf16ps(3, 5, 7);
  }
  constexpr int64_t rows = kTwoRows ? 2 * kRows : kRows, cols = kTwoCols ? 2 * kCols : kCols;
  if (r + rows <= m && t0 * kCols + cols <= n) {
    float* out = y + r * n + t0 * kCols;
    const int64_t stride = n * static_cast<int64_t>(sizeof(float));
    _tile_stored(0, out, stride);
    if constexpr (kTwoCols) _tile_stored(1, out + kCols, stride);
    if constexpr (kTwoRows) _tile_stored(2, out + kRows * n, stride);
    if constexpr (kTwoRows && kTwoCols) _tile_stored(3, out + kRows * n + kCols, stride);
    return;
  }
  _tile_stored(0, tmp, 64);
  if constexpr (kTwoCols) _tile_stored(1, tmp + 256, 64);
  if constexpr (kTwoRows) _tile_stored(2, tmp + 512, 64);
  if constexpr (kTwoRows && kTwoCols) _tile_stored(3, tmp + 768, 64);
  Store(tmp, r, t0, m, n, kTwoRows, kTwoCols, y);
}

void RunMatmul(ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* y, int64_t m,
               int64_t k, int64_t kp, int64_t n, int64_t tiles) {
  const int64_t mp = (m + kRows - 1) / kRows * kRows;
  thread_local std::vector<uint16_t> rounded;
  rounded.resize(mp * kp);
  uint16_t* xb = rounded.data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Rounding, split over the threads by row blocks where there are many rows (at prefill sizes
  // it is a visible share of a call on one core; at few rows the hand-off would cost more).
  const int64_t blocks = mp / kRows;
  const int64_t round_chunks = m < 64 ? 1 : std::min(blocks, threads);
  const int64_t blocks_per = (blocks + round_chunks - 1) / round_chunks;
  jaxserve::RunChunks(pool, round_chunks, [=](int64_t chunk) {
    RoundRows(x, m, k, xb, kp, std::min(mp, chunk * blocks_per * kRows),
              std::min(mp, (chunk + 1) * blocks_per * kRows));
  });
  // Column tiles in pairs, split over the threads (a chunk per thread: the pool is the cores).
  const int64_t pairs = (tiles + 1) / 2;
  const int64_t work = m * k * n * 2;
  const int64_t num_chunks = work < (256 << 10) ? 1 : std::min(pairs, threads);
  const int64_t per = (pairs + num_chunks - 1) / num_chunks;
  jaxserve::RunChunks(pool, num_chunks, [=](int64_t chunk) {
    const int64_t t_begin = chunk * per * 2, t_end = std::min(tiles, (chunk + 1) * per * 2);
    if (t_begin >= t_end) return;
    ConfigureTiles();
    alignas(64) float tmp[4 * 256];
    for (int64_t t = t_begin; t < t_end; t += 2) {
      const bool two_cols = t + 1 < t_end;
      for (int64_t r = 0; r < mp; r += 2 * kRows) {
        const bool two_rows = r + kRows < mp;
        if (two_rows && two_cols) Block<true, true>(xb, kp, w, t, r, tmp, y, m, n);
        else if (two_rows) Block<true, false>(xb, kp, w, t, r, tmp, y, m, n);
        else if (two_cols) Block<false, true>(xb, kp, w, t, r, tmp, y, m, n);
        else Block<false, false>(xb, kp, w, t, r, tmp, y, m, n);
      }
    }
    _tile_release();  // no tile state to save at the next context switch
  });
}

// A mixture of experts' grouped matmul (expert_matmul.cc's, for bfloat16 experts): the rows of
// x in groups, group e the next sizes[e] rows, times expert e's tiles (w + e * expert_elems);
// rows past the last group zero. Each group's rows are rounded into row blocks of their own, so
// a block never mixes two experts' rows, and only the experts with rows are read. The threads
// split the (group, pair of column tiles) visits by cost: a visit's row blocks plus 2 for
// streaming its tiles.
void RunExperts(ffi::ThreadPool& pool, const float* x, const uint16_t* w, const int32_t* sizes,
                int64_t experts, float* y, int64_t m, int64_t k, int64_t kp, int64_t n,
                int64_t tiles) {
  const std::vector<int64_t> start = expert_groups::Starts(sizes, experts);
  std::vector<int64_t> padded(experts + 1, 0);  // group e's first row in the rounded copy
  for (int64_t e = 0; e < experts; ++e) {
    padded[e + 1] = padded[e] + (sizes[e] + kRows - 1) / kRows * kRows;
  }
  std::memset(y + start[experts] * n, 0, (m - start[experts]) * n * sizeof(float));
  thread_local std::vector<uint16_t> rounded;
  rounded.resize(padded[experts] * kp);
  for (int64_t e = 0; e < experts; ++e) {
    RoundRows(x + start[e] * k, sizes[e], k, rounded.data() + padded[e] * kp, kp, 0,
              padded[e + 1] - padded[e]);
  }
  const int64_t pairs = (tiles + 1) / 2, expert_elems = tiles * kp * kCols;
  // A tile pair's visit: its row blocks, plus 2 for streaming the pair.
  const auto each = [&](int64_t e) { return (padded[e + 1] - padded[e]) / kRows + 2; };
  const int64_t cost = expert_groups::TotalCost(sizes, experts, pairs, each);
  if (cost == 0) return;
  const int64_t work = start[experts] * k * n * 2;
  const int64_t chunks = work < (256 << 10) ? 1 : std::max<int64_t>(1, pool.num_threads());
  const uint16_t* all = rounded.data();  // this thread's: the name is each thread's own
  jaxserve::RunChunks(pool, chunks, [&](int64_t chunk) {
    ConfigureTiles();
    alignas(64) float tmp[4 * 256];
    expert_groups::ChunkVisits(chunk, chunks, cost, sizes, experts, pairs, each,
                               [&](int64_t e, int64_t p0, int64_t p1) {
      const int64_t mp = padded[e + 1] - padded[e];
      const uint16_t* xb = all + padded[e] * kp;
      const uint16_t* we = w + e * expert_elems;
      float* ye = y + start[e] * n;
      for (int64_t t = 2 * p0; t < std::min(tiles, 2 * p1); t += 2) {
        const bool two_cols = t + 1 < tiles;
        for (int64_t r = 0; r < mp; r += 2 * kRows) {
          const bool two_rows = r + kRows < mp;
          if (two_rows && two_cols) Block<true, true>(xb, kp, we, t, r, tmp, ye, sizes[e], n);
          else if (two_rows) Block<true, false>(xb, kp, we, t, r, tmp, ye, sizes[e], n);
          else if (two_cols) Block<false, true>(xb, kp, we, t, r, tmp, ye, sizes[e], n);
          else Block<false, false>(xb, kp, we, t, r, tmp, ye, sizes[e], n);
        }
      }
    });
    _tile_release();
  });
}
#endif  // JAXSERVE_AMX

ffi::Error MatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2 || wd[2] != kCols || wd[3] != 2 ||
      (2 * wd[1]) % kDepth != 0 || xd[1] > 2 * wd[1] || yd[0] != xd[0] ||
      yd[1] > wd[0] * kCols || yd[1] <= (wd[0] - 1) * kCols) {
    return ffi::Error::InvalidArgument(
        "matmul_bf16: x [M, K] @ w [T, Kp / 2, 16, 2] -> y [M, N], K <= Kp, 32 | Kp, "
        "16 (T - 1) < N <= 16 T");
  }
#if defined(JAXSERVE_AMX)
  if (!AmxGranted()) return ffi::Error::Internal("matmul_bf16: AMX tile state not granted");
  RunMatmul(pool, x.typed_data(), w.typed_data(),
            y->typed_data(), xd[0], xd[1], 2 * wd[1], yd[1], wd[0]);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("matmul_bf16: built without AMX-BF16");
#endif
}

ffi::Error ExpertMatmulBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::U16> w, ffi::Buffer<ffi::S32> sizes,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 5 || yd.size() != 2 || wd[3] != kCols || wd[4] != 2 ||
      (2 * wd[2]) % kDepth != 0 || xd[1] > 2 * wd[2] || yd[0] != xd[0] ||
      yd[1] > wd[1] * kCols || yd[1] <= (wd[1] - 1) * kCols) {
    return ffi::Error::InvalidArgument(
        "expert_matmul_bf16: x [M, K], w [E, T, Kp / 2, 16, 2], sizes [E] -> y [M, N], "
        "K <= Kp, 32 | Kp, 16 (T - 1) < N <= 16 T");
  }
  if (auto e = expert_groups::Check(sizes, wd[0], xd[0], "expert_matmul_bf16");
      e.failure()) {
    return e;
  }
#if defined(JAXSERVE_AMX)
  if (!AmxGranted()) return ffi::Error::Internal("expert_matmul_bf16: AMX tile state not granted");
  RunExperts(pool, x.typed_data(), w.typed_data(), sizes.typed_data(), wd[0], y->typed_data(),
             xd[0], xd[1], 2 * wd[2], yd[1], wd[1]);
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("expert_matmul_bf16: built without AMX-BF16");
#endif
}

}  // namespace

extern "C" int JaxserveAmxBf16Available() {
#if defined(JAXSERVE_AMX)
  return AmxGranted() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulBf16, MatmulBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveExpertMatmulBf16, ExpertMatmulBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
