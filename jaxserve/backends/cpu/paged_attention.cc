// Paged attention on the CPU as an XLA FFI custom call: every query token attends its row's
// keys causally, reading each [B, D] key/value page in place from the pool through the page
// table. XLA's own lowering gathers every page into a new buffer first: a copy of every row's
// whole context each step, written and read again, where this reads each key and value once.
//
// Shapes (the letters of jaxserve/model/attention.py): q f32[T, Hq, D]; k, v [Hkv, N, B, D] of
// float32, bfloat16, or int8 with k_scale, v_scale f32[Hkv, N, B] (key = k * k_scale, one scale per
// token and KV head: kv_cache.py's quantize_kv); page_tables i32[S, P]; seq_lens i32[S]; token_row
// i32[T] (S or more: padding, output zeros); positions i32[T]. Query head h * G + g reads KV head h
// (G = Hq / Hkv). Token t attends key positions j <= positions[t] and j < seq_lens[token_row[t]],
// and with a sliding window W > 0 only j > positions[t] - W: pages wholly before the window are not
// read (their table entries may be the scratch page 0). A soft cap C > 0 turns each scaled score s
// into C * tanh(s / C). sinks f32[Hq] (or [0]: none): a logit per query head in the softmax's
// denominator, with no value (gpt-oss), taken as the softmax's starting state (max = sink, sum = 1)
// by the first split of each unit only. A row's seq_len must fit its page table (P pages of B keys)
// and the pages holding its keys must be in the pool (0 <= id < N): both are checked once per call,
// before any key is read, and fail the call with an InvalidArgument error. Entries past a row's
// keys are not read (padding rows: seq_len 0, page tables of 0s; page 0 is the pool's scratch
// page), nor are those slots' scales (garbage, even NaN).
//
// Work is split into (token, KV head) units over the kernels' worker threads (parallel.h). Each
// unit walks its pages once with an online float32 softmax, all G query heads of the group
// together, so a KV page is read once per token. A step of too few units for the threads (one
// decode row: 3) splits each unit's pages and merges the splits' softmax states. With many decode
// rows the kernel is bound by reading scattered pages from memory, not by its arithmetic, hence the
// software prefetch of each next page (Prefetch). Narrow pages (int8, a quarter of the bytes;
// bfloat16, half) are widened to float32 a row at a time as they are read: the pool is never
// converted or copied.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "exp_nonpositive.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Pulls `bytes` at `p` toward the cache. A page of one head is a few KB wherever the page table
// points, so the hardware prefetcher cannot see the next one coming.
inline void Prefetch(const void* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

// The page element types: float, int8_t (with scales) and bfloat16, held as its bits.
using Bf16Bits = uint16_t;
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t>;

inline float ToFloat(float x) { return x; }
inline float ToFloat(int8_t x) { return static_cast<float>(x); }
// A bfloat16 is the top half of the float32 of the same value.
inline float ToFloat(Bf16Bits x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }

// A row of d elements of a page as float32: float rows in place, others widened into `buf` (in
// L1, then read by every query head of the group; the loop vectorizes).
template <typename T>
inline const float* Widen(const T* row, int64_t d, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t e = 0; e < d; ++e) buf[e] = ToFloat(row[e]);
    return buf;
  }
}

struct Problem {
  const float* q;
  const void* k;  // the page type's elements: AttendUnit<T> casts
  const void* v;
  const float* k_scale;  // int8 pages' scales [Hkv, N, B]; null for float pages
  const float* v_scale;
  const int32_t* page_tables;
  const int32_t* seq_lens;
  const int32_t* token_row;
  const int32_t* positions;
  const float* sinks;  // [Hq]; null: none
  float* out;
  int64_t num_tokens, num_q_heads, num_kv_heads, num_pages, page_size, num_rows, table_width;
  float sm_scale;
  int64_t window;  // 0: none
  float soft_cap;  // 0: none
};

// Floats of one split's softmax state: m[G], l[G], acc[G, D].
inline int64_t SplitStateSize(const Problem& p, int64_t d) {
  return p.num_q_heads / p.num_kv_heads * (d + 2);
}

// The number of keys token t attends (0 for a padding token); within its row's page table and
// pool, as CheckPages found.
inline int64_t KeysOf(const Problem& p, int64_t t) {
  const int64_t row = p.token_row[t];
  if (row < 0 || row >= p.num_rows) return 0;
  return std::max<int64_t>(0, std::min<int64_t>(p.positions[t] + 1, p.seq_lens[row]));
}

// The first key position token t attends (its sliding window's start; 0 without a window).
inline int64_t FirstKeyOf(const Problem& p, int64_t t) {
  return p.window > 0 ? std::max<int64_t>(0, p.positions[t] - p.window + 1) : 0;
}

// Whether every row's seq_len fits its page table and the pages holding its keys are in the
// pool: once per row before the work, so that the loops over keys need no bounds checks (a bad
// id would otherwise read, and prefetch, outside the pool).
ffi::Error CheckPages(const Problem& p) {
  const int64_t capacity = p.table_width * p.page_size;
  for (int64_t s = 0; s < p.num_rows; ++s) {
    const int64_t len = p.seq_lens[s];
    if (len > capacity) {
      return ffi::Error::InvalidArgument(
          "paged attention: row " + std::to_string(s) + " has seq_len " + std::to_string(len) +
          ", more than its page table holds (" + std::to_string(p.table_width) + " pages of " +
          std::to_string(p.page_size) + " keys)");
    }
    const int32_t* table = p.page_tables + s * p.table_width;
    for (int64_t i = 0; i < (len + p.page_size - 1) / p.page_size; ++i) {
      if (table[i] < 0 || table[i] >= p.num_pages) {
        return ffi::Error::InvalidArgument(
            "paged attention: row " + std::to_string(s) + " reads page id " +
            std::to_string(table[i]) + " (page table entry " + std::to_string(i) +
            "), outside the pool's " + std::to_string(p.num_pages) + " pages");
      }
    }
  }
  return ffi::Error::Success();
}

// Scores, softmax and values of one (token, KV head) unit over split `split` of `num_splits`
// equal runs of its pages. With one split the result is normalized into `out`; with more, the
// unnormalized state (m[G], l[G], acc[G, D]) goes to `partial` for MergeSplits. kG, kD > 0 fix
// the group size and head dim at compile time (the common shapes: loops unroll and the
// accumulators stay in registers, which the run-time loops cannot); 0 reads them at run time.
// int8 pages' scales are folded in rather than multiplied into each element: a key's score is
// k_scale * (q . k_int8), and its value's weight p * v_scale, one multiply per key.
template <typename T, int kG, int kD>
void AttendUnit(const Problem& p, int64_t unit, int64_t d_runtime, int64_t split,
                int64_t num_splits, float* partial, std::vector<float>& scratch) {
  const int64_t d = kD > 0 ? kD : d_runtime;
  const int64_t t = unit / p.num_kv_heads, h = unit % p.num_kv_heads;
  const int64_t g_size = kG > 0 ? kG : p.num_q_heads / p.num_kv_heads;
  float* out = p.out + (t * p.num_q_heads + h * g_size) * d;
  const int64_t len = KeysOf(p, t), b = p.page_size;
  // Splits are whole pages from the page holding the window's first key.
  const int64_t lo = std::min(len, FirstKeyOf(p, t)), base = lo / b * b;
  const int64_t per_split = ((len - base + b - 1) / b + num_splits - 1) / num_splits * b;
  const int64_t begin = std::min(len, std::max(lo, base + split * per_split));
  const int64_t end = std::min(len, base + (split + 1) * per_split);
  if (begin >= end && partial == nullptr) {
    std::fill(out, out + g_size * d, 0.0f);
    return;
  }
  const float* q = p.q + (t * p.num_q_heads + h * g_size) * d;
  const int32_t* table = p.page_tables + (len > 0 ? p.token_row[t] * p.table_width : 0);
  const int64_t page_elems = b * d;
  const T* k_head = static_cast<const T*>(p.k) + h * p.num_pages * page_elems;
  const T* v_head = static_cast<const T*>(p.v) + h * p.num_pages * page_elems;
  const float* ks_head = kScaled<T> ? p.k_scale + h * p.num_pages * b : nullptr;
  const float* vs_head = kScaled<T> ? p.v_scale + h * p.num_pages * b : nullptr;

  // One pass over the pages with an online softmax: a page's keys and values are read
  // together, then never again. m, l: running max and sum per query head; acc in `out`.
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  constexpr bool kStatic = kG > 0 && kD > 0;
  alignas(64) float acc_static[kStatic ? kG * kD : 1];
  // A widened row on the stack, not in `scratch`: the compiler then knows that the int8 page
  // (a char type, which may alias anything) is not written through it, and checks nothing.
  alignas(64) float row_static[kStatic ? kD : 1];
  scratch.resize(g_size * (b + 2) + (kStatic ? 0 : g_size * d + d));
  float* scores = scratch.data();  // [G, B]
  float* m = scores + g_size * b;
  float* l = m + g_size;
  float* acc = kStatic ? acc_static : l + g_size;  // [G, D]
  float* row = kStatic ? row_static : acc + g_size * d;  // [D]: a narrow row widened (Widen)
  std::fill(m, m + g_size, -1e30f);
  std::fill(l, l + g_size, 0.0f);
  if (p.sinks != nullptr && split == 0) {  // the sink as a key of weight exp(sink), value 0
    std::copy(p.sinks + h * g_size, p.sinks + (h + 1) * g_size, m);
    std::fill(l, l + g_size, 1.0f);
  }
  std::fill(acc, acc + g_size * d, 0.0f);
  // Runs of keys within one page: [first, first + n), n <= B; only the window's first run may
  // start inside its page (at offset `skip`).
  for (int64_t first = begin; first < end; first += b - first % b) {
    const int64_t page = table[first / b], skip = first % b;
    const T* kp = k_head + page * page_elems + skip * d;
    const T* vp = v_head + page * page_elems + skip * d;
    const float* ks_page = kScaled<T> ? ks_head + page * b + skip : nullptr;
    const float* vs_page = kScaled<T> ? vs_head + page * b + skip : nullptr;
    const int64_t n = std::min(b - skip, end - first);
    if (first + n < end) {  // see Prefetch
      const int64_t next = table[first / b + 1];
      const int64_t rows = std::min(b, end - first - n);
      Prefetch(k_head + next * page_elems, rows * row_bytes);
      Prefetch(v_head + next * page_elems, rows * row_bytes);
      if constexpr (kScaled<T>) {
        Prefetch(ks_head + next * b, rows * static_cast<int64_t>(sizeof(float)));
        Prefetch(vs_head + next * b, rows * static_cast<int64_t>(sizeof(float)));
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* key = Widen(kp + i * d, d, row);
      const float scale = kScaled<T> ? ks_page[i] * p.sm_scale : p.sm_scale;
      for (int64_t g = 0; g < g_size; ++g) {
        const float* qg = q + g * d;
        float dot = 0.0f;
        for (int64_t e = 0; e < d; ++e) dot += qg[e] * key[e];
        scores[g * b + i] = dot * scale;
      }
    }
    if (p.soft_cap > 0.0f) {  // every [G, B] entry: those past n are never read
      for (int64_t i = 0; i < g_size * b; ++i) {
        scores[i] = p.soft_cap * std::tanh(scores[i] / p.soft_cap);
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
      const float* value = Widen(vp + i * d, d, row);
      const float scale = kScaled<T> ? vs_page[i] : 1.0f;
      for (int64_t g = 0; g < g_size; ++g) {
        const float w = scores[g * b + i] * scale;
        float* o = acc + g * d;
        for (int64_t e = 0; e < d; ++e) o[e] += w * value[e];
      }
    }
  }
  if (partial != nullptr) {
    std::copy(m, m + g_size, partial);
    std::copy(l, l + g_size, partial + g_size);
    std::copy(acc, acc + g_size * d, partial + 2 * g_size);
    return;
  }
  for (int64_t g = 0; g < g_size; ++g) {
    const float inv = 1.0f / l[g];
    for (int64_t e = 0; e < d; ++e) out[g * d + e] = acc[g * d + e] * inv;
  }
}

// Work items [begin, end) of `num_splits` per unit (item = unit * num_splits + split); each
// split's state goes to partials + item * (G * (D + 2)) when there is more than one.
template <typename T, int kG, int kD>
void AttendItems(const Problem& p, int64_t d, int64_t num_splits, float* partials,
                 int64_t begin, int64_t end) {
  thread_local std::vector<float> scratch;
  const int64_t stride = SplitStateSize(p, d);
  for (int64_t i = begin; i < end; ++i) {
    AttendUnit<T, kG, kD>(p, i / num_splits, d, i % num_splits, num_splits,
                          num_splits > 1 ? partials + i * stride : nullptr, scratch);
  }
}

template <typename T>
void AttendRange(const Problem& p, int64_t d, int64_t num_splits, float* partials,
                 int64_t begin, int64_t end) {
  const int64_t g = p.num_q_heads / p.num_kv_heads;
#define JAXSERVE_CASE(G, D) \
  if (g == G && d == D) return AttendItems<T, G, D>(p, d, num_splits, partials, begin, end);
  JAXSERVE_CASE(1, 64) JAXSERVE_CASE(2, 64) JAXSERVE_CASE(3, 64) JAXSERVE_CASE(4, 64)
  JAXSERVE_CASE(5, 64) JAXSERVE_CASE(6, 64) JAXSERVE_CASE(7, 64) JAXSERVE_CASE(8, 64)
  JAXSERVE_CASE(1, 128) JAXSERVE_CASE(2, 128) JAXSERVE_CASE(4, 128) JAXSERVE_CASE(8, 128)
#undef JAXSERVE_CASE
  AttendItems<T, 0, 0>(p, d, num_splits, partials, begin, end);
}

// out = the softmax-weighted merge of each unit's split states.
void MergeSplits(const Problem& p, int64_t d, int64_t units, int64_t num_splits,
                 const float* partials) {
  const int64_t g_size = p.num_q_heads / p.num_kv_heads, stride = SplitStateSize(p, d);
  for (int64_t u = 0; u < units; ++u) {
    const int64_t t = u / p.num_kv_heads, h = u % p.num_kv_heads;
    float* out = p.out + (t * p.num_q_heads + h * g_size) * d;
    const float* first = partials + u * num_splits * stride;
    for (int64_t g = 0; g < g_size; ++g) {
      float m = -1e30f;
      for (int64_t s = 0; s < num_splits; ++s) m = std::max(m, first[s * stride + g]);
      float l = 0.0f;
      float* o = out + g * d;
      std::fill(o, o + d, 0.0f);
      for (int64_t s = 0; s < num_splits; ++s) {
        const float* part = first + s * stride;
        const float w = exp_nonpositive(part[g] - m);
        l += w * part[g_size + g];
        const float* acc = part + 2 * g_size + g * d;
        for (int64_t e = 0; e < d; ++e) o[e] += w * acc[e];
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t e = 0; e < d; ++e) o[e] *= inv;
    }
  }
}

// The handlers' common part, for pages of dtype kPage (scales: int8 pages', else null).
template <ffi::DataType kPage>
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<kPage> k,
                  ffi::Buffer<kPage> v, const ffi::Buffer<ffi::F32>* k_scale,
                  const ffi::Buffer<ffi::F32>* v_scale, ffi::Buffer<ffi::S32> page_tables,
                  ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> token_row,
                  ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> sinks,
                  float sm_scale, int64_t window, float soft_cap,
                  ffi::ResultBuffer<ffi::F32> out) {
  using T = ffi::NativeType<kPage>;  // float, int8_t, or bfloat16's bits (Bf16Bits)
  const auto qd = q.dimensions(), kd = k.dimensions(), td = page_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || !(v.dimensions() == kd) ||
      qd[2] != kd[3] || kd[0] == 0 || kd[2] == 0 || qd[1] % kd[0] != 0 ||
      (k_scale != nullptr && !(k_scale->dimensions() == kd.first(3) &&
                               v_scale->dimensions() == kd.first(3))) ||
      !(out->dimensions() == qd) ||
      seq_lens.element_count() != static_cast<size_t>(td[0]) ||
      token_row.element_count() != static_cast<size_t>(qd[0]) ||
      positions.element_count() != static_cast<size_t>(qd[0]) ||
      (sinks.element_count() != 0 && sinks.element_count() != static_cast<size_t>(qd[1]))) {
    return ffi::Error::InvalidArgument(
        "paged attention: q [T, Hq, D], k and v [Hkv, N, B > 0, D] (Hkv divides Hq), page_tables "
        "[S, P], seq_lens [S], token_row and positions [T] -> out [T, Hq, D]; int8 pages' "
        "k_scale and v_scale [Hkv, N, B]; sinks [Hq] or [0]");
  }
  Problem p{q.typed_data(), k.typed_data(), v.typed_data(),
            k_scale != nullptr ? k_scale->typed_data() : nullptr,
            v_scale != nullptr ? v_scale->typed_data() : nullptr, page_tables.typed_data(),
            seq_lens.typed_data(), token_row.typed_data(), positions.typed_data(),
            sinks.element_count() ? sinks.typed_data() : nullptr, out->typed_data(), qd[0], qd[1], kd[0], kd[1], kd[2], td[0], td[1], sm_scale,
            window, soft_cap};
  if (auto e = CheckPages(p); e.failure()) return e;
  const int64_t d = qd[2];
  const int64_t units = p.num_tokens * p.num_kv_heads;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads > 1 && units >= 4 * threads) {
    const int64_t num_chunks = std::min<int64_t>(units, 8 * threads);
    const int64_t per_chunk = (units + num_chunks - 1) / num_chunks;
    jaxserve::RunChunks(pool, num_chunks, [p, d, units, per_chunk](int64_t c) {
      AttendRange<T>(p, d, 1, nullptr, c * per_chunk, std::min(units, (c + 1) * per_chunk));
    });
    return ffi::Error::Success();
  }
  // Few units (a decode step of one or two rows): split each unit's pages so that every thread
  // has work, where there are enough keys (64 KB of pages) to pay for the hand-off.
  int64_t keys = 0, longest = 0;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t n = KeysOf(p, t) - std::min(KeysOf(p, t), FirstKeyOf(p, t));
    keys += n;
    longest = std::max(longest, n);
  }
  const int64_t kv_bytes = keys * p.num_kv_heads * d * 2 * static_cast<int64_t>(sizeof(T));
  const int64_t num_splits = std::min((4 * threads + units - 1) / std::max<int64_t>(units, 1),
                                      (longest + p.page_size - 1) / p.page_size);
  if (threads == 1 || kv_bytes < (64 << 10) || num_splits < 2) {
    AttendRange<T>(p, d, 1, nullptr, 0, units);
    return ffi::Error::Success();
  }
  thread_local std::vector<float> partials;
  partials.resize(units * num_splits * SplitStateSize(p, d));
  float* parts = partials.data();
  jaxserve::RunChunks(pool, units * num_splits, [p, d, num_splits, parts](int64_t i) {
    AttendRange<T>(p, d, num_splits, parts, i, i + 1);
  });
  MergeSplits(p, d, units, num_splits, parts);
  return ffi::Error::Success();
}

// Float pages (F32, BF16): no scales.
template <ffi::DataType kPage>
ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<kPage> k,
                          ffi::Buffer<kPage> v, ffi::Buffer<ffi::S32> page_tables,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> token_row,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> sinks,
                          float sm_scale, int64_t window, float soft_cap,
                          ffi::ResultBuffer<ffi::F32> out) {
  return Attend<kPage>(pool, q, k, v, nullptr, nullptr, page_tables, seq_lens, token_row,
                       positions, sinks, sm_scale, window, soft_cap, out);
}

ffi::Error PagedAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::S8> k, ffi::Buffer<ffi::S8> v,
                              ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                              ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> seq_lens,
                              ffi::Buffer<ffi::S32> token_row, ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::F32> sinks, float sm_scale, int64_t window,
                              float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  return Attend<ffi::S8>(pool, q, k, v, &k_scale, &v_scale, page_tables, seq_lens, token_row,
                         positions, sinks, sm_scale, window, soft_cap, out);
}

// The handlers' arguments: q, then k and v of dtype kPage (then int8's scales: see below) ...
template <ffi::DataType kPage>
auto BindPages() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()          // q
      .Arg<ffi::Buffer<kPage>>()             // k
      .template Arg<ffi::Buffer<kPage>>();  // v
}

// ... then the rest, common to all three.
template <typename Binding>
auto BindRest(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()  // page_tables
      .template Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()  // token_row
      .template Arg<ffi::Buffer<ffi::S32>>()  // positions
      .template Arg<ffi::Buffer<ffi::F32>>()  // sinks
      .template Attr<float>("sm_scale")
      .template Attr<int64_t>("window")
      .template Attr<float>("soft_cap")
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttention<ffi::F32>,
                              BindRest(BindPages<ffi::F32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionBf16, PagedAttention<ffi::BF16>,
                              BindRest(BindPages<ffi::BF16>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionInt8, PagedAttentionInt8,
                              BindRest(BindPages<ffi::S8>()
                                           .Arg<ffi::Buffer<ffi::F32>>()    // k_scale
                                           .Arg<ffi::Buffer<ffi::F32>>()));  // v_scale
