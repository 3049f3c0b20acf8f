// The autograd of adls::mxint8_linear in C++, for CPU and CUDA tensors: a call runs no Python.
//
// ops.py also registers the same backward in Python (torch.library.register_autograd, on the Autograd alias key),
// which serves when this extension is not loaded; a kernel registered for a backend's own autograd key
// (AutogradCPU, AutogradCUDA) takes precedence over an alias key's. The Python wrapper cost ~8-14 us per call on
// the 2-core CPU where this was written (7-14 us more than the op itself under inference mode), and 70 us on an
// H200 machine's host: more than the whole layer at a few rows.
//
// The gradients are the Python backward's: d/dx = grad_output @ W with W dequantized in x's dtype (float64 x: the
// exact float32 weight, converted), d/dbias = grad_output summed over rows; the packed weight is a constant.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>

namespace adls {
namespace mxint8 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_linear(const at::Tensor& x, const at::Tensor& mantissa, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t group_size) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("adls::mxint8_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            int64_t)>();
  return op.call(x, mantissa, scale, bias, group_size);
}

at::Tensor call_dequantize(const at::Tensor& mantissa, const at::Tensor& scale, int64_t group_size,
                           at::ScalarType dtype) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("adls::mxint8_dequantize", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType)>();
  return op.call(mantissa, scale, group_size, dtype);
}

class PackedLinearFunction : public torch::autograd::Function<PackedLinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& mantissa,
                            const at::Tensor& scale, const std::optional<at::Tensor>& bias, int64_t group_size) {
    ctx->save_for_backward({mantissa, scale});
    ctx->saved_data["group_size"] = group_size;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["has_bias"] = bias.has_value();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_linear(x, mantissa, scale, bias, group_size);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad_output = grad_outputs[0];
    const variable_list saved = ctx->get_saved_variables();
    const at::ScalarType x_dtype = ctx->saved_data["x_dtype"].toScalarType();
    at::Tensor grad_x;
    at::Tensor grad_bias;
    if (ctx->needs_input_grad(0)) {
      const at::ScalarType weight_dtype = x_dtype == at::kDouble ? at::kFloat : x_dtype;
      const at::Tensor weight =
          call_dequantize(saved[0], saved[1], ctx->saved_data["group_size"].toInt(), weight_dtype).to(x_dtype);
      grad_x = at::matmul(grad_output.to(x_dtype), weight);
    }
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(3)) {
      grad_bias = grad_output.reshape({-1, grad_output.size(-1)}).sum(0);
    }
    return {grad_x, at::Tensor(), at::Tensor(), grad_bias, at::Tensor()};
  }
};

at::Tensor mxint8_linear_autograd(const at::Tensor& x, const at::Tensor& mantissa, const at::Tensor& scale,
                                  const std::optional<at::Tensor>& bias, int64_t group_size) {
  return PackedLinearFunction::apply(x, mantissa, scale, bias, group_size);
}

}  // namespace
}  // namespace mxint8
}  // namespace adls

TORCH_LIBRARY_IMPL(adls, AutogradCPU, m) { m.impl("mxint8_linear", &adls::mxint8::mxint8_linear_autograd); }
TORCH_LIBRARY_IMPL(adls, AutogradCUDA, m) { m.impl("mxint8_linear", &adls::mxint8::mxint8_linear_autograd); }
