// What every CUDA kernel file shares: the launch shape, exact fp32 arithmetic, 16-byte vector
// loads and stores, block reductions, and the host-side stream/guard.
//
// Rounding: the references (pycomm.reference) and the CPU kernels (built with
// -ffp-contract=off) round after every multiply and every add. The device code spells each
// operation with an _rn intrinsic, so that no multiply-add is ever fused whatever the nvcc
// flags (setup.py also passes --fmad=false).
//
// With PYCOMM_CUDA_EMULATION the same source compiles as C++ against emu/emu.h, which runs
// the kernels on the CPU (tests/kernels/test_cuda.py): device code may use only what is defined
// here or there, and launches go through PYCOMM_LAUNCH.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "checks.h"

#ifdef PYCOMM_CUDA_EMULATION
#include "cuda/emu/emu.h"
#else
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace pycomm::cuda {

// Every kernel runs blocks of kThreads threads; a thread handles kVec consecutive elements at a
// time, so that its fp32 traffic is whole 16-byte vectors.
constexpr int kThreads = 256;
constexpr int kVec = 8;
constexpr int kWarp = 32;

#ifdef PYCOMM_CUDA_EMULATION
// the kernels' registration: emulated, they are the CPU kernels of the mirror library pycomm_emu
#define PYCOMM_CUDA_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(pycomm_emu, CPU, m)
#define PYCOMM_LAUNCH(grid, threads, stream, ...) \
  ::pycomm::emu::launch(dim3(grid), dim3(threads), __VA_ARGS__)
using Stream = int;
inline Stream current_stream() { return 0; }
struct DeviceGuard {
  explicit DeviceGuard(const at::Device&) {}
};

inline float fmul(float a, float b) { return a * b; }
inline float fadd(float a, float b) { return a + b; }
inline float fsub(float a, float b) { return a - b; }
inline float fdiv(float a, float b) { return a / b; }
inline float rint_even(float a) { return std::nearbyint(a); }
inline double dadd(double a, double b) { return a + b; }
inline double dmul(double a, double b) { return a * b; }
inline double ddiv(double a, double b) { return a / b; }
inline float to_float(double a) { return static_cast<float>(a); }
inline bool finite(float a) { return std::isfinite(a); }
inline bool finite(double a) { return std::isfinite(a); }
inline bool is_nan(float a) { return std::isnan(a); }
inline uint32_t float_bits(float a) {
  uint32_t u;
  std::memcpy(&u, &a, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float a;
  std::memcpy(&a, &u, sizeof a);
  return a;
}
inline void sync_threads() { ::pycomm::emu::sync_threads(); }
template <typename T>
T shfl_xor(T v, int lane_mask, int width) {
  return ::pycomm::emu::shfl_xor(v, lane_mask, width);
}
inline void check_aligned(const void* p, size_t bytes) { ::pycomm::emu::check_aligned(p, bytes); }
#else
#define PYCOMM_CUDA_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(pycomm, CUDA, m)
#define PYCOMM_LAUNCH(grid, threads, stream, ...) __VA_ARGS__<<<(grid), (threads), 0, (stream)>>>
using Stream = cudaStream_t;
inline Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }
using DeviceGuard = c10::cuda::CUDAGuard;

__device__ __forceinline__ float fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float fsub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float fdiv(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float rint_even(float a) { return rintf(a); }
__device__ __forceinline__ double dadd(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double dmul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double ddiv(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float to_float(double a) { return __double2float_rn(a); }
__device__ __forceinline__ bool finite(float a) { return isfinite(a); }
__device__ __forceinline__ bool finite(double a) { return isfinite(a); }
__device__ __forceinline__ bool is_nan(float a) { return isnan(a); }
__device__ __forceinline__ uint32_t float_bits(float a) { return __float_as_uint(a); }
__device__ __forceinline__ float bits_float(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ void sync_threads() { __syncthreads(); }
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int lane_mask, int width) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
}
__device__ __forceinline__ void check_aligned(const void*, size_t) {}
#endif

// N elements of T as one aligned access of sizeof(T) * N <= 16 bytes.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T>
__device__ __forceinline__ bool aligned(const T* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Pointers to kVec consecutive elements that may be moved as 16-byte vectors (kVec elements of
// a 16-bit type are one vector, of fp32 two).
template <typename T>
__device__ __forceinline__ bool vec_ok(const T* p) {
  return aligned(p, sizeof(T) * kVec < 16 ? sizeof(T) * kVec : 16);
}

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  check_aligned(p, sizeof(Vec<T, N>));
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  check_aligned(p, sizeof(Vec<T, N>));
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// Four floats to p in shared memory, 16-byte aligned, as one st.shared.v4.f32 (inline PTX:
// nvcc splits some 16-byte struct or float4 stores into four scalar ones).
__device__ __forceinline__ void store_shared4(float* p, const Vec<float, 4>& v) {
  check_aligned(p, 16);
#ifdef PYCOMM_CUDA_EMULATION
  *reinterpret_cast<Vec<float, 4>*>(p) = v;
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v.v[0]), "f"(v.v[1]),
               "f"(v.v[2]), "f"(v.v[3])
               : "memory");
#endif
}

// Loads kVec values of T from p aligned to W bytes (a power of two, sizeof(T) <= W <= 16):
// loads of W bytes (or of kVec elements, if fewer).
template <int W, typename T>
__device__ __forceinline__ void load_raw8_as(const T* p, T (&v)[kVec]) {
  static_assert(W >= static_cast<int>(sizeof(T)) && W <= 16 && (W & (W - 1)) == 0,
                "a load width is a power of two between the element and 16 bytes");
  constexpr int kPer = W / static_cast<int>(sizeof(T)) < kVec ? W / static_cast<int>(sizeof(T))
                                                               : kVec;
#pragma unroll
  for (int k = 0; k < kVec; k += kPer) {
    const Vec<T, kPer> u = load_vec<T, kPer>(p + k);
#pragma unroll
    for (int j = 0; j < kPer; ++j) v[k + j] = u.v[j];
  }
}

// Loads kVec values of T as 16-byte vectors, from vec_ok(p).
template <typename T>
__device__ __forceinline__ void load_raw8(const T* p, T (&v)[kVec]) {
  load_raw8_as<16>(p, v);
}

// Stores kVec values of T as 16-byte vectors, at vec_ok(p).
template <typename T>
__device__ __forceinline__ void store_raw8(T* p, const T (&v)[kVec]) {
  constexpr int kPer = 16 / sizeof(T) < kVec ? 16 / sizeof(T) : kVec;
#pragma unroll
  for (int k = 0; k < kVec; k += kPer) {
    Vec<T, kPer> u;
#pragma unroll
    for (int j = 0; j < kPer; ++j) u.v[j] = v[k + j];
    store_vec<T, kPer>(p + k, u);
  }
}

// kVec elements as fp32, from vec_ok(p).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&f)[kVec]) {
  T v[kVec];
  load_raw8(p, v);
#pragma unroll
  for (int k = 0; k < kVec; ++k) f[k] = static_cast<float>(v[k]);
}

// Rounds kVec fp32 values to T (to nearest even) and stores them, at vec_ok(p).
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&f)[kVec]) {
  T v[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) v[k] = static_cast<T>(f[k]);
  store_raw8(p, v);
}

// x rounded to T and back: the value a store of x to a T keeps.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// The combination over the block of every thread's v by op (an associative, commutative
// function: a fixed tree, so deterministic), returned to every thread. Every thread of the
// block must call it.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op) {
  __shared__ T partial[kThreads / kWarp];
  __shared__ T total;
#pragma unroll
  for (int m = kWarp / 2; m > 0; m /= 2) v = op(v, shfl_xor(v, m, kWarp));
  const int tid = threadIdx.x;
  if (tid % kWarp == 0) partial[tid / kWarp] = v;
  sync_threads();
  if (tid == 0) {
    T s = partial[0];
    for (int w = 1; w < kThreads / kWarp; ++w) s = op(s, partial[w]);
    total = s;
  }
  sync_threads();
  const T out = total;
  sync_threads();  // total may be written again by the next call
  return out;
}

// (a, b) summed over the block in a fixed order (deterministic), returned to every thread;
// one round of shared memory for both. Every thread of the block must call it.
__device__ inline void block_sum2(double& a, double& b) {
  __shared__ double pa[kThreads / kWarp], pb[kThreads / kWarp];
  __shared__ double ta, tb;
#pragma unroll
  for (int m = kWarp / 2; m > 0; m /= 2) {
    a = dadd(a, shfl_xor(a, m, kWarp));
    b = dadd(b, shfl_xor(b, m, kWarp));
  }
  const int tid = threadIdx.x;
  if (tid % kWarp == 0) {
    pa[tid / kWarp] = a;
    pb[tid / kWarp] = b;
  }
  sync_threads();
  if (tid == 0) {
    double sa = pa[0], sb = pb[0];
    for (int w = 1; w < kThreads / kWarp; ++w) {
      sa = dadd(sa, pa[w]);
      sb = dadd(sb, pb[w]);
    }
    ta = sa;
    tb = sb;
  }
  sync_threads();
  a = ta;
  b = tb;
  sync_threads();  // ta and tb may be written again by the next call
}

// Blocks of kThreads of `Kernel` that the current device holds at once (one wave): its SMs
// times the blocks an SM holds by the kernel's registers and shared memory
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor, a host-side computation: no synchronization),
// asked once per kernel and device and cached. The emulation says 4, so that the tests run the
// grid-stride loops through several turns.
template <auto Kernel>
int64_t resident_blocks() {
#ifdef PYCOMM_CUDA_EMULATION
  return 4;
#else
  constexpr int kDevices = 64;
  static std::atomic<int> per_sm_of[kDevices] = {};  // 0: not asked yet
  const int dev = c10::cuda::current_device();
  int per_sm = dev < kDevices ? per_sm_of[dev].load(std::memory_order_relaxed) : 0;
  if (per_sm == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0));
    per_sm = std::max(1, per_sm);
    if (dev < kDevices) per_sm_of[dev].store(per_sm, std::memory_order_relaxed);
  }
  return int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount} * per_sm;
#endif
}

// Blocks of `Kernel` for a grid-stride loop over n elements, per_block a block's elements per
// pass (kVec a thread by default): at most one wave of the device, so that every thread gets
// the same number of groups (within one) whatever n is.
template <auto Kernel>
int64_t blocks_for(int64_t n, int64_t per_block = int64_t{kThreads} * kVec) {
  const int64_t wanted = (n + per_block - 1) / per_block;
  return std::max<int64_t>(1, std::min<int64_t>(resident_blocks<Kernel>(), wanted));
}

}  // namespace pycomm::cuda
