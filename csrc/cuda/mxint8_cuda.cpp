// Torch binding of the MXINT8 CUDA kernels: checks arguments, allocates outputs and launches the
// kernels of mxint8_kernels.cu on the current stream. Built only when torch has CUDA.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "../mxint8_checks.h"
#include "mxint8_kernels.h"

namespace adls {
namespace mxint8 {
namespace {

cuda::FloatType float_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return cuda::FloatType::kFloat32;
    case at::kBFloat16: return cuda::FloatType::kBFloat16;
    case at::kHalf: return cuda::FloatType::kFloat16;
    default: TORCH_CHECK(false, "mxint8: unsupported dtype ", dtype);
  }
}

void check_launch(cudaError_t error, const char* op) {
  TORCH_CHECK(error == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(error));
}

std::tuple<at::Tensor, at::Tensor> mxint8_quantize_cuda(const at::Tensor& x, int64_t group_size) {
  check_quantize_args(x, group_size);
  TORCH_INTERNAL_ASSERT(x.device().is_cuda());
  const c10::cuda::CUDAGuard device_guard(x.device());
  // The format defines float64 input as rounded to float32 first.
  const at::Tensor input = (x.scalar_type() == at::kDouble ? x.to(at::kFloat) : x).contiguous();
  at::Tensor mantissa = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scale = at::empty(grouped_shape(x.sizes(), group_size), x.options().dtype(at::kByte));
  check_launch(cuda::launch_quantize(input.const_data_ptr(), float_type(input.scalar_type()),
                                     mantissa.data_ptr<int8_t>(), scale.data_ptr<uint8_t>(), scale.numel(), group_size,
                                     c10::cuda::getCurrentCUDAStream()),
               "mxint8_quantize");
  return {mantissa, scale};
}

at::Tensor mxint8_dequantize_cuda(const at::Tensor& mantissa, const at::Tensor& scale, int64_t group_size,
                                  at::ScalarType dtype) {
  check_dequantize_args(mantissa, scale, group_size, dtype);
  TORCH_INTERNAL_ASSERT(mantissa.device().is_cuda());
  const c10::cuda::CUDAGuard device_guard(mantissa.device());
  const at::Tensor mantissa_c = mantissa.contiguous();
  const at::Tensor scale_c = scale.contiguous();
  at::Tensor out = at::empty(mantissa.sizes(), mantissa.options().dtype(dtype));
  check_launch(cuda::launch_dequantize(mantissa_c.const_data_ptr<int8_t>(), scale_c.const_data_ptr<uint8_t>(),
                                       out.data_ptr(), float_type(dtype), out.numel(), group_size,
                                       c10::cuda::getCurrentCUDAStream()),
               "mxint8_dequantize");
  return out;
}

// y = x dequantize(W)^T + bias. Up to cuda::kFusedMaxRows rows of float32/bfloat16/float16 x: the fused kernel,
// which reads the packed weight once and never writes the dequantized one. More rows (or float64 x, or an
// empty input): the reference's route -- the weight dequantized once by the CUDA kernel in x's dtype, then
// cuBLAS -- where the multiply-adds, not the weight's bytes, bound the time.
at::Tensor mxint8_linear_cuda(const at::Tensor& x, const at::Tensor& mantissa, const at::Tensor& scale,
                              const std::optional<at::Tensor>& bias, int64_t group_size) {
  check_linear_args(x, mantissa, scale, bias, group_size);
  TORCH_INTERNAL_ASSERT(x.device().is_cuda());
  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t in_features = mantissa.size(1);
  const int64_t out_features = mantissa.size(0);
  const int64_t rows = in_features == 0 ? 0 : x.numel() / in_features;
  if (x.scalar_type() == at::kDouble || in_features == 0 || rows > cuda::kFusedMaxRows) {
    const at::ScalarType weight_dtype = x.scalar_type() == at::kDouble ? at::kFloat : x.scalar_type();
    const at::Tensor weight = mxint8_dequantize_cuda(mantissa, scale, group_size, weight_dtype).to(x.scalar_type());
    return at::linear(x, weight, bias.has_value() ? std::optional<at::Tensor>(bias->to(x.scalar_type())) : bias);
  }
  const at::Tensor x2 = x.reshape({rows, in_features}).contiguous();
  const at::Tensor mantissa_c = mantissa.contiguous();
  const at::Tensor scale_c = scale.contiguous();
  std::optional<at::Tensor> bias_c;
  if (bias.has_value()) bias_c = bias->to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, out_features}, x.options());
  check_launch(cuda::launch_linear(x2.const_data_ptr(), float_type(x.scalar_type()), mantissa_c.const_data_ptr<int8_t>(),
                                   scale_c.const_data_ptr<uint8_t>(),
                                   bias_c.has_value() ? bias_c->const_data_ptr<float>() : nullptr, out.data_ptr(), rows,
                                   in_features, out_features, group_size, c10::cuda::getCurrentCUDAStream()),
               "mxint8_linear");
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = out_features;
  return out.view(out_shape);
}

}  // namespace
}  // namespace mxint8
}  // namespace adls

TORCH_LIBRARY_IMPL(adls, CUDA, m) {
  m.impl("mxint8_quantize", &adls::mxint8::mxint8_quantize_cuda);
  m.impl("mxint8_dequantize", &adls::mxint8::mxint8_dequantize_cuda);
  m.impl("mxint8_linear", &adls::mxint8::mxint8_linear_cuda);
}
