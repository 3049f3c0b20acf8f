// Launchers of the MXINT8 CUDA kernels. Plain C++ and CUDA runtime types only (no torch headers),
// so the kernels compile with `nvcc -c` on machines whose torch has no CUDA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace adls {
namespace mxint8 {
namespace cuda {

enum class FloatType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Quantizes `num_groups * group_size` contiguous values of `x` (of type `x_type`) into int8
// mantissas and uint8 scales (one per group), asynchronously on `stream`.
cudaError_t launch_quantize(const void* x, FloatType x_type, int8_t* mantissa, uint8_t* scale, int64_t num_groups,
                            int64_t group_size, cudaStream_t stream);

// Dequantizes `numel` contiguous mantissas (groups of `group_size` sharing one scale) into `out`
// of type `out_type`, asynchronously on `stream`.
cudaError_t launch_dequantize(const int8_t* mantissa, const uint8_t* scale, void* out, FloatType out_type,
                              int64_t numel, int64_t group_size, cudaStream_t stream);

// The fused packed linear serves at most this many rows of x (batch x tokens); above it the binding dequantizes
// the weight once and calls cuBLAS, which is then bound by its multiply-adds rather than by reading the weight.
constexpr int64_t kFusedMaxRows = 16;

// out[r, n] = sum_k x[r, k] * decode(mantissa[n, k], scale[n, k / group_size]) + bias[n] for `rows` rows, straight
// from the int8 mantissas (the dequantized weight is never written), accumulated in float32 and rounded once to
// `x_type` (also the type of `out`). `bias` is float32 or null. Needs rows <= kFusedMaxRows; asynchronous on
// `stream`.
cudaError_t launch_linear(const void* x, FloatType x_type, const int8_t* mantissa, const uint8_t* scale,
                          const float* bias, void* out, int64_t rows, int64_t in_features, int64_t out_features,
                          int64_t group_size, cudaStream_t stream);

}  // namespace cuda
}  // namespace mxint8
}  // namespace adls
