// The one host entry of each codec op (encode16, quantize_int8, quantize_int4, quantize_fp8,
// quantize_onebit, decode16_sum, dequantize_int8_sum, dequantize_int4_sum, dequantize_fp8_sum,
// dequantize_onebit_sum), shared by every device: the argument checks
// (csrc/checks.h), the outputs' allocation, the empty case and the dtype dispatch happen here,
// once; a device's launcher D (csrc/cpu/codecs.cpp, csrc/cuda/codecs.cu) only runs its kernels
// on arguments that passed them, described by the plain structs below. The Meta kernels'
// launcher (meta.h) runs nothing: they return before touching data.
//
// A launcher D provides:
//   Guard                                    constructed from x's / out's device around a launch
//   encode16(Encoding<T, R>, out_t* out, numel)     out [numel] = y rounded (Half, BFloat16)
//   quantize_int8(Encoding<T, R>, codes, scales, block, numel)
//   quantize_int4(Encoding<T, R>, codes, S* scales, block, numel)  (S: float or BFloat16)
//   quantize_fp8(Encoding<T, R>, codes, scales, block, numel)   (codes: e4m3fn bytes)
//   quantize_onebit(Encoding<T, R>, bits, scales, block, numel)
// (numel > 0; the residual updated as the schema says), and
//   sum_rows<out_t>(rows, nrows, s, out, stats)   the decoders, for rows of each kind
//       (Chunks16<T>, Int8Rows, Int4Rows<S>, Fp8Rows, OnebitRows): out (contiguous, numel > 0) = s *
//       the sum over rows of each row's decoded elements; stats (Double [2] on out's device) =
//       (squared norm, non-finite count), both as docs/custom_hooks.md, "The decode contract"
//       states them.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <type_traits>

#include "checks.h"
#include "host/meta.h"

namespace pycomm::host {

// An encoder's input: y = x * s (+ r), x zero beyond its n elements. T: x's type, R: the
// residual's (float or at::BFloat16; float without one).
template <typename T, typename R>
struct Encoding {
  const T* x;  // [n], contiguous
  const R* r;  // [numel] residual read, or nullptr without error feedback
  R* r_out;    // [numel] residual written: r itself, or residual_out (nullptr without one)
  int64_t n;
  float s;
};

// A decoder's rows: row r's element i is at [r * ld + i] (bits: byte [r * ld + i / 8]), its
// codec block's scale at [r * lds + i / block].
template <typename T>
struct Chunks16 {
  const T* c;
  int64_t ld;
};
struct Int8Rows {
  const int8_t* q;
  const float* sc;
  int64_t ld, lds, block;
};
// Two int4 codes a byte (element i in nibble i % 2 of byte i / 2, the low one first), scales
// of S (float or BFloat16).
template <typename S>
struct Int4Rows {
  const uint8_t* q;
  const S* sc;
  int64_t ld, lds, block;  // ld in bytes
};
// float8 e4m3fn codes, as their bytes.
struct Fp8Rows {
  const uint8_t* q;
  const float* sc;
  int64_t ld, lds, block;
};
struct OnebitRows {
  const uint8_t* bits;
  const at::BFloat16* sc;
  int64_t ld, lds, block;
};

// Calls f(T{}) with T the C++ type of a 16-bit float dtype (Half or BFloat16).
template <typename F>
void dispatch_16bit(at::ScalarType t, F&& f) {
  TORCH_INTERNAL_ASSERT(t == at::kHalf || t == at::kBFloat16, "dispatch_16bit: unchecked dtype ",
                        t);
  dispatch_float(t, [&](auto tag) {
    if constexpr (!std::is_same_v<decltype(tag), float>) f(tag);
  });
}

// Calls f(S{}) with S the C++ type of an int4 scale dtype (Float or BFloat16).
template <typename F>
void dispatch_scale(at::ScalarType t, F&& f) {
  TORCH_INTERNAL_ASSERT(t == at::kFloat || t == at::kBFloat16, "dispatch_scale: unchecked dtype ",
                        t);
  if (t == at::kFloat) {
    f(float{});
  } else {
    f(at::BFloat16{});
  }
}

// Calls f(Encoding<T, R>) for x (staged contiguous when it is not), reading residual and
// writing residual_out if given, else residual. check_encoder has checked that both have one
// dtype.
template <typename F>
void with_encoding(const at::Tensor& x, const std::optional<at::Tensor>& residual, double scale,
                   const std::optional<at::Tensor>& residual_out, F&& f) {
  const at::Tensor xc = x.contiguous();
  const auto run = [&](auto r_tag) {
    using R = decltype(r_tag);
    R* r_in = residual.has_value() ? residual->data_ptr<R>() : nullptr;
    R* r_out = residual_out.has_value() ? residual_out->data_ptr<R>() : r_in;
    dispatch_float(xc.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      f(Encoding<T, R>{xc.const_data_ptr<T>(), r_in, r_out, xc.numel(),
                       static_cast<float>(scale)});
    });
  };
  if (residual.has_value() && residual->scalar_type() == at::kBFloat16) {
    run(at::BFloat16{});
  } else {
    run(float{});
  }
}

// x: any float dtype, n <= numel elements, any strides. residual: [numel] fp32 or bf16, or
// absent. dtype: Half or BFloat16. Returns [numel] of dtype: y = x * scale (+ residual) padded
// with zeros to numel, rounded; residual = y - returned where that is finite.
template <typename D>
at::Tensor encode16(const at::Tensor& x, const std::optional<at::Tensor>& residual, double scale,
                    at::ScalarType dtype, int64_t numel,
                    const std::optional<at::Tensor>& residual_out) {
  check_encode16(x, residual, dtype, numel, residual_out);
  at::Tensor out = at::empty({numel}, x.options().dtype(dtype));
  if (numel == 0 || !launches<D>) return out;
  const typename D::Guard guard(x.device());
  with_encoding(x, residual, scale, residual_out, [&](const auto& src) {
    dispatch_16bit(dtype, [&](auto out_tag) {
      using out_t = decltype(out_tag);
      D::encode16(src, out.data_ptr<out_t>(), numel);
    });
  });
  return out;
}

// x, residual: as encode16. block >= 1, numel % block == 0. Returns (codes int8 [numel],
// scales fp32 [numel / block]).
template <typename D>
std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& x,
                                                 const std::optional<at::Tensor>& residual,
                                                 double scale, int64_t block, int64_t numel,
                                                 const std::optional<at::Tensor>& residual_out) {
  check_quantize("pycomm.quantize_int8", x, residual, block, numel, residual_out, 1);
  at::Tensor codes = at::empty({numel}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({numel / block}, x.options().dtype(at::kFloat));
  if (numel == 0 || !launches<D>) return {codes, scales};
  const typename D::Guard guard(x.device());
  with_encoding(x, residual, scale, residual_out, [&](const auto& src) {
    D::quantize_int8(src, codes.data_ptr<int8_t>(), scales.data_ptr<float>(), block, numel);
  });
  return {codes, scales};
}

// x, residual: as encode16. block % 2 == 0, numel % block == 0, scale_dtype Float or
// BFloat16. Returns (codes uint8 [numel / 2], scales scale_dtype [numel / block]).
template <typename D>
std::tuple<at::Tensor, at::Tensor> quantize_int4(const at::Tensor& x,
                                                 const std::optional<at::Tensor>& residual,
                                                 double scale, int64_t block, int64_t numel,
                                                 const std::optional<at::Tensor>& residual_out,
                                                 at::ScalarType scale_dtype) {
  check_quantize_int4(x, residual, block, numel, residual_out, scale_dtype);
  at::Tensor codes = at::empty({numel / 2}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({numel / block}, x.options().dtype(scale_dtype));
  if (numel == 0 || !launches<D>) return {codes, scales};
  const typename D::Guard guard(x.device());
  with_encoding(x, residual, scale, residual_out, [&](const auto& src) {
    dispatch_scale(scale_dtype, [&](auto s_tag) {
      using S = decltype(s_tag);
      D::quantize_int4(src, codes.data_ptr<uint8_t>(), scales.data_ptr<S>(), block, numel);
    });
  });
  return {codes, scales};
}

// x, residual: as encode16. block >= 1, numel % block == 0. Returns (codes float8_e4m3fn
// [numel], scales fp32 [numel / block]).
template <typename D>
std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& x,
                                                const std::optional<at::Tensor>& residual,
                                                double scale, int64_t block, int64_t numel,
                                                const std::optional<at::Tensor>& residual_out) {
  check_quantize("pycomm.quantize_fp8", x, residual, block, numel, residual_out, 1);
  at::Tensor codes = at::empty({numel}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scales = at::empty({numel / block}, x.options().dtype(at::kFloat));
  if (numel == 0 || !launches<D>) return {codes, scales};
  const typename D::Guard guard(x.device());
  with_encoding(x, residual, scale, residual_out, [&](const auto& src) {
    D::quantize_fp8(src, static_cast<uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(), block,
                    numel);
  });
  return {codes, scales};
}

// x, residual: as encode16. block % 8 == 0, numel % block == 0. Returns (bits uint8
// [numel / 8], scales bf16 [numel / block]).
template <typename D>
std::tuple<at::Tensor, at::Tensor> quantize_onebit(const at::Tensor& x,
                                                   const std::optional<at::Tensor>& residual,
                                                   double scale, int64_t block, int64_t numel,
                                                   const std::optional<at::Tensor>& residual_out) {
  check_quantize("pycomm.quantize_onebit", x, residual, block, numel, residual_out, 8);
  at::Tensor bits = at::empty({numel / 8}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({numel / block}, x.options().dtype(at::kBFloat16));
  if (numel == 0 || !launches<D>) return {bits, scales};
  const typename D::Guard guard(x.device());
  with_encoding(x, residual, scale, residual_out, [&](const auto& src) {
    D::quantize_onebit(src, bits.data_ptr<uint8_t>(), scales.data_ptr<at::BFloat16>(), block,
                       numel);
  });
  return {bits, scales};
}

// A decoder's stats when it has nothing to run: zeros for an empty out, an unwritten [2] in
// the Meta kernels (checked first: their out may have a symbolic numel); else none.
template <typename D>
std::optional<at::Tensor> nothing_to_decode(const at::Tensor& out) {
  const auto stats_options = out.options().dtype(at::kDouble);
  if (!launches<D>) return at::empty({2}, stats_options);
  if (out.numel() == 0) return at::zeros({2}, stats_options);
  return std::nullopt;
}

// The decoders' common part, for a non-empty out: out = scale * the fp32 sum over rows of each
// row's first out.numel() decoded elements (D::sum_rows, for out's element type), stats for it.
template <typename D, typename Rows>
at::Tensor decode_sum(const Rows& rows, int64_t nrows, double scale, const at::Tensor& out) {
  at::Tensor stats = at::empty({2}, out.options().dtype(at::kDouble));
  const typename D::Guard guard(out.device());
  dispatch_float(out.scalar_type(), [&](auto out_tag) {
    using out_t = decltype(out_tag);
    D::template sum_rows<out_t>(rows, nrows, static_cast<float>(scale), out, stats);
  });
  return stats;
}

// chunks: [R, m] Half/BFloat16, rows contiguous (a row slice of wider rows is read in place).
// out: contiguous float, numel <= m, same device. out = scale * sum_r chunks[r, :out.numel()].
// Returns fp64 [2]: (squared norm, non-finite count), the decode contract's (registration.cpp).
template <typename D>
at::Tensor decode16_sum(const at::Tensor& chunks, double scale, const at::Tensor& out) {
  check_decode16_sum(chunks, out);
  if (auto done = nothing_to_decode<D>(out)) return *done;
  at::Tensor stats;
  dispatch_16bit(chunks.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const Chunks16<T> rows{chunks.const_data_ptr<T>(), chunks.stride(0)};
    stats = decode_sum<D>(rows, chunks.size(0), scale, out);
  });
  return stats;
}

// codes: [R, m] int8, rows contiguous, m % block == 0. scales: [R, m / block] fp32, rows
// contiguous. out: as decode16_sum. out = scale * sum_r codes[r] * scales[r] (per block).
template <typename D>
at::Tensor dequantize_int8_sum(const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                               double scale, const at::Tensor& out) {
  check_dequantize_int8_sum(codes, scales, block, out);
  if (auto done = nothing_to_decode<D>(out)) return *done;
  const Int8Rows rows{codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                      codes.stride(0), scales.stride(0), block};
  return decode_sum<D>(rows, codes.size(0), scale, out);
}

// codes: [R, m / 2] uint8, rows contiguous, block even, m % block == 0. scales: [R, m / block]
// Float or BFloat16, rows contiguous. out: as decode16_sum. out = scale * sum_r q[r] * scales[r].
template <typename D>
at::Tensor dequantize_int4_sum(const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                               double scale, const at::Tensor& out) {
  check_dequantize_int4_sum(codes, scales, block, out);
  if (auto done = nothing_to_decode<D>(out)) return *done;
  at::Tensor stats;
  dispatch_scale(scales.scalar_type(), [&](auto s_tag) {
    using S = decltype(s_tag);
    const Int4Rows<S> rows{codes.const_data_ptr<uint8_t>(), scales.const_data_ptr<S>(),
                           codes.stride(0), scales.stride(0), block};
    stats = decode_sum<D>(rows, codes.size(0), scale, out);
  });
  return stats;
}

// codes: [R, m] float8_e4m3fn, rows contiguous, m % block == 0. scales: [R, m / block] fp32,
// rows contiguous. out: as decode16_sum. out = scale * sum_r codes[r] * scales[r] (per block).
template <typename D>
at::Tensor dequantize_fp8_sum(const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                              double scale, const at::Tensor& out) {
  check_dequantize_fp8_sum(codes, scales, block, out);
  if (auto done = nothing_to_decode<D>(out)) return *done;
  const Fp8Rows rows{static_cast<const uint8_t*>(codes.const_data_ptr()),
                     scales.const_data_ptr<float>(), codes.stride(0), scales.stride(0), block};
  return decode_sum<D>(rows, codes.size(0), scale, out);
}

// bits: [R, m / 8] uint8, rows contiguous, m % block == 0, block % 8 == 0. scales:
// [R, m / block] bf16, rows contiguous. out: as decode16_sum. out = scale * sum_r (bit ? +s : -s).
template <typename D>
at::Tensor dequantize_onebit_sum(const at::Tensor& bits, const at::Tensor& scales, int64_t block,
                                 double scale, const at::Tensor& out) {
  check_dequantize_onebit_sum(bits, scales, block, out);
  if (auto done = nothing_to_decode<D>(out)) return *done;
  const OnebitRows rows{bits.const_data_ptr<uint8_t>(), scales.const_data_ptr<at::BFloat16>(),
                        bits.stride(0), scales.stride(0), block};
  return decode_sum<D>(rows, bits.size(0), scale, out);
}

// The codec ops' kernels for one dispatch key: TORCH_LIBRARY_IMPL(<lib>, <key>, m) calls it.
template <typename D>
void register_codecs(torch::Library& m) {
  m.impl("encode16", &encode16<D>);
  m.impl("quantize_int8", &quantize_int8<D>);
  m.impl("quantize_int4", &quantize_int4<D>);
  m.impl("quantize_fp8", &quantize_fp8<D>);
  m.impl("quantize_onebit", &quantize_onebit<D>);
  m.impl("decode16_sum", &decode16_sum<D>);
  m.impl("dequantize_int8_sum", &dequantize_int8_sum<D>);
  m.impl("dequantize_int4_sum", &dequantize_int4_sum<D>);
  m.impl("dequantize_fp8_sum", &dequantize_fp8_sum<D>);
  m.impl("dequantize_onebit_sum", &dequantize_onebit_sum<D>);
}

}  // namespace pycomm::host
