// Argument checks shared by the CPU and CUDA bindings of the adls::mxint8_* ops.
// The messages match adls_lightning/mxint8/format.py (check_quantize_args / check_dequantize_args).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace adls {
namespace mxint8 {

inline void check_quantize_args(const at::Tensor& x, int64_t group_size) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
              "mxint8_quantize: x must be float32, bfloat16, float16 or float64, got ", dtype);
  TORCH_CHECK(x.dim() >= 1, "mxint8_quantize: x must have at least one dimension");
  TORCH_CHECK(group_size > 0, "mxint8_quantize: group_size must be positive, got ", group_size);
  TORCH_CHECK(x.size(-1) % group_size == 0, "mxint8_quantize: group_size=", group_size,
              " must divide the last dimension (size ", x.size(-1), ") of x with shape ", x.sizes());
}

inline std::vector<int64_t> grouped_shape(at::IntArrayRef shape, int64_t group_size) {
  std::vector<int64_t> result = shape.vec();
  result.back() /= group_size;
  return result;
}

inline void check_dequantize_args(const at::Tensor& mantissa, const at::Tensor& scale, int64_t group_size,
                                  at::ScalarType dtype) {
  TORCH_CHECK(mantissa.scalar_type() == at::kChar, "mxint8_dequantize: mantissa must be int8, got ",
              mantissa.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kByte, "mxint8_dequantize: scale must be uint8, got ", scale.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "mxint8_dequantize: dtype must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(mantissa.dim() >= 1, "mxint8_dequantize: mantissa must have at least one dimension");
  TORCH_CHECK(group_size > 0, "mxint8_dequantize: group_size must be positive, got ", group_size);
  TORCH_CHECK(mantissa.size(-1) % group_size == 0, "mxint8_dequantize: group_size=", group_size,
              " must divide the last dimension (size ", mantissa.size(-1), ") of mantissa with shape ",
              mantissa.sizes());
  const auto expected = grouped_shape(mantissa.sizes(), group_size);
  TORCH_CHECK(scale.sizes() == at::IntArrayRef(expected), "mxint8_dequantize: scale shape ", scale.sizes(),
              " does not match mantissa shape ", mantissa.sizes(), " with group_size=", group_size, "; expected ",
              at::IntArrayRef(expected));
  TORCH_CHECK(mantissa.device() == scale.device(), "mxint8_dequantize: mantissa (", mantissa.device(),
              ") and scale (", scale.device(), ") must be on one device");
}

// y = x dequant(W)^T + bias: W is (out, in) int8 mantissas with (out, in/group_size) uint8 scales.
inline void check_linear_args(const at::Tensor& x, const at::Tensor& mantissa, const at::Tensor& scale,
                              const std::optional<at::Tensor>& bias, int64_t group_size) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
              "mxint8_linear: x must be float32, bfloat16, float16 or float64, got ", dtype);
  TORCH_CHECK(mantissa.dim() == 2, "mxint8_linear: mantissa must be 2-D (out_features, in_features), got shape ",
              mantissa.sizes());
  check_dequantize_args(mantissa, scale, group_size, at::kFloat);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == mantissa.size(1), "mxint8_linear: x with shape ", x.sizes(),
              " must end in in_features=", mantissa.size(1));
  TORCH_CHECK(x.device() == mantissa.device(), "mxint8_linear: x (", x.device(), ") and mantissa (",
              mantissa.device(), ") must be on one device");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == mantissa.size(0), "mxint8_linear: bias with shape ",
                bias->sizes(), " must be (out_features=", mantissa.size(0), ",)");
    TORCH_CHECK(bias->device() == x.device(), "mxint8_linear: bias (", bias->device(), ") and x (", x.device(),
                ") must be on one device");
  }
}

}  // namespace mxint8
}  // namespace adls
