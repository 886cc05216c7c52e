// Argument checks shared by every device's kernels and by the Meta kernels (csrc/meta.cpp), so
// that meta tensors, FakeTensorMode and torch.compile refuse what the kernels refuse, in their
// words. User errors name the op, the argument and what was expected.
//
// Sizes are read as c10::SymInt (sym_numel, sym_size, ...): under torch.compile with dynamic
// shapes the Meta kernels get tensors with symbolic sizes, and each comparison below then
// records a guard; on real tensors a SymInt is a plain integer. Nothing here reads data.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <utility>
#include <string>
#include <vector>

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

// --- bucket fusion (pack, pack_into_, unpack_) ----------------------------------------------

// Checks that every tensor is a supported float of one dtype on one device. Returns each
// tensor's offset into flat and, last, their total numel.
inline std::vector<c10::SymInt> check_list(const char* op, at::TensorList tensors) {
  std::vector<c10::SymInt> offsets(1, c10::SymInt(0));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const std::string arg = "tensors[" + std::to_string(i) + "]";
    check_float(op, arg.c_str(), t);
    if (i > 0) {
      TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), op, ": ", arg, " has dtype ",
                  t.scalar_type(), ", expected ", tensors[0].scalar_type(),
                  " like tensors[0] (one dtype per call)");
      check_same_device(op, arg.c_str(), t, "tensors[0]", tensors[0]);
    }
    offsets.push_back(offsets.back() + t.sym_numel());
  }
  return offsets;
}

// flat: 1-D contiguous float.
inline void check_flat(const char* op, const at::Tensor& flat) {
  check_float(op, "flat", flat);
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), op, ": flat has shape ",
              flat.sym_sizes(), " and strides ", flat.sym_strides(),
              ", expected a 1-D contiguous tensor");
}

// flat (as check_flat) holds exactly the tensors' total elements, on their device.
inline void check_flat_total(const char* op, const at::Tensor& flat, at::TensorList tensors,
                             const c10::SymInt& total) {
  TORCH_CHECK(flat.sym_numel() == total, op, ": flat has ", flat.sym_numel(),
              " elements, expected ", total, " (the total numel of tensors)");
  if (!tensors.empty()) check_same_device(op, "tensors[0]", tensors[0], "flat", flat);
}

// --- encoders (encode16, quantize_int8, quantize_int4, quantize_onebit) --------------------------

// r: [numel] fp32 or bf16 (half the memory and traffic; the new residual is rounded to it),
// contiguous on x's device.
inline void check_residual(const char* op, const char* arg, const at::Tensor& r,
                           const at::Tensor& x, int64_t numel) {
  TORCH_CHECK(r.defined(), op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK(r.layout() == at::kStrided, op, ": ", arg, " has layout ", r.layout(),
              ", expected a dense (strided) tensor");
  TORCH_CHECK(r.scalar_type() == at::kFloat || r.scalar_type() == at::kBFloat16, op, ": ", arg,
              " has dtype ", r.scalar_type(), ", expected Float or BFloat16");
  check_same_device(op, arg, r, "x", x);
  TORCH_CHECK(r.sym_numel() == numel, op, ": ", arg, " has ", r.sym_numel(),
              " elements, expected numel = ", numel);
  TORCH_CHECK(r.is_contiguous(), op, ": ", arg, " has strides ", r.sym_strides(),
              ", expected a contiguous tensor");
}

// x: any float dtype, n <= numel elements, any strides. residual: as check_residual, or
// absent. residual_out: absent (residual is updated in place), or as residual (same dtype),
// given with it, and not overlapping it (residual is then only read).
inline void check_encoder(const char* op, const at::Tensor& x,
                          const std::optional<at::Tensor>& residual, int64_t numel,
                          const std::optional<at::Tensor>& residual_out) {
  check_float(op, "x", x);
  TORCH_CHECK(x.sym_numel() <= numel, op, ": numel is ", numel, ", expected >= x.numel() = ",
              x.sym_numel());
  if (residual.has_value()) check_residual(op, "residual", *residual, x, numel);
  if (!residual_out.has_value()) return;
  TORCH_CHECK(residual.has_value(), op,
              ": residual_out is given without residual, expected both or residual alone");
  check_residual(op, "residual_out", *residual_out, x, numel);
  const auto& a = *residual;
  const auto& b = *residual_out;
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), op, ": residual_out has dtype ",
              b.scalar_type(), ", expected ", a.scalar_type(), " like residual");
  // both contiguous [numel]: they overlap when they share a storage at offsets closer than
  // numel elements (from the offsets alone: meta and fake tensors have no data)
  const c10::SymInt apart = a.sym_storage_offset() - b.sym_storage_offset();
  const bool overlap = a.is_alias_of(b) && apart != 0 && apart < numel && apart > -numel;
  TORCH_CHECK(!overlap, op,
              ": residual_out overlaps residual, expected separate tensors (or the same one)");
}

inline void check_block(const char* op, int64_t block, int64_t numel, int64_t multiple_of) {
  TORCH_CHECK(block >= 1, op, ": block is ", block, ", expected >= 1");
  TORCH_CHECK(block % multiple_of == 0, op, ": block is ", block, ", expected a multiple of ",
              multiple_of);
  TORCH_CHECK(numel % block == 0, op, ": numel is ", numel, ", expected a multiple of block = ",
              block);
}

// --- decoders (decode16_sum, dequantize_int8_sum, dequantize_int4_sum, dequantize_onebit_sum)

// t: [rows, cols], each row contiguous and rows apart by at least a row: a row-major tensor,
// or a column slice of one. The decoders (CPU and CUDA) read each row through the row stride,
// so the hooks decode straight out of column slices of their [R, codes | scales] receive
// buffers.
inline void check_row_layout(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK((t.sym_size(1) <= 1 || t.sym_stride(1) == 1) &&
                  (t.sym_size(0) <= 1 || t.sym_stride(0) >= t.sym_size(1)),
              op, ": ", arg, " has shape ", t.sym_sizes(), " and strides ", t.sym_strides(),
              ", expected contiguous rows (stride 1 within a row, rows apart by >= a row)");
}

// rows: [R, cols], R >= 1, rows contiguous (check_row_layout), of dtype `dtype` (a
// description for the message).
inline void check_rows(const char* op, const char* arg, const at::Tensor& t, bool dtype_ok,
                       const char* dtype) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, " has layout ", t.layout(),
              ", expected a dense (strided) tensor");
  TORCH_CHECK(dtype_ok, op, ": ", arg, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.dim() == 2, op, ": ", arg, " has shape ", t.sym_sizes(),
              ", expected a 2-D [R, m] tensor");
  TORCH_CHECK(t.sym_size(0) >= 1, op, ": ", arg, " has shape ", t.sym_sizes(),
              ", expected R >= 1 rows");
  check_row_layout(op, arg, t);
}

// out: contiguous float on ref's device, at most m elements.
inline void check_out(const char* op, const at::Tensor& out, const char* ref_arg,
                      const at::Tensor& ref, const c10::SymInt& m) {
  check_float(op, "out", out);
  check_same_device(op, "out", out, ref_arg, ref);
  TORCH_CHECK(out.sym_numel() <= m, op, ": out has ", out.sym_numel(),
              " elements, expected <= m = ", m);
  TORCH_CHECK(out.is_contiguous(), op, ": out has strides ", out.sym_strides(),
              ", expected a contiguous tensor");
}

// scales: [R, m / block], rows contiguous, of dtype want, on ref's device.
inline void check_scales(const char* op, const at::Tensor& scales, at::ScalarType want,
                         const char* ref_arg, const at::Tensor& ref, const c10::SymInt& rows,
                         const c10::SymInt& m, int64_t block) {
  TORCH_CHECK(scales.defined(), op, ": scales is an undefined tensor");
  TORCH_CHECK(scales.layout() == at::kStrided, op, ": scales has layout ", scales.layout(),
              ", expected a dense (strided) tensor");
  TORCH_CHECK(scales.scalar_type() == want, op, ": scales has dtype ", scales.scalar_type(),
              ", expected ", want);
  check_same_device(op, "scales", scales, ref_arg, ref);
  TORCH_CHECK(scales.dim() == 2 && scales.sym_size(0) == rows && scales.sym_size(1) == m / block,
              op, ": scales has shape ", scales.sym_sizes(), ", expected [", rows, ", ",
              m / block, "] ([R, m / block])");
  check_row_layout(op, "scales", scales);
}

// --- each op's whole argument contract ------------------------------------------------------
// The CPU, CUDA and Meta kernels of an op run the same host entry (csrc/host), which calls the
// same function here, so every device and FakeTensorMode accept the same inputs and refuse the
// others with the same message.

// flat: [sum numel] 1-D contiguous float. tensors: [N] float tensors, one dtype, flat's device.
// Returns each tensor's offset into flat and, last, their total numel.
inline std::vector<c10::SymInt> check_pack_into(const char* op, const at::Tensor& flat,
                                                at::TensorList tensors) {
  std::vector<c10::SymInt> offsets = check_list(op, tensors);
  check_flat(op, flat);
  check_flat_total(op, flat, tensors, offsets.back());
  return offsets;
}

// tensors: as pack_into_'s. Returns the output's dtype (dtype, else the tensors') and numel.
inline std::pair<at::ScalarType, c10::SymInt> check_pack(at::TensorList tensors,
                                                         std::optional<at::ScalarType> dtype) {
  const auto in_type = tensors.empty() ? at::kFloat : tensors[0].scalar_type();
  const auto out_type = dtype.value_or(in_type);
  TORCH_CHECK(!dtype || is_supported_float(*dtype), "pycomm.pack: dtype is ", out_type,
              ", expected Float, Half or BFloat16");
  return {out_type, check_list("pycomm.pack", tensors).back()};
}

// flat, tensors: as pack_into_'s (flat checked first). Returns the offsets and the total.
inline std::vector<c10::SymInt> check_unpack(const at::Tensor& flat, at::TensorList tensors) {
  constexpr const char* op = "pycomm.unpack_";
  check_flat(op, flat);
  std::vector<c10::SymInt> offsets = check_list(op, tensors);
  check_flat_total(op, flat, tensors, offsets.back());
  return offsets;
}

// dst: Float or src's dtype. src: float dtype, dst's shape and device.
inline void check_accumulate(const at::Tensor& dst, const at::Tensor& src) {
  constexpr const char* op = "pycomm.accumulate_";
  check_float(op, "dst", dst);
  check_float(op, "src", src);
  TORCH_CHECK(dst.scalar_type() == at::kFloat || dst.scalar_type() == src.scalar_type(), op,
              ": dst has dtype ", dst.scalar_type(), ", expected Float or src's dtype ",
              src.scalar_type());
  check_same_device(op, "src", src, "dst", dst);
  TORCH_CHECK(dst.sym_sizes() == src.sym_sizes(), op, ": src has shape ", src.sym_sizes(),
              ", expected dst's shape ", dst.sym_sizes());
}

// t: any float tensor.
inline void check_scale(const at::Tensor& t) { check_float("pycomm.scale_", "t", t); }

// x, residual, residual_out: as check_encoder. dtype: Half or BFloat16.
inline void check_encode16(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                           at::ScalarType dtype, int64_t numel,
                           const std::optional<at::Tensor>& residual_out) {
  constexpr const char* op = "pycomm.encode16";
  check_encoder(op, x, residual, numel, residual_out);
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, ": dtype is ", dtype,
              ", expected Half or BFloat16");
}

// As check_encoder, and block >= 1 dividing numel (and a multiple of 8 for 1-bit codes).
inline void check_quantize(const char* op, const at::Tensor& x,
                           const std::optional<at::Tensor>& residual, int64_t block, int64_t numel,
                           const std::optional<at::Tensor>& residual_out, int64_t multiple_of) {
  check_encoder(op, x, residual, numel, residual_out);
  check_block(op, block, numel, multiple_of);
}

// As check_quantize with an even block, and scale_dtype Float or BFloat16.
inline void check_quantize_int4(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                int64_t block, int64_t numel,
                                const std::optional<at::Tensor>& residual_out,
                                at::ScalarType scale_dtype) {
  constexpr const char* op = "pycomm.quantize_int4";
  check_quantize(op, x, residual, block, numel, residual_out, 2);
  TORCH_CHECK(scale_dtype == at::kFloat || scale_dtype == at::kBFloat16, op,
              ": scale_dtype is ", scale_dtype, ", expected Float or BFloat16");
}

// chunks: [R, m] Half/BFloat16, rows contiguous. out: contiguous float, numel <= m.
inline void check_decode16_sum(const at::Tensor& chunks, const at::Tensor& out) {
  constexpr const char* op = "pycomm.decode16_sum";
  check_rows(op, "chunks", chunks,
             chunks.scalar_type() == at::kHalf || chunks.scalar_type() == at::kBFloat16,
             "Half or BFloat16");
  check_out(op, out, "chunks", chunks, chunks.sym_size(1));
}

// codes: [R, m] int8, rows contiguous, m % block == 0. scales: [R, m / block] fp32. out: as
// decode16_sum's.
inline void check_dequantize_int8_sum(const at::Tensor& codes, const at::Tensor& scales,
                                      int64_t block, const at::Tensor& out) {
  constexpr const char* op = "pycomm.dequantize_int8_sum";
  check_rows(op, "codes", codes, codes.scalar_type() == at::kChar, "Char (int8)");
  const c10::SymInt rows = codes.sym_size(0), m = codes.sym_size(1);
  TORCH_CHECK(block >= 1, op, ": block is ", block, ", expected >= 1");
  TORCH_CHECK(m % block == 0, op, ": codes has m = ", m,
              " columns, expected a multiple of block = ", block);
  check_scales(op, scales, at::kFloat, "codes", codes, rows, m, block);
  check_out(op, out, "codes", codes, m);
}

// codes: [R, m] float8_e4m3fn, rows contiguous, m % block == 0. scales: [R, m / block] fp32.
// out: as decode16_sum's.
inline void check_dequantize_fp8_sum(const at::Tensor& codes, const at::Tensor& scales,
                                     int64_t block, const at::Tensor& out) {
  constexpr const char* op = "pycomm.dequantize_fp8_sum";
  check_rows(op, "codes", codes, codes.scalar_type() == at::kFloat8_e4m3fn, "Float8_e4m3fn");
  const c10::SymInt rows = codes.sym_size(0), m = codes.sym_size(1);
  TORCH_CHECK(block >= 1, op, ": block is ", block, ", expected >= 1");
  TORCH_CHECK(m % block == 0, op, ": codes has m = ", m,
              " columns, expected a multiple of block = ", block);
  check_scales(op, scales, at::kFloat, "codes", codes, rows, m, block);
  check_out(op, out, "codes", codes, m);
}

// codes: [R, m / 2] uint8, rows contiguous, block even, m % block == 0. scales: [R, m / block]
// Float or BFloat16. out: as decode16_sum's.
inline void check_dequantize_int4_sum(const at::Tensor& codes, const at::Tensor& scales,
                                      int64_t block, const at::Tensor& out) {
  constexpr const char* op = "pycomm.dequantize_int4_sum";
  check_rows(op, "codes", codes, codes.scalar_type() == at::kByte, "Byte (uint8)");
  const c10::SymInt rows = codes.sym_size(0), m = codes.sym_size(1) * 2;
  TORCH_CHECK(block >= 1, op, ": block is ", block, ", expected >= 1");
  TORCH_CHECK(block % 2 == 0, op, ": block is ", block, ", expected a multiple of 2");
  TORCH_CHECK(m % block == 0, op, ": codes has m = ", m,
              " elements (2 per column), expected a multiple of block = ", block);
  TORCH_CHECK(scales.defined(), op, ": scales is an undefined tensor");
  const auto st = scales.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16, op, ": scales has dtype ", st,
              ", expected Float or BFloat16");
  check_scales(op, scales, st, "codes", codes, rows, m, block);
  check_out(op, out, "codes", codes, m);
}

// bits: [R, m / 8] uint8, rows contiguous, m % block == 0, block % 8 == 0. scales:
// [R, m / block] bf16. out: as decode16_sum's.
inline void check_dequantize_onebit_sum(const at::Tensor& bits, const at::Tensor& scales,
                                        int64_t block, const at::Tensor& out) {
  constexpr const char* op = "pycomm.dequantize_onebit_sum";
  check_rows(op, "bits", bits, bits.scalar_type() == at::kByte, "Byte (uint8)");
  const c10::SymInt rows = bits.sym_size(0), m = bits.sym_size(1) * 8;
  TORCH_CHECK(block >= 1, op, ": block is ", block, ", expected >= 1");
  TORCH_CHECK(block % 8 == 0, op, ": block is ", block, ", expected a multiple of 8");
  TORCH_CHECK(m % block == 0, op, ": bits has m = ", m,
              " elements (8 per column), expected a multiple of block = ", block);
  check_scales(op, scales, at::kBFloat16, "bits", bits, rows, m, block);
  check_out(op, out, "bits", bits, m);
}

}  // namespace pycomm
