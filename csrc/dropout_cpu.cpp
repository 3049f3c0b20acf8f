// CPU kernel of adls::philox_dropout: dropout whose mask comes from a counter-based generator.
//
// ATen's CPU dropout draws its mask with bernoulli_, one serial mt19937 draw per element (~7 ns per
// element on CPUs without MKL's vectorised generator). Philox4x32-10 (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", SC'11; Random123's reference rounds) is a pure function of (counter, key):
// every block of the tensor is computed independently, so the kernel runs in SIMD lanes and in parallel
// over the tensor, and the backward recomputes the mask from (seed, offset) instead of storing it.
//
// The stream, which the pure-PyTorch reference in adls_lightning/dropout.py reproduces bit for bit:
//   * key = (low, high) 32-bit halves of the seed's 64-bit pattern;
//   * Philox instance j (j = 0, 1, ...) has counter (low(j), high(j), low(offset), high(offset));
//   * the tensor (contiguous order) is cut into blocks of 32 elements; block b uses instances 8b..8b+7, and
//     element 32b + 8w + k gets word w of instance 8b + k (one 8-lane vector of word w = 8 consecutive
//     elements, so the SIMD kernel needs no transpose);
//   * the element is kept when its 32-bit word < round((1 - p) * 2^32); kept elements are multiplied by
//     1 / (1 - p) (a float, as ATen's dropout computes it), dropped ones by 0 (so NaN stays NaN, as in ATen).
// The schema, fake kernel, autograd and the p = 0 / p = 1 edges are in adls_lightning/dropout.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "mxint8_cpu_isa.h"

// The AVX2 kernel follows the extension's one switch for every CPU kernel (MXINT8_NO_AVX2_KERNELS at
// build time, ADLS_MXINT8_PORTABLE_CPU at run time, decided by adls::mxint8::avx2_selected()).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MXINT8_NO_AVX2_KERNELS)
#define ADLS_DROPOUT_HAVE_AVX2 1
#include <immintrin.h>
#endif

namespace adls {
namespace dropout {
namespace {

constexpr uint32_t kMultiplier0 = 0xD2511F53u;
constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;
constexpr int kRounds = 10;
constexpr int64_t kInstances = 8;                   // Philox instances per block (one SIMD vector per word)
constexpr int64_t kBlock = 4 * kInstances;          // elements per block
constexpr int64_t kBlocksPerTask = 2048;            // 64 Ki elements per parallel task

struct Stream {
  uint32_t key0, key1;        // the seed
  uint32_t offset0, offset1;  // counter words 2 and 3
  uint32_t threshold;         // keep when word < threshold
};

// The 32 words of block `block`, word w of instance k at bits[w * kInstances + k].
inline void philox_block_portable(const Stream& s, int64_t block, uint32_t* bits) {
  const uint64_t first = static_cast<uint64_t>(block) * kInstances;
  std::array<uint32_t, kInstances> c0, c1, c2, c3;
  for (int64_t k = 0; k < kInstances; ++k) {
    c0[k] = static_cast<uint32_t>(first + k);
    c1[k] = static_cast<uint32_t>((first + k) >> 32);
    c2[k] = s.offset0;
    c3[k] = s.offset1;
  }
  uint32_t key0 = s.key0, key1 = s.key1;
  for (int round = 0; round < kRounds; ++round) {
    for (int64_t k = 0; k < kInstances; ++k) {
      const uint64_t product0 = static_cast<uint64_t>(kMultiplier0) * c0[k];
      const uint64_t product1 = static_cast<uint64_t>(kMultiplier1) * c2[k];
      const uint32_t next0 = static_cast<uint32_t>(product1 >> 32) ^ c1[k] ^ key0;
      const uint32_t next2 = static_cast<uint32_t>(product0 >> 32) ^ c3[k] ^ key1;
      c1[k] = static_cast<uint32_t>(product1);
      c3[k] = static_cast<uint32_t>(product0);
      c0[k] = next0;
      c2[k] = next2;
    }
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  for (int64_t k = 0; k < kInstances; ++k) {
    bits[k] = c0[k];
    bits[kInstances + k] = c1[k];
    bits[2 * kInstances + k] = c2[k];
    bits[3 * kInstances + k] = c3[k];
  }
}

template <typename scalar_t, typename opmath_t>
void apply_portable(const Stream& s, opmath_t scale, const scalar_t* x, scalar_t* out, int64_t numel,
                    int64_t first_block, int64_t end_block) {
  alignas(64) uint32_t bits[kBlock];
  for (int64_t block = first_block; block < end_block; ++block) {
    philox_block_portable(s, block, bits);
    const int64_t start = block * kBlock;
    const int64_t count = std::min(kBlock, numel - start);
    for (int64_t i = 0; i < count; ++i) {
      const opmath_t factor = bits[i] < s.threshold ? scale : opmath_t(0);
      out[start + i] = static_cast<scalar_t>(static_cast<opmath_t>(x[start + i]) * factor);
    }
  }
}

#ifdef ADLS_DROPOUT_HAVE_AVX2
#define ADLS_AVX2 __attribute__((target("avx2")))

// (high, low) 32-bit halves of a * multiplier in each of 8 lanes.
ADLS_AVX2 inline void mulhilo8(__m256i a, __m256i multiplier, __m256i& high, __m256i& low) {
  const __m256i even = _mm256_mul_epu32(a, multiplier);                       // lanes 0, 2, 4, 6 (64-bit)
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), multiplier);  // lanes 1, 3, 5, 7
  low = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  high = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// Eight elements to and from float lanes. float32 as is; bfloat16 widened exactly (its bits are the top half of
// a float's) and narrowed as c10::BFloat16's float constructor does (round to nearest even, any NaN to 0x7FC0),
// so the vector path writes what the portable loop writes, bit for bit.
struct Float32Lanes {
  using scalar_t = float;
  ADLS_AVX2 static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  ADLS_AVX2 static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

struct BFloat16Lanes {
  using scalar_t = c10::BFloat16;
  ADLS_AVX2 static __m256 load(const c10::BFloat16* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  ADLS_AVX2 static void store(c10::BFloat16* p, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i narrow = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
    // Each lane holds < 2^16: pack to 16 bits (per 128-bit half), then gather the two halves' low 64 bits.
    const __m256i packed = _mm256_packus_epi32(narrow, narrow);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
  }
};

template <typename Lanes>
ADLS_AVX2 void apply_avx2(const Stream& s, float scale, const typename Lanes::scalar_t* x,
                          typename Lanes::scalar_t* out, int64_t numel, int64_t first_block, int64_t end_block) {
  const __m256i multiplier0 = _mm256_set1_epi32(static_cast<int>(kMultiplier0));
  const __m256i multiplier1 = _mm256_set1_epi32(static_cast<int>(kMultiplier1));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  // No unsigned compare in AVX2: word < threshold  <=>  (threshold ^ sign) > (word ^ sign), signed.
  const __m256i threshold = _mm256_set1_epi32(static_cast<int>(s.threshold ^ 0x80000000u));
  const __m256 scale_vector = _mm256_set1_ps(scale);
  const int64_t full_end = std::min(end_block, numel / kBlock);
  for (int64_t block = first_block; block < full_end; ++block) {
    const uint64_t first = static_cast<uint64_t>(block) * kInstances;  // a multiple of 8: no carry across lanes
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first))), lane);
    __m256i c1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first >> 32)));
    __m256i c2 = _mm256_set1_epi32(static_cast<int>(s.offset0));
    __m256i c3 = _mm256_set1_epi32(static_cast<int>(s.offset1));
    uint32_t key0 = s.key0, key1 = s.key1;
    for (int round = 0; round < kRounds; ++round) {
      __m256i high0, low0, high1, low1;
      mulhilo8(c0, multiplier0, high0, low0);
      mulhilo8(c2, multiplier1, high1, low1);
      c0 = _mm256_xor_si256(_mm256_xor_si256(high1, c1), _mm256_set1_epi32(static_cast<int>(key0)));
      c2 = _mm256_xor_si256(_mm256_xor_si256(high0, c3), _mm256_set1_epi32(static_cast<int>(key1)));
      c1 = low1;
      c3 = low0;
      key0 += kWeyl0;
      key1 += kWeyl1;
    }
    const __m256i words[4] = {c0, c1, c2, c3};
    const int64_t start = block * kBlock;
    for (int w = 0; w < 4; ++w) {
      const __m256i keep = _mm256_cmpgt_epi32(threshold, _mm256_xor_si256(words[w], sign));
      const __m256 factor = _mm256_and_ps(_mm256_castsi256_ps(keep), scale_vector);
      const int64_t at = start + w * kInstances;
      Lanes::store(out + at, _mm256_mul_ps(Lanes::load(x + at), factor));
    }
  }
  // The last, partial block (at most one per tensor).
  if (full_end < end_block) {
    apply_portable<typename Lanes::scalar_t, float>(s, scale, x, out, numel, full_end, end_block);
  }
}
#endif

// The AVX2 kernel's lanes for a dtype: float32, the training dtype, and bfloat16, the activations' dtype under CPU
// autocast (trainer.precision=bf16-mixed); void (the portable loops) for the others.
template <typename scalar_t>
struct LanesOf {
  using type = void;
};
#ifdef ADLS_DROPOUT_HAVE_AVX2
template <>
struct LanesOf<float> {
  using type = Float32Lanes;
};
template <>
struct LanesOf<c10::BFloat16> {
  using type = BFloat16Lanes;
};
#endif

template <typename scalar_t, typename opmath_t>
void apply(const Stream& s, opmath_t scale, const scalar_t* x, scalar_t* out, int64_t numel, int64_t first_block,
           int64_t end_block) {
#ifdef ADLS_DROPOUT_HAVE_AVX2
  using Lanes = typename LanesOf<scalar_t>::type;
  if constexpr (!std::is_void_v<Lanes>) {
    if (mxint8::avx2_selected()) {
      apply_avx2<Lanes>(s, scale, x, out, numel, first_block, end_block);
      return;
    }
  }
#endif
  apply_portable<scalar_t, opmath_t>(s, scale, x, out, numel, first_block, end_block);
}

void check_args(const at::Tensor& x, double p, const at::Tensor& seed, int64_t offset) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "philox_dropout: x must be floating point, got ",
              x.scalar_type());
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "philox_dropout: p must be in [0, 1], got ", p);
  TORCH_CHECK(seed.scalar_type() == at::kLong && seed.numel() == 1 && seed.device().is_cpu(),
              "philox_dropout: seed must be one int64 on the CPU, got ", seed.scalar_type(), " with ",
              seed.numel(), " elements on ", seed.device());
  TORCH_CHECK(offset >= 0, "philox_dropout: offset must be >= 0, got ", offset);
}

at::Tensor philox_dropout_cpu(const at::Tensor& x, double p, const at::Tensor& seed, int64_t offset) {
  check_args(x, p, seed, offset);
  TORCH_INTERNAL_ASSERT(x.device().is_cpu());
  if (p == 0.0) return x.clone(at::MemoryFormat::Contiguous);
  if (p == 1.0) return x.mul(0.0).contiguous();
  const at::Tensor x_c = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const uint64_t seed_bits = static_cast<uint64_t>(seed.item<int64_t>());
  const uint64_t offset_bits = static_cast<uint64_t>(offset);
  // round((1 - p) * 2^32) is in (0, 2^32) for 0 < p < 1, up to rounding at the ends.
  const double keep_words = std::nearbyint((1.0 - p) * 4294967296.0);
  const uint32_t threshold = static_cast<uint32_t>(std::clamp(keep_words, 0.0, 4294967295.0));
  const Stream stream{static_cast<uint32_t>(seed_bits), static_cast<uint32_t>(seed_bits >> 32),
                      static_cast<uint32_t>(offset_bits), static_cast<uint32_t>(offset_bits >> 32), threshold};
  const int64_t numel = x_c.numel();
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "philox_dropout_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    // As ATen's dropout: the scale 1 / (1 - p) is computed in the tensor's (op-math) type.
    const opmath_t scale = opmath_t(1) / static_cast<opmath_t>(1.0 - p);
    const scalar_t* x_ptr = x_c.const_data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t first_block, int64_t end_block) {
      apply(stream, scale, x_ptr, out_ptr, numel, first_block, end_block);
    });
  });
  return out;
}

}  // namespace
}  // namespace dropout
}  // namespace adls

TORCH_LIBRARY_IMPL(adls, CPU, m) { m.impl("philox_dropout", &adls::dropout::philox_dropout_cpu); }
