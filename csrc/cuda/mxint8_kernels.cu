// MXINT8 CUDA kernels. Includes no torch headers (see mxint8_kernels.h); the arithmetic is the
// shared host/device code in ../mxint8_math.h, so CPU, CUDA and the Python reference agree bit
// for bit. Launched by mxint8_cuda.cpp (the torch binding).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../mxint8_math.h"
#include "mxint8_kernels.h"

namespace adls {
namespace mxint8 {
namespace cuda {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kMaxBlocks = 65535;  // grid-stride loops cover the rest
constexpr int kBytesPerAccess = 16;    // one 128-bit load/store per access

// How each float type is read into float32 and written from an exactly representable float32.
template <FloatType T>
struct Traits;

template <>
struct Traits<FloatType::kFloat32> {
  using Storage = float;
  static __device__ __forceinline__ float load(float value) { return value; }
  static __device__ __forceinline__ float store(float value) { return value; }
};

template <>
struct Traits<FloatType::kBFloat16> {
  using Storage = uint16_t;
  static __device__ __forceinline__ float load(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }
  static __device__ __forceinline__ uint16_t store(float value) { return exact_float_to_bfloat16_bits(value); }
};

template <>
struct Traits<FloatType::kFloat16> {
  using Storage = uint16_t;
  static __device__ __forceinline__ float load(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
  // Rounds to nearest even, like the float32 -> float16 conversion of the CPU path.
  static __device__ __forceinline__ uint16_t store(float value) { return __half_as_ushort(__float2half_rn(value)); }
};

__device__ __forceinline__ int64_t global_thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

int blocks_for(int64_t work_items) {
  const int64_t blocks = (work_items + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

bool is_aligned(const void* pointer, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(pointer) % alignment == 0;
}

// ---------------------------------------------------------------------------------------------
// Dequantize

template <int kCount>
struct alignas(kCount) Bytes {
  int8_t values[kCount];
};

// One 128-bit store per thread (4 float32 or 8 16-bit outputs), so a warp's stores are one contiguous 512-byte
// run, from one 4- or 8-byte load of mantissas (contiguous across the warp too). On an H200, 16 mantissas per
// thread (one 128-bit load, then four 128-bit stores 64 bytes apart across lanes) ran float32 output at 0.43-0.46x
// copy speed; this layout runs it at 0.80-0.89x (docs/mxint8.md). Needs group_size % 16 == 0 and 16-byte alignment
// (what the dispatch checks).
template <FloatType T>
__global__ void dequantize_vectorized_kernel(const int8_t* __restrict__ mantissa, const uint8_t* __restrict__ scale,
                                             typename Traits<T>::Storage* __restrict__ out, int64_t num_chunks,
                                             int64_t group_size) {
  using Storage = typename Traits<T>::Storage;
  constexpr int kChunk = kBytesPerAccess / sizeof(Storage);
  for (int64_t chunk = global_thread_index(); chunk < num_chunks; chunk += grid_stride()) {
    const int64_t first = chunk * kChunk;
    const float step = element_scale(__ldg(scale + first / group_size));
    const Bytes<kChunk> codes = reinterpret_cast<const Bytes<kChunk>*>(mantissa)[chunk];
    alignas(kBytesPerAccess) Storage values[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) values[i] = Traits<T>::store(static_cast<float>(codes.values[i]) * step);
    reinterpret_cast<int4*>(out)[chunk] = *reinterpret_cast<const int4*>(values);
  }
}

// Any group size and alignment: one element per thread.
template <FloatType T>
__global__ void dequantize_elementwise_kernel(const int8_t* __restrict__ mantissa, const uint8_t* __restrict__ scale,
                                              typename Traits<T>::Storage* __restrict__ out, int64_t numel,
                                              int64_t group_size) {
  for (int64_t i = global_thread_index(); i < numel; i += grid_stride()) {
    out[i] = Traits<T>::store(static_cast<float>(mantissa[i]) * element_scale(__ldg(scale + i / group_size)));
  }
}

template <FloatType T>
cudaError_t dequantize_as(const int8_t* mantissa, const uint8_t* scale, void* out, int64_t numel, int64_t group_size,
                          cudaStream_t stream) {
  auto* typed_out = static_cast<typename Traits<T>::Storage*>(out);
  if (group_size % kBytesPerAccess == 0 && is_aligned(mantissa, kBytesPerAccess) &&
      is_aligned(out, kBytesPerAccess)) {
    const int64_t num_chunks = numel / (kBytesPerAccess / sizeof(typename Traits<T>::Storage));
    dequantize_vectorized_kernel<T><<<blocks_for(num_chunks), kThreadsPerBlock, 0, stream>>>(
        mantissa, scale, typed_out, num_chunks, group_size);
  } else {
    dequantize_elementwise_kernel<T>
        <<<blocks_for(numel), kThreadsPerBlock, 0, stream>>>(mantissa, scale, typed_out, numel, group_size);
  }
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Quantize

// A team of kTeam consecutive lanes (kTeam a power of two <= 32) quantizes one group of
// kTeam * kVec elements; each lane loads kVec elements with one 128-bit load, and the group amax
// is reduced with warp shuffles. Needs a 16-byte-aligned input.
template <FloatType T, int kTeam>
__global__ void quantize_team_kernel(const typename Traits<T>::Storage* __restrict__ x, int8_t* __restrict__ mantissa,
                                     uint8_t* __restrict__ scale, int64_t num_vectors) {
  using Storage = typename Traits<T>::Storage;
  constexpr int kVec = kBytesPerAccess / sizeof(Storage);
  const int lane = threadIdx.x % 32;
  // The loop condition is uniform across the warp (v - lane is the warp's first vector), so every
  // lane reaches the shuffles; lanes past the end work on zeros and store nothing.
  for (int64_t v = global_thread_index(); v - lane < num_vectors; v += grid_stride()) {
    const bool active = v < num_vectors;
    alignas(kBytesPerAccess) Storage raw[kVec];
    if (active) {
      *reinterpret_cast<int4*>(raw) = __ldg(reinterpret_cast<const int4*>(x) + v);
    } else {
      *reinterpret_cast<int4*>(raw) = make_int4(0, 0, 0, 0);
    }
    float values[kVec];
    uint32_t amax_bits = 0;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      values[i] = Traits<T>::load(raw[i]);
      amax_bits = max(amax_bits, abs_bits(values[i]));
    }
#pragma unroll
    for (int offset = kTeam / 2; offset > 0; offset /= 2) {
      amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, offset));
    }
    if (!active) continue;
    const uint32_t group_scale = scale_from_amax_bits(amax_bits);
    if (v % kTeam == 0) scale[v / kTeam] = static_cast<uint8_t>(group_scale);
    Bytes<kVec> codes;
    if (group_scale == kNanScale) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) codes.values[i] = 0;
    } else {
      const QuantizeFactors factors = quantize_factors(group_scale);
#pragma unroll
      for (int i = 0; i < kVec; ++i) codes.values[i] = quantize_element(values[i], factors);
    }
    reinterpret_cast<Bytes<kVec>*>(mantissa)[v] = codes;
  }
}

// Any group size and alignment: one thread per group.
template <FloatType T>
__global__ void quantize_group_per_thread_kernel(const typename Traits<T>::Storage* __restrict__ x,
                                                 int8_t* __restrict__ mantissa, uint8_t* __restrict__ scale,
                                                 int64_t num_groups, int64_t group_size) {
  for (int64_t group = global_thread_index(); group < num_groups; group += grid_stride()) {
    const auto* group_x = x + group * group_size;
    int8_t* group_mantissa = mantissa + group * group_size;
    uint32_t amax_bits = 0;
    for (int64_t i = 0; i < group_size; ++i) amax_bits = max(amax_bits, abs_bits(Traits<T>::load(group_x[i])));
    const uint32_t group_scale = scale_from_amax_bits(amax_bits);
    scale[group] = static_cast<uint8_t>(group_scale);
    if (group_scale == kNanScale) {
      for (int64_t i = 0; i < group_size; ++i) group_mantissa[i] = 0;
      continue;
    }
    const QuantizeFactors factors = quantize_factors(group_scale);
    for (int64_t i = 0; i < group_size; ++i) group_mantissa[i] = quantize_element(Traits<T>::load(group_x[i]), factors);
  }
}

template <FloatType T, int kTeam>
void launch_team(const void* x, int8_t* mantissa, uint8_t* scale, int64_t num_vectors, cudaStream_t stream) {
  quantize_team_kernel<T, kTeam><<<blocks_for(num_vectors), kThreadsPerBlock, 0, stream>>>(
      static_cast<const typename Traits<T>::Storage*>(x), mantissa, scale, num_vectors);
}

template <FloatType T>
cudaError_t quantize_as(const void* x, int8_t* mantissa, uint8_t* scale, int64_t num_groups, int64_t group_size,
                        cudaStream_t stream) {
  constexpr int64_t kVec = kBytesPerAccess / sizeof(typename Traits<T>::Storage);
  const int64_t team = group_size / kVec;
  const bool team_fits = group_size % kVec == 0 && team <= 32 && (team & (team - 1)) == 0;
  if (team_fits && is_aligned(x, kBytesPerAccess) && is_aligned(mantissa, kVec)) {
    const int64_t num_vectors = num_groups * team;
    switch (team) {
      case 1: launch_team<T, 1>(x, mantissa, scale, num_vectors, stream); break;
      case 2: launch_team<T, 2>(x, mantissa, scale, num_vectors, stream); break;
      case 4: launch_team<T, 4>(x, mantissa, scale, num_vectors, stream); break;
      case 8: launch_team<T, 8>(x, mantissa, scale, num_vectors, stream); break;
      case 16: launch_team<T, 16>(x, mantissa, scale, num_vectors, stream); break;
      default: launch_team<T, 32>(x, mantissa, scale, num_vectors, stream); break;
    }
  } else {
    quantize_group_per_thread_kernel<T><<<blocks_for(num_groups), kThreadsPerBlock, 0, stream>>>(
        static_cast<const typename Traits<T>::Storage*>(x), mantissa, scale, num_groups, group_size);
  }
  return cudaGetLastError();
}


// ---------------------------------------------------------------------------------------------
// Fused packed linear (few rows)
//
// A block computes kLinearColumns output features for up to kRows rows of x. Its threads split the input features
// into chunks of 16 (one 128-bit load of mantissas per output feature), decode each chunk once in registers --
// m * 2^(E - 133) is exact in float32 -- and multiply it into every row, so the weight is read once per row tile
// and the dequantized weight is never written. Partial sums are reduced across lanes by shuffles and across warps
// in shared memory in a fixed order, so a result does not depend on scheduling.

constexpr int kLinearColumns = 4;
constexpr int kCodesPerChunk = kBytesPerAccess;  // int8 mantissas per 128-bit load
constexpr int kMaxLinearThreads = 256;
constexpr int kWarpSize = 32;

struct LinearProblem {
  const int8_t* mantissa;
  const uint8_t* scale;
  const float* bias;  // null: no bias
  int64_t rows;
  int64_t in_features;
  int64_t out_features;
  int64_t group_size;
};

// A float32 sum rounded to nearest even in the output type (sums are not on the type's grid, unlike the
// dequantized values Traits::store writes).
template <FloatType T>
__device__ __forceinline__ typename Traits<T>::Storage round_from_float(float value);

template <>
__device__ __forceinline__ float round_from_float<FloatType::kFloat32>(float value) {
  return value;
}

template <>
__device__ __forceinline__ uint16_t round_from_float<FloatType::kBFloat16>(float value) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

template <>
__device__ __forceinline__ uint16_t round_from_float<FloatType::kFloat16>(float value) {
  return __half_as_ushort(__float2half_rn(value));
}

// 16 consecutive values of x as float32, by 128-bit loads (the caller checked the 16-byte alignment).
template <FloatType T>
__device__ __forceinline__ void load_x_chunk(const typename Traits<T>::Storage* __restrict__ x,
                                             float (&values)[kCodesPerChunk]) {
  using Storage = typename Traits<T>::Storage;
  constexpr int kPerLoad = kBytesPerAccess / sizeof(Storage);
#pragma unroll
  for (int load = 0; load < kCodesPerChunk / kPerLoad; ++load) {
    alignas(kBytesPerAccess) Storage raw[kPerLoad];
    *reinterpret_cast<int4*>(raw) = __ldg(reinterpret_cast<const int4*>(x) + load);
#pragma unroll
    for (int i = 0; i < kPerLoad; ++i) values[load * kPerLoad + i] = Traits<T>::load(raw[i]);
  }
}

// The block's sums: each (column, row) pair reduced over the lanes of every warp, then over the warps, then the
// bias added and the result rounded once into `out`.
template <FloatType T, int kRows>
__device__ __forceinline__ void store_block_sums(float (&sums)[kLinearColumns][kRows], float* partial,
                                                 typename Traits<T>::Storage* __restrict__ out,
                                                 const LinearProblem& p, int64_t first_column, int64_t first_row,
                                                 int rows_here) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  constexpr int kPairs = kLinearColumns * kRows;
#pragma unroll
  for (int c = 0; c < kLinearColumns; ++c) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float value = sums[c][r];
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
      }
      if (lane == 0) partial[warp * kPairs + c * kRows + r] = value;
    }
  }
  __syncthreads();
  for (int pair = threadIdx.x; pair < kPairs; pair += blockDim.x) {
    const int r = pair % kRows;
    const int64_t column = first_column + pair / kRows;
    if (r >= rows_here || column >= p.out_features) continue;
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += partial[w * kPairs + pair];
    if (p.bias != nullptr) total += __ldg(p.bias + column);
    out[(first_row + r) * p.out_features + column] = round_from_float<T>(total);
  }
}

// `kWidth` consecutive weights of one output feature, decoded (they share one scale: kWidth divides the group size).
template <int kWidth>
__device__ __forceinline__ void decode_weights(const int8_t* __restrict__ codes, float step, float (&weight)[kWidth]) {
  if constexpr (kWidth == kCodesPerChunk) {
    Bytes<kCodesPerChunk> chunk;
    *reinterpret_cast<int4*>(&chunk) = __ldg(reinterpret_cast<const int4*>(codes));
#pragma unroll
    for (int i = 0; i < kWidth; ++i) weight[i] = static_cast<float>(chunk.values[i]) * step;
  } else {
#pragma unroll
    for (int i = 0; i < kWidth; ++i) weight[i] = static_cast<float>(codes[i]) * step;
  }
}

// `kWidth` consecutive values of x as float32.
template <FloatType T, int kWidth>
__device__ __forceinline__ void load_x(const typename Traits<T>::Storage* __restrict__ x, float (&values)[kWidth]) {
  if constexpr (kWidth == kCodesPerChunk) {
    load_x_chunk<T>(x, values);
  } else {
#pragma unroll
    for (int i = 0; i < kWidth; ++i) values[i] = Traits<T>::load(x[i]);
  }
}

// kVectorized (in_features and group_size multiples of 16, x and mantissa 16-byte aligned): each thread takes
// chunks of 16 input features, by 128-bit loads. Otherwise one input feature per thread and step, any shape and
// alignment.
template <FloatType T, int kRows, bool kVectorized>
__global__ void __launch_bounds__(kMaxLinearThreads)
    linear_kernel(const typename Traits<T>::Storage* __restrict__ x, typename Traits<T>::Storage* __restrict__ out,
                  LinearProblem p) {
  constexpr int kWidth = kVectorized ? kCodesPerChunk : 1;
  __shared__ float partial[kMaxLinearThreads / kWarpSize * kLinearColumns * kRows];
  const int64_t first_column = static_cast<int64_t>(blockIdx.x) * kLinearColumns;
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * kRows;
  const int rows_here = static_cast<int>(min(static_cast<int64_t>(kRows), p.rows - first_row));
  const int64_t groups_per_row = p.in_features / p.group_size;
  float sums[kLinearColumns][kRows];
#pragma unroll
  for (int c = 0; c < kLinearColumns; ++c) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) sums[c][r] = 0.0f;
  }
  const int64_t stride = static_cast<int64_t>(blockDim.x) * kWidth;
  for (int64_t k = static_cast<int64_t>(threadIdx.x) * kWidth; k < p.in_features; k += stride) {
    float weight[kLinearColumns][kWidth];
#pragma unroll
    for (int c = 0; c < kLinearColumns; ++c) {
      const int64_t column = first_column + c;
      if (column < p.out_features) {
        const float step = element_scale(__ldg(p.scale + column * groups_per_row + k / p.group_size));
        decode_weights<kWidth>(p.mantissa + column * p.in_features + k, step, weight[c]);
      } else {
#pragma unroll
        for (int i = 0; i < kWidth; ++i) weight[c][i] = 0.0f;
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < rows_here) {
        float values[kWidth];
        load_x<T, kWidth>(x + (first_row + r) * p.in_features + k, values);
#pragma unroll
        for (int c = 0; c < kLinearColumns; ++c) {
#pragma unroll
          for (int i = 0; i < kWidth; ++i) sums[c][r] = fmaf(values[i], weight[c][i], sums[c][r]);
        }
      }
    }
  }
  store_block_sums<T, kRows>(sums, partial, out, p, first_column, first_row, rows_here);
}

// Enough whole warps for the block's chunks of input features, at most kMaxLinearThreads.
int linear_threads(int64_t work_per_row) {
  const int64_t warps = (work_per_row + kWarpSize - 1) / kWarpSize;
  const int64_t threads = warps * kWarpSize;
  return static_cast<int>(threads < kWarpSize ? kWarpSize : (threads > kMaxLinearThreads ? kMaxLinearThreads : threads));
}

template <FloatType T, int kRows>
void launch_linear_tiles(const void* x, void* out, const LinearProblem& p, bool vectorized, cudaStream_t stream) {
  using Storage = typename Traits<T>::Storage;
  const dim3 grid(static_cast<unsigned>((p.out_features + kLinearColumns - 1) / kLinearColumns),
                  static_cast<unsigned>((p.rows + kRows - 1) / kRows));
  const auto* typed_x = static_cast<const Storage*>(x);
  auto* typed_out = static_cast<Storage*>(out);
  if (vectorized) {
    linear_kernel<T, kRows, true>
        <<<grid, linear_threads(p.in_features / kCodesPerChunk), 0, stream>>>(typed_x, typed_out, p);
  } else {
    linear_kernel<T, kRows, false><<<grid, linear_threads(p.in_features), 0, stream>>>(typed_x, typed_out, p);
  }
}

template <FloatType T>
cudaError_t linear_as(const void* x, void* out, const LinearProblem& p, cudaStream_t stream) {
  const bool vectorized = p.in_features % kCodesPerChunk == 0 && p.group_size % kCodesPerChunk == 0 &&
                          is_aligned(x, kBytesPerAccess) && is_aligned(p.mantissa, kBytesPerAccess);
  // the smallest row tile that holds all rows: no accumulators spent on rows that are not there
  if (p.rows <= 1) {
    launch_linear_tiles<T, 1>(x, out, p, vectorized, stream);
  } else if (p.rows <= 2) {
    launch_linear_tiles<T, 2>(x, out, p, vectorized, stream);
  } else if (p.rows <= 4) {
    launch_linear_tiles<T, 4>(x, out, p, vectorized, stream);
  } else if (p.rows <= 8) {
    launch_linear_tiles<T, 8>(x, out, p, vectorized, stream);
  } else {
    launch_linear_tiles<T, 16>(x, out, p, vectorized, stream);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize(const void* x, FloatType x_type, int8_t* mantissa, uint8_t* scale, int64_t num_groups,
                            int64_t group_size, cudaStream_t stream) {
  if (num_groups == 0) return cudaSuccess;
  switch (x_type) {
    case FloatType::kFloat32: return quantize_as<FloatType::kFloat32>(x, mantissa, scale, num_groups, group_size, stream);
    case FloatType::kBFloat16: return quantize_as<FloatType::kBFloat16>(x, mantissa, scale, num_groups, group_size, stream);
    case FloatType::kFloat16: return quantize_as<FloatType::kFloat16>(x, mantissa, scale, num_groups, group_size, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_dequantize(const int8_t* mantissa, const uint8_t* scale, void* out, FloatType out_type,
                              int64_t numel, int64_t group_size, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  switch (out_type) {
    case FloatType::kFloat32: return dequantize_as<FloatType::kFloat32>(mantissa, scale, out, numel, group_size, stream);
    case FloatType::kBFloat16: return dequantize_as<FloatType::kBFloat16>(mantissa, scale, out, numel, group_size, stream);
    case FloatType::kFloat16: return dequantize_as<FloatType::kFloat16>(mantissa, scale, out, numel, group_size, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_linear(const void* x, FloatType x_type, const int8_t* mantissa, const uint8_t* scale,
                          const float* bias, void* out, int64_t rows, int64_t in_features, int64_t out_features,
                          int64_t group_size, cudaStream_t stream) {
  if (rows < 0 || rows > kFusedMaxRows || in_features < 0 || out_features < 0 || group_size <= 0 ||
      in_features % group_size != 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || out_features == 0) return cudaSuccess;
  const LinearProblem problem{mantissa, scale, bias, rows, in_features, out_features, group_size};
  switch (x_type) {
    case FloatType::kFloat32: return linear_as<FloatType::kFloat32>(x, out, problem, stream);
    case FloatType::kBFloat16: return linear_as<FloatType::kBFloat16>(x, out, problem, stream);
    case FloatType::kFloat16: return linear_as<FloatType::kFloat16>(x, out, problem, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace mxint8
}  // namespace adls
