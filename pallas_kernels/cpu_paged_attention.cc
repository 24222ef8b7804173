// Paged attention on the CPU as an XLA FFI custom call: every query token attends its row's
// keys causally, reading each [B, D] key/value page in place from the pool through the page
// table. XLA's own lowering gathers every page into a new buffer first, and that copy was most
// of the attention time (scripts/bench_attention.py).
//
// Shapes (the letters of jaxserve/model/attention.py): q f32[T, Hq, D]; k, v f32[Hkv, N, B, D];
// page_tables i32[S, P]; seq_lens i32[S]; token_row i32[T] (S or more: padding, output zeros);
// positions i32[T]. Query head h * G + g reads KV head h (G = Hq / Hkv). Token t attends key
// positions j <= positions[t] and j < seq_lens[token_row[t]].
//
// Work is split into (token, KV head) units over XLA's intra-op thread pool. Each unit walks its
// pages once with an online float32 softmax, all G query heads of the group together, so a KV
// page is read once per token. At 256 decode rows x 200 keys the kernel is bound by memory
// (about 17 GB/s of scattered 4 KB pages here), not by its arithmetic.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// Pulls `bytes` at `p` toward the cache. A page of one head is a few KB wherever the page table
// points, so the hardware prefetcher cannot see the next one coming.
inline void Prefetch(const float* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* page_tables;
  const int32_t* seq_lens;
  const int32_t* token_row;
  const int32_t* positions;
  float* out;
  int64_t num_tokens, num_q_heads, num_kv_heads, num_pages, page_size, num_rows, table_width;
  float sm_scale;
};

// Scores, softmax and values of one (token, KV head) unit. kG, kD > 0 fix the group size and
// head dim at compile time (the common shapes: loops unroll and the accumulators stay in
// registers: 1.35x faster on cached pages at G = 3, D = 64); 0 reads them at run time.
template <int kG, int kD>
void AttendUnit(const Problem& p, int64_t unit, int64_t d_runtime, std::vector<float>& scratch) {
  const int64_t d = kD > 0 ? kD : d_runtime;
  const int64_t t = unit / p.num_kv_heads, h = unit % p.num_kv_heads;
  const int64_t g_size = kG > 0 ? kG : p.num_q_heads / p.num_kv_heads;
  float* out = p.out + (t * p.num_q_heads + h * g_size) * d;
  const int64_t row = p.token_row[t];
  int64_t len = 0;
  if (row >= 0 && row < p.num_rows) {
    len = std::min<int64_t>(p.positions[t] + 1, p.seq_lens[row]);
    len = std::min<int64_t>(len, p.table_width * p.page_size);
  }
  if (len <= 0) {
    std::fill(out, out + g_size * d, 0.0f);
    return;
  }
  const float* q = p.q + (t * p.num_q_heads + h * g_size) * d;
  const int32_t* table = p.page_tables + row * p.table_width;
  const int64_t page_elems = p.page_size * d;
  const float* k_head = p.k + h * p.num_pages * page_elems;
  const float* v_head = p.v + h * p.num_pages * page_elems;

  // One pass over the pages with an online softmax: a page's keys and values are read
  // together, then never again. m, l: running max and sum per query head; acc in `out`.
  const int64_t b = p.page_size, row_bytes = d * static_cast<int64_t>(sizeof(float));
  constexpr bool kStatic = kG > 0 && kD > 0;
  alignas(64) float acc_static[kStatic ? kG * kD : 1];
  scratch.resize(g_size * (b + 2) + (kStatic ? 0 : g_size * d));
  float* scores = scratch.data();  // [G, B]
  float* m = scores + g_size * b;
  float* l = m + g_size;
  float* acc = kStatic ? acc_static : l + g_size;  // [G, D]
  std::fill(m, m + g_size, -1e30f);
  std::fill(l, l + g_size, 0.0f);
  std::fill(acc, acc + g_size * d, 0.0f);
  for (int64_t first = 0; first < len; first += b) {
    const int64_t page = table[first / b];
    const float* kp = k_head + page * page_elems;
    const float* vp = v_head + page * page_elems;
    const int64_t n = std::min(b, len - first);
    if (first + b < len) {  // see Prefetch
      const int64_t next = table[first / b + 1] * page_elems;
      const int64_t bytes = std::min(b, len - first - b) * row_bytes;
      Prefetch(k_head + next, bytes);
      Prefetch(v_head + next, bytes);
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* key = kp + i * d;
      for (int64_t g = 0; g < g_size; ++g) {
        const float* qg = q + g * d;
        float dot = 0.0f;
        for (int64_t e = 0; e < d; ++e) dot += qg[e] * key[e];
        scores[g * b + i] = dot * p.sm_scale;
      }
    }
    for (int64_t g = 0; g < g_size; ++g) {
      float* s = scores + g * b;
      float m_new = m[g];
      for (int64_t i = 0; i < n; ++i) m_new = std::max(m_new, s[i]);
      const float rescale = exp_nonpositive(m[g] - m_new);
      float sum = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        s[i] = exp_nonpositive(s[i] - m_new);
        sum += s[i];
      }
      l[g] = l[g] * rescale + sum;
      m[g] = m_new;
      float* o = acc + g * d;
      for (int64_t e = 0; e < d; ++e) o[e] *= rescale;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* value = vp + i * d;
      for (int64_t g = 0; g < g_size; ++g) {
        const float w = scores[g * b + i];
        float* o = acc + g * d;
        for (int64_t e = 0; e < d; ++e) o[e] += w * value[e];
      }
    }
  }
  for (int64_t g = 0; g < g_size; ++g) {
    const float inv = 1.0f / l[g];
    for (int64_t e = 0; e < d; ++e) out[g * d + e] = acc[g * d + e] * inv;
  }
}

template <int kG, int kD>
void AttendUnits(const Problem& p, int64_t d, int64_t begin, int64_t end) {
  thread_local std::vector<float> scratch;
  for (int64_t u = begin; u < end; ++u) AttendUnit<kG, kD>(p, u, d, scratch);
}

void AttendRange(const Problem& p, int64_t d, int64_t begin, int64_t end) {
  const int64_t g = p.num_q_heads / p.num_kv_heads;
#define JAXSERVE_CASE(G, D) \
  if (g == G && d == D) return AttendUnits<G, D>(p, d, begin, end);
  JAXSERVE_CASE(1, 64) JAXSERVE_CASE(2, 64) JAXSERVE_CASE(3, 64) JAXSERVE_CASE(4, 64)
  JAXSERVE_CASE(5, 64) JAXSERVE_CASE(6, 64) JAXSERVE_CASE(7, 64) JAXSERVE_CASE(8, 64)
  JAXSERVE_CASE(1, 128) JAXSERVE_CASE(2, 128) JAXSERVE_CASE(4, 128) JAXSERVE_CASE(8, 128)
#undef JAXSERVE_CASE
  AttendUnits<0, 0>(p, d, begin, end);
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> page_tables,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> token_row,
                          ffi::Buffer<ffi::S32> positions, float sm_scale,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = page_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || !(v.dimensions() == kd) ||
      qd[2] != kd[3] || kd[0] == 0 || qd[1] % kd[0] != 0) {
    return ffi::Error::InvalidArgument("paged attention: bad q/k/v/page_tables shapes");
  }
  Problem p{q.typed_data(), k.typed_data(), v.typed_data(), page_tables.typed_data(),
            seq_lens.typed_data(), token_row.typed_data(), positions.typed_data(),
            out->typed_data(), qd[0], qd[1], kd[0], kd[1], kd[2], td[0], td[1], sm_scale};
  const int64_t d = qd[2];
  const int64_t units = p.num_tokens * p.num_kv_heads;
  // Below a few thousand keys a unit of work is microseconds: scheduling would cost more.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads == 1 || units < 4 * threads) {
    AttendRange(p, d, 0, units);
    return ffi::Error::Success();
  }
  const int64_t num_chunks = std::min<int64_t>(units, 8 * threads);
  const int64_t per_chunk = (units + num_chunks - 1) / num_chunks;
  jaxserve::RunChunks(pool, num_chunks, [p, d, units, per_chunk](int64_t c) {
    AttendRange(p, d, c * per_chunk, std::min(units, (c + 1) * per_chunk));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token_row
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
