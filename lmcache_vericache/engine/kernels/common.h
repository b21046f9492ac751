// Helpers shared by the CPU attention kernels (int8_attention.cpp, dense_attention.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

namespace vericache {

// exp(x) for x <= 0 from 2^x = 2^n * 2^f, with a degree-6 polynomial for 2^f on [0, 1) (relative
// error ~2e-7): plain arithmetic the compiler vectorizes, unlike a libm call per element.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504089f;
  const float n = std::floor(t);
  const float f = t - n;
  float p = 1.53533e-4f;
  p = p * f + 1.33989e-3f;
  p = p * f + 9.61844e-3f;
  p = p * f + 5.55033e-2f;
  p = p * f + 2.40227e-1f;
  p = p * f + 6.93147e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace vericache
