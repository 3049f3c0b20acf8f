// MXINT8 scalar arithmetic shared by the C++ CPU kernels and the CUDA kernels.
//
// This header includes no torch headers so that the CUDA kernels (and their `nvcc -c` compile
// check in CI) do not need them. Every function mirrors one step of the project's definition of
// the format, adls_lightning/mxint8/format.py, and must stay bit-identical to it.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MXINT8_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MXINT8_HOST_DEVICE inline
#endif

namespace adls {
namespace mxint8 {

constexpr uint32_t kNanScale = 0xFF;          // E8M0 code for NaN
constexpr uint32_t kFloatQuietNanBits = 0x7FC00000u;
constexpr uint16_t kBFloat16QuietNanBits = 0x7FC0u;
constexpr float kMaxMantissa = 127.0f;        // symmetric clamp: -128 is never produced

MXINT8_HOST_DEVICE uint32_t float_to_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

MXINT8_HOST_DEVICE float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// |x| as float32 bits. Non-negative float bit patterns order like their values and NaN patterns
// sort above +inf, so an unsigned max over these is amax with NaN propagation.
MXINT8_HOST_DEVICE uint32_t abs_bits(float value) { return float_to_bits(value) & 0x7FFFFFFFu; }

// Shared scale byte E = floor(log2(amax)) + 127 clamped at 0 = float32 exponent field of amax
// (0 for zero/subnormal amax, 0xFF for inf/NaN amax).
MXINT8_HOST_DEVICE uint32_t scale_from_amax_bits(uint32_t amax_bits) { return amax_bits >> 23; }

// x * 2^(133 - E) computed as (x * pre) * post: 2^(133-E) overflows float32 for E < 6, so those
// groups take two exact power-of-two steps (x * 2^64) * 2^(69 - E).
struct QuantizeFactors {
  float pre;
  float post;
};

MXINT8_HOST_DEVICE QuantizeFactors quantize_factors(uint32_t scale) {
  const bool small = scale < 6;
  const int post_exponent = 133 - static_cast<int>(scale) - (small ? 64 : 0);  // in [-122, 127]
  QuantizeFactors factors;
  factors.pre = small ? 18446744073709551616.0f : 1.0f;  // 2^64
  factors.post = bits_to_float(static_cast<uint32_t>(post_exponent + 127) << 23);
  return factors;
}

// Round half to even for |value| < 2^22: adding and subtracting 1.5 * 2^23 leaves only the
// integer part, rounded by the FPU's default round-to-nearest-even mode. Written this way (not
// nearbyintf) so the CPU loops vectorise with plain SSE2/AVX2 adds. CUDA has a single
// round-to-nearest-even instruction (rintf), which gives the same result.
MXINT8_HOST_DEVICE float round_half_to_even(float value) {
#if defined(__CUDA_ARCH__)
  return rintf(value);
#else
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return (value + magic) - magic;
#endif
}

// (value * pre) * post as two separately rounded multiplies, never fused with the rounding add.
MXINT8_HOST_DEVICE float scale_for_rounding(float value, QuantizeFactors factors) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__fmul_rn(value, factors.pre), factors.post);
#else
  return (value * factors.pre) * factors.post;  // built with -ffp-contract=off
#endif
}

MXINT8_HOST_DEVICE int8_t quantize_element(float value, QuantizeFactors factors) {
  // Written as `a < b ? a : b` / `a > b ? a : b`, exactly the semantics of x86 minps/maxps, so the
  // clamp vectorises to two instructions (no NaN reaches here: NaN groups are skipped).
  const float rounded = round_half_to_even(scale_for_rounding(value, factors));
  const float below = rounded < kMaxMantissa ? rounded : kMaxMantissa;
  const float clamped = below > -kMaxMantissa ? below : -kMaxMantissa;
  return static_cast<int8_t>(static_cast<int32_t>(clamped));
}

// Value of one mantissa step, 2^(E - 133), as float32 (NaN for E = 0xFF). It is a normal number
// for E >= 7 (biased exponent E - 6) and the subnormal with the single bit 2^(E + 16) for E < 7.
MXINT8_HOST_DEVICE float element_scale(uint32_t scale) {
  if (scale == kNanScale) return bits_to_float(kFloatQuietNanBits);
  return bits_to_float(scale >= 7 ? (scale - 6) << 23 : 1u << (scale + 16));
}

// bfloat16 bits of a dequantized value. m * 2^(E-133) with |m| <= 128 has at most 8 significant
// bits and lies on bfloat16's grid (its subnormals reach 2^-133), so truncation is exact.
MXINT8_HOST_DEVICE uint16_t exact_float_to_bfloat16_bits(float value) {
  return static_cast<uint16_t>(float_to_bits(value) >> 16);
}

}  // namespace mxint8
}  // namespace adls
