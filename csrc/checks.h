// Argument checks shared by every device's kernels. User errors name the op, the argument and
// what was expected.
#pragma once
#include <ATen/ATen.h>

namespace pycomm {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_float(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, " has layout ", t.layout(),
              ", expected a dense (strided) tensor");
  TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": ", arg, " has dtype ",
              t.scalar_type(), ", expected Float, Half or BFloat16");
}

inline void check_same_device(const char* op, const char* arg, const at::Tensor& t,
                              const char* ref_arg, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", arg, " is on ", t.device(), ", expected ",
              ref.device(), " like ", ref_arg);
}

// Calls f(T{}) with T the C++ type of a supported float dtype.
template <typename F>
void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(at::Half{});
      break;
    case at::kBFloat16:
      f(at::BFloat16{});
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "dispatch_float: unchecked dtype ", t);
  }
}

}  // namespace pycomm
