// The launcher of the Meta kernels (csrc/meta.cpp): it runs nothing. The host entries
// (codecs.h, fusion.h) check their arguments and allocate their outputs as on any device, then
// return before the first data access when `launches<D>` is false, so that meta tensors,
// FakeTensorMode and torch.compile (which dispatch to the Meta kernels) get the devices' own
// checks, messages and output shapes. The members below only make the host entries compile.
#pragma once
#include <ATen/ATen.h>

#include <type_traits>

namespace pycomm::host {

struct Meta {
  struct Guard {
    explicit Guard(const at::Device&) {}
  };
  static at::TensorOptions no_tensors() { return at::TensorOptions(at::kMeta); }
  template <typename... A>
  static void encode16(A&&...) {}
  template <typename... A>
  static void quantize_int8(A&&...) {}
  template <typename... A>
  static void quantize_int4(A&&...) {}
  template <typename... A>
  static void quantize_fp8(A&&...) {}
  template <typename... A>
  static void quantize_onebit(A&&...) {}
  template <typename out_t, typename... A>
  static void sum_rows(A&&...) {}
  template <typename out_t, typename in_t, typename... A>
  static void pack_into(A&&...) {}
  template <typename out_t, typename in_t, typename... A>
  static void unpack(A&&...) {}
  template <typename dst_t, typename src_t, typename... A>
  static void accumulate(A&&...) {}
  template <typename T, typename... A>
  static void scale(A&&...) {}
};

// Whether launcher D runs kernels on data: every device's, not the Meta kernels'.
template <typename D>
inline constexpr bool launches = !std::is_same_v<D, Meta>;

}  // namespace pycomm::host
