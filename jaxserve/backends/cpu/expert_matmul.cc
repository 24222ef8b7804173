// A mixture of experts' grouped matmul, as XLA FFI custom calls, against each expert's weight
// packed in column panels (panel_gemm.h), the experts stacked:
//
//   ExpertMatmulF32   y f32[M, N]: the rows of x f32[M, K] in groups, group g the next
//                     sizes[g] rows, each group's rows @ W[g]      w f32[E, P, K, 48]
//
// sizes i32[E]; rows past the last group are zero. Only the experts that have rows are read,
// each in place, once however many rows it has: a decode step's few (token, expert) pairs read
// their experts' weights and no others, where gathering them would copy each first. The
// threads split the (group, panel) visits evenly by their cost, a panel's stream plus its rows.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel_gemm.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve::panel_gemm;  // NOLINT: the tiles' vocabulary

// A (group, panel) visit costs its rows plus this many: streaming a panel from memory takes
// about as long as this many rows' FMAs on it.
constexpr int64_t kStreamRows = 4;

void RunExperts(ffi::ThreadPool& pool, const float* x, const float* w, const int32_t* sizes,
                int64_t experts, float* y, int64_t m, int64_t k_dim, int64_t n_dim) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  const int64_t expert_size = panels * PanelSize<float>(k_dim);  // one expert's weights
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) start[e + 1] = start[e] + sizes[e];
  std::memset(y + start[experts] * n_dim, 0, (m - start[experts]) * n_dim * sizeof(float));
  int64_t cost = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes[e] > 0) cost += panels * (sizes[e] + kStreamRows);
  }
  if (cost == 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t bytes = start[experts] * k_dim * n_dim * static_cast<int64_t>(sizeof(float));
  const int64_t chunks = bytes < (256 << 10) ? 1 : threads;  // as matmul.cc's RunMatmul
  // Chunk c takes the visits that start, counting cost in (group, panel) order, in
  // [c, c + 1) * cost / chunks: of each group a run of panels, or none.
  jaxserve::RunChunks(pool, chunks, [&](int64_t chunk) {
    const int64_t lo = chunk * cost / chunks, hi = (chunk + 1) * cost / chunks;
    int64_t before = 0;  // the cost of the visits before group e's
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t rows = sizes[e];
      if (rows <= 0) continue;
      // Group e's panels p whose visits start, at cost before + p * each, in [lo, hi).
      const int64_t each = rows + kStreamRows;
      const int64_t p0 = std::clamp<int64_t>((lo - before + each - 1) / each, 0, panels);
      const int64_t p1 = std::clamp<int64_t>((hi - before + each - 1) / each, 0, panels);
      before += panels * each;
      const int64_t r = start[e];
      PanelRange<float>(x + r * k_dim, rows, k_dim, w + e * expert_size, nullptr, nullptr,
                        nullptr, p0, p1, y + r * n_dim, n_dim);
    }
  });
}

// Checks x [M, K], w [E, P, K, 48], sizes [E] (each >= 0, their sum <= M) and
// y [M, N] with 48 (P - 1) < N <= 48 P.
ffi::Error CheckShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                       const ffi::Buffer<ffi::S32>& sizes, ffi::Span<const int64_t> yd) {
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2 || wd[3] != kPanel ||
      xd[1] != wd[2] || yd[0] != xd[0] || yd[1] > wd[1] * kPanel ||
      yd[1] <= (wd[1] - 1) * kPanel || sizes.dimensions().size() != 1 ||
      sizes.dimensions()[0] != wd[0]) {
    return ffi::Error::InvalidArgument(
        "expert_matmul: x [M, K], w [E, P, K, 48], sizes [E] -> y [M, N], "
        "48 (P - 1) < N <= 48 P");
  }
  int64_t rows = 0;
  for (int64_t e = 0; e < wd[0]; ++e) {
    if (sizes.typed_data()[e] < 0) {
      return ffi::Error::InvalidArgument("expert_matmul: a group size is negative");
    }
    rows += sizes.typed_data()[e];
  }
  if (rows > xd[0]) {
    return ffi::Error::InvalidArgument("expert_matmul: the group sizes sum past x's rows");
  }
  return ffi::Error::Success();
}

ffi::Error ExpertMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> sizes,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (auto e = CheckShapes(xd, wd, sizes, y->dimensions()); e.failure()) return e;
  RunExperts(pool, x.typed_data(), w.typed_data(), sizes.typed_data(), wd[0], y->typed_data(),
             xd[0], xd[1], y->dimensions()[1]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveExpertMatmulF32, ExpertMatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
