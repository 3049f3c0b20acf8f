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

}  // namespace cuda
}  // namespace mxint8
}  // namespace adls
