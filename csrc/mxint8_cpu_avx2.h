// AVX2 group kernels of the MXINT8 CPU ops, for group sizes that are a multiple of 8.
//
// GCC's auto-vectorised portable loops (mxint8_cpu.cpp) turn the float -> int8 narrowing and the
// float -> bfloat16 truncation into long mask/blend/permute chains; written with intrinsics each
// 8 elements take a handful of instructions (quantize 3.8x, bfloat16 dequantize 1.5x faster, see
// docs/mxint8.md). They compute exactly the steps of mxint8_math.h and stay bit-identical to it:
//   * amax over the |x| bit patterns with an unsigned max (NaN sorts above +inf);
//   * clamping to +-127 *before* rounding equals rounding then clamping, because the bounds are
//     integers and rounding is monotone; cvtps2dq then rounds half to even in the default MXCSR
//     mode, the same mode the portable path's 1.5 * 2^23 trick relies on;
//   * the scaled values lie in (-128, 128), so the saturating int32 -> int8 packs never saturate.
// Functions carry target("avx2") so the file builds for baseline x86-64; the caller checks the CPU.
// Define MXINT8_NO_AVX2_KERNELS to build without them (what non-x86 builds get).
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MXINT8_NO_AVX2_KERNELS)
#define MXINT8_HAVE_AVX2_KERNELS 1

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "mxint8_math.h"

#define MXINT8_AVX2 __attribute__((target("avx2")))

namespace adls {
namespace mxint8 {
namespace avx2 {

constexpr int64_t kLanes = 8;

MXINT8_AVX2 inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }

MXINT8_AVX2 inline __m256 load8(const uint16_t* bfloat16_x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bfloat16_x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

MXINT8_AVX2 inline uint32_t horizontal_max(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// round_half_to_even(clamp((x * pre) * post, -127, 127)) of 8 elements, as int32.
template <typename In>
MXINT8_AVX2 inline __m256i quantize8(const In* x, __m256 pre, __m256 post) {
  const __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(load8(x), pre), post);
  const __m256 at_least_lower = _mm256_max_ps(scaled, _mm256_set1_ps(-kMaxMantissa));
  return _mm256_cvtps_epi32(_mm256_min_ps(at_least_lower, _mm256_set1_ps(kMaxMantissa)));
}

template <typename In>
MXINT8_AVX2 void quantize_groups(const In* x, int8_t* mantissa, uint8_t* scale, int64_t group_size,
                                 int64_t first_group, int64_t end_group) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i lane_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t group = first_group; group < end_group; ++group) {
    const In* group_x = x + group * group_size;
    int8_t* group_mantissa = mantissa + group * group_size;
    __m256i amax = _mm256_setzero_si256();
    for (int64_t i = 0; i < group_size; i += kLanes) {
      amax = _mm256_max_epu32(amax, _mm256_and_si256(_mm256_castps_si256(load8(group_x + i)), abs_mask));
    }
    const uint32_t group_scale = scale_from_amax_bits(horizontal_max(amax));
    scale[group] = static_cast<uint8_t>(group_scale);
    if (group_scale == kNanScale) {
      std::memset(group_mantissa, 0, static_cast<size_t>(group_size));
      continue;
    }
    const QuantizeFactors factors = quantize_factors(group_scale);
    const __m256 pre = _mm256_set1_ps(factors.pre);
    const __m256 post = _mm256_set1_ps(factors.post);
    int64_t i = 0;
    for (; i + 4 * kLanes <= group_size; i += 4 * kLanes) {
      // In-lane packs interleave the 128-bit halves; one cross-lane permute restores the order.
      const In* block = group_x + i;
      const __m256i words_low =
          _mm256_packs_epi32(quantize8(block, pre, post), quantize8(block + kLanes, pre, post));
      const __m256i words_high =
          _mm256_packs_epi32(quantize8(block + 2 * kLanes, pre, post), quantize8(block + 3 * kLanes, pre, post));
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words_low, words_high), lane_order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(group_mantissa + i), bytes);
    }
    for (; i < group_size; i += kLanes) {
      const __m256i rounded = quantize8(group_x + i, pre, post);
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(group_mantissa + i), _mm_packs_epi16(words, words));
    }
  }
}

MXINT8_AVX2 inline __m256 dequantize8(const int8_t* mantissa, __m256 step) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mantissa));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), step);
}

// bfloat16 = top half of the float32 bits (exact, see exact_float_to_bfloat16_bits).
MXINT8_AVX2 inline __m256i bfloat16_bits(__m256 values) { return _mm256_srli_epi32(_mm256_castps_si256(values), 16); }

template <typename Out>
MXINT8_AVX2 void dequantize_groups(const int8_t* mantissa, const uint8_t* scale, Out* out, int64_t group_size,
                                   int64_t first_group, int64_t end_group) {
  for (int64_t group = first_group; group < end_group; ++group) {
    // A NaN step (scale 0xFF) makes every product the same quiet NaN, as in the portable path.
    const __m256 step = _mm256_set1_ps(element_scale(scale[group]));
    const int8_t* group_mantissa = mantissa + group * group_size;
    Out* group_out = out + group * group_size;
    int64_t i = 0;
    if constexpr (sizeof(Out) == sizeof(uint16_t)) {
      // 16 at a time: one in-lane pack of two vectors and one permute per 32-byte store.
      for (; i + 2 * kLanes <= group_size; i += 2 * kLanes) {
        const __m256i packed = _mm256_packus_epi32(bfloat16_bits(dequantize8(group_mantissa + i, step)),
                                                   bfloat16_bits(dequantize8(group_mantissa + i + kLanes, step)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(group_out + i), _mm256_permute4x64_epi64(packed, 0xD8));
      }
      for (; i < group_size; i += kLanes) {
        const __m256i high = bfloat16_bits(dequantize8(group_mantissa + i, step));
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(group_out + i), packed);
      }
    } else {
      for (; i < group_size; i += kLanes) _mm256_storeu_ps(group_out + i, dequantize8(group_mantissa + i, step));
    }
  }
}

}  // namespace avx2
}  // namespace mxint8
}  // namespace adls

#endif
