// C++ CPU kernels of adls::mxint8_quantize / adls::mxint8_dequantize.
//
// The op schemas, fake kernels and the pure-PyTorch reference kernels live in
// adls_lightning/mxint8/ops.py; this file only adds CPU implementations to the dispatcher.
// Importing the module adls_lightning._C runs the static TORCH_LIBRARY_IMPL registrations.
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "mxint8_checks.h"
#include "mxint8_cpu_avx2.h"
#include "mxint8_cpu_isa.h"
#include "mxint8_math.h"

namespace adls {
namespace mxint8 {

// Environment switch that keeps the portable loops on an AVX2 machine (to test and compare them).
constexpr const char* kPortableEnv = "ADLS_MXINT8_PORTABLE_CPU";

// The AVX2 group kernels serve group sizes that are a multiple of 8; the portable loops (plain C++,
// auto-vectorised for the build's baseline ISA) serve every other case. FMA is required for the fused linear.
bool avx2_selected() {
  static const bool selected = [] {
#ifdef MXINT8_HAVE_AVX2_KERNELS
    const char* portable = std::getenv(kPortableEnv);
    const bool forced_portable = portable != nullptr && portable[0] != '\0' && std::strcmp(portable, "0") != 0;
    return !forced_portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
  }();
  return selected;
}

namespace {

// Groups per parallel task: enough elements per task to amortise the thread hand-off.
constexpr int64_t kElementsPerTask = 32768;

const char* cpu_kernel_isa() { return avx2_selected() ? "avx2" : "portable"; }

#ifdef MXINT8_HAVE_AVX2_KERNELS
bool use_avx2_kernels(int64_t group_size) { return group_size % avx2::kLanes == 0 && avx2_selected(); }
#endif

inline float load_as_float(float value) { return value; }
inline float load_as_float(uint16_t bfloat16_bits) { return bits_to_float(static_cast<uint32_t>(bfloat16_bits) << 16); }

template <typename In>
inline void quantize_groups(const In* x, int8_t* mantissa, uint8_t* scale, int64_t group_size, int64_t first_group,
                            int64_t end_group) {
  for (int64_t group = first_group; group < end_group; ++group) {
    const In* group_x = x + group * group_size;
    int8_t* group_mantissa = mantissa + group * group_size;
    uint32_t amax_bits = 0;
    for (int64_t i = 0; i < group_size; ++i) {
      amax_bits = std::max(amax_bits, abs_bits(load_as_float(group_x[i])));
    }
    const uint32_t group_scale = scale_from_amax_bits(amax_bits);
    scale[group] = static_cast<uint8_t>(group_scale);
    if (group_scale == kNanScale) {
      std::memset(group_mantissa, 0, static_cast<size_t>(group_size));
      continue;
    }
    const QuantizeFactors factors = quantize_factors(group_scale);
    for (int64_t i = 0; i < group_size; ++i) {
      group_mantissa[i] = quantize_element(load_as_float(group_x[i]), factors);
    }
  }
}

inline void store_float(float value, float* out) { *out = value; }
inline void store_float(float value, uint16_t* bfloat16_out) { *bfloat16_out = exact_float_to_bfloat16_bits(value); }

template <typename Out>
inline void dequantize_groups(const int8_t* mantissa, const uint8_t* scale, Out* out, int64_t group_size,
                              int64_t first_group, int64_t end_group) {
  for (int64_t group = first_group; group < end_group; ++group) {
    // A NaN step (scale 0xFF) makes every product NaN, so the NaN group needs no branch.
    const float step = element_scale(scale[group]);
    const int8_t* group_mantissa = mantissa + group * group_size;
    Out* group_out = out + group * group_size;
    for (int64_t i = 0; i < group_size; ++i) {
      store_float(static_cast<float>(group_mantissa[i]) * step, group_out + i);
    }
  }
}

int64_t groups_per_task(int64_t group_size) { return std::max<int64_t>(1, kElementsPerTask / group_size); }

// Runs `kernel(pointers..., group_size, first_group, end_group)` over all groups on ATen's pool.
template <typename Kernel, typename... Pointers>
void parallel_over_groups(Kernel* kernel, int64_t num_groups, int64_t group_size, Pointers... pointers) {
  at::parallel_for(0, num_groups, groups_per_task(group_size), [&](int64_t begin, int64_t end) {
    kernel(pointers..., group_size, begin, end);
  });
}

// The group kernel `name` for `group_size`: its AVX2 version where that serves, else the portable loop.
#ifdef MXINT8_HAVE_AVX2_KERNELS
#define MXINT8_GROUP_KERNEL(name, group_size) (use_avx2_kernels(group_size) ? &avx2::name : &name)
#else
#define MXINT8_GROUP_KERNEL(name, group_size) (&name)
#endif

std::tuple<at::Tensor, at::Tensor> mxint8_quantize_cpu(const at::Tensor& x, int64_t group_size) {
  check_quantize_args(x, group_size);
  TORCH_INTERNAL_ASSERT(x.device().is_cpu());
  // float16/float64 take the float32 path: float16 -> float32 is exact, and the format defines
  // float64 input as rounded to float32 first.
  const bool native_dtype = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  const at::Tensor input = (native_dtype ? x : x.to(at::kFloat)).contiguous();
  at::Tensor mantissa = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scale = at::empty(grouped_shape(x.sizes(), group_size), x.options().dtype(at::kByte));
  const int64_t num_groups = scale.numel();
  int8_t* mantissa_ptr = mantissa.data_ptr<int8_t>();
  uint8_t* scale_ptr = scale.data_ptr<uint8_t>();
  if (input.scalar_type() == at::kFloat) {
    parallel_over_groups(MXINT8_GROUP_KERNEL(quantize_groups<float>, group_size), num_groups, group_size,
                         input.const_data_ptr<float>(), mantissa_ptr, scale_ptr);
  } else {
    const auto* x_ptr = reinterpret_cast<const uint16_t*>(input.const_data_ptr<at::BFloat16>());
    parallel_over_groups(MXINT8_GROUP_KERNEL(quantize_groups<uint16_t>, group_size), num_groups, group_size, x_ptr,
                         mantissa_ptr, scale_ptr);
  }
  return {mantissa, scale};
}

at::Tensor mxint8_dequantize_cpu(const at::Tensor& mantissa, const at::Tensor& scale, int64_t group_size,
                                 at::ScalarType dtype) {
  check_dequantize_args(mantissa, scale, group_size, dtype);
  TORCH_INTERNAL_ASSERT(mantissa.device().is_cpu());
  const at::Tensor mantissa_c = mantissa.contiguous();
  const at::Tensor scale_c = scale.contiguous();
  // float16 is produced by rounding the exact float32 result, as the reference does.
  const at::ScalarType kernel_dtype = dtype == at::kHalf ? at::kFloat : dtype;
  at::Tensor out = at::empty(mantissa.sizes(), mantissa.options().dtype(kernel_dtype));
  const int64_t num_groups = scale_c.numel();
  const int8_t* mantissa_ptr = mantissa_c.const_data_ptr<int8_t>();
  const uint8_t* scale_ptr = scale_c.const_data_ptr<uint8_t>();
  if (kernel_dtype == at::kFloat) {
    parallel_over_groups(MXINT8_GROUP_KERNEL(dequantize_groups<float>, group_size), num_groups, group_size,
                         mantissa_ptr, scale_ptr, out.data_ptr<float>());
  } else {
    auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    parallel_over_groups(MXINT8_GROUP_KERNEL(dequantize_groups<uint16_t>, group_size), num_groups, group_size,
                         mantissa_ptr, scale_ptr, out_ptr);
  }
  return dtype == kernel_dtype ? out : out.to(dtype);
}

}  // namespace
}  // namespace mxint8
}  // namespace adls

TORCH_LIBRARY_IMPL(adls, CPU, m) {
  m.impl("mxint8_quantize", &adls::mxint8::mxint8_quantize_cpu);
  m.impl("mxint8_dequantize", &adls::mxint8::mxint8_dequantize_cpu);
}

// A Python module with one attribute, `cpu_isa`: `import adls_lightning._C` loads this shared
// library, which runs the registrations above (the pattern of pytorch/extension-cpp, limited-API
// friendly).
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && PyModule_AddStringConstant(module, "cpu_isa", adls::mxint8::cpu_kernel_isa()) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}
