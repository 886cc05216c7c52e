// Bucket fusion on the CPU: the kernels of pack, pack_into_, unpack_, accumulate_, scale_ (their
// host entries, shared with CUDA, are csrc/host/fusion.h).
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

#include "cpu/vec_io.h"
#include "host/fusion.h"

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

// The CPU kernels of the fusion ops, behind their host entries (csrc/host/fusion.h: checks,
// allocation, empty case, dtype dispatch).
struct Cpu {
  struct Guard {
    explicit Guard(const at::Device&) {}
  };
  static at::TensorOptions no_tensors() { return at::TensorOptions(at::kCPU); }

  // flat[offset_i : offset_i + numel_i] = tensors[i] * s, N >= 1.
  template <typename out_t, typename in_t>
  static void pack_into(const at::Tensor& flat, at::TensorList tensors,
                        const std::vector<int64_t>& offsets, float s) {
    const std::vector<char> contiguous = contiguous_flags(tensors);
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
  }

  // tensors[i] = flat[offset_i : offset_i + numel_i] * s, N >= 1.
  template <typename out_t, typename in_t>
  static void unpack(const at::Tensor& flat, at::TensorList tensors,
                     const std::vector<int64_t>& offsets, float s) {
    const std::vector<char> contiguous = contiguous_flags(tensors);
    const auto* src = flat.const_data_ptr<in_t>();
    for_each_piece(offsets, contiguous, [&](size_t i, int64_t b, int64_t n) {
      scaled_copy(tensors[i].data_ptr<out_t>() + b, src + offsets[i] + b, n, s);
    });
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (contiguous[i]) continue;
      const auto view = flat.narrow(0, offsets[i], tensors[i].numel()).view(tensors[i].sizes());
      iter_scaled_copy<out_t, in_t>(tensors[i], view, s);
    }
  }

  // dst += a * src elementwise, any strides.
  template <typename dst_t, typename src_t>
  static void accumulate(const at::Tensor& dst, const at::Tensor& src, float a) {
    auto iter = at::TensorIteratorConfig()
                    .add_output(dst)
                    .add_const_input(dst)
                    .add_const_input(src)
                    .check_all_same_dtype(false)
                    .resize_outputs(false)
                    .build();
    iter.for_each(
        [a](char** data, const int64_t* strides, int64_t n) {
          if (strides[0] == sizeof(dst_t) && strides[1] == sizeof(dst_t) &&
              strides[2] == sizeof(src_t)) {
            axpy(reinterpret_cast<dst_t*>(data[0]), reinterpret_cast<const src_t*>(data[2]), n,
                 a);
            return;
          }
          for (int64_t k = 0; k < n; ++k) {
            const float d = static_cast<float>(*reinterpret_cast<dst_t*>(data[1] + k * strides[1]));
            const float x = static_cast<float>(*reinterpret_cast<src_t*>(data[2] + k * strides[2]));
            *reinterpret_cast<dst_t*>(data[0] + k * strides[0]) = static_cast<dst_t>(d + x * a);
          }
        },
        kGrain);
  }

  // t *= s, any strides.
  template <typename T>
  static void scale(const at::Tensor& t, float s) {
    if (!t.is_contiguous()) {
      iter_scaled_copy<T, T>(t, t, s);
      return;
    }
    T* p = t.data_ptr<T>();
    at::parallel_for(0, t.numel(), kGrain,
                     [&](int64_t b, int64_t e) { scaled_copy(p + b, p + b, e - b, s); });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(pycomm, CPU, m) { host::register_fusion<Cpu>(m); }

}  // namespace pycomm::cpu
