// A step's keys and values written into their slots of one layer's paged pool, in place, as an
// XLA FFI custom call whose page (and scale) outputs alias its page inputs:
//
//   WriteKv  k, v f32[T, Hkv, D]; slots i32[T] (page * B + offset); pages [Hkv, N, B, D] of
//            float32, bfloat16 (rounded to nearest even), or int8 with scales f32[Hkv, N, B]
//            -> the same pages with token t's vectors at slot slots[t]
//
// XLA's scatter does the same, but as several kernels per layer (and with int8 pages, the
// quantization's reductions, divisions and transposes as a dozen more): compiled code that every
// step shape of the unrolled model keeps in memory. An int8 vector is quantized as
// kv_cache.py's quantize_kv: its absolute maximum maps to 127 (scale = max * (1 / 127); a zero vector
// gets scale 0 and zeros), each element divided by the scale and rounded to nearest even.
// A slot outside the pool fails the call before anything is written.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Bf16Bits = uint16_t;

// float32 -> bfloat16 rounded to nearest even, NaN kept quiet (as XLA's convert).
inline Bf16Bits ToBf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return static_cast<Bf16Bits>((bits >> 16) | 0x40);
  return static_cast<Bf16Bits>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// One vector of d floats into a page row of type T (and its scale for int8).
template <typename T>
inline void Store(const float* x, int64_t d, T* row, float* scale) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(x, x + d, row);
  } else if constexpr (std::is_same_v<T, Bf16Bits>) {
    for (int64_t e = 0; e < d; ++e) row[e] = ToBf16(x[e]);
  } else {
    float amax = 0.0f;
    for (int64_t e = 0; e < d; ++e) amax = std::max(amax, std::fabs(x[e]));
    const float s = amax * (1.0f / 127.0f);  // as XLA folds quantize_kv's division
    const float div = s > 0.0f ? s : 1.0f;
    for (int64_t e = 0; e < d; ++e) {
      const float q = std::nearbyint(x[e] / div);  // the default rounding: to nearest even
      row[e] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
    }
    *scale = s;
  }
}

template <ffi::DataType kPage>
ffi::Error Write(ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slots,
                 ffi::Result<ffi::Buffer<kPage>> k_pages, ffi::Result<ffi::Buffer<kPage>> v_pages,
                 float* k_scale, float* v_scale) {
  using T = ffi::NativeType<kPage>;  // float, int8_t, or bfloat16's bits
  const auto kd = k.dimensions(), pd = k_pages->dimensions();
  if (kd.size() != 3 || pd.size() != 4 || !(v.dimensions() == kd) ||
      !(v_pages->dimensions() == pd) || kd[1] != pd[0] || kd[2] != pd[3] ||
      slots.element_count() != static_cast<size_t>(kd[0])) {
    return ffi::Error::InvalidArgument(
        "write_kv: k, v [T, Hkv, D], slots [T], pages [Hkv, N, B, D] (int8: scales "
        "[Hkv, N, B])");
  }
  const int64_t tokens = kd[0], heads = kd[1], d = kd[2];
  const int64_t pool_slots = pd[1] * pd[2];  // N * B: a head's slots, page-major
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0 || slot[t] >= pool_slots) {
      return ffi::Error::InvalidArgument(
          "write_kv: token " + std::to_string(t) + " writes slot " + std::to_string(slot[t]) +
          ", outside the pool's " + std::to_string(pool_slots) + " slots");
    }
  }
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  T* kout = k_pages->typed_data();
  T* vout = v_pages->typed_data();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = h * pool_slots + slot[t];  // [h, page, offset] as one slot index
      const int64_t src = (t * heads + h) * d;
      Store<T>(kp + src, d, kout + at * d, k_scale != nullptr ? k_scale + at : nullptr);
      Store<T>(vp + src, d, vout + at * d, v_scale != nullptr ? v_scale + at : nullptr);
    }
  }
  return ffi::Error::Success();
}

template <ffi::DataType kPage>
ffi::Error WriteFloat(ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                      ffi::Buffer<ffi::S32> slots, ffi::Buffer<kPage>, ffi::Buffer<kPage>,
                      ffi::Result<ffi::Buffer<kPage>> k_pages,
                      ffi::Result<ffi::Buffer<kPage>> v_pages) {
  return Write<kPage>(k, v, slots, k_pages, v_pages, nullptr, nullptr);
}

ffi::Error WriteInt8(ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::S8>,
                     ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                     ffi::Result<ffi::Buffer<ffi::S8>> k_pages,
                     ffi::Result<ffi::Buffer<ffi::S8>> v_pages,
                     ffi::Result<ffi::Buffer<ffi::F32>> k_scale,
                     ffi::Result<ffi::Buffer<ffi::F32>> v_scale) {
  if (!(k_scale->dimensions() == k_pages->dimensions().first(3)) ||
      !(v_scale->dimensions() == k_scale->dimensions())) {
    return ffi::Error::InvalidArgument("write_kv: int8 pages' scales are [Hkv, N, B]");
  }
  return Write<ffi::S8>(k, v, slots, k_pages, v_pages, k_scale->typed_data(),
                        v_scale->typed_data());
}

// Arguments k, v, slots, then the pages (aliased by the results, in the same order).
auto BindNew() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()   // k
      .Arg<ffi::Buffer<ffi::F32>>()   // v
      .Arg<ffi::Buffer<ffi::S32>>();  // slots
}

template <ffi::DataType kPage>
auto BindFloat() {
  return BindNew()
      .template Arg<ffi::Buffer<kPage>>()
      .template Arg<ffi::Buffer<kPage>>()
      .template Ret<ffi::Buffer<kPage>>()
      .template Ret<ffi::Buffer<kPage>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, WriteFloat<ffi::F32>, BindFloat<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKvBf16, WriteFloat<ffi::BF16>, BindFloat<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKvInt8, WriteInt8,
                              BindNew()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
