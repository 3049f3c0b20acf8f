// C++ CPU kernel of adls::mxint8_linear: y = x dequant(W)^T + bias straight from the int8 mantissas and
// E8M0 scales, without materialising the float weight.
//
// Arithmetic, two ways: the 4x2.. tiles accumulate each group's dot product sum_k m[n,k] x[r,k] in float32
// from the int8 mantissas, then multiply it by the group's step 2^(E-133) once (a power of two, so exact);
// the exact-decode tiles turn the mantissas into the exact weights m * 2^(E-133) first. Either way, compared
// with dequantize-then-matmul only the order of the float32 additions differs. At a few rows the layer is
// bound by reading the weight: 1.03 bytes per weight here against 4 for an fp32 nn.Linear, hence the
// speed-up; at many rows the matmul's compute dominates and dequantize + a BLAS matmul wins
// (QLinearPacked.forward switches; see docs/mxint8.md).
//
// Work split: blocks of kBlock output features, in parallel over ATen's pool. With AVX2+FMA, float32 x and
// a group size that is a multiple of 8 (up to kChunkInputs):
//  * every 8 rows take the exact-decode tiles: one feature at a time, each vector of 8 mantissas decoded
//    into the exact float weights (no per-group rescale) and multiplied into 8 rows of x, whose 8 input
//    features are plain loads from an L1-resident copy (8 independent FMA chains, one shuffle per 8 FMAs);
//  * the remaining rows (all rows below 8) take tiles of R rows x C features that share each converted
//    weight vector across R rows and each loaded x vector across C features, rescaling once per group.
// Other group sizes take portable tiles; other dtypes dequantize and call at::linear, like the reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "mxint8_checks.h"
#include "mxint8_cpu_isa.h"
#include "mxint8_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MXINT8_NO_AVX2_KERNELS)
#define MXINT8_HAVE_AVX2_LINEAR 1
#include <immintrin.h>
#define MXINT8_AVX2_FMA __attribute__((target("avx2,fma")))
#endif

namespace adls {
namespace mxint8 {
namespace {

// Output features per block (every tile width below divides it).
constexpr int64_t kBlock = 8;
// Multiply-adds per parallel task: enough to amortise the thread hand-off.
constexpr int64_t kMacsPerTask = 1 << 17;

struct LinearProblem {
  const float* x;          // rows x in_features, contiguous
  const int8_t* mantissa;  // out_features x in_features
  const uint8_t* scale;    // out_features x groups
  const float* bias;       // out_features, or nullptr
  float* out;              // rows x out_features
  int64_t rows;
  int64_t in_features;
  int64_t out_features;
  int64_t group_size;
  int64_t groups() const { return in_features / group_size; }
};

inline float step_of(const LinearProblem& p, int64_t feature, int64_t group) {
  return element_scale(p.scale[feature * p.groups() + group]);
}

inline void store_output(const LinearProblem& p, int64_t row, int64_t feature, float total) {
  p.out[row * p.out_features + feature] = p.bias != nullptr ? total + p.bias[feature] : total;
}

// Portable tile: R rows x C features, 8 independent lanes per dot product so the compiler can vectorise
// the inner loop without reassociating (-ffp-contract=off, no -ffast-math).
template <int R, int C>
void tile_portable(const LinearProblem& p, int64_t row, int64_t feature) {
  constexpr int kLanes = 8;
  const int64_t in = p.in_features;
  float total[R][C] = {};
  for (int64_t group = 0; group < p.groups(); ++group) {
    const int64_t first = group * p.group_size;
    const int64_t end = first + p.group_size;
    float lanes[R][C][kLanes] = {};
    int64_t k = first;
    for (; k + kLanes <= end; k += kLanes) {
      for (int c = 0; c < C; ++c) {
        const int8_t* w = p.mantissa + (feature + c) * in + k;
        for (int r = 0; r < R; ++r) {
          const float* x = p.x + (row + r) * in + k;
          for (int l = 0; l < kLanes; ++l) lanes[r][c][l] += static_cast<float>(w[l]) * x[l];
        }
      }
    }
    for (; k < end; ++k) {
      for (int c = 0; c < C; ++c) {
        for (int r = 0; r < R; ++r) {
          lanes[r][c][0] += static_cast<float>(p.mantissa[(feature + c) * in + k]) * p.x[(row + r) * in + k];
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const float step = step_of(p, feature + c, group);
      for (int r = 0; r < R; ++r) {
        float dot = 0.0f;
        for (int l = 0; l < kLanes; ++l) dot += lanes[r][c][l];
        total[r][c] += dot * step;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) store_output(p, row + r, feature + c, total[r][c]);
  }
}

#ifdef MXINT8_HAVE_AVX2_LINEAR
MXINT8_AVX2_FMA inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 mantissas as floats (vpmovsxbd + vcvtdq2ps).
MXINT8_AVX2_FMA inline __m256 convert_mantissas(const int8_t* mantissa) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mantissa))));
}

// AVX2 tile: 8 input features per step; the group size is a multiple of 8.
template <int R, int C>
MXINT8_AVX2_FMA void tile_avx2(const LinearProblem& p, int64_t row, int64_t feature) {
  const int64_t in = p.in_features;
  const int8_t* w[C];
  for (int c = 0; c < C; ++c) w[c] = p.mantissa + (feature + c) * in;
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = p.x + (row + r) * in;
  __m256 total[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) total[r][c] = _mm256_setzero_ps();
  }
  for (int64_t group = 0; group < p.groups(); ++group) {
    const int64_t first = group * p.group_size;
    const int64_t end = first + p.group_size;
    __m256 dot[R][C];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) dot[r][c] = _mm256_setzero_ps();
    }
    for (int64_t k = first; k < end; k += 8) {
      __m256 weight[C];
      for (int c = 0; c < C; ++c) weight[c] = convert_mantissas(w[c] + k);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x[r] + k);
        for (int c = 0; c < C; ++c) dot[r][c] = _mm256_fmadd_ps(weight[c], xv, dot[r][c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const __m256 step = _mm256_set1_ps(step_of(p, feature + c, group));
      for (int r = 0; r < R; ++r) total[r][c] = _mm256_fmadd_ps(dot[r][c], step, total[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) store_output(p, row + r, feature + c, horizontal_sum(total[r][c]));
  }
}


// Exact decode of 8 mantissas of one group into the dequantized weights m * 2^(E-133), for E <= 237: the
// float whose exponent field is E + 17 and whose mantissa field is m + 128, minus the same float with
// m = 0 (both have the same exponent, so the subtraction is exact, subnormal results included). An integer
// add and a float subtract, neither of which runs on the FMA pipes.
constexpr uint32_t kMaxDecodableScale = 237;
// Inputs per chunk of the exact-decode tiles (at most; whole groups): 8 rows of x take 24 KiB of the 32 KiB
// L1. Each chunk ends in a horizontal sum per output, so longer chunks cost less (at 8 rows, 256 inputs
// took 1.10-1.18x the time of 768, 512 took 1.02-1.09x, and 1024, all of L1, 1.04-1.11x). The copy's row
// stride is 16 floats longer than a chunk and a compile-time constant, so that the 8 rows are one pointer
// plus displacements.
constexpr int64_t kChunkInputs = 768;
constexpr int64_t kChunkStride = kChunkInputs + 16;

struct ExactDecode {
  __m256i offset;  // bits of the float with exponent field E + 17 and mantissa field 128
  MXINT8_AVX2_FMA explicit ExactDecode(uint32_t scale)
      : offset(_mm256_set1_epi32(static_cast<int32_t>(((scale + 17) << 23) + 128))) {}
  MXINT8_AVX2_FMA __m256 operator()(const int8_t* mantissa) const {
    const __m256i m = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mantissa)));
    return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(m, offset)), _mm256_castsi256_ps(offset));
  }
};

// The same weights for any scale (larger E, or NaN): convert and multiply by the exact step.
struct ConvertAndScale {
  __m256 step;
  MXINT8_AVX2_FMA explicit ConvertAndScale(uint32_t scale) : step(_mm256_set1_ps(element_scale(scale))) {}
  MXINT8_AVX2_FMA __m256 operator()(const int8_t* mantissa) const {
    return _mm256_mul_ps(convert_mantissas(mantissa), step);
  }
};

// acc[r] += x[r, k] * weight[k] over inputs [begin, begin + group_size) of one group, 8 at a time, where
// x + r * kChunkStride + k reads x[r, k] and weights(w + k) gives the 8 weights from k on.
template <class Weights>
MXINT8_AVX2_FMA inline void fma_group8(__m256 (&acc)[8], const float* x, const int8_t* w, int64_t begin,
                                       int64_t group_size, Weights weights) {
#pragma GCC unroll 4
  for (int64_t k = begin; k < begin + group_size; k += 8) {
    const __m256 weight = weights(w + k);
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * kChunkStride + k), weight, acc[r]);
    }
  }
}

// Lane r of the result is the sum of the 8 lanes of v[r].
MXINT8_AVX2_FMA inline __m256 sum_each(const __m256 (&v)[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Rows [row, row + 8) x features [first, end) over inputs [k0, k1) (whole groups): each feature's weights
// are decoded once per 8 inputs and shared by 8 rows, whose x vectors are plain loads (8 independent FMA
// chains, no shuffles besides the decode's widen). Adds each dot product to out, or starts it at k0 = 0;
// adds the bias with the last inputs. GroupSize > 0 fixes the group size at compile time, which unrolls
// fma_group8's loop (for 32, the default: 1.17x faster at 8 rows than the run-time loop).
template <int64_t GroupSize>
MXINT8_AVX2_FMA void decode_rows8(const LinearProblem& p, const float* xchunk, int64_t row,
                                  int64_t first, int64_t end, int64_t k0, int64_t k1) {
  const int64_t group_size = GroupSize > 0 ? GroupSize : p.group_size;
  const int64_t in = p.in_features;
  const float* x = xchunk - k0;  // x + r * kChunkStride + k reads x[row + r, k]
  const bool last = k1 == in;
  for (int64_t feature = first; feature < end; ++feature) {
    const int8_t* w = p.mantissa + feature * in;
    const uint8_t* scale = p.scale + feature * p.groups();
    __m256 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t group = k0 / group_size; group < k1 / group_size; ++group) {
      const uint32_t e = scale[group];
      if (e <= kMaxDecodableScale) {
        fma_group8(acc, x, w, group * group_size, group_size, ExactDecode(e));
      } else {
        fma_group8(acc, x, w, group * group_size, group_size, ConvertAndScale(e));
      }
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, sum_each(acc));
    for (int r = 0; r < 8; ++r) {
      float& out = p.out[(row + r) * p.out_features + feature];
      float total = k0 == 0 ? sums[r] : out + sums[r];
      if (last && p.bias != nullptr) total += p.bias[feature];
      out = total;
    }
  }
}

// Rows [0, rows - rows % 8) of features [first, end), 8 rows at a time, in chunks of whole groups of inputs
// whose x for 8 rows stays in L1 while the weights stream past.
void decode_rows(const LinearProblem& p, int64_t first, int64_t end) {
  const int64_t rows = p.rows - p.rows % 8;
  const int64_t chunk_groups = kChunkInputs / p.group_size;  // group_size <= kChunkInputs
  const int64_t chunk = chunk_groups * p.group_size;
  // x's chunk for 8 rows, copied once and read for every feature of the task; 64-byte aligned, so that no
  // 32-byte load straddles two cache lines.
  alignas(64) float xchunk[8 * kChunkStride];
  for (int64_t k0 = 0; k0 < p.in_features; k0 += chunk) {
    const int64_t k1 = std::min(p.in_features, k0 + chunk);
    for (int64_t row = 0; row < rows; row += 8) {
      for (int r = 0; r < 8; ++r) {
        const float* source = p.x + (row + r) * p.in_features;
        std::copy(source + k0, source + k1, xchunk + r * kChunkStride);
      }
      if (p.group_size == 32) {
        decode_rows8<32>(p, xchunk, row, first, end, k0, k1);
      } else {
        decode_rows8<0>(p, xchunk, row, first, end, k0, k1);
      }
    }
  }
}
#endif

// Rows of a tile and features of a tile, as tiles of kRows rows and kRows-dependent widths.
template <bool Avx2, int R, int C>
void run_tile(const LinearProblem& p, int64_t row, int64_t feature) {
#ifdef MXINT8_HAVE_AVX2_LINEAR
  if constexpr (Avx2) {
    tile_avx2<R, C>(p, row, feature);
    return;
  }
#endif
  tile_portable<R, C>(p, row, feature);
}

// One block of output features [first, end) for rows [row, row + R): full C-wide tiles, then single features.
template <bool Avx2, int R, int C>
void run_rows(const LinearProblem& p, int64_t row, int64_t first, int64_t end) {
  int64_t feature = first;
  for (; feature + C <= end; feature += C) run_tile<Avx2, R, C>(p, row, feature);
  for (; feature < end; ++feature) run_tile<Avx2, R, 1>(p, row, feature);
}

// All rows of one block: tiles of 4 rows x 2 features, the remainder as 3x2, 2x4 or 1x4 (the weight block
// stays in L1 across the row tiles).
template <bool Avx2>
void run_block(const LinearProblem& p, int64_t first, int64_t end, int64_t row = 0) {
  for (; row + 4 <= p.rows; row += 4) run_rows<Avx2, 4, 2>(p, row, first, end);
  switch (p.rows - row) {
    case 3:
      run_rows<Avx2, 3, 2>(p, row, first, end);
      break;
    case 2:
      run_rows<Avx2, 2, 4>(p, row, first, end);
      break;
    case 1:
      run_rows<Avx2, 1, 4>(p, row, first, end);
      break;
    default:
      break;
  }
}

void fused_linear_float(const LinearProblem& p) {
#ifdef MXINT8_HAVE_AVX2_LINEAR
  const bool avx2 = p.group_size % 8 == 0 && avx2_selected();
#else
  const bool avx2 = false;
#endif
  const int64_t blocks = (p.out_features + kBlock - 1) / kBlock;
  const int64_t macs_per_block = kBlock * p.in_features * std::max<int64_t>(p.rows, 1);
  const int64_t grain = std::max<int64_t>(1, kMacsPerTask / macs_per_block);
#ifdef MXINT8_HAVE_AVX2_LINEAR
  // From 8 rows, multiples of 8 rows take the exact-decode tiles; the remaining rows the 4x2.. tiles.
  const int64_t decoded_rows = avx2 && p.group_size <= kChunkInputs ? p.rows - p.rows % 8 : 0;
#else
  const int64_t decoded_rows = 0;
#endif
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
#ifdef MXINT8_HAVE_AVX2_LINEAR
    if (decoded_rows > 0) decode_rows(p, begin * kBlock, std::min(end * kBlock, p.out_features));
#endif
    if (decoded_rows == p.rows) return;
    for (int64_t block = begin; block < end; ++block) {
      const int64_t block_first = block * kBlock;
      const int64_t block_last = std::min(block_first + kBlock, p.out_features);
      if (avx2) {
        run_block<true>(p, block_first, block_last, decoded_rows);
      } else {
        run_block<false>(p, block_first, block_last, decoded_rows);
      }
    }
  });
}

at::Tensor dequantize_weight(const at::Tensor& mantissa, const at::Tensor& scale, int64_t group_size,
                             at::ScalarType dtype) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("adls::mxint8_dequantize", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType)>();
  return op.call(mantissa, scale, group_size, dtype);
}

at::Tensor mxint8_linear_cpu(const at::Tensor& x, const at::Tensor& mantissa, const at::Tensor& scale,
                             const std::optional<at::Tensor>& bias, int64_t group_size) {
  check_linear_args(x, mantissa, scale, bias, group_size);
  TORCH_INTERNAL_ASSERT(x.device().is_cpu());
  if (x.scalar_type() != at::kFloat) {
    // The reference's route: the weight in x's dtype (float64: float32 weight, converted exactly).
    const at::ScalarType weight_dtype = x.scalar_type() == at::kDouble ? at::kFloat : x.scalar_type();
    const at::Tensor weight = dequantize_weight(mantissa, scale, group_size, weight_dtype).to(x.scalar_type());
    return at::linear(x, weight, bias.has_value() ? std::optional<at::Tensor>(bias->to(x.scalar_type())) : bias);
  }
  const int64_t in_features = mantissa.size(1);
  const int64_t out_features = mantissa.size(0);
  const at::Tensor x2 = x.reshape({-1, in_features}).contiguous();
  const at::Tensor mantissa_c = mantissa.contiguous();
  const at::Tensor scale_c = scale.contiguous();
  std::optional<at::Tensor> bias_c;
  if (bias.has_value()) bias_c = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x2.size(0), out_features}, x.options());
  const LinearProblem problem{x2.const_data_ptr<float>(),
                              mantissa_c.const_data_ptr<int8_t>(),
                              scale_c.const_data_ptr<uint8_t>(),
                              bias_c.has_value() ? bias_c->const_data_ptr<float>() : nullptr,
                              out.data_ptr<float>(),
                              x2.size(0),
                              in_features,
                              out_features,
                              group_size};
  if (problem.rows > 0 && out_features > 0) fused_linear_float(problem);
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = out_features;
  return out.view(out_shape);
}

}  // namespace
}  // namespace mxint8
}  // namespace adls

TORCH_LIBRARY_IMPL(adls, CPU, m) { m.impl("mxint8_linear", &adls::mxint8::mxint8_linear_cpu); }
