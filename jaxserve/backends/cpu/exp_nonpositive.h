// The exponential of paged attention's online softmax (paged_attention.cc).

#ifndef JAXSERVE_CPU_EXP_NONPOSITIVE_H_
#define JAXSERVE_CPU_EXP_NONPOSITIVE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

// exp(x) for x <= 0 (scores minus their row max), branch-free so that loops over keys
// vectorize: Cody-Waite range reduction and Cephes' degree-6 polynomial (relative error ~1e-7).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#endif  // JAXSERVE_CPU_EXP_NONPOSITIVE_H_
