// Compression codecs on CUDA: the encoders encode16, quantize_int8, quantize_onebit and the
// decoders decode16_sum, dequantize_int8_sum, dequantize_onebit_sum.
//
// Every op is one pass over memory. An encoder block stages a tile of y = x * scale + residual
// in shared memory (whole codec blocks, at most kTile elements), takes each codec block's
// statistic (absmax, sum of |y|) from there with a team of up to 32 lanes per codec block,
// then writes codes, scales and the new residual from the y it kept in registers: x and the
// residual are read once, the outputs written once. A codec block longer than a tile gets a
// thread block of its own, which reads its x and residual twice (statistic, then codes).
// A decoder thread decodes kVec elements of up to kRowsAtOnce rows at a time (their loads in
// flight together), sums them in fp32 in row order, scales, rounds and stores them, and adds
// what it stored to the squared norm; per-block partial norms go to a workspace that one more
// small kernel sums in a fixed order (deterministic, no atomics, no host synchronization).
//
// The residual is fp32 or bf16 (R below): y is fp32 either way, and the new residual is rounded
// to R only when it is stored (so a bf16 residual halves that traffic, nothing else changes).
//
// The arithmetic is pycomm.reference's, operation for operation (see common.cuh), so outputs
// match the CPU kernels bit for bit. As on the CPU, two fp64 sums are taken in another order
// than torch's: a 1-bit block's sum of |y| (exact unless one block spans more than about
// 2^(29 - log2 block) in magnitude) and the decoders' squared norm (summed in fp64 here).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>

#include "cuda/common.cuh"

namespace pycomm::cuda {
namespace {

// Elements of one encoder tile: kVec per thread.
constexpr int kTile = kThreads * kVec;
constexpr float kMaxFinite = std::numeric_limits<float>::max();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// y = x * s (+ r), x zero beyond its n elements: the references' y. R: the residual's type,
// float or at::BFloat16 (float without a residual).
template <typename T, typename R>
struct Source {
  using x_t = T;
  using r_t = R;
  const T* x;  // [n], contiguous
  const R* r;  // [numel] residual read, or nullptr without error feedback
  R* r_out;    // [numel] residual written: r itself, or residual_out
  int64_t n;
  float s;
};

// A residual as fp32, exactly. bf16 by its bits, not a conversion (sm_90's cvt may quiet a
// NaN): to_residual below then stores a kept NaN back bit for bit.
__device__ __forceinline__ float from_residual(float v) { return v; }
__device__ __forceinline__ float from_residual(at::BFloat16 v) {
  return bits_float(static_cast<uint32_t>(v.x) << 16);
}

// v as a residual of type R. bf16: to nearest even, as c10::BFloat16(float), except NaN, which
// only a non-finite block's kept residual can be (a new one is always finite): its upper half
// is the bf16 it was widened from, so truncating keeps that value bit for bit (payload, sign).
template <typename R>
__device__ __forceinline__ R to_residual(float v) {
  if constexpr (std::is_same_v<R, float>) {
    return v;
  } else {
    static_assert(std::is_same_v<R, at::BFloat16>, "a residual is Float or BFloat16");
    return is_nan(v) ? R(static_cast<uint16_t>(float_bits(v) >> 16), R::from_bits()) : R(v);
  }
}

// y and the residual's old value (0 without one) of elements [i, i + count), count <= kVec;
// lanes past count are 0.
template <typename T, typename R>
__device__ __forceinline__ void load_y(const Source<T, R>& src, int64_t i, int count,
                                       float (&y)[kVec], float (&r_old)[kVec]) {
  if (count == kVec && i + kVec <= src.n && vec_ok(src.x + i) &&
      (src.r == nullptr || vec_ok(src.r + i))) {
    load8(src.x + i, y);
    if (src.r != nullptr) {
      R r[kVec];
      load_raw8(src.r + i, r);  // bf16: one 16-byte vector, fp32: two
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        r_old[k] = from_residual(r[k]);
        y[k] = fadd(fmul(y[k], src.s), r_old[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        y[k] = fmul(y[k], src.s);
        r_old[k] = 0.0f;
      }
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const int64_t e = i + k;
    // padding is +0 (+ r): 0 + -0 is +0, as in the reference
    const float xs = (k < count && e < src.n) ? fmul(static_cast<float>(src.x[e]), src.s) : 0.0f;
    r_old[k] = (k < count && src.r != nullptr) ? from_residual(src.r[e]) : 0.0f;
    y[k] = (k < count && src.r != nullptr) ? fadd(xs, r_old[k]) : xs;
  }
}

// r[i, i + count) = v[0, count), rounded to R.
template <typename R>
__device__ __forceinline__ void store_r(R* r, int64_t i, int count, const float (&v)[kVec]) {
  R w[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) w[k] = to_residual<R>(v[k]);
  if (count == kVec && vec_ok(r + i)) {
    store_raw8(r + i, w);  // bf16: one 16-byte vector, fp32: two
    return;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    if (k < count) r[i + k] = w[k];
  }
}

template <typename in_t, typename R, typename out_t>
__global__ void __launch_bounds__(kThreads)
    encode16_kernel(Source<in_t, R> src, out_t* out, int64_t numel) {
  const int64_t stride = int64_t{gridDim.x} * kThreads * kVec;
  for (int64_t i = (int64_t{blockIdx.x} * kThreads + threadIdx.x) * kVec; i < numel;
       i += stride) {
    const int count = static_cast<int>(std::min<int64_t>(kVec, numel - i));
    float y[kVec], r_old[kVec];
    load_y(src, i, count, y, r_old);
    if (count == kVec && vec_ok(out + i)) {
      store8(out + i, y);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (k < count) out[i + k] = static_cast<out_t>(y[k]);
      }
    }
    if (src.r_out == nullptr) continue;
    float r_new[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      // a result that is not finite keeps the old residual (never a NaN in later steps)
      const float back = round_to<out_t>(y[k]);
      r_new[k] = finite(back) ? fsub(y[k], back) : r_old[k];
    }
    store_r(src.r_out, i, count, r_new);
  }
}

// Symmetric int8 per block: s = absmax / 127, q = round_half_even(y * inv) clamped to ±127.
// R: the residual's type.
template <typename R>
struct Int8Codec {
  int8_t* codes;  // [numel]
  float* scales;  // [numel / block]
  R* r;           // [numel] residual written (a non-finite block's old value too), or nullptr
  using Stat = float;  // absmax, NaN-propagating: finite iff the block is
  struct Param {
    float s, inv;  // s is NaN for a block that is not finite
  };
  static constexpr int kMinBlock = 1;

  __device__ static float identity() { return 0.0f; }
  // NaN-propagating max, as torch's amax
  __device__ static float combine(float m, float a) { return (is_nan(a) || a > m) ? a : m; }
  __device__ static float add(float m, float y) { return combine(m, fabsf(y)); }

  __device__ Param param(int64_t blk, float absmax, bool write) const {
    if (!(absmax <= kMaxFinite)) {
      if (write) scales[blk] = kNaN;
      return {kNaN, 0.0f};
    }
    const float s = fdiv(absmax, 127.0f);
    // the reference's `127.0 / absmax` is reciprocal(absmax) * 127: two roundings
    float inv = absmax > 0.0f ? fmul(fdiv(1.0f, absmax), 127.0f) : 0.0f;
    // absmax below ~127 / FLT_MAX: such a block quantizes to 0 and keeps y in the residual
    if (!finite(inv)) inv = 0.0f;
    if (write) scales[blk] = s;
    return {s, inv};
  }

  // Codes and residual of elements [i, i + count); element i is element `off` of the codec
  // blocks that params[0] describes, each `block` long.
  __device__ void store(int64_t i, int count, const float (&y)[kVec], const float (&r_old)[kVec],
                        const Param* params, int64_t off, int64_t block) const {
    float q[kVec], r_new[kVec];
    int64_t b = off / block, next = (b + 1) * block;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      q[k] = 0.0f;
      r_new[k] = r_old[k];
      if (k >= count) continue;
      if (off + k >= next) {
        ++b;
        next += block;
      }
      const Param p = params[b];
      if (is_nan(p.s)) continue;  // codes 0, residual kept
      q[k] = fminf(fmaxf(rint_even(fmul(y[k], p.inv)), -127.0f), 127.0f);
      r_new[k] = fsub(y[k], fmul(q[k], p.s));
    }
    if (count == kVec && vec_ok(codes + i)) {
      Vec<int8_t, kVec> v;
#pragma unroll
      for (int k = 0; k < kVec; ++k) v.v[k] = static_cast<int8_t>(q[k]);
      store_vec(codes + i, v);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (k < count) codes[i + k] = static_cast<int8_t>(q[k]);
      }
    }
    if (r != nullptr) store_r(r, i, count, r_new);
  }
};

// One sign bit per element (y >= 0), one bf16 scale per block: the mean |y| (fp64 sum).
// R: the residual's type.
template <typename R>
struct OnebitCodec {
  uint8_t* bits;         // [numel / 8]
  at::BFloat16* scales;  // [numel / block]
  R* r;                  // [numel] residual written (a non-finite block's old value too), or nullptr
  using Stat = double;   // sum of |y|: finite iff the block is (no fp32 sum overflows fp64)
  struct Param {
    float s;
    bool finite;
  };
  static constexpr int kMinBlock = 8;
  int64_t block;

  __device__ static double identity() { return 0.0; }
  __device__ static double combine(double a, double b) { return dadd(a, b); }
  __device__ static double add(double sum, float y) {
    return dadd(sum, static_cast<double>(fabsf(y)));
  }

  __device__ Param param(int64_t blk, double sum, bool write) const {
    if (!finite(sum)) {
      if (write) scales[blk] = at::BFloat16(kNaN);
      return {kNaN, false};
    }
    const at::BFloat16 s(to_float(ddiv(sum, static_cast<double>(block))));
    if (write) scales[blk] = s;
    return {static_cast<float>(s), true};
  }

  // Bits and residual of elements [i, i + count): i and `off` are multiples of 8 and count is
  // 8 (blocks are multiples of 8), so the byte belongs to one codec block.
  __device__ void store(int64_t i, int count, const float (&y)[kVec], const float (&r_old)[kVec],
                        const Param* params, int64_t off, int64_t block_len) const {
    const Param p = params[off / block_len];
    uint8_t byte = 0;
    float r_new[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const bool pos = y[k] >= 0.0f;  // false for NaN, true for -0
      if (k < count && pos) byte |= static_cast<uint8_t>(1u << k);
      r_new[k] = p.finite ? fsub(y[k], pos ? p.s : -p.s) : r_old[k];
    }
    bits[i / 8] = byte;
    if (r != nullptr) store_r(r, i, count, r_new);
  }
};

template <typename Codec>
struct Combine {
  __device__ typename Codec::Stat operator()(typename Codec::Stat a,
                                             typename Codec::Stat b) const {
    return Codec::combine(a, b);
  }
};

// Codec blocks [blockIdx.x * per_tile, + per_tile) (fewer in the last tile), each `block`
// <= kTile elements long; team: lanes per codec block for the statistic, a power of two <= 32.
template <typename T, typename R, typename Codec>
__global__ void __launch_bounds__(kThreads)
    encode_tiles_kernel(Source<T, R> src, Codec codec, int64_t block, int64_t per_tile,
                        int64_t nblocks, int team) {
  __shared__ float ys[kTile];
  __shared__ typename Codec::Param params[kTile / Codec::kMinBlock];
  const int tid = threadIdx.x;
  const int64_t blk0 = int64_t{blockIdx.x} * per_tile;
  const int nb = static_cast<int>(std::min<int64_t>(per_tile, nblocks - blk0));
  const int blen = static_cast<int>(block);
  const int len = nb * blen;
  const int64_t base = blk0 * block;
  const int e0 = tid * kVec;
  const int count = len - e0 >= kVec ? kVec : std::max(0, len - e0);  // kVec by value: no ODR-use
  float y[kVec], r_old[kVec];
  if (count > 0) {
    load_y(src, base + e0, count, y, r_old);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k < count) ys[e0 + k] = y[k];
    }
  }
  sync_threads();
  const int lane = tid % team, first = tid / team, teams = kThreads / team;
  // the trip count is the same for every thread: the shuffles below need every lane
  for (int b0 = 0; b0 < nb; b0 += teams) {
    const int b = b0 + first;
    typename Codec::Stat st = Codec::identity();
    if (b < nb) {
      for (int j = lane; j < blen; j += team) st = Codec::add(st, ys[b * blen + j]);
    }
    for (int m = team / 2; m > 0; m /= 2) st = Codec::combine(st, shfl_xor(st, m, team));
    if (b < nb && lane == 0) params[b] = codec.param(blk0 + b, st, true);
  }
  sync_threads();
  if (count > 0) codec.store(base + e0, count, y, r_old, params, e0, block);
}

// One codec block of `block` > kTile elements per thread block: its statistic from a first
// sweep over x and the residual, its codes from a second.
template <typename T, typename R, typename Codec>
__global__ void __launch_bounds__(kThreads)
    encode_large_kernel(Source<T, R> src, Codec codec, int64_t block) {
  const int64_t blk = blockIdx.x;
  const int64_t base = blk * block;
  float y[kVec], r_old[kVec];
  typename Codec::Stat st = Codec::identity();
  for (int64_t o = int64_t{threadIdx.x} * kVec; o < block; o += int64_t{kThreads} * kVec) {
    const int count = static_cast<int>(std::min<int64_t>(kVec, block - o));
    load_y(src, base + o, count, y, r_old);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k < count) st = Codec::add(st, y[k]);
    }
  }
  st = block_reduce(st, Combine<Codec>{});
  const typename Codec::Param p = codec.param(blk, st, threadIdx.x == 0);
  for (int64_t o = int64_t{threadIdx.x} * kVec; o < block; o += int64_t{kThreads} * kVec) {
    const int count = static_cast<int>(std::min<int64_t>(kVec, block - o));
    load_y(src, base + o, count, y, r_old);
    codec.store(base + o, count, y, r_old, &p, o, block);
  }
}

// Runs codec over the numel / block codec blocks of y = src.
template <typename T, typename R, typename Codec>
void encode_blocks(const Source<T, R>& src, const Codec& codec, int64_t numel, int64_t block,
                   Stream stream) {
  const int64_t nblocks = numel / block;
  if (block > kTile) {
    PYCOMM_LAUNCH(static_cast<unsigned>(nblocks), kThreads, stream,
                  encode_large_kernel<T, R, Codec>)(src, codec, block);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  int64_t per_tile = kTile / block;
  // tiles that start at a multiple of kVec elements keep every vector access aligned
  const int64_t step = kVec / std::gcd<int64_t>(block, kVec);
  if (per_tile >= step) per_tile = per_tile / step * step;
  int team = 1;
  while (team * 2 <= std::min<int64_t>(block, kWarp)) team *= 2;
  const int64_t tiles = (nblocks + per_tile - 1) / per_tile;
  PYCOMM_LAUNCH(static_cast<unsigned>(tiles), kThreads, stream, encode_tiles_kernel<T, R, Codec>)(
      src, codec, block, per_tile, nblocks, team);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(Source<T, R>) with T x's dtype (x staged contiguous when it is not) and R the
// residual's (float or at::BFloat16; float without one), reading residual and writing
// residual_out if given, else residual. check_encoder has checked that both have one dtype.
template <typename F>
void with_source(const at::Tensor& x, const std::optional<at::Tensor>& residual, double scale,
                 const std::optional<at::Tensor>& residual_out, F&& f) {
  const at::Tensor xc = x.contiguous();
  const auto run = [&](auto r_tag) {
    using R = decltype(r_tag);
    R* r_in = residual.has_value() ? residual->data_ptr<R>() : nullptr;
    R* r_out = residual_out.has_value() ? residual_out->data_ptr<R>() : r_in;
    dispatch_float(xc.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      f(Source<T, R>{xc.const_data_ptr<T>(), r_in, r_out, xc.numel(),
                     static_cast<float>(scale)});
    });
  };
  if (residual.has_value() && residual->scalar_type() == at::kBFloat16) {
    run(at::BFloat16{});
  } else {
    run(float{});
  }
}

// x: any float dtype, n <= numel elements, any strides, on a CUDA device. residual: [numel]
// fp32 or bf16, or absent. dtype: Half or BFloat16. Returns [numel] of dtype: y = x * scale
// (+ residual) padded with zeros to numel, rounded; residual = y - returned where finite.
at::Tensor encode16_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                         double scale, at::ScalarType dtype, int64_t numel,
                         const std::optional<at::Tensor>& residual_out) {
  check_encode16(x, residual, dtype, numel, residual_out);
  at::Tensor out = at::empty({numel}, x.options().dtype(dtype));
  if (numel == 0) return out;
  const DeviceGuard guard(x.device());
  const Stream stream = current_stream();
  with_source(x, residual, scale, residual_out, [&](const auto& src) {
    using Src = std::decay_t<decltype(src)>;
    using in_t = typename Src::x_t;
    using R = typename Src::r_t;
    dispatch_float(dtype, [&](auto out_tag) {
      using out_t = decltype(out_tag);
      if constexpr (!std::is_same_v<out_t, float>) {  // checked above: Half or BFloat16
        PYCOMM_LAUNCH(blocks_for(numel), kThreads, stream, encode16_kernel<in_t, R, out_t>)(
            src, out.data_ptr<out_t>(), numel);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  return out;
}

// x, residual: as encode16. block >= 1, numel % block == 0. Returns (codes int8 [numel],
// scales fp32 [numel / block]).
std::tuple<at::Tensor, at::Tensor> quantize_int8_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, double scale, int64_t block,
    int64_t numel, const std::optional<at::Tensor>& residual_out) {
  check_quantize("pycomm.quantize_int8", x, residual, block, numel, residual_out, 1);
  at::Tensor codes = at::empty({numel}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({numel / block}, x.options().dtype(at::kFloat));
  if (numel == 0) return {codes, scales};
  const DeviceGuard guard(x.device());
  const Stream stream = current_stream();
  with_source(x, residual, scale, residual_out, [&](const auto& src) {
    using R = typename std::decay_t<decltype(src)>::r_t;
    const Int8Codec<R> codec{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), src.r_out};
    encode_blocks(src, codec, numel, block, stream);
  });
  return {codes, scales};
}

// x, residual: as encode16. block % 8 == 0, numel % block == 0. Returns (bits uint8
// [numel / 8], scales bf16 [numel / block]).
std::tuple<at::Tensor, at::Tensor> quantize_onebit_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, double scale, int64_t block,
    int64_t numel, const std::optional<at::Tensor>& residual_out) {
  check_quantize("pycomm.quantize_onebit", x, residual, block, numel, residual_out, 8);
  at::Tensor bits = at::empty({numel / 8}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({numel / block}, x.options().dtype(at::kBFloat16));
  if (numel == 0) return {bits, scales};
  const DeviceGuard guard(x.device());
  const Stream stream = current_stream();
  with_source(x, residual, scale, residual_out, [&](const auto& src) {
    using R = typename std::decay_t<decltype(src)>::r_t;
    const OnebitCodec<R> codec{bits.data_ptr<uint8_t>(), scales.data_ptr<at::BFloat16>(),
                               src.r_out, block};
    encode_blocks(src, codec, numel, block, stream);
  });
  return {bits, scales};
}

// --- decoders ----------------------------------------------------------------------------

// Each Rows::load(r, i, count, d) decodes elements [i, i + count) of row r into d (count >= 1,
// lanes past count 0); the kernel adds the rows in order.

// Rows of [R, m] 16-bit chunks.
template <typename T>
struct Rows16 {
  const T* c;
  int64_t ld;  // elements from one row to the next (rows may be slices of wider rows)

  __device__ void load(int64_t r, int64_t i, int count, float (&d)[kVec]) const {
    const T* p = c + r * ld + i;
    if (count == kVec && vec_ok(p)) {
      load8(p, d);
      return;
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) d[k] = k < count ? static_cast<float>(p[k]) : 0.0f;
  }
};

// Rows of [R, m] int8 codes with [R, m / block] fp32 scales: code * scale.
struct RowsInt8 {
  const int8_t* q;
  const float* sc;
  int64_t ld, lds, block;  // row strides of the codes and of the scales, in elements

  __device__ void load(int64_t r, int64_t i, int count, float (&d)[kVec]) const {
    const int8_t* p = q + r * ld + i;
    const float* srow = sc + r * lds;
    int8_t c[kVec];
    if (count == kVec && vec_ok(p)) {
      const Vec<int8_t, kVec> v = load_vec<int8_t, kVec>(p);
#pragma unroll
      for (int k = 0; k < kVec; ++k) c[k] = v.v[k];
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) c[k] = k < count ? p[k] : 0;
    }
    int64_t b = i / block, next = (b + 1) * block;
    float s = srow[b];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k < count && i + k >= next) {
        ++b;
        next += block;
        s = srow[b];
      }
      d[k] = fmul(static_cast<float>(c[k]), s);
    }
  }
};

// Rows of [R, m / 8] sign bits with [R, m / block] bf16 scales: +scale or -scale.
struct RowsOnebit {
  const uint8_t* bits;
  const at::BFloat16* sc;
  int64_t ld, lds, block;  // row strides of the bits (bytes) and of the scales, in elements

  // i is a multiple of 8 and block of 8: elements [i, i + 8) are one byte of one codec block
  __device__ void load(int64_t r, int64_t i, int count, float (&d)[kVec]) const {
    const uint8_t byte = bits[r * ld + i / 8];
    const float s = static_cast<float>(sc[r * lds + i / block]);
#pragma unroll
    for (int k = 0; k < kVec; ++k) d[k] = ((byte >> k) & 1) ? s : -s;  // ±s, as the CPU's ±1 * s
  }
};

// Rows decoded per step: their loads are in flight together, their sums still in row order.
constexpr int kRowsAtOnce = 4;

// out[i] = round(scale * sum over rows, in row order, of rows' element i) for i < m_out, in a
// grid-stride loop; partial[blockIdx.x] = sum of out^2 over this block's finite out,
// partial[gridDim.x + blockIdx.x] = count of its non-finite out.
template <typename out_t, typename Rows>
__global__ void __launch_bounds__(kThreads)
    sum_rows_kernel(Rows rows, int64_t nrows, float scale, out_t* out, int64_t m_out,
                    double* partial) {
  double sq = 0.0, bad = 0.0;
  const int64_t stride = int64_t{gridDim.x} * kThreads * kVec;
  for (int64_t i = (int64_t{blockIdx.x} * kThreads + threadIdx.x) * kVec; i < m_out;
       i += stride) {
    const int count = static_cast<int>(std::min<int64_t>(kVec, m_out - i));
    float acc[kVec];
    for (int64_t r0 = 0; r0 < nrows; r0 += kRowsAtOnce) {
      float d[kRowsAtOnce][kVec];
#pragma unroll
      for (int u = 0; u < kRowsAtOnce; ++u) {
        if (r0 + u < nrows) rows.load(r0 + u, i, count, d[u]);
      }
#pragma unroll
      for (int u = 0; u < kRowsAtOnce; ++u) {
        if (r0 + u >= nrows) break;
        // the first row adds to +0, as the reference's zeros do (0 + -0 is +0)
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc[k] = fadd(r0 + u == 0 ? 0.0f : acc[k], d[u][k]);
      }
    }
    float v[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = fmul(acc[k], scale);
    if (count == kVec && vec_ok(out + i)) {
      store8(out + i, v);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (k < count) out[i + k] = static_cast<out_t>(v[k]);
      }
    }
    // loops to kVec with a guard, not to count: constant indices keep the arrays in registers
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k >= count) continue;
      const float stored = round_to<out_t>(v[k]);
      if (finite(stored)) {
        const double d = stored;
        sq = dadd(sq, dmul(d, d));
      } else {
        bad += 1.0;
      }
    }
  }
  block_sum2(sq, bad);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = sq;
    partial[gridDim.x + blockIdx.x] = bad;
  }
}

// stats = (sum of partial[0, parts), sum of partial[parts, 2 * parts)), in a fixed order.
__global__ void __launch_bounds__(kThreads)
    finish_stats_kernel(const double* partial, int64_t parts, double* stats) {
  double sq = 0.0, bad = 0.0;
#pragma unroll 4
  for (int64_t p = threadIdx.x; p < parts; p += kThreads) {
    sq = dadd(sq, partial[p]);
    bad = dadd(bad, partial[parts + p]);
  }
  block_sum2(sq, bad);
  if (threadIdx.x == 0) {
    stats[0] = sq;
    stats[1] = bad;
  }
}

// out: contiguous float, its numel() elements written from rows. Returns fp64 [2] on out's
// device: (sum of out^2 over finite out, count of non-finite out).
template <typename Rows>
at::Tensor sum_rows(const Rows& rows, int64_t nrows, double scale, const at::Tensor& out) {
  const int64_t m_out = out.numel();
  const auto stats_options = out.options().dtype(at::kDouble);
  if (m_out == 0) return at::zeros({2}, stats_options);
  const DeviceGuard guard(out.device());
  const Stream stream = current_stream();
  const int64_t grid = blocks_for(m_out);
  at::Tensor partial = at::empty({2 * grid}, stats_options);
  at::Tensor stats = at::empty({2}, stats_options);
  dispatch_float(out.scalar_type(), [&](auto tag) {
    using out_t = decltype(tag);
    PYCOMM_LAUNCH(static_cast<unsigned>(grid), kThreads, stream, sum_rows_kernel<out_t, Rows>)(
        rows, nrows, static_cast<float>(scale), out.data_ptr<out_t>(), m_out,
        partial.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  PYCOMM_LAUNCH(1, kThreads, stream, finish_stats_kernel)(partial.const_data_ptr<double>(), grid,
                                                          stats.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return stats;
}

// chunks: [R, m] Half/BFloat16 on a CUDA device, rows contiguous (a row slice of wider rows,
// as the exchange receives them, is read in place). out: contiguous float, numel <= m,
// same device. out = scale * sum_r chunks[r, :out.numel()] (fp32, row order). Returns fp64 [2]
// (see sum_rows).
at::Tensor decode16_sum_cuda(const at::Tensor& chunks, double scale, const at::Tensor& out) {
  check_decode16_sum(chunks, out);
  const int64_t rows = chunks.size(0);
  at::Tensor stats;
  dispatch_float(chunks.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      stats = sum_rows(Rows16<T>{chunks.const_data_ptr<T>(), chunks.stride(0)}, rows, scale, out);
    }
  });
  return stats;
}

// codes: [R, m] int8, rows contiguous, m % block == 0. scales: [R, m / block] fp32, rows
// contiguous. out: as decode16_sum. out = scale * sum_r codes[r] * scales[r] (per block).
at::Tensor dequantize_int8_sum_cuda(const at::Tensor& codes, const at::Tensor& scales,
                                    int64_t block, double scale, const at::Tensor& out) {
  check_dequantize_int8_sum(codes, scales, block, out);
  const int64_t rows = codes.size(0);
  return sum_rows(RowsInt8{codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                           codes.stride(0), scales.stride(0), block},
                  rows, scale, out);
}

// bits: [R, m / 8] uint8, rows contiguous, m % block == 0, block % 8 == 0. scales:
// [R, m / block] bf16, rows contiguous. out: as decode16_sum. out = scale * sum_r (bit ? +s : -s).
at::Tensor dequantize_onebit_sum_cuda(const at::Tensor& bits, const at::Tensor& scales,
                                      int64_t block, double scale, const at::Tensor& out) {
  check_dequantize_onebit_sum(bits, scales, block, out);
  const int64_t rows = bits.size(0);
  return sum_rows(RowsOnebit{bits.const_data_ptr<uint8_t>(), scales.const_data_ptr<at::BFloat16>(),
                             bits.stride(0), scales.stride(0), block},
                  rows, scale, out);
}

}  // namespace

#ifndef PYCOMM_CUDA_EMULATION
TORCH_LIBRARY_IMPL(pycomm, CUDA, m) {
#else
TORCH_LIBRARY_IMPL(pycomm_emu, CPU, m) {
#endif
  m.impl("encode16", &encode16_cuda);
  m.impl("quantize_int8", &quantize_int8_cuda);
  m.impl("quantize_onebit", &quantize_onebit_cuda);
  m.impl("decode16_sum", &decode16_sum_cuda);
  m.impl("dequantize_int8_sum", &dequantize_int8_sum_cuda);
  m.impl("dequantize_onebit_sum", &dequantize_onebit_sum_cuda);
}

}  // namespace pycomm::cuda
