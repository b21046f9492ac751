// Helpers shared by the CPU attention kernels (int8_attention.cpp, dense_attention.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(VERICACHE_VEC_WIDTH)
#include <immintrin.h>
#endif

namespace vericache {

// Floats per vector: the target's register width. GCC/Clang lower a vector extension type wider
// than the registers through general-purpose registers and the stack, not as a pair of registers,
// so 16-float vectors on an AVX2-only CPU would be far slower than 8-float ones.
// -DVERICACHE_VEC_WIDTH=N builds another width (tests check the 16-lane code on AVX2 machines).
#if defined(VERICACHE_VEC_WIDTH)
constexpr int kW = VERICACHE_VEC_WIDTH;
#elif defined(__AVX512F__)
constexpr int kW = 16;
#elif defined(__AVX__)
constexpr int kW = 8;
#else
constexpr int kW = 4;
#endif
static_assert(kW == 4 || kW == 8 || kW == 16, "VERICACHE_VEC_WIDTH must be 4, 8 or 16");
// Vector registers for accumulators and operands: 32 with AVX-512, 16 with AVX2 / SSE.
constexpr int kVecRegs = kW == 16 ? 32 : 16;

typedef float vfloat __attribute__((vector_size(4 * kW)));
typedef int32_t vint __attribute__((vector_size(4 * kW)));
inline vfloat load_floats(const float* p) { vfloat r; std::memcpy(&r, p, sizeof r); return r; }

// Prefetch for reading, into L1, every cache line of the bytes [at, at + bytes). A prefetch never
// faults, so the range may run past an array's end; it is an integer address (a pointer formed past
// the end of its array would be undefined).
inline void prefetch_bytes(uintptr_t at, int64_t bytes) {
  const uintptr_t end = at + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = at & ~uintptr_t{63}; line < end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
}
inline void store_floats(float* p, vfloat x) { std::memcpy(p, &x, sizeof x); }

// 2^f on [0, 1): a degree-6 polynomial (relative error ~2e-7), for a float or a vector of them.
template <typename F>
inline F exp2_fraction(F f) {
  F p = f * 1.53533e-4f + 1.33989e-3f;
  p = p * f + 9.61844e-3f;
  p = p * f + 5.55033e-2f;
  p = p * f + 2.40227e-1f;
  p = p * f + 6.93147e-1f;
  return p * f + 1.0f;
}

// exp(x) for x <= 0 from 2^x = 2^n * 2^f, with a degree-6 polynomial for 2^f on [0, 1) (relative
// error ~2e-7): plain arithmetic the compiler vectorizes, unlike a libm call per element.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504089f;
  const float n = std::floor(t);
  const float f = t - n;
  const float p = exp2_fraction(f);
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// exp_nonpositive of kW lanes (the same polynomial; floor from truncation, as every lane is <= 0).
inline vfloat exp_nonpositive(vfloat x) {
  x = x < -87.f ? vfloat{} - 87.f : x;
  const vfloat t = x * 1.44269504089f;
  vint n = __builtin_convertvector(t, vint);
  n += __builtin_convertvector(n, vfloat) > t;  // truncation rounded up a negative t: -1
  const vfloat f = t - __builtin_convertvector(n, vfloat);
  const vfloat p = exp2_fraction(f);
  vint bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += n << 23;
  vfloat r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// kW elements of a K/V row or weight row as floats (bf16: the bits shifted into the high half).
inline vfloat load_as_float(const float* p) { return load_floats(p); }
#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(VERICACHE_VEC_WIDTH)
// AVX2 (8 floats): one vpmovzxwd from memory and a shift; the portable form below compiles to two
// half-width conversions and an insert.
inline vfloat load_as_float(const c10::BFloat16* p) {
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<vfloat>(w);
}
#else
inline vfloat load_as_float(const c10::BFloat16* p) {
  typedef uint16_t vbits __attribute__((vector_size(2 * kW)));
  vbits b;
  std::memcpy(&b, p, sizeof b);
  const vint w = __builtin_convertvector(b, vint) << 16;
  vfloat r;
  std::memcpy(&r, &w, sizeof r);
  return r;
}
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace vericache
