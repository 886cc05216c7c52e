// The one host entry of each bucket-fusion op (pack, pack_into_, unpack_, accumulate_, scale_),
// shared by every device and the Meta kernels: the argument checks (csrc/checks.h), the output's
// allocation, the empty case and the dtype dispatch happen here, once; a device's launcher D
// (csrc/cpu/fusion.cpp, csrc/cuda/fusion.cu) only runs its kernels on arguments that passed
// them, with the element types as template arguments. The Meta kernels' launcher (meta.h) runs
// nothing: they return before touching data.
//
// A launcher D provides:
//   Guard                          constructed from the output's device around the launch
//   no_tensors()                   pack's output options when the list is empty
//   pack_into<out_t, in_t>(flat, tensors, offsets, s)   flat[offset_i + j] = tensors[i][j] * s
//   unpack<out_t, in_t>(flat, tensors, offsets, s)      tensors[i][j] = flat[offset_i + j] * s
//   accumulate<dst_t, src_t>(dst, src, a)               dst += a * src, numel > 0
//   scale<T>(t, s)                                      t *= s, numel > 0, s != 1
#pragma once
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "checks.h"
#include "host/meta.h"

namespace pycomm::host {

// Offsets (check_list's) as the launchers take them: plain integers, as they are on tensors
// with data.
inline std::vector<int64_t> concrete(const std::vector<c10::SymInt>& offsets) {
  std::vector<int64_t> out;
  out.reserve(offsets.size());
  for (const auto& o : offsets) out.push_back(o.expect_int());
  return out;
}

// flat: [sum numel] 1-D contiguous float. tensors: [N] tensors, one float dtype, flat's device,
// any shapes/strides. flat[offset_i : offset_i + numel_i] = tensors[i] * scale.
template <typename D>
void pack_into_as(const char* op, const at::Tensor& flat, at::TensorList tensors, double scale) {
  const std::vector<c10::SymInt> sym_offsets = check_pack_into(op, flat, tensors);
  if (tensors.empty() || !launches<D>) return;
  const std::vector<int64_t> offsets = concrete(sym_offsets);
  const typename D::Guard guard(flat.device());
  dispatch_float(tensors[0].scalar_type(), [&](auto in_tag) {
    using in_t = decltype(in_tag);
    dispatch_float(flat.scalar_type(), [&](auto out_tag) {
      using out_t = decltype(out_tag);
      D::template pack_into<out_t, in_t>(flat, tensors, offsets, static_cast<float>(scale));
    });
  });
}

template <typename D>
void pack_into_(const at::Tensor& flat, at::TensorList tensors, double scale) {
  pack_into_as<D>("pycomm.pack_into_", flat, tensors, scale);
}

// tensors: as pack_into_'s. Returns [sum numel] contiguous on the tensors' device, dtype `dtype`
// or the tensors'.
template <typename D>
at::Tensor pack(at::TensorList tensors, double scale, std::optional<at::ScalarType> dtype) {
  const auto [out_type, total] = check_pack(tensors, dtype);
  const auto options = tensors.empty() ? D::no_tensors() : tensors[0].options();
  at::Tensor flat = at::empty_symint({total}, options.dtype(out_type));
  pack_into_as<D>("pycomm.pack", flat, tensors, scale);
  return flat;
}

// flat: [sum numel] 1-D contiguous float. tensors: [N] tensors, one float dtype, flat's device,
// any shapes/strides. tensors[i] = flat[offset_i : offset_i + numel_i] * scale.
template <typename D>
void unpack_(const at::Tensor& flat, at::TensorList tensors, double scale) {
  const std::vector<c10::SymInt> sym_offsets = check_unpack(flat, tensors);
  if (tensors.empty() || !launches<D>) return;
  const std::vector<int64_t> offsets = concrete(sym_offsets);
  const typename D::Guard guard(flat.device());
  dispatch_float(flat.scalar_type(), [&](auto in_tag) {
    using in_t = decltype(in_tag);
    dispatch_float(tensors[0].scalar_type(), [&](auto out_tag) {
      using out_t = decltype(out_tag);
      D::template unpack<out_t, in_t>(flat, tensors, offsets, static_cast<float>(scale));
    });
  });
}

// dst: Float or src's dtype. src: float dtype, dst's shape and device. dst += alpha * src in
// fp32, rounded once to dst's dtype.
template <typename D>
void accumulate_(const at::Tensor& dst, const at::Tensor& src, double alpha) {
  check_accumulate(dst, src);
  // what a TensorIterator over (dst; dst, src) refuses, with its messages (they read sizes
  // as integers: not on the symbolic ones of a traced program)
  if (!dst.unsafeGetTensorImpl()->has_symbolic_sizes_strides() &&
      !src.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    at::assert_no_internal_overlap(dst);
    at::assert_no_partial_overlap(dst, src);
  }
  if (!launches<D> || dst.numel() == 0) return;
  const typename D::Guard guard(dst.device());
  dispatch_float(src.scalar_type(), [&](auto src_tag) {
    using src_t = decltype(src_tag);
    dispatch_float(dst.scalar_type(), [&](auto dst_tag) {
      using dst_t = decltype(dst_tag);
      D::template accumulate<dst_t, src_t>(dst, src, static_cast<float>(alpha));
    });
  });
}

// t: any float tensor, scaled in place in fp32.
template <typename D>
void scale_(const at::Tensor& t, double scale) {
  check_scale(t);
  if (!launches<D> || scale == 1.0 || t.numel() == 0) return;
  const typename D::Guard guard(t.device());
  dispatch_float(t.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    D::template scale<T>(t, static_cast<float>(scale));
  });
}

// The fusion ops' kernels for one dispatch key: TORCH_LIBRARY_IMPL(<lib>, <key>, m) calls it.
template <typename D>
void register_fusion(torch::Library& m) {
  m.impl("pack", &pack<D>);
  m.impl("pack_into_", &pack_into_<D>);
  m.impl("unpack_", &unpack_<D>);
  m.impl("accumulate_", &accumulate_<D>);
  m.impl("scale_", &scale_<D>);
}

}  // namespace pycomm::host
