// The panel GEMM that the CPU backend's matmuls share (matmul.cc: one weight; expert_matmul.cc:
// a mixture of experts' stacked weights, the rows in groups), over weights packed in column
// panels: a panel [K / per_byte, 48] holds 48 output columns of a [K, N] weight, k-major.
//
// Panel p holds output columns [48 p, 48 p + 48) of the [K, N] weight (zero past N), k-major,
// so each k of a panel is three contiguous 16-lane vectors (AVX-512; six 8-lane ones on AVX2).
// That is the layout of a GEMM microkernel: per k, the weight vectors and one broadcast x value
// per row feed one FMA per vector and row, the accumulators stay in registers, and no horizontal
// sums are needed. A panel is read from memory once (software prefetch keeps the stream ahead of
// the FMAs) and stays in L2 while later row tiles reuse it; each thread takes one contiguous run
// of panels, a block at a time, and prefetches its next block while the row tiles compute on the
// current one. At a decode step's few rows a matmul is bound by streaming its weights, so reading
// each once is what matters there; at many rows the register tiles keep the FMAs fed from L2.
// At one or two rows the int8 kernel sums each group's products x q apart and applies the
// group's scale and offset once (s sum x q + o sum x): one FMA a weight, as f32 has. Up to a row
// tile it dequantizes each weight in registers, past that into an f32 copy of the panel shared
// by all row tiles, where XLA converts the whole weight first. 4-bit levels stream half the
// bytes of int8 and widen in registers to the same float levels, in the same order: on the
// vector paths the results equal int8's bit for bit.

#ifndef JAXSERVE_CPU_PANEL_GEMM_H_
#define JAXSERVE_CPU_PANEL_GEMM_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace jaxserve::panel_gemm {

using jaxserve::vec::Broadcast;
using jaxserve::vec::Fma;
using jaxserve::vec::kLanes;
using jaxserve::vec::Load;
using jaxserve::vec::LoadFirst;
using jaxserve::vec::LoadHalf;
using jaxserve::vec::LoadNibbles;
using jaxserve::vec::Prefetch;
using jaxserve::vec::PrefetchL2;
using jaxserve::vec::StoreFirst;
using jaxserve::vec::Vec;
using jaxserve::vec::Zero;

constexpr int64_t kPanel = 48;  // output columns per panel: three 16-lane or six 8-lane vectors
constexpr int64_t kGroup = 32;  // k per int8 scale and offset (quantize.py's GROUP)
// Weights prefetched this many k ahead (3 KB of f32), except f32 at one row: there the FMAs wait
// on nothing but the stream, and the hardware prefetcher alone kept it faster than with
// software prefetches added. Int8 at one row is the other way round: it needs them.
constexpr int64_t kPrefetchK = 16;
// Weights a thread's row tiles share before moving on (one panel at SmolLM2's K = 576): each
// weight comes from memory once however many row tiles there are, and the next block is
// prefetched into L2 while they compute. Without blocks a weight larger than the caches (the
// head) would be streamed once per row tile; without the prefetch the stream and the FMAs would
// take turns.
constexpr int64_t kBlockBytes = 128 << 10;

constexpr int kVecs = kPanel / kLanes;  // vectors per k of a panel
// Panels of uint8_t hold 4-bit levels, two k a byte (MatmulInt4); of int8_t or float, one k.
template <typename W>
constexpr int64_t kPerByte = std::is_same_v<W, uint8_t> ? 2 : 1;
// Elements of W in one panel of k_dim.
template <typename W>
constexpr int64_t PanelSize(int64_t k_dim) { return k_dim / kPerByte<W> * kPanel; }
// Register tiling. 16 lanes (32 registers): a row tile is 8 rows x one panel's 3 accumulators,
// in one pass over k. 8 lanes (AVX2, 16 registers): a panel is six vectors and a pass holds at
// most 12 accumulators: one row over two panels, two rows over one, up to four over half a
// panel, six over a third (16 columns, one cache line a k). Two-row passes over whole panels
// read 192 bytes from L2 per 12 FMAs, all that L2 delivers in their time, so more rows take
// narrower passes that reuse each weight vector loaded over more rows. (The portable 16-lane
// struct is not kept in registers at all: it is the correct fallback, not a fast one, hence the
// 8-lane AVX2 path.)
constexpr bool kNarrow = kLanes == 8;
constexpr int kRegisters = kNarrow ? 16 : 32;
constexpr int kRowTile = kNarrow ? 6 : 8;
// Panels a tile reads at once: with 16 lanes up to four rows are bound by the weight stream, and
// a core reads two weight streams faster than one.
constexpr int64_t PanelsPerTile(int64_t rows) { return rows <= (kNarrow ? 1 : 4) ? 2 : 1; }
// A tile's vectors (vecs = kVecs kP) accumulated in one pass over k.
constexpr int PassVecs(int rows, int vecs) {
  if (!kNarrow || rows <= 1) return vecs;
  return rows <= 2 ? std::min(vecs, 6) : rows <= 4 ? 3 : 2;
}
template <int kM>
constexpr int kPanelsPerTile = PanelsPerTile(kM);

// y[0:kM, 0:cols] = x[0:kM] @ W for kP consecutive panels of W (cols <= 48 kP valid columns).
// An int8 W comes with its panels' group scales and offsets [kP, k_dim / 32, 48] (null for f32)
// and x's group sums xsum[kM][k_dim / 32] (null for f32). x has row stride k_dim, or with
// kPackedX is one row tile packed k-major (PackRows); y has row stride n_dim.
//
// The tile's kVecs kP column vectors are accumulated PassVecs at a time, each pass a walk over
// k. Per k, a pass loads its weight vectors before the rows' broadcasts where both fit in the
// registers beside the accumulators, and otherwise broadcasts the rows first and loads one
// weight vector at a time. Int8 sums each group's x q apart where those sums fit in the
// registers too (kGroupSums: then s sum x q + o sum x per group), and otherwise dequantizes each
// weight, q s + o.
//
// The tile also prefetches `pf_lines` cache lines from `pf` into L2, spread over its k loops:
// the next block's weights, fetched while this block's row tiles compute on weights already in
// L2.
template <int kM, int kP, typename W, bool kPackedX>
inline void Tile(const float* x, int64_t k_dim, const W* panels, const uint16_t* scale,
                 const uint16_t* offset, const float* xsum, float* y, int64_t n_dim,
                 int64_t cols, const char* pf = nullptr, int64_t pf_lines = 0) {
  constexpr int kAll = kVecs * kP;
  constexpr int kG = PassVecs(kM, kAll);
  constexpr int kPanelVecs = std::min(kG, kVecs);  // a pass's vectors within one panel
  static_assert(kAll % kG == 0 && (kG % kVecs == 0 || kVecs % kG == 0));
  constexpr bool kInt8 = sizeof(W) == 1;  // int8 or 4-bit levels, with group factors
  constexpr int kStep = kPerByte<W>;  // k per row of stored weights
  constexpr bool kGroupSums = kInt8 && 2 * kM * kG + kG + 1 <= kRegisters;
  constexpr int kScales = kInt8 && !kGroupSums ? 2 * kG : 0;  // a group's scales and offsets
  constexpr int kSums = (kGroupSums ? 2 : 1) * kM * kG;  // accumulators (and group sums)
  constexpr bool kWeightsFirst = kScales + kStep * kG + 1 + kSums <= kRegisters;
  const int64_t span = kInt8 ? kGroup : k_dim;  // k per group (f32: one span)
  const int64_t steps = kAll / kG * k_dim;
  int64_t issued = 0;
  for (int g = 0; g < kAll; g += kG) {
    // Vector g + j of the tile: columns kLanes (g + j) .., in panel (g + j) / kVecs.
    const auto weights = [&](int j, int64_t k) {
      const int v = g + j;
      return panels + (v / kVecs) * PanelSize<W>(k_dim) + k / kStep * kPanel + kLanes * (v % kVecs);
    };
    // Int8: vector j's scales or offsets for the group of 32 k from k.
    const auto group = [&](const uint16_t* a, int j, int64_t k) {
      const int v = g + j;
      return LoadHalf(a + ((v / kVecs) * k_dim + k) / kGroup * kPanel + kLanes * (v % kVecs));
    };
    Vec sv[kG], ov[kG];  // dequantizing: the current group's
    // Vector j's weights of k .. k + kStep - 1 into w[0 .. kStep).
    const auto weight = [&](int j, int64_t k, Vec* w) {
      if constexpr (kStep == 2) {
        LoadNibbles(weights(j, k), w[0], w[1]);
      } else {
        w[0] = Load(weights(j, k));
      }
      if constexpr (kInt8 && !kGroupSums) {
        for (int h = 0; h < kStep; ++h) w[h] = Fma(w[h], sv[j], ov[j]);
      }
    };
    Vec acc[kM][kG], part[kM][kG];
    for (int m = 0; m < kM; ++m) {
      for (int j = 0; j < kG; ++j) acc[m][j] = Zero();
    }
    Vec(&sums)[kM][kG] = kGroupSums ? part : acc;  // what the k loop accumulates into
    for (int64_t k0 = 0; k0 < k_dim; k0 += span) {
      if constexpr (kGroupSums) {
        for (int m = 0; m < kM; ++m) {
          for (int j = 0; j < kG; ++j) part[m][j] = Zero();
        }
        // The scales and offsets of a group two ahead (each panel's 96 bytes a group).
        for (int j = 0; j < kG; j += kPanelVecs) {
          const int v = g + j;
          const int64_t at = ((v / kVecs) * k_dim + k0) / kGroup * kPanel + 2 * kPanel;
          Prefetch(scale + at), Prefetch(scale + at + 32), Prefetch(offset + at),
              Prefetch(offset + at + 32);
        }
      } else if constexpr (kInt8) {
        for (int j = 0; j < kG; ++j) sv[j] = group(scale, j, k0), ov[j] = group(offset, j, k0);
      }
      for (int64_t k = k0; k < k0 + span; k += kStep) {
        const int64_t step = g / kG * k_dim + k + kStep - 1;
        for (; issued * steps < (step + 1) * pf_lines; ++issued) PrefetchL2(pf + 64 * issued);
        if constexpr (kM > 1 || kInt8) {  // see kPrefetchK
          // The pass's weights of one k span up to three cache lines a panel (int8: the next
          // k's line is the same or the one after); prefetching past the end is harmless.
          for (int j = 0; j < kG; j += kPanelVecs) {
            const char* ahead = reinterpret_cast<const char*>(weights(j, k + kPrefetchK * kStep));
            const int64_t bytes = kInt8 ? 1 : kPanelVecs * kLanes * sizeof(W);
            for (int64_t b = 0; b < bytes; b += 64) Prefetch(ahead + b);
          }
        }
        const auto xk = [&](int m, int64_t kk) {
          return kPackedX ? x[kk * kRowTile + m] : x[m * k_dim + kk];
        };
        // Per k, in order (4-bit: the pair's first k, then its second, as int8 sums them).
        if constexpr (kWeightsFirst) {
          Vec wv[kG][kStep];
          for (int j = 0; j < kG; ++j) weight(j, k, wv[j]);
          for (int h = 0; h < kStep; ++h) {
            for (int m = 0; m < kM; ++m) {
              const Vec xv = Broadcast(xk(m, k + h));
              for (int j = 0; j < kG; ++j) sums[m][j] = Fma(xv, wv[j][h], sums[m][j]);
            }
          }
        } else {
          Vec xv[kStep][kM];
          for (int h = 0; h < kStep; ++h) {
            for (int m = 0; m < kM; ++m) xv[h][m] = Broadcast(xk(m, k + h));
          }
          for (int j = 0; j < kG; ++j) {
            Vec wv[kStep];
            weight(j, k, wv);
            for (int h = 0; h < kStep; ++h) {
              for (int m = 0; m < kM; ++m) sums[m][j] = Fma(xv[h][m], wv[h], sums[m][j]);
            }
          }
        }
      }
      if constexpr (kGroupSums) {
        const int64_t at = k0 / kGroup, groups = k_dim / kGroup;
        for (int j = 0; j < kG; ++j) {
          const Vec sj = group(scale, j, k0), oj = group(offset, j, k0);
          for (int m = 0; m < kM; ++m) {
            acc[m][j] = Fma(part[m][j], sj, Fma(Broadcast(xsum[m * groups + at]), oj, acc[m][j]));
          }
        }
      }
    }
    for (int j = 0; j < kG; ++j) {
      const int64_t col = kLanes * (g + j), lanes = cols - col;
      if (lanes <= 0) break;
      for (int m = 0; m < kM; ++m) StoreFirst(y + m * n_dim + col, acc[m][j], lanes);
    }
  }
}

// Calls body.template operator()<kM>() for the compile-time row count m (1..kRowTile).
template <int kM = 1, typename Body>
void DispatchRows(int64_t m, Body body) {
  if constexpr (kM <= kRowTile) {
    if (m == kM) {
      body.template operator()<kM>();
    } else {
      DispatchRows<kM + 1>(m, body);
    }
  }
}

// x [m, k_dim] into xp row tile by row tile, each k-major: xp[t][k][i] = x[kRowTile t + i][k],
// zero past row m. A tile's k then broadcasts its rows' values from one run instead of kRowTile
// rows a row apart.
inline void PackRows(const float* x, int64_t m, int64_t k_dim, float* xp) {
  for (int64_t t = 0; t * kRowTile < m; ++t) {
    float* dst = xp + t * kRowTile * k_dim;
    const int64_t rows = std::min<int64_t>(kRowTile, m - t * kRowTile);
    for (int64_t i = 0; i < kRowTile; ++i) {
      const float* src = x + (t * kRowTile + i) * k_dim;
      for (int64_t k = 0; k < k_dim; ++k) dst[k * kRowTile + i] = i < rows ? src[k] : 0.0f;
    }
  }
}

// All m rows of x against num_panels consecutive panels (w, and for int8 scale and offset, point
// at the first, and xsum at x's group sums [m, k_dim / 32]; y at its first column, cols of which
// are valid): a block of panels that fits in
// L2 at a time, row tile by row tile within it, so each panel is read from memory once however
// many rows there are. With kPackedX, x is packed by PackRows (row tile r / 8 then starts at
// x + r * k_dim as well).
template <typename W, bool kPackedX = false>
void PanelRows(const float* x, int64_t m, int64_t k_dim, const W* w, int64_t num_panels,
               const uint16_t* scale, const uint16_t* offset, const float* xsum, float* y,
               int64_t n_dim, int64_t cols) {
  const int64_t panel_bytes = PanelSize<W>(k_dim) * static_cast<int64_t>(sizeof(W));
  const int64_t pair = PanelsPerTile(m);
  const int64_t block = std::max<int64_t>(pair, kBlockBytes / panel_bytes / pair * pair);
  const int64_t row_tiles = (m + kRowTile - 1) / kRowTile;
  for (int64_t b = 0; b < num_panels; b += block) {
    const int64_t b1 = std::min(num_panels, b + block);
    // The block's tiles prefetch the next block between them (at 1-2 rows the hardware
    // prefetcher keeps up with the stream, and extra prefetches only compete with it).
    const int64_t next_panels = std::min(num_panels, b1 + block) - b1;
    const int64_t next_lines = m > 2 ? next_panels * panel_bytes / 64 : 0;
    const char* next = reinterpret_cast<const char*>(w + b1 * PanelSize<W>(k_dim));
    int64_t job = 0;
    const int64_t jobs = row_tiles * (b1 - b);
    for (int64_t r = 0; r < m; r += kRowTile) {
      DispatchRows(std::min<int64_t>(kRowTile, m - r), [&]<int kM>() {
        int64_t p = b;
        const auto tile = [&]<int kP>() {
          const int64_t col = p * kPanel;
          const int64_t first = job * next_lines / jobs, last = (job + kP) * next_lines / jobs;
          const int64_t at = p * k_dim / kGroup * kPanel;  // the panel's group scales
          Tile<kM, kP, W, kPackedX>(x + r * k_dim, k_dim, w + p * PanelSize<W>(k_dim),
                                    scale != nullptr ? scale + at : nullptr,
                                    offset != nullptr ? offset + at : nullptr,
                                    xsum != nullptr ? xsum + r * k_dim / kGroup : nullptr,
                                    y + r * n_dim + col, n_dim,
                                    std::min(kP * kPanel, cols - col), next + 64 * first,
                                    last - first);
          p += kP;
          job += kP;
        };
        while (p + kPanelsPerTile<kM> <= b1) tile.template operator()<kPanelsPerTile<kM>>();
        while (p < b1) tile.template operator()<1>();
      });
    }
  }
}

// One panel's levels (int8, or 4-bit two a byte) times its group scales plus its offsets (f16
// [K / 32, 48]) into f32 [K, 48]: one FMA a vector of levels, as the dequantizing tiles do.
template <typename W>
void DequantizePanel(const W* panel, const uint16_t* scale, const uint16_t* offset,
                     int64_t k_dim, float* out) {
  for (int64_t g = 0; g < k_dim / kGroup; ++g, scale += kPanel, offset += kPanel) {
    Vec s[kVecs], o[kVecs];
    for (int j = 0; j < kVecs; ++j)
      s[j] = LoadHalf(scale + j * kLanes), o[j] = LoadHalf(offset + j * kLanes);
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += kPerByte<W>) {
      for (int j = 0; j < kVecs; ++j) {
        float* at = out + k * kPanel + j * kLanes;
        Vec lo, hi;  // the levels of k (and, 4-bit, of k + 1)
        if constexpr (kPerByte<W> == 2) LoadNibbles(panel + k / 2 * kPanel + j * kLanes, lo, hi);
        else lo = Load(panel + k * kPanel + j * kLanes);
        StoreFirst(at, Fma(lo, s[j], o[j]), kLanes);
        if constexpr (kPerByte<W> == 2) StoreFirst(at + kPanel, Fma(hi, s[j], o[j]), kLanes);
      }
    }
  }
}

// x's sums per group of 32 k, the first `count` of them (x [m, K] -> xsum [m, K / 32] is
// count = m K / 32): the int8 tiles' s sum x q + o sum x needs sum x.
inline void GroupSums(const float* x, int64_t count, float* xsum) {
  for (int64_t i = 0; i < count; ++i) {
    float sum = 0.0f;
    for (int64_t k = 0; k < kGroup; ++k) sum += x[i * kGroup + k];
    xsum[i] = sum;
  }
}

// All m rows of x against panels [p0, p1) of a weight of n_dim columns (w, scale and offset
// point at its first panel, y at row 0 column 0; xsum: GroupSums of x for int8 up to a row
// tile). Int8 past a row tile dequantizes each panel once into float32 for all the row tiles,
// in a buffer each thread keeps across calls.
template <typename W>
void PanelRange(const float* x, int64_t m, int64_t k_dim, const W* w, const uint16_t* scale,
                const uint16_t* offset, const float* xsum, int64_t p0, int64_t p1, float* y,
                int64_t n_dim) {
  if (p0 >= p1) return;
  const int64_t groups = k_dim / kGroup;
  if (sizeof(W) == 4 || m <= kRowTile) {
    PanelRows<W>(x, m, k_dim, w + p0 * PanelSize<W>(k_dim), p1 - p0,
                 scale != nullptr ? scale + p0 * groups * kPanel : nullptr,
                 offset != nullptr ? offset + p0 * groups * kPanel : nullptr, xsum,
                 y + p0 * kPanel, n_dim, n_dim - p0 * kPanel);
    return;
  }
  thread_local std::vector<float> converted;
  converted.resize(k_dim * kPanel);
  for (int64_t p = p0; p < p1; ++p) {
    DequantizePanel(w + p * PanelSize<W>(k_dim), scale + p * groups * kPanel,
                    offset + p * groups * kPanel, k_dim, converted.data());
    PanelRows<float>(x, m, k_dim, converted.data(), 1, nullptr, nullptr, nullptr,
                     y + p * kPanel, n_dim, n_dim - p * kPanel);
  }
}

}  // namespace jaxserve::panel_gemm

#endif  // JAXSERVE_CPU_PANEL_GEMM_H_
