// What the grouped matmuls of a mixture's experts share (expert_matmul.cc's panels, and
// matmul_bf16.cc's AMX tiles): the rows of x in groups, group e the next sizes[e] rows, each
// times expert e's weight; checking the group sizes, and splitting the (group, unit) visits
// over the threads, a unit being what the kernel reads of a weight at a time (a panel, a pair
// of tiles).

#ifndef JAXSERVE_CPU_EXPERT_GROUPS_H_
#define JAXSERVE_CPU_EXPERT_GROUPS_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxserve::expert_groups {

// sizes [experts]: each >= 0, their sum at most `rows` (x's); `op` names the call in the error.
inline xla::ffi::Error Check(const xla::ffi::Buffer<xla::ffi::S32>& sizes, int64_t experts,
                             int64_t rows, const std::string& op) {
  if (sizes.dimensions().size() != 1 || sizes.dimensions()[0] != experts) {
    return xla::ffi::Error::InvalidArgument(op + ": sizes must be [E], one a stacked expert");
  }
  int64_t sum = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes.typed_data()[e] < 0) {
      return xla::ffi::Error::InvalidArgument(op + ": a group size is negative");
    }
    sum += sizes.typed_data()[e];
  }
  if (sum > rows) {
    return xla::ffi::Error::InvalidArgument(op + ": the group sizes sum past x's rows");
  }
  return xla::ffi::Error::Success();
}

// Group e's first row, e in [0, experts]: the last entry is the rows in groups.
inline std::vector<int64_t> Starts(const int32_t* sizes, int64_t experts) {
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) start[e + 1] = start[e] + sizes[e];
  return start;
}

// The cost of every visit: each group with rows has `units` visits of cost each(e).
template <typename Each>
int64_t TotalCost(const int32_t* sizes, int64_t experts, int64_t units, Each each) {
  int64_t cost = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes[e] > 0) cost += units * each(e);
  }
  return cost;
}

// Chunk `chunk` of `chunks` takes the visits that start, counting cost in (group, unit) order,
// in [chunk, chunk + 1) * total / chunks: of each group a run of units, or none. Calls
// visit(e, u0, u1) for each group with rows (u0 >= u1: none of its units).
template <typename Each, typename Visit>
void ChunkVisits(int64_t chunk, int64_t chunks, int64_t total, const int32_t* sizes,
                 int64_t experts, int64_t units, Each each, Visit visit) {
  const int64_t lo = chunk * total / chunks, hi = (chunk + 1) * total / chunks;
  int64_t before = 0;  // the cost of the visits before group e's
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes[e] <= 0) continue;
    // Group e's units u whose visits start, at cost before + u * cost_e, in [lo, hi).
    const int64_t cost_e = each(e);
    const int64_t u0 = std::clamp<int64_t>((lo - before + cost_e - 1) / cost_e, 0, units);
    const int64_t u1 = std::clamp<int64_t>((hi - before + cost_e - 1) / cost_e, 0, units);
    before += units * cost_e;
    visit(e, u0, u1);
  }
}

}  // namespace jaxserve::expert_groups

#endif  // JAXSERVE_CPU_EXPERT_GROUPS_H_
