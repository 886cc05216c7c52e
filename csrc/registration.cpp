// Every pycomm op schema, and the Python module init of pycomm._C.
//
// The ops are dispatcher ops (torch.ops.pycomm.*): per-device kernels register themselves with
// TORCH_LIBRARY_IMPL in csrc/cpu and csrc/cuda, the Meta kernels (which FakeTensorMode and
// torch.compile run) in csrc/meta.cpp; all of them are the host entries of csrc/host. Mutated
// arguments are annotated (a!) and are not returned.
#include <Python.h>
#include <torch/library.h>

#ifndef PYCOMM_TORCH_VERSION
#error "PYCOMM_TORCH_VERSION must be defined by setup.py"
#endif

TORCH_LIBRARY(pycomm, m) {
  // tensors: N tensors of one dtype (Float, Half or BFloat16) on one device, any shapes and
  // strides. Returns a 1-D contiguous tensor of sum(numel) elements, dtype `dtype` (default:
  // the tensors' dtype), holding each tensor flattened in order, times `scale`.
  m.def("pack(Tensor[] tensors, float scale=1., ScalarType? dtype=None) -> Tensor");
  // pack into an existing 1-D contiguous buffer of sum(numel) elements (any float dtype), so
  // that a buffer that lives across steps is not reallocated.
  m.def("pack_into_(Tensor(a!) flat, Tensor[] tensors, float scale=1.) -> ()");
  // flat: 1-D contiguous, sum(numel) elements. Writes flat[offset_i : offset_i + numel_i] *
  // scale into tensors[i] (converted to its dtype); the way back from pack.
  m.def("unpack_(Tensor flat, Tensor(a!)[] tensors, float scale=1.) -> ()");
  // dst += alpha * src, computed in fp32. dst: Float or src's dtype; src: Float, Half or
  // BFloat16; same shape and device.
  m.def("accumulate_(Tensor(a!) dst, Tensor src, float alpha=1.) -> ()");
  // t *= scale, computed in fp32.
  m.def("scale_(Tensor(a!) t, float scale) -> ()");

  // Codecs (pycomm.reference defines their arithmetic). Every encoder takes x (Float, Half or
  // BFloat16, n elements, any shape and strides), computes y = x * scale + residual over
  // `numel` >= n elements (x padded with zeros), and updates residual (optional; Float or
  // BFloat16, contiguous, numel elements, x's device; y is fp32 either way and a BFloat16
  // residual keeps the new value rounded to nearest even) in place to y - decode(code), except
  // where the block (16-bit: the element) is non-finite, where it keeps its value. With
  // residual_out (as residual, same dtype, not overlapping it) the new residual goes there and
  // residual is only read:
  // the hooks keep two and commit a step's only once it is known to be finite everywhere.
  //
  // Returns [numel] of dtype (Half or BFloat16): y rounded.
  m.def("encode16(Tensor x, Tensor(a!)? residual, float scale, ScalarType dtype, int numel, "
        "Tensor(b!)? residual_out=None) -> Tensor");
  // block >= 1 divides numel. Returns (codes Char [numel], scales Float [numel / block]):
  // per block s = absmax / 127, codes round_half_even(y * 127 / absmax); a non-finite block
  // has scale NaN and codes 0.
  m.def("quantize_int8(Tensor x, Tensor(a!)? residual, float scale, int block, int numel, "
        "Tensor(b!)? residual_out=None) -> (Tensor, Tensor)");
  // block % 2 == 0 divides numel; scale_dtype Float or BFloat16. Returns (codes Byte
  // [numel / 2], scales scale_dtype [numel / block]): per block s = absmax / 7 rounded to
  // scale_dtype, codes q = round_half_even(y * (1 / s)) clamped to [-7, 7], two a byte (element
  // 2k in the low nibble of byte k, two's complement); a non-finite block has scale NaN and
  // codes 0.
  m.def("quantize_int4(Tensor x, Tensor(a!)? residual, float scale, int block, int numel, "
        "Tensor(b!)? residual_out=None, ScalarType scale_dtype=float32) -> (Tensor, Tensor)");
  // block >= 1 divides numel. Returns (codes Float8_e4m3fn [numel], scales Float
  // [numel / block]): per block s = absmax / 448, codes = e4m3fn(clamp(y * (448 / absmax),
  // -448, 448)) rounded to nearest even (torch's cast); a non-finite block has scale NaN and
  // codes 0.
  m.def("quantize_fp8(Tensor x, Tensor(a!)? residual, float scale, int block, int numel, "
        "Tensor(b!)? residual_out=None) -> (Tensor, Tensor)");
  // block % 8 == 0 divides numel. Returns (bits Byte [numel / 8], scales BFloat16
  // [numel / block]): bit j of byte k is y[8k + j] >= 0; scale = mean |y| of the block, NaN
  // for a non-finite block.
  m.def("quantize_onebit(Tensor x, Tensor(a!)? residual, float scale, int block, int numel, "
        "Tensor(b!)? residual_out=None) -> (Tensor, Tensor)");
  // The decoders: R >= 1 rows of m elements each, contiguous. out (Float, Half or BFloat16,
  // contiguous, numel <= m, the rows' device) = scale * the sum over rows of each row's first
  // out.numel() decoded elements. Each returns a new Double [2] on out's device, (squared
  // norm, non-finite count); the sum's order and rounding, and the statistics: the decode
  // contract (docs/custom_hooks.md, "The decode contract").
  //
  // chunks: [R, m] Half or BFloat16.
  m.def("decode16_sum(Tensor chunks, float scale, Tensor(a!) out) -> Tensor");
  // codes: [R, m] Char, m % block == 0; scales: [R, m / block] Float.
  m.def("dequantize_int8_sum(Tensor codes, Tensor scales, int block, float scale, "
        "Tensor(a!) out) -> Tensor");
  // codes: [R, m / 2] Byte, block even, m % block == 0; scales: [R, m / block] Float or
  // BFloat16.
  m.def("dequantize_int4_sum(Tensor codes, Tensor scales, int block, float scale, "
        "Tensor(a!) out) -> Tensor");
  // codes: [R, m] Float8_e4m3fn, m % block == 0; scales: [R, m / block] Float.
  m.def("dequantize_fp8_sum(Tensor codes, Tensor scales, int block, float scale, "
        "Tensor(a!) out) -> Tensor");
  // bits: [R, m / 8] Byte, block % 8 == 0, m % block == 0; scales: [R, m / block] BFloat16.
  m.def("dequantize_onebit_sum(Tensor bits, Tensor scales, int block, float scale, "
        "Tensor(a!) out) -> Tensor");
}

namespace {
PyModuleDef pycomm_module = {PyModuleDef_HEAD_INIT, "_C", "pycomm's C++ core", -1, nullptr};
}  // namespace

// Importing pycomm._C loads this library, which runs the registrations above.
PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&pycomm_module);
  if (m == nullptr) return nullptr;
#ifdef PYCOMM_WITH_CUDA
  const long with_cuda = 1;
#else
  const long with_cuda = 0;
#endif
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", PYCOMM_TORCH_VERSION) < 0 ||
      PyModule_AddIntConstant(m, "WITH_CUDA", with_cuda) < 0 ||
      PyModule_AddStringConstant(m, "CPU_CAPABILITY", PYCOMM_CPU_CAPABILITY) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
