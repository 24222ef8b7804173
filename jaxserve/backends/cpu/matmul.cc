// The CPU backend's matmuls, as XLA FFI custom calls, against weights packed in column panels:
//
//   MatmulF32    y f32[M, N] = x f32[M, K] @ W                     w f32[P, K, 48]
//   MatmulInt8   y f32[M, N] = x f32[M, K] @ (Q * scale + offset)   q i8[P, K, 48],
//                scale, offset f16[P, K / 32, 48]: one of each per 32 k of each column
//   MatmulInt4   as MatmulInt8 for levels Q in 0..15 (GGUF Q4_1 blocks), two a byte:
//                q u8[P, K / 2, 48], byte [p, i, c] = Q[2 i, c] | Q[2 i + 1, c] << 4
//
// The panels and the tiles that multiply them are panel_gemm.h's; this file splits a matmul's
// panels (or, at many rows, its rows) over the threads.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "panel_gemm.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve::panel_gemm;  // NOLINT: the tiles' vocabulary

// From this many rows a thread on, f32 matmuls split the rows over the threads, not the panels,
// and broadcast from packed rows (PackRows). Every thread then streams all the weights, which
// pays only where enough rows reuse each panel; below this the shared stream of a panel split
// costs less (the threshold is measured: scripts/bench_matmul.py, docs/performance-history.md).
// It is the packed rows that make the row split pay: split without packing, it gained nothing.
constexpr int64_t kSplitRowsPerThread = 48;

// y = x @ w (int8: w dequantized by scale and offset) over the pool, a chunk of panels at a time.
// `work` is rows x weight bytes: under 256 KB of it, handing work to another thread costs more
// than it saves.
template <typename W>
void RunMatmul(ffi::ThreadPool& pool, const float* x, const W* w, const uint16_t* scale,
               const uint16_t* offset, float* y, int64_t m, int64_t k_dim, int64_t n_dim) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t work = m * k_dim * n_dim * static_cast<int64_t>(sizeof(W)) / kPerByte<W>;
  const int64_t num_chunks = work < (256 << 10) ? 1 : std::min(panels, threads);
  // Whole tiles per chunk: panels in pairs where a tile reads two.
  const int64_t pair = PanelsPerTile(m);
  if (sizeof(W) == 4 && m >= kSplitRowsPerThread * threads && num_chunks > 1) {
    // Many rows: each thread takes a run of row tiles over every panel and packs its rows
    // first (PackRows). Every thread then streams all the weights, which only pays where
    // there are rows enough to reuse each panel.
    const int64_t tiles = (m + kRowTile - 1) / kRowTile;
    const int64_t chunks = std::min(threads, tiles);
    jaxserve::RunChunks(pool, chunks, [=](int64_t chunk) {
      const int64_t r0 = chunk * tiles / chunks * kRowTile;
      const int64_t r1 = std::min(m, (chunk + 1) * tiles / chunks * kRowTile);
      thread_local std::vector<float> packed;
      packed.resize((r1 - r0 + kRowTile - 1) / kRowTile * kRowTile * k_dim);
      PackRows(x + r0 * k_dim, r1 - r0, k_dim, packed.data());
      PanelRows<W, true>(packed.data(), r1 - r0, k_dim, w, panels, nullptr, nullptr, nullptr,
                         y + r0 * n_dim, n_dim, n_dim);
    });
    return;
  }
  const int64_t per = ((panels + num_chunks - 1) / num_chunks + pair - 1) / pair * pair;
  // Int8 up to a row tile: x's group sums, for the tiles that scale and offset group sums.
  std::vector<float> xsum(sizeof(W) == 1 && m <= kRowTile ? m * k_dim / kGroup : 0);
  GroupSums(x, static_cast<int64_t>(xsum.size()), xsum.data());
  jaxserve::RunChunks(pool, num_chunks, [=, &xsum](int64_t chunk) {
    PanelRange<W>(x, m, k_dim, w, scale, offset, xsum.empty() ? nullptr : xsum.data(),
                  chunk * per, std::min(panels, (chunk + 1) * per), y, n_dim);
  });
}

// Checks x [M, K], w [P, K / per_byte, 48] and y [M, N] with 48 (P - 1) < N <= 48 P.
ffi::Error CheckShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                       ffi::Span<const int64_t> yd, int64_t per_byte = 1) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel ||
      xd[1] != wd[1] * per_byte || yd[0] != xd[0] || yd[1] > wd[0] * kPanel ||
      yd[1] <= (wd[0] - 1) * kPanel) {
    return ffi::Error::InvalidArgument("matmul: x [M, K] @ w [P, K, 48] (4-bit: [P, K / 2, 48]) -> y [M, N], 48 (P - 1) < N <= 48 P");
  }
  return ffi::Error::Success();
}

ffi::Error MatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), y->dimensions()); e.failure()) return e;
  const auto xd = x.dimensions();
  RunMatmul<float>(pool, x.typed_data(), w.typed_data(), nullptr, nullptr, y->typed_data(), xd[0],
                   xd[1], y->dimensions()[1]);
  return ffi::Error::Success();
}

// Int8 (S8: int8_t levels) or 4-bit levels (U8: uint8_t, two a byte) with their group scales
// and offsets.
template <ffi::DataType kType>
ffi::Error MatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kType> q,
                         ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> offset,
                         ffi::ResultBuffer<ffi::F32> y) {
  using W = ffi::NativeType<kType>;
  const auto xd = x.dimensions(), qd = q.dimensions();
  if (auto e = CheckShapes(xd, qd, y->dimensions(), kPerByte<W>); e.failure()) return e;
  for (const auto& d : {scale.dimensions(), offset.dimensions()}) {
    if (xd[1] % kGroup != 0 || d.size() != 3 || d[0] != qd[0] || d[1] != xd[1] / kGroup ||
        d[2] != kPanel) {
      return ffi::Error::InvalidArgument("matmul: scale, offset [P, K / 32, 48] for q of K k");
    }
  }
  RunMatmul<W>(pool, x.typed_data(), q.typed_data(), scale.typed_data(), offset.typed_data(),
               y->typed_data(), xd[0], xd[1], y->dimensions()[1]);
  return ffi::Error::Success();
}

// The grouped matmuls' arguments: x, the levels of kType, their scales and offsets.
template <ffi::DataType kType>
auto BindGrouped() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<kType>>()
      .template Arg<ffi::Buffer<ffi::F16>>()  // scales
      .template Arg<ffi::Buffer<ffi::F16>>()  // offsets
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulF32, MatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulInt8, MatmulGrouped<ffi::S8>, BindGrouped<ffi::S8>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulInt4, MatmulGrouped<ffi::U8>, BindGrouped<ffi::U8>());
