// Bucket fusion on the CPU: pack, unpack_, accumulate_, scale_.
//
// pack/unpack_ run one parallel pass over the concatenated element range of all contiguous
// tensors (work split by elements, not by tensor, so 200 small tensors and 4 large ones are
// balanced the same way); non-contiguous tensors go through a TensorIterator each. Every
// element is converted, scaled and stored in the same pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "checks.h"
#include "cpu/vec_io.h"

namespace pycomm::cpu {
namespace {

// Elements per parallel task: large enough that a task costs more than its scheduling.
constexpr int64_t kGrain = 32768;

// out = in * s elementwise through a TensorIterator: any strides, out and in of one shape.
template <typename out_t, typename in_t>
void iter_scaled_copy(const at::Tensor& out, const at::Tensor& in, float s) {
  auto iter = at::TensorIteratorConfig()
                  .add_output(out)
                  .add_const_input(in)
                  .check_all_same_dtype(false)
                  .resize_outputs(false)
                  .build();
  iter.for_each(
      [s](char** data, const int64_t* strides, int64_t n) {
        auto* o = data[0];
        const auto* i = data[1];
        if (strides[0] == sizeof(out_t) && strides[1] == sizeof(in_t)) {
          scaled_copy(reinterpret_cast<out_t*>(o), reinterpret_cast<const in_t*>(i), n, s);
          return;
        }
        for (int64_t k = 0; k < n; ++k) {
          const float x = static_cast<float>(*reinterpret_cast<const in_t*>(i + k * strides[1]));
          *reinterpret_cast<out_t*>(o + k * strides[0]) = static_cast<out_t>(x * s);
        }
      },
      kGrain);
}

// Calls f(i, begin, n) for pieces of contiguous tensor i, parallel over the concatenated
// element range [0, offsets.back()). offsets has one more entry than there are tensors.
template <typename F>
void for_each_piece(const std::vector<int64_t>& offsets, const std::vector<char>& contiguous,
                    const F& f) {
  at::parallel_for(0, offsets.back(), kGrain, [&](int64_t b, int64_t e) {
    size_t i = std::upper_bound(offsets.begin(), offsets.end(), b) - offsets.begin() - 1;
    while (b < e) {
      const int64_t end = std::min(e, offsets[i + 1]);
      if (contiguous[i] && end > b) f(i, b - offsets[i], end - b);
      b = end;
      ++i;
    }
  });
}

// Whether each tensor is contiguous (for_each_piece's; the others go through a TensorIterator).
std::vector<char> contiguous_flags(at::TensorList tensors) {
  std::vector<char> contiguous;
  for (const auto& t : tensors) contiguous.push_back(t.is_contiguous());
  return contiguous;
}

// flat: [sum numel] 1-D contiguous float, the tensors' device. tensors: [N] tensors, one float
// dtype, one device, any shapes/strides. flat[offset_i : offset_i + numel_i] = tensors[i] * s.
void pack_into_impl(const char* op, const at::Tensor& flat, at::TensorList tensors,
                    double scale) {
  const std::vector<int64_t> offsets = check_pack_into(op, flat, tensors);
  if (tensors.empty()) return;
  const std::vector<char> contiguous = contiguous_flags(tensors);
  const float s = static_cast<float>(scale);
  dispatch_float(tensors[0].scalar_type(), [&](auto in_tag) {
    using in_t = decltype(in_tag);
    dispatch_float(flat.scalar_type(), [&](auto out_tag) {
      using out_t = decltype(out_tag);
      auto* dst = flat.data_ptr<out_t>();
      for_each_piece(offsets, contiguous, [&](size_t i, int64_t b, int64_t n) {
        const auto* src = tensors[i].const_data_ptr<in_t>();
        scaled_copy(dst + offsets[i] + b, src + b, n, s);
      });
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (contiguous[i]) continue;
        const auto view = flat.narrow(0, offsets[i], tensors[i].numel()).view(tensors[i].sizes());
        iter_scaled_copy<out_t, in_t>(view, tensors[i], s);
      }
    });
  });
}

void pack_into_cpu(const at::Tensor& flat, at::TensorList tensors, double scale) {
  pack_into_impl("pycomm.pack_into_", flat, tensors, scale);
}

// tensors: as pack_into_. returns: [sum numel] contiguous, dtype `dtype` or the tensors'.
at::Tensor pack_cpu(at::TensorList tensors, double scale, std::optional<at::ScalarType> dtype) {
  const auto [out_type, total] = check_pack(tensors, dtype);
  const auto options = tensors.empty() ? at::TensorOptions(at::kCPU) : tensors[0].options();
  at::Tensor flat = at::empty({total}, options.dtype(out_type));
  pack_into_impl("pycomm.pack", flat, tensors, scale);
  return flat;
}

// flat: [sum numel] contiguous float. tensors: [N] tensors, one float dtype, flat's device.
void unpack_cpu(const at::Tensor& flat, at::TensorList tensors, double scale) {
  const std::vector<int64_t> offsets = check_unpack(flat, tensors);
  if (tensors.empty()) return;
  const std::vector<char> contiguous = contiguous_flags(tensors);
  const float s = static_cast<float>(scale);
  dispatch_float(flat.scalar_type(), [&](auto in_tag) {
    using in_t = decltype(in_tag);
    dispatch_float(tensors[0].scalar_type(), [&](auto out_tag) {
      using out_t = decltype(out_tag);
      const auto* src = flat.const_data_ptr<in_t>();
      for_each_piece(offsets, contiguous, [&](size_t i, int64_t b, int64_t n) {
        scaled_copy(tensors[i].data_ptr<out_t>() + b, src + offsets[i] + b, n, s);
      });
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (contiguous[i]) continue;
        const auto view = flat.narrow(0, offsets[i], tensors[i].numel()).view(tensors[i].sizes());
        iter_scaled_copy<out_t, in_t>(tensors[i], view, s);
      }
    });
  });
}

// dst: Float or src's dtype. src: float dtype, dst's shape and device.
void accumulate_cpu(const at::Tensor& dst, const at::Tensor& src, double alpha) {
  check_accumulate(dst, src);
  const float a = static_cast<float>(alpha);
  auto iter = at::TensorIteratorConfig()
                  .add_output(dst)
                  .add_const_input(dst)
                  .add_const_input(src)
                  .check_all_same_dtype(false)
                  .resize_outputs(false)
                  .build();
  dispatch_float(src.scalar_type(), [&](auto src_tag) {
    using src_t = decltype(src_tag);
    dispatch_float(dst.scalar_type(), [&](auto dst_tag) {
      using dst_t = decltype(dst_tag);
      iter.for_each(
          [a](char** data, const int64_t* strides, int64_t n) {
            if (strides[0] == sizeof(dst_t) && strides[1] == sizeof(dst_t) &&
                strides[2] == sizeof(src_t)) {
              axpy(reinterpret_cast<dst_t*>(data[0]), reinterpret_cast<const src_t*>(data[2]),
                   n, a);
              return;
            }
            for (int64_t k = 0; k < n; ++k) {
              const float d = static_cast<float>(*reinterpret_cast<dst_t*>(data[1] + k * strides[1]));
              const float x = static_cast<float>(*reinterpret_cast<src_t*>(data[2] + k * strides[2]));
              *reinterpret_cast<dst_t*>(data[0] + k * strides[0]) = static_cast<dst_t>(d + x * a);
            }
          },
          kGrain);
    });
  });
}

// t: any float tensor, scaled in place.
void scale_cpu(const at::Tensor& t, double scale) {
  check_scale(t);
  if (scale == 1.0 || t.numel() == 0) return;
  const float s = static_cast<float>(scale);
  dispatch_float(t.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (!t.is_contiguous()) {
      iter_scaled_copy<T, T>(t, t, s);
      return;
    }
    T* p = t.data_ptr<T>();
    at::parallel_for(0, t.numel(), kGrain,
                     [&](int64_t b, int64_t e) { scaled_copy(p + b, p + b, e - b, s); });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(pycomm, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("pack_into_", &pack_into_cpu);
  m.impl("unpack_", &unpack_cpu);
  m.impl("accumulate_", &accumulate_cpu);
  m.impl("scale_", &scale_cpu);
}

}  // namespace pycomm::cpu
