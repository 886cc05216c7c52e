// Bucket fusion on CUDA: pack, pack_into_, unpack_, accumulate_, scale_.
//
// pack/pack_into_/unpack_ move any number of tensors in one launch per CopyTable (up to
// CopyTable::kMax tensors; more take more launches), as apex's multi_tensor_apply does: the
// table of pointers and sizes travels as the kernel's argument, and each block of threads finds
// its tensor and chunk in it, so 200 small tensors cost about what 4 large ones of the same
// total do. Elements are converted, scaled and stored in the same pass: a destination's head up
// to a 16-byte boundary element by element, the rest as aligned 16-byte stores, the source
// read with the widest loads its alignment allows. Tensors that are not contiguous are staged
// through a contiguous copy (an extra pass for those tensors alone), as are accumulate_ and
// scale_ operands whose memory is not one dense block.
//
// Arithmetic is the CPU kernels' (csrc/cpu/fusion.cpp): fp32, one rounding per operation. The
// host entries are theirs too (csrc/host/fusion.h: checks, allocation, empty case, dtype
// dispatch), with the same messages; this file holds the kernels and their launches.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "cuda/common.cuh"
#include "host/fusion.h"

namespace pycomm::cuda {
namespace {

// Elements per block of a multi-tensor copy: 4 steps of kVec per thread.
constexpr int64_t kChunk = int64_t{kThreads} * kVec * 4;

// One launch's tensors. Block b copies chunk (b - first_block[i]) of tensor i, where
// first_block[i] <= b < first_block[i + 1]. 256 tensors a launch (7,176 bytes, 7,180 with the
// scale: the kernel's parameters): a bucket's tensors in one launch. Kernel parameters over
// 4,096 bytes (up to 32,764) need CUDA 12.1 or later, driver and toolkit, and a Volta or newer
// GPU (compute capability 7.0); torch 2.11, pycomm's oldest, is built with CUDA 12.6 or later,
// and check_large_params refuses, with a message, a driver or GPU without them.
struct CopyTable {
  static constexpr int kMax = 256;
  const void* src[kMax];
  void* dst[kMax];
  int64_t numel[kMax];
  int32_t first_block[kMax + 1];
  int32_t count;
};

// v * s rounded to out_t; with `identity` (same dtype, scale 1) v itself, bit for bit, NaN
// payloads too, as the CPU's memcpy leaves them.
template <typename out_t, typename in_t>
__device__ __forceinline__ out_t scaled(in_t v, float s, bool identity) {
  if constexpr (std::is_same_v<out_t, in_t>) {
    if (identity) return v;
  }
  return static_cast<out_t>(fmul(static_cast<float>(v), s));
}

// Elements of T from p to the next 16-byte boundary (0 if p is on one): the head a kernel
// peels off with scalar accesses so that the stores after it are whole aligned vectors.
template <typename T>
__device__ __forceinline__ int64_t head_to_16(const T* p) {
  return static_cast<int64_t>((16 - reinterpret_cast<uintptr_t>(p) % 16) % 16 / sizeof(T));
}

// Calls f(std::integral_constant<int, W>) with W the widest load (16, 8 or 4 bytes, else one
// element) that p + kVec * j is aligned to for every j: p's alignment, up to 16 bytes.
template <typename T, typename F>
__device__ __forceinline__ void with_load_width(const T* p, F&& f) {
  if (aligned(p, 16)) {
    f(std::integral_constant<int, 16>{});
  } else if (sizeof(T) < 8 && aligned(p, 8)) {
    f(std::integral_constant<int, sizeof(T) < 8 ? 8 : 16>{});
  } else if (sizeof(T) < 4 && aligned(p, 4)) {
    f(std::integral_constant<int, sizeof(T) < 4 ? 4 : 16>{});
  } else {
    f(std::integral_constant<int, static_cast<int>(sizeof(T))>{});
  }
}

// dst[i] = src[i] * s for i in [begin, end), by the whole block: a thread converts kVec
// consecutive elements at a time; dst + begin is 16-byte aligned (stores are whole vectors)
// and src + begin aligned to W bytes (loads of W bytes).
template <int W, typename out_t, typename in_t>
__device__ void scaled_copy_body(out_t* dst, const in_t* src, int64_t begin, int64_t end,
                                 float s) {
  const int tid = threadIdx.x;
  const bool identity = std::is_same_v<out_t, in_t> && s == 1.0f;
  for (int64_t i = begin + int64_t{tid} * kVec; i < end; i += int64_t{kThreads} * kVec) {
    if (i + kVec > end) {
      for (int64_t j = i; j < end; ++j) dst[j] = scaled<out_t>(src[j], s, identity);
      continue;
    }
    in_t v[kVec];
    load_raw8_as<W>(src + i, v);
    if constexpr (std::is_same_v<out_t, in_t>) {
      if (identity) {  // the bits themselves (a conversion may quiet a NaN)
        store_raw8(dst + i, v);
        continue;
      }
    }
    float f[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) f[k] = fmul(static_cast<float>(v[k]), s);
    store8(dst + i, f);
  }
}

// dst[i] = src[i] * s for i in [begin, end), by the whole block. A dst that is not 16-byte
// aligned (a tensor packed at an offset that is not a multiple of 16 bytes, and, in a bucket,
// every tensor after an odd-sized one) has its head up to the boundary copied element by
// element, the rest with aligned vector stores; src is read from there with the widest loads
// its own alignment allows (16 bytes where both sides are misaligned alike).
template <typename out_t, typename in_t>
__device__ void scaled_copy(out_t* dst, const in_t* src, int64_t begin, int64_t end, float s) {
  const int tid = threadIdx.x;
  const bool identity = std::is_same_v<out_t, in_t> && s == 1.0f;
  // (a dst not aligned to its own elements, which no tensor is, would go element by element)
  const int64_t start =
      aligned(dst, sizeof(out_t)) ? std::min(end, begin + head_to_16(dst + begin)) : end;
  for (int64_t i = begin + tid; i < start; i += kThreads) {
    dst[i] = scaled<out_t>(src[i], s, identity);
  }
  with_load_width(src + start, [&](auto w) {
    scaled_copy_body<decltype(w)::value>(dst, src, start, end, s);
  });
}

// The bytes of multi_copy_kernel's parameters.
constexpr size_t kCopyParamBytes = sizeof(CopyTable) + sizeof(float);

// Kernel parameters over 4 KB need a CUDA 12.1 or later driver and a Volta or newer GPU: a clear
// error, naming the op and the launch's tensors, where the current device or driver has not
// them (asked once: the driver version is cached here, the device's properties by torch).
inline void check_large_params(const char* op, int count) {
#ifndef PYCOMM_CUDA_EMULATION
  if constexpr (kCopyParamBytes > 4096) {
    static const int driver = [] {
      int v = 0;
      C10_CUDA_CHECK(cudaDriverGetVersion(&v));
      return v;
    }();
    const cudaDeviceProp* p = at::cuda::getCurrentDeviceProperties();
    TORCH_CHECK(driver >= 12010 && p->major >= 7, op, ": the CUDA kernel copies up to ",
                CopyTable::kMax, " tensors a launch (this one ", count,
                ") from a table passed as ", kCopyParamBytes,
                " bytes of kernel parameters, which needs a CUDA 12.1 or later driver and a "
                "Volta or newer GPU (compute capability 7.0 or higher); this is a CUDA ",
                driver / 1000, ".", driver % 1000 / 10, " driver and a compute capability ",
                p->major, ".", p->minor, " GPU (", p->name, ")");
  }
#else
  (void)op;
  (void)count;
#endif
}

// After a launch of multi_copy_kernel: its error, with what its parameters need.
inline void check_copy_launch(const char* op, int count) {
#ifndef PYCOMM_CUDA_EMULATION
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": the launch of the CUDA kernel copying ", count,
              " tensors failed: ", cudaGetErrorString(err), " (its table of tensors is ",
              kCopyParamBytes,
              " bytes of kernel parameters: a CUDA 12.1 or later driver and a Volta or newer "
              "GPU are needed for more than 4,096)");
#else
  (void)op;
  (void)count;
#endif
}

template <typename out_t, typename in_t>
__global__ void __launch_bounds__(kThreads) multi_copy_kernel(CopyTable t, float s) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  int lo = 0, hi = t.count - 1;  // the last tensor whose first block is <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first_block[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t begin = int64_t{b - t.first_block[lo]} * kChunk;
  const int64_t end = std::min<int64_t>(begin + kChunk, t.numel[lo]);
  scaled_copy(static_cast<out_t*>(t.dst[lo]), static_cast<const in_t*>(t.src[lo]), begin, end,
              s);
}

// dst[i][:numel[i]] = src[i][:numel[i]] * s for every i (contiguous), in one launch per
// CopyTable::kMax tensors.
template <typename out_t, typename in_t>
void multi_copy(const char* op, const std::vector<const void*>& src,
                const std::vector<void*>& dst, const std::vector<int64_t>& numel, float s,
                Stream stream) {
  CopyTable table;
  table.count = 0;
  int64_t blocks = 0;
  auto flush = [&] {
    if (table.count == 0) return;
    table.first_block[table.count] = static_cast<int32_t>(blocks);
    check_large_params(op, table.count);
    PYCOMM_LAUNCH(static_cast<unsigned>(blocks), kThreads, stream,
                  multi_copy_kernel<out_t, in_t>)(table, s);
    check_copy_launch(op, table.count);
    table.count = 0;
    blocks = 0;
  };
  for (size_t i = 0; i < src.size(); ++i) {
    if (numel[i] == 0) continue;
    const int64_t chunks = (numel[i] + kChunk - 1) / kChunk;
    if (table.count == CopyTable::kMax || blocks + chunks > std::numeric_limits<int32_t>::max()) {
      flush();
    }
    TORCH_INTERNAL_ASSERT(chunks <= std::numeric_limits<int32_t>::max(),
                          "pycomm multi_copy: a tensor of ", numel[i], " elements");
    table.src[table.count] = src[i];
    table.dst[table.count] = dst[i];
    table.numel[table.count] = numel[i];
    table.first_block[table.count] = static_cast<int32_t>(blocks);
    ++table.count;
    blocks += chunks;
  }
  flush();
}

// dst[i] += src[i] * a for i in [begin, n) in a grid-stride loop of kVec elements a thread:
// dst + begin is 16-byte aligned, src + begin aligned to W bytes (its loads' width).
template <int W, typename dst_t, typename src_t>
__device__ void axpy_body(dst_t* dst, const src_t* src, int64_t begin, int64_t n, float a) {
  const int64_t stride = int64_t{gridDim.x} * kThreads * kVec;
  for (int64_t i = begin + (int64_t{blockIdx.x} * kThreads + threadIdx.x) * kVec; i < n;
       i += stride) {
    if (i + kVec <= n) {
      float d[kVec];
      src_t x[kVec];
      load8(dst + i, d);
      load_raw8_as<W>(src + i, x);
#pragma unroll
      for (int k = 0; k < kVec; ++k) d[k] = fadd(d[k], fmul(static_cast<float>(x[k]), a));
      store8(dst + i, d);
      continue;
    }
    for (int64_t j = i; j < std::min<int64_t>(i + kVec, n); ++j) {
      dst[j] = static_cast<dst_t>(
          fadd(static_cast<float>(dst[j]), fmul(static_cast<float>(src[j]), a)));
    }
  }
}

// dst += src * a over n elements. dst's head up to a 16-byte boundary element by element, the
// rest in aligned vectors (src read with the widest loads its alignment allows from there).
template <typename dst_t, typename src_t>
__global__ void __launch_bounds__(kThreads)
    axpy_kernel(dst_t* dst, const src_t* src, int64_t n, float a) {
  const int64_t head = aligned(dst, sizeof(dst_t)) ? std::min(n, head_to_16(dst)) : n;
  for (int64_t j = int64_t{blockIdx.x} * kThreads + threadIdx.x; j < head;
       j += int64_t{gridDim.x} * kThreads) {
    dst[j] = static_cast<dst_t>(
        fadd(static_cast<float>(dst[j]), fmul(static_cast<float>(src[j]), a)));
  }
  with_load_width(src + head, [&](auto w) {
    axpy_body<decltype(w)::value>(dst, src, head, n, a);
  });
}

// t *= s over n elements: t's head up to a 16-byte boundary element by element, the rest in
// aligned vectors.
template <typename T>
__global__ void __launch_bounds__(kThreads) scale_kernel(T* t, int64_t n, float s) {
  const int64_t head = aligned(t, sizeof(T)) ? std::min(n, head_to_16(t)) : n;
  for (int64_t j = int64_t{blockIdx.x} * kThreads + threadIdx.x; j < head;
       j += int64_t{gridDim.x} * kThreads) {
    t[j] = static_cast<T>(fmul(static_cast<float>(t[j]), s));
  }
  const int64_t stride = int64_t{gridDim.x} * kThreads * kVec;
  for (int64_t i = head + (int64_t{blockIdx.x} * kThreads + threadIdx.x) * kVec; i < n;
       i += stride) {
    if (i + kVec <= n) {
      float f[kVec];
      load8(t + i, f);
#pragma unroll
      for (int k = 0; k < kVec; ++k) f[k] = fmul(f[k], s);
      store8(t + i, f);
      continue;
    }
    for (int64_t j = i; j < std::min<int64_t>(i + kVec, n); ++j) {
      t[j] = static_cast<T>(fmul(static_cast<float>(t[j]), s));
    }
  }
}

// The CUDA kernels' launches, behind the fusion ops' host entries (csrc/host/fusion.h: checks,
// allocation, empty case, dtype dispatch), on the current stream of the guarded device.
struct Cuda {
  using Guard = DeviceGuard;
  static at::TensorOptions no_tensors() {
    // the dispatcher chose CUDA from a tensor's device: the list is not empty
    TORCH_INTERNAL_ASSERT(false, "pycomm.pack: no tensors on the CUDA kernel");
    return {};
  }

  // flat[offset_i : offset_i + numel_i] = tensors[i] * s, N >= 1; strided tensors staged.
  template <typename out_t, typename in_t>
  static void pack_into(const at::Tensor& flat, at::TensorList tensors,
                        const std::vector<int64_t>& offsets, float s) {
    std::vector<at::Tensor> staged;  // contiguous copies of the strided tensors, kept alive
    std::vector<const void*> src;
    std::vector<void*> dst;
    std::vector<int64_t> numel;
    char* base = static_cast<char*>(flat.data_ptr());
    for (size_t i = 0; i < tensors.size(); ++i) {
      at::Tensor t = tensors[i];
      if (!t.is_contiguous()) {
        t = t.contiguous();
        staged.push_back(t);
      }
      src.push_back(t.const_data_ptr());
      dst.push_back(base + offsets[i] * flat.element_size());
      numel.push_back(t.numel());
    }
    multi_copy<out_t, in_t>("pycomm.pack/pack_into_", src, dst, numel, s, current_stream());
  }

  // tensors[i] = flat[offset_i : offset_i + numel_i] * s, N >= 1; strided targets written
  // through a contiguous stand-in.
  template <typename out_t, typename in_t>
  static void unpack(const at::Tensor& flat, at::TensorList tensors,
                     const std::vector<int64_t>& offsets, float s) {
    // a target with several elements at one address has no defined result (the CPU's
    // TensorIterator refuses it with this message too)
    for (const auto& t : tensors) {
      if (!t.is_contiguous()) at::assert_no_internal_overlap(t);
    }
    std::vector<std::pair<at::Tensor, at::Tensor>> staged;  // (target, contiguous stand-in)
    std::vector<const void*> src;
    std::vector<void*> dst;
    std::vector<int64_t> numel;
    const char* base = static_cast<const char*>(flat.const_data_ptr());
    for (size_t i = 0; i < tensors.size(); ++i) {
      at::Tensor t = tensors[i];
      if (!t.is_contiguous()) {
        at::Tensor c = at::empty(t.sizes(), t.options());
        staged.emplace_back(t, c);
        t = c;
      }
      src.push_back(base + offsets[i] * flat.element_size());
      dst.push_back(t.data_ptr());
      numel.push_back(t.numel());
    }
    multi_copy<out_t, in_t>("pycomm.unpack_", src, dst, numel, s, current_stream());
    for (auto& [target, c] : staged) target.copy_(c);
  }

  // dst += a * src; operands that are not one dense block laid out alike are staged.
  template <typename dst_t, typename src_t>
  static void accumulate(const at::Tensor& dst, const at::Tensor& src, float a) {
    // elementwise over memory: one dense block laid out alike needs no reordering
    const bool direct = dst.is_non_overlapping_and_dense() &&
                        src.is_non_overlapping_and_dense() && dst.strides() == src.strides();
    const at::Tensor d = direct ? dst : dst.contiguous();
    const at::Tensor s = direct ? src : src.contiguous();
    constexpr auto kernel = axpy_kernel<dst_t, src_t>;
    PYCOMM_LAUNCH(blocks_for<kernel>(d.numel()), kThreads, current_stream(), kernel)(
        d.data_ptr<dst_t>(), s.const_data_ptr<src_t>(), d.numel(), a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!direct) dst.copy_(d);
  }

  // t *= s; a t that is not one dense block is staged.
  template <typename T>
  static void scale(const at::Tensor& t, float s) {
    const bool direct = t.is_non_overlapping_and_dense();
    if (!direct) at::assert_no_internal_overlap(t);
    const at::Tensor c = direct ? t : t.contiguous();
    constexpr auto kernel = scale_kernel<T>;
    PYCOMM_LAUNCH(blocks_for<kernel>(c.numel()), kThreads, current_stream(), kernel)(
        c.data_ptr<T>(), c.numel(), s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!direct) t.copy_(c);
  }
};

}  // namespace

PYCOMM_CUDA_LIBRARY_IMPL(m) { host::register_fusion<Cuda>(m); }

}  // namespace pycomm::cuda
