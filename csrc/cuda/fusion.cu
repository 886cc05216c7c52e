// Bucket fusion on CUDA: pack, pack_into_, unpack_, accumulate_, scale_.
//
// pack/pack_into_/unpack_ move any number of tensors in one launch per CopyTable (up to
// CopyTable::kMax tensors; more take more launches), as apex's multi_tensor_apply does: the
// table of pointers and sizes travels as the kernel's argument, and each block of threads finds
// its tensor and chunk in it, so 200 small tensors cost about what 4 large ones of the same
// total do. Elements are converted, scaled and stored in the same pass, 16 bytes at a time
// where both sides are aligned. Tensors that are not contiguous are staged through a
// contiguous copy (an extra pass for those tensors alone), as are accumulate_ and scale_
// operands whose memory is not one dense block.
//
// Arithmetic is the CPU kernels' (csrc/cpu/fusion.cpp): fp32, one rounding per operation.
// The argument checks are theirs too (csrc/checks.h), with the same messages.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "cuda/common.cuh"

namespace pycomm::cuda {
namespace {

// Elements per block of a multi-tensor copy: 4 steps of kVec per thread.
constexpr int64_t kChunk = int64_t{kThreads} * kVec * 4;

// One launch's tensors. Block b copies chunk (b - first_block[i]) of tensor i, where
// first_block[i] <= b < first_block[i + 1]. Sized to stay under the 4 KB of kernel parameters.
struct CopyTable {
  static constexpr int kMax = 96;
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

// dst[i] = src[i] * s for i in [begin, end), by the whole block; begin is a multiple of kVec.
template <typename out_t, typename in_t>
__device__ void scaled_copy(out_t* dst, const in_t* src, int64_t begin, int64_t end, float s) {
  const int tid = threadIdx.x;
  const bool identity = std::is_same_v<out_t, in_t> && s == 1.0f;
  if (vec_ok(dst + begin) && vec_ok(src + begin)) {
    for (int64_t i = begin + int64_t{tid} * kVec; i < end; i += int64_t{kThreads} * kVec) {
      if (i + kVec > end) {
        for (int64_t j = i; j < end; ++j) dst[j] = scaled<out_t>(src[j], s, identity);
        continue;
      }
      if constexpr (std::is_same_v<out_t, in_t>) {
        if (identity) {
          constexpr int kPer = 16 / sizeof(in_t);
#pragma unroll
          for (int k = 0; k < kVec; k += kPer) {
            store_vec<out_t, kPer>(dst + i + k, load_vec<in_t, kPer>(src + i + k));
          }
          continue;
        }
      }
      float f[kVec];
      load8(src + i, f);
#pragma unroll
      for (int k = 0; k < kVec; ++k) f[k] = fmul(f[k], s);
      store8(dst + i, f);
    }
    return;
  }
  // misaligned (a pack into flat at an offset that is not a multiple of 16 bytes): one element
  // per thread, still coalesced
  for (int64_t i = begin + tid; i < end; i += kThreads) {
    dst[i] = scaled<out_t>(src[i], s, identity);
  }
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
void multi_copy(const std::vector<const void*>& src, const std::vector<void*>& dst,
                const std::vector<int64_t>& numel, float s, Stream stream) {
  CopyTable table;
  table.count = 0;
  int64_t blocks = 0;
  auto flush = [&] {
    if (table.count == 0) return;
    table.first_block[table.count] = static_cast<int32_t>(blocks);
    PYCOMM_LAUNCH(static_cast<unsigned>(blocks), kThreads, stream,
                  multi_copy_kernel<out_t, in_t>)(table, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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

// flat: [sum numel] 1-D contiguous float on the tensors' device. tensors: [N] tensors, one
// float dtype, one CUDA device, any shapes/strides. flat[offset_i : offset_i + numel_i] =
// tensors[i] * scale.
void pack_into_impl(const char* op, const at::Tensor& flat, at::TensorList tensors,
                    double scale) {
  const std::vector<int64_t> offsets = check_pack_into(op, flat, tensors);
  if (tensors.empty()) return;
  const DeviceGuard guard(flat.device());
  const Stream stream = current_stream();
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
  dispatch_float(tensors[0].scalar_type(), [&](auto in_tag) {
    using in_t = decltype(in_tag);
    dispatch_float(flat.scalar_type(), [&](auto out_tag) {
      using out_t = decltype(out_tag);
      multi_copy<out_t, in_t>(src, dst, numel, static_cast<float>(scale), stream);
    });
  });
}

void pack_into_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  pack_into_impl("pycomm.pack_into_", flat, tensors, scale);
}

// tensors: as pack_into_. Returns [sum numel] contiguous on tensors[0]'s device, dtype `dtype`
// or the tensors'.
at::Tensor pack_cuda(at::TensorList tensors, double scale, std::optional<at::ScalarType> dtype) {
  const auto [out_type, total] = check_pack(tensors, dtype);
  // the dispatcher chose CUDA from a tensor's device: the list is not empty
  TORCH_INTERNAL_ASSERT(!tensors.empty(), "pycomm.pack: no tensors on the CUDA kernel");
  at::Tensor flat = at::empty({total}, tensors[0].options().dtype(out_type));
  pack_into_impl("pycomm.pack", flat, tensors, scale);
  return flat;
}

// flat: [sum numel] 1-D contiguous float. tensors: [N] tensors, one float dtype, flat's device,
// any shapes/strides. tensors[i] = flat[offset_i : offset_i + numel_i] * scale.
void unpack_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  const std::vector<int64_t> offsets = check_unpack(flat, tensors);
  if (tensors.empty()) return;
  // a target with several elements at one address has no defined result (the CPU's
  // TensorIterator refuses it with this message too)
  for (const auto& t : tensors) {
    if (!t.is_contiguous()) at::assert_no_internal_overlap(t);
  }
  const DeviceGuard guard(flat.device());
  const Stream stream = current_stream();
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
  dispatch_float(flat.scalar_type(), [&](auto in_tag) {
    using in_t = decltype(in_tag);
    dispatch_float(tensors[0].scalar_type(), [&](auto out_tag) {
      using out_t = decltype(out_tag);
      multi_copy<out_t, in_t>(src, dst, numel, static_cast<float>(scale), stream);
    });
  });
  for (auto& [target, c] : staged) target.copy_(c);
}

template <typename dst_t, typename src_t>
__global__ void __launch_bounds__(kThreads)
    axpy_kernel(dst_t* dst, const src_t* src, int64_t n, float a) {
  const bool vec = vec_ok(dst) && vec_ok(src);
  const int64_t stride = int64_t{gridDim.x} * kThreads * kVec;
  for (int64_t i = (int64_t{blockIdx.x} * kThreads + threadIdx.x) * kVec; i < n; i += stride) {
    if (vec && i + kVec <= n) {
      float d[kVec], x[kVec];
      load8(dst + i, d);
      load8(src + i, x);
#pragma unroll
      for (int k = 0; k < kVec; ++k) d[k] = fadd(d[k], fmul(x[k], a));
      store8(dst + i, d);
      continue;
    }
    for (int64_t j = i; j < std::min<int64_t>(i + kVec, n); ++j) {
      dst[j] = static_cast<dst_t>(
          fadd(static_cast<float>(dst[j]), fmul(static_cast<float>(src[j]), a)));
    }
  }
}

// dst: Float or src's dtype. src: float dtype, dst's shape and device. dst += alpha * src in
// fp32, rounded once to dst's dtype.
void accumulate_cuda(const at::Tensor& dst, const at::Tensor& src, double alpha) {
  check_accumulate(dst, src);
  at::assert_no_internal_overlap(dst);
  at::assert_no_partial_overlap(dst, src);
  if (dst.numel() == 0) return;
  const DeviceGuard guard(dst.device());
  const Stream stream = current_stream();
  // elementwise over memory: one dense block laid out alike needs no reordering
  const bool direct = dst.is_non_overlapping_and_dense() && src.is_non_overlapping_and_dense() &&
                      dst.strides() == src.strides();
  const at::Tensor d = direct ? dst : dst.contiguous();
  const at::Tensor s = direct ? src : src.contiguous();
  const float a = static_cast<float>(alpha);
  dispatch_float(src.scalar_type(), [&](auto src_tag) {
    using src_t = decltype(src_tag);
    dispatch_float(dst.scalar_type(), [&](auto dst_tag) {
      using dst_t = decltype(dst_tag);
      PYCOMM_LAUNCH(blocks_for(d.numel()), kThreads, stream, axpy_kernel<dst_t, src_t>)(
          d.data_ptr<dst_t>(), s.const_data_ptr<src_t>(), d.numel(), a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  if (!direct) dst.copy_(d);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) scale_kernel(T* t, int64_t n, float s) {
  const bool vec = vec_ok(t);
  const int64_t stride = int64_t{gridDim.x} * kThreads * kVec;
  for (int64_t i = (int64_t{blockIdx.x} * kThreads + threadIdx.x) * kVec; i < n; i += stride) {
    if (vec && i + kVec <= n) {
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

// t: any float tensor on a CUDA device, scaled in place in fp32.
void scale_cuda(const at::Tensor& t, double scale) {
  check_scale(t);
  if (scale == 1.0 || t.numel() == 0) return;
  const bool direct = t.is_non_overlapping_and_dense();
  if (!direct) at::assert_no_internal_overlap(t);
  const DeviceGuard guard(t.device());
  const Stream stream = current_stream();
  const at::Tensor c = direct ? t : t.contiguous();
  dispatch_float(t.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    PYCOMM_LAUNCH(blocks_for(c.numel()), kThreads, stream, scale_kernel<T>)(
        c.data_ptr<T>(), c.numel(), static_cast<float>(scale));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!direct) t.copy_(c);
}

}  // namespace

#ifndef PYCOMM_CUDA_EMULATION
TORCH_LIBRARY_IMPL(pycomm, CUDA, m) {
#else
TORCH_LIBRARY_IMPL(pycomm_emu, CPU, m) {
#endif
  m.impl("pack", &pack_cuda);
  m.impl("pack_into_", &pack_into_cuda);
  m.impl("unpack_", &unpack_cuda);
  m.impl("accumulate_", &accumulate_cuda);
  m.impl("scale_", &scale_cuda);
}

}  // namespace pycomm::cuda
