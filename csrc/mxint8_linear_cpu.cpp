// C++ CPU kernel of adls::mxint8_linear: y = x dequant(W)^T + bias straight from the int8 mantissas and
// E8M0 scales, without materialising the float weight.
//
// For every output feature n and row r, each group's dot product sum_k m[n,k] x[r,k] is accumulated in
// float32 from the int8 mantissas, then multiplied by the group's step 2^(E-133) once (a power of two, so
// exact) and added to the total. Compared with dequantize-then-matmul only the order of the float32
// additions differs. At a few rows the layer is bound by reading the weight: 1.03 bytes per weight here
// against 4 for an fp32 nn.Linear, hence the speed-up; at many rows the matmul's compute dominates and
// dequantize + a BLAS matmul wins (QLinearPacked.forward switches; see docs/mxint8.md).
//
// Work split: blocks of kBlock output features, in parallel over ATen's pool; inside a block, tiles of
// R rows x C features share each converted weight vector across R rows and each loaded x vector across C
// features (R * C independent FMA chains hide the FMA latency). float32 x with group sizes that are a
// multiple of 8 run the AVX2+FMA tiles; other group sizes the portable tiles; other dtypes dequantize and
// call at::linear, like the reference.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

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
      for (int c = 0; c < C; ++c) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w[c] + k));
        weight[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      }
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
void run_block(const LinearProblem& p, int64_t first, int64_t end) {
  int64_t row = 0;
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
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * kBlock;
      const int64_t last = std::min(first + kBlock, p.out_features);
      if (avx2) {
        run_block<true>(p, first, last);
      } else {
        run_block<false>(p, first, last);
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
