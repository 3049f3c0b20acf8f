// Which CPU kernels serve: shared by the MXINT8 quantize/dequantize kernels (mxint8_cpu.cpp) and the fused
// linear (mxint8_linear_cpu.cpp), so one switch (ADLS_MXINT8_PORTABLE_CPU) and one CPU check decide for all.
#pragma once

namespace adls {
namespace mxint8 {

// True when the AVX2 kernels serve (an x86-64 build with them, a CPU with AVX2 and FMA, and the
// portable switch unset); decided once, at the first call.
bool avx2_selected();

}  // namespace mxint8
}  // namespace adls
