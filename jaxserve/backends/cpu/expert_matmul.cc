// A mixture of experts' grouped matmul, as XLA FFI custom calls, against each expert's weight
// packed in column panels (panel_gemm.h), the experts stacked:
//
//   ExpertMatmulF32   y f32[M, N]: the rows of x f32[M, K] in groups, group g the next
//                     sizes[g] rows, each group's rows @ W[g]      w f32[E, P, K, 48]
//   ExpertMatmulInt8  as F32 for W = Q * scale + offset             q i8[E, P, K, 48],
//                     scale, offset f16[E, P, K / 32, 48]
//   ExpertMatmulInt4  as Int8 for levels 0..15, two a byte          q u8[E, P, K / 2, 48]
//
// sizes i32[E]; rows past the last group are zero. Only the experts that have rows are read,
// each in place, once however many rows it has: a decode step's few (token, expert) pairs read
// their experts' weights and no others, where gathering them would copy each first. The
// threads split the (group, panel) visits evenly by their cost, a panel's stream plus its rows.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "expert_groups.h"
#include "panel_gemm.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxserve::panel_gemm;  // NOLINT: the tiles' vocabulary
namespace expert_groups = jaxserve::expert_groups;

// A (group, panel) visit costs its rows plus this many: streaming a panel from memory takes
// about as long as this many rows' FMAs on it.
constexpr int64_t kStreamRows = 4;

template <typename W>
void RunExperts(ffi::ThreadPool& pool, const float* x, const W* w, const uint16_t* scale,
                const uint16_t* offset, const int32_t* sizes, int64_t experts, float* y,
                int64_t m, int64_t k_dim, int64_t n_dim) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  const int64_t expert_size = panels * PanelSize<W>(k_dim);  // one expert's weight elements
  const int64_t expert_factors = panels * (k_dim / kGroup) * kPanel;  // its scales, offsets
  const std::vector<int64_t> start = expert_groups::Starts(sizes, experts);
  std::memset(y + start[experts] * n_dim, 0, (m - start[experts]) * n_dim * sizeof(float));
  const auto each = [&](int64_t e) { return sizes[e] + kStreamRows; };  // a panel's visit
  const int64_t cost = expert_groups::TotalCost(sizes, experts, panels, each);
  if (cost == 0) return;
  // Int8: every row's group sums, for the groups of up to a row tile (the tiles' s sum x q).
  std::vector<float> xsum(sizeof(W) == 1 ? start[experts] * k_dim / kGroup : 0);
  GroupSums(x, static_cast<int64_t>(xsum.size()), xsum.data());
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t bytes = start[experts] * k_dim * n_dim * static_cast<int64_t>(sizeof(W)) /
                        kPerByte<W>;
  const int64_t chunks = bytes < (256 << 10) ? 1 : threads;  // as matmul.cc's RunMatmul
  jaxserve::RunChunks(pool, chunks, [&](int64_t chunk) {
    expert_groups::ChunkVisits(chunk, chunks, cost, sizes, experts, panels, each,
                               [&](int64_t e, int64_t p0, int64_t p1) {
      const int64_t rows = sizes[e], r = start[e];
      const bool sums = rows <= kRowTile && !xsum.empty();
      PanelRange<W>(x + r * k_dim, rows, k_dim, w + e * expert_size,
                    scale != nullptr ? scale + e * expert_factors : nullptr,
                    offset != nullptr ? offset + e * expert_factors : nullptr,
                    sums ? xsum.data() + r * k_dim / kGroup : nullptr, p0, p1, y + r * n_dim,
                    n_dim);
    });
  });
}

// Checks x [M, K], w [E, P, K / per_byte, 48], sizes (expert_groups::Check) and y [M, N] with
// 48 (P - 1) < N <= 48 P.
ffi::Error CheckShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                       const ffi::Buffer<ffi::S32>& sizes, ffi::Span<const int64_t> yd,
                       int64_t per_byte = 1) {
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2 || wd[3] != kPanel ||
      xd[1] != wd[2] * per_byte || yd[0] != xd[0] || yd[1] > wd[1] * kPanel ||
      yd[1] <= (wd[1] - 1) * kPanel) {
    return ffi::Error::InvalidArgument(
        "expert_matmul: x [M, K], w [E, P, K, 48] (4-bit: K / 2), sizes [E] -> y [M, N], "
        "48 (P - 1) < N <= 48 P");
  }
  return expert_groups::Check(sizes, wd[0], xd[0], "expert_matmul");
}

ffi::Error ExpertMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> sizes,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (auto e = CheckShapes(xd, wd, sizes, y->dimensions()); e.failure()) return e;
  RunExperts<float>(pool, x.typed_data(), w.typed_data(), nullptr, nullptr, sizes.typed_data(),
                    wd[0], y->typed_data(), xd[0], xd[1], y->dimensions()[1]);
  return ffi::Error::Success();
}

// Int8 (S8: int8_t levels) or 4-bit levels (U8: uint8_t, two a byte) with their group scales
// and offsets, as matmul.cc's.
template <ffi::DataType kType>
ffi::Error ExpertMatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<kType> q, ffi::Buffer<ffi::F16> scale,
                               ffi::Buffer<ffi::F16> offset, ffi::Buffer<ffi::S32> sizes,
                               ffi::ResultBuffer<ffi::F32> y) {
  using W = ffi::NativeType<kType>;
  const auto xd = x.dimensions(), qd = q.dimensions();
  if (auto e = CheckShapes(xd, qd, sizes, y->dimensions(), kPerByte<W>); e.failure()) return e;
  for (const auto& d : {scale.dimensions(), offset.dimensions()}) {
    if (xd[1] % kGroup != 0 || d.size() != 4 || d[0] != qd[0] || d[1] != qd[1] ||
        d[2] != xd[1] / kGroup || d[3] != kPanel) {
      return ffi::Error::InvalidArgument("expert_matmul: scale, offset [E, P, K / 32, 48]");
    }
  }
  RunExperts<W>(pool, x.typed_data(), q.typed_data(),
                reinterpret_cast<const uint16_t*>(scale.typed_data()),
                reinterpret_cast<const uint16_t*>(offset.typed_data()), sizes.typed_data(),
                qd[0], y->typed_data(), xd[0], xd[1], y->dimensions()[1]);
  return ffi::Error::Success();
}

template <ffi::DataType kType>
auto BindGrouped() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<kType>>()
      .template Arg<ffi::Buffer<ffi::F16>>()  // scales
      .template Arg<ffi::Buffer<ffi::F16>>()  // offsets
      .template Arg<ffi::Buffer<ffi::S32>>()  // group sizes
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveExpertMatmulF32, ExpertMatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveExpertMatmulInt8, ExpertMatmulGrouped<ffi::S8>,
                              BindGrouped<ffi::S8>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveExpertMatmulInt4, ExpertMatmulGrouped<ffi::U8>,
                              BindGrouped<ffi::U8>());
