// Compression codecs on CUDA: the kernels of the encoders encode16, quantize_int8,
// quantize_int4, quantize_fp8, quantize_onebit and the decoders decode16_sum,
// dequantize_int8_sum, dequantize_int4_sum, dequantize_fp8_sum, dequantize_onebit_sum (their
// host entries, shared with the CPU, are csrc/host/codecs.h). float8 e4m3fn is converted by
// c10::Float8_e4m3fn (integer arithmetic, the same on host and device), so codes match
// torch's cast bit for bit.
//
// Every op is one pass over memory. An encoder block stages a tile of y = x * scale + residual
// in shared memory (whole codec blocks, at most kTile elements), takes each codec block's
// statistic (absmax, sum of |y|) from there with a team of up to 32 lanes per codec block,
// then writes codes, scales and the new residual from the y it kept in registers: x and the
// residual are read once, the outputs written once. A codec block longer than a tile gets a
// thread block of its own, which reads its x and residual twice (statistic, then codes).
// A decoder thread owns runs of contiguous elements, as many as one 16-byte load of a row's
// codes holds (see "decoders" below), fetches them from up to kRowsAtOnce rows at a time (their
// loads in flight together), sums them in fp32 registers in row order, scales, rounds and
// stores them 16 bytes at a time, and adds what it stored to the squared norm; per-block partial
// norms go to a workspace that one more small kernel sums in a fixed order (deterministic, no
// atomics, no host synchronization).
//
// The residual is fp32 or bf16 (R below): y is fp32 either way, and the new residual is rounded
// to R only when it is stored (so a bf16 residual halves that traffic, nothing else changes).
//
// The arithmetic is pycomm.reference's, operation for operation (see common.cuh), so outputs
// match the CPU kernels bit for bit. As on the CPU, two fp64 sums are taken in another order
// than torch's: a 1-bit block's sum of |y| (exact unless one block spans more than about
// 2^(29 - log2 block) in magnitude) and the decoders' squared norm (summed in fp64 here).
#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>

#include "cuda/common.cuh"
#include "host/codecs.h"

namespace pycomm::cuda {
namespace {

// Elements of one encoder tile: kVec per thread.
constexpr int kTile = kThreads * kVec;
constexpr float kMaxFinite = std::numeric_limits<float>::max();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// y = x * s (+ r), x zero beyond its n elements: the references' y (host::Encoding's fields:
// x [n] contiguous, r the residual read or nullptr, r_out the residual written). R: the
// residual's type, float or at::BFloat16 (float without a residual).
template <typename T, typename R>
struct Source : host::Encoding<T, R> {
  using x_t = T;
  using r_t = R;
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

// The symmetric codecs' lanes [0, count) of elements from `off` of the codec blocks that
// params[0] describes, each `block` long: q = round_half_even(y * inv) clamped to ±qmax and the
// new residual y - q * s, with the (s, inv) of each element's block; a non-finite block's
// (s NaN) lanes, and lanes past count, get code 0 and keep r_old.
template <typename Param>
__device__ __forceinline__ void symmetric_codes(int count, const float (&y)[kVec],
                                                const float (&r_old)[kVec], const Param* params,
                                                int64_t off, int64_t block, float qmax,
                                                float (&q)[kVec], float (&r_new)[kVec]) {
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
    q[k] = fminf(fmaxf(rint_even(fmul(y[k], p.inv)), -qmax), qmax);
    r_new[k] = fsub(y[k], fmul(q[k], p.s));
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

  // (s, inv) = (absmax / qmax, qmax / absmax), s NaN for a non-finite absmax
  __device__ static Param of(float absmax, float qmax) {
    if (!(absmax <= kMaxFinite)) return {kNaN, 0.0f};
    // the reference's `qmax / absmax` is reciprocal(absmax) * qmax: two roundings
    float inv = absmax > 0.0f ? fmul(fdiv(1.0f, absmax), qmax) : 0.0f;
    // absmax below ~qmax / FLT_MAX: such a block quantizes to 0 and keeps y in the residual
    if (!finite(inv)) inv = 0.0f;
    return {fdiv(absmax, qmax), inv};
  }

  __device__ Param param(int64_t blk, float absmax, bool write) const {
    const Param p = of(absmax, 127.0f);
    if (write) scales[blk] = p.s;
    return p;
  }

  // Codes and residual of elements [i, i + count); element i is element `off` of the codec
  // blocks that params[0] describes, each `block` long.
  __device__ void store(int64_t i, int count, const float (&y)[kVec], const float (&r_old)[kVec],
                        const Param* params, int64_t off, int64_t block) const {
    float q[kVec], r_new[kVec];
    symmetric_codes(count, y, r_old, params, off, block, 127.0f, q, r_new);
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

// Symmetric int4 per block: s = absmax / 7 rounded to S (float or BFloat16), q =
// round_half_even(y * (1 / s)) clamped to ±7, two codes a byte (element 2k in the low nibble of
// byte k). R: the residual's type.
template <typename R, typename S>
struct Int4Codec {
  uint8_t* codes;  // [numel / 2]
  S* scales;       // [numel / block]
  R* r;            // [numel] residual written (a non-finite block's old value too), or nullptr
  using Stat = float;  // absmax, as int8's
  using Param = typename Int8Codec<R>::Param;
  static constexpr int kMinBlock = 2;

  __device__ static float identity() { return 0.0f; }
  __device__ static float combine(float m, float a) { return Int8Codec<R>::combine(m, a); }
  __device__ static float add(float m, float y) { return combine(m, fabsf(y)); }

  __device__ Param param(int64_t blk, float absmax, bool write) const {
    if (!(absmax <= kMaxFinite)) {
      if (write) scales[blk] = static_cast<S>(kNaN);
      return {kNaN, 0.0f};
    }
    const S stored = static_cast<S>(fdiv(absmax, 7.0f));
    const float s = static_cast<float>(stored);
    // the reference's 1.0 / s: one rounding; 0 for an all-zero block, and where it overflows
    float inv = s > 0.0f ? fdiv(1.0f, s) : 0.0f;
    if (!finite(inv)) inv = 0.0f;
    if (write) scales[blk] = stored;
    return {s, inv};
  }

  // Codes and residual of elements [i, i + count), as Int8Codec::store; i, count and the
  // blocks are even, so each byte holds two elements of this thread.
  __device__ void store(int64_t i, int count, const float (&y)[kVec], const float (&r_old)[kVec],
                        const Param* params, int64_t off, int64_t block) const {
    float q[kVec], r_new[kVec];
    symmetric_codes(count, y, r_old, params, off, block, 7.0f, q, r_new);
    Vec<uint8_t, kVec / 2> v;
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const int lo = static_cast<int>(q[2 * k]) & 15, hi = static_cast<int>(q[2 * k + 1]) & 15;
      v.v[k] = static_cast<uint8_t>(lo | (hi << 4));
    }
    uint8_t* c = codes + i / 2;
    if (count == kVec && aligned(c, sizeof v)) {
      store_vec(c, v);
    } else {
#pragma unroll
      for (int k = 0; k < kVec / 2; ++k) {
        if (2 * k < count) c[k] = v.v[k];
      }
    }
    if (r != nullptr) store_r(r, i, count, r_new);
  }
};

// float8 e4m3fn per block: s = absmax / 448, code = e4m3(clamp(y * inv, ±448)) with inv =
// (1 / absmax) * 448 (the reference's 448.0 / absmax: two roundings), decoded code * s.
// R: the residual's type.
template <typename R>
struct Fp8Codec {
  uint8_t* codes;  // [numel], e4m3fn bytes
  float* scales;   // [numel / block]
  R* r;            // [numel] residual written (a non-finite block's old value too), or nullptr
  using Stat = float;  // absmax, as int8's
  using Param = typename Int8Codec<R>::Param;
  static constexpr int kMinBlock = 1;

  __device__ static float identity() { return 0.0f; }
  __device__ static float combine(float m, float a) { return Int8Codec<R>::combine(m, a); }
  __device__ static float add(float m, float y) { return combine(m, fabsf(y)); }

  __device__ Param param(int64_t blk, float absmax, bool write) const {
    const Param p = Int8Codec<R>::of(absmax, 448.0f);
    if (write) scales[blk] = p.s;
    return p;
  }

  __device__ void store(int64_t i, int count, const float (&y)[kVec], const float (&r_old)[kVec],
                        const Param* params, int64_t off, int64_t block) const {
    Vec<uint8_t, kVec> v;
    float r_new[kVec];
    int64_t b = off / block, next = (b + 1) * block;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      v.v[k] = 0;
      r_new[k] = r_old[k];
      if (k >= count) continue;
      if (off + k >= next) {
        ++b;
        next += block;
      }
      const Param p = params[b];
      if (is_nan(p.s)) continue;  // codes 0, residual kept
      const c10::Float8_e4m3fn q(fminf(fmaxf(fmul(y[k], p.inv), -448.0f), 448.0f));
      v.v[k] = q.x;
      r_new[k] = fsub(y[k], fmul(static_cast<float>(q), p.s));
    }
    if (count == kVec && aligned(codes + i, sizeof v)) {
      store_vec(codes + i, v);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (k < count) codes[i + k] = v.v[k];
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
  alignas(16) __shared__ float ys[kTile];
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
  if (count > 0) load_y(src, base + e0, count, y, r_old);
  if (count == kVec) {
    // two 16-byte stores (st.shared.v4). A quarter warp's 8 threads store together: thread t's
    // halves start at banks 8t and 8t + 4 (mod 32), so threads t and t + 4 would collide; the
    // odd quads of threads store their upper half first, and each store covers 32 banks once.
    const bool upper_first = (tid >> 2) & 1;
    Vec<float, 4> a, b;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      a.v[k] = upper_first ? y[4 + k] : y[k];
      b.v[k] = upper_first ? y[k] : y[4 + k];
    }
    store_shared4(ys + e0 + (upper_first ? 4 : 0), a);
    store_shared4(ys + e0 + (upper_first ? 0 : 4), b);
  } else {
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

// --- decoders ----------------------------------------------------------------------------

// A decoder thread owns runs of Rows::kElems contiguous elements, kElems being what one
// Rows::kBytes load of a row's codes holds (16 bytes; 4 for onebit's bits, whose 16 bytes
// would be 128 sums). For up to kRowsAtOnce rows at a time it fetches the codes (their loads
// in flight together, as wide as their alignment allows) and, when a run lies inside one codec
// block (block % kElems == 0), that block's scale once; then it decodes and adds the rows in
// row order into fp32 sums held in registers.
//
// Each Rows type gives: codes(r, i), the first byte of row r's codes of element i (i a
// multiple of kElems); bytes_of(count), the bytes of count elements' codes from there;
// scale(r, b), row r's scale of codec block b (kScaled types only); value(raw, k, s), element
// k of a fetched run with scale s (s unused when !kScaled).

// The bytes [p, p + nbytes) as N / 4 little-endian words, zero past nbytes (nbytes <= N): one
// load of N bytes when p is N-aligned and nbytes == N, else of 8 or 4 where p allows, else
// bytewise.
template <int N>
struct Raw {
  static_assert(N % 4 == 0, "a run's codes are whole words");
  uint32_t w[N / 4];

  __device__ __forceinline__ uint32_t byte(int k) const {
    return (w[k / 4] >> (8 * (k % 4))) & 0xFFu;
  }
};

template <int N, int W>
__device__ __forceinline__ void load_words(const uint8_t* p, Raw<N>& raw) {
#pragma unroll
  for (int k = 0; k < N / 4; k += W / 4) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(p);
    const Vec<uint32_t, W / 4> u = load_vec<uint32_t, W / 4>(words + k);
#pragma unroll
    for (int j = 0; j < W / 4; ++j) raw.w[k + j] = u.v[j];
  }
}

template <int N>
__device__ __forceinline__ Raw<N> fetch(const uint8_t* p, int nbytes) {
  Raw<N> raw;
  if (nbytes == N) {
    if constexpr (N % 16 == 0) {
      if (aligned(p, 16)) {
        load_words<N, 16>(p, raw);
        return raw;
      }
    }
    if constexpr (N % 8 == 0) {
      if (aligned(p, 8)) {
        load_words<N, 8>(p, raw);
        return raw;
      }
    }
    if (aligned(p, 4)) {
      load_words<N, 4>(p, raw);
      return raw;
    }
  }
#pragma unroll
  for (int k = 0; k < N / 4; ++k) raw.w[k] = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (k < nbytes) raw.w[k / 4] |= uint32_t{p[k]} << (8 * (k % 4));
  }
  return raw;
}

// Rows of [R, m] 16-bit chunks.
template <typename T>
struct Rows16 : host::Chunks16<T> {  // c, ld: elements from one row to the next (rows may be
                                     // slices of wider rows)
  using host::Chunks16<T>::c;
  using host::Chunks16<T>::ld;
  static constexpr int kElems = 8, kBytes = 16;
  static constexpr bool kScaled = false;
  static constexpr int kMinBlocks = 5;  // 48 registers a thread, as without a bound

  __device__ const uint8_t* codes(int64_t r, int64_t i) const {
    return reinterpret_cast<const uint8_t*>(c + r * ld + i);
  }
  __device__ static int bytes_of(int count) { return 2 * count; }
  __device__ float scale(int64_t, int64_t) const { return 1.0f; }
  __device__ static float value(const Raw<kBytes>& raw, int k, float) {
    const uint16_t bits = static_cast<uint16_t>(raw.w[k / 2] >> (16 * (k % 2)));
    return static_cast<float>(T(bits, T::from_bits()));
  }
};

// What the scaled Rows share, over their host struct H (ld, lds: row strides of the codes in
// bytes and of the scales; sc: the scales): codes of kPerByte elements a byte.
template <typename H, int kPerByte>
struct Scaled : H {
  static constexpr bool kScaled = true;

  __device__ static int bytes_of(int count) { return (count + kPerByte - 1) / kPerByte; }
  __device__ float scale(int64_t r, int64_t b) const {
    return static_cast<float>(this->sc[r * this->lds + b]);
  }
};

// Rows of [R, m] int8 codes with [R, m / block] fp32 scales: code * scale.
struct RowsInt8 : Scaled<host::Int8Rows, 1> {
  static constexpr int kElems = 16, kBytes = 16;
  static constexpr int kMinBlocks = 4;  // 64 registers a thread

  __device__ const uint8_t* codes(int64_t r, int64_t i) const {
    return reinterpret_cast<const uint8_t*>(q + r * ld + i);
  }
  __device__ static float value(const Raw<kBytes>& raw, int k, float s) {
    return fmul(static_cast<float>(static_cast<int8_t>(raw.byte(k))), s);
  }
};

// Rows of [R, m / 2] int4 codes (two a byte, the low nibble first) with [R, m / block] scales
// of S: code * scale. A short run reads the byte of its last element, which the row holds (m
// is even). Runs of 16 elements, 8 bytes (32 took 176 registers a thread), and 3 blocks an SM
// (72 registers): at 4 (64), ptxas spills.
template <typename S>
struct RowsInt4 : Scaled<host::Int4Rows<S>, 2> {
  static constexpr int kElems = 16, kBytes = 8;
  static constexpr int kMinBlocks = 3;  // 72 registers a thread

  __device__ const uint8_t* codes(int64_t r, int64_t i) const {
    return this->q + r * this->ld + i / 2;
  }
  __device__ static float value(const Raw<kBytes>& raw, int k, float s) {
    // the nibble sign-extended: to the top of the word, then an arithmetic shift down
    const int nib = static_cast<int32_t>(raw.w[k / 8] << (28 - 4 * (k % 8))) >> 28;
    return fmul(static_cast<float>(nib), s);
  }
};

// Rows of [R, m] float8 e4m3fn codes with [R, m / block] fp32 scales: code * scale.
struct RowsFp8 : Scaled<host::Fp8Rows, 1> {
  static constexpr int kElems = 16, kBytes = 16;
  static constexpr int kMinBlocks = 4;  // 64 registers a thread

  __device__ const uint8_t* codes(int64_t r, int64_t i) const { return q + r * ld + i; }
  __device__ static float value(const Raw<kBytes>& raw, int k, float s) {
    const c10::Float8_e4m3fn c(static_cast<uint8_t>(raw.byte(k)), c10::Float8_e4m3fn::from_bits());
    return fmul(static_cast<float>(c), s);
  }
};

// Rows of [R, m / 8] sign bits with [R, m / block] bf16 scales: +scale or -scale (the CPU's
// ±1 * s, the same bits). A short run reads the bytes its elements touch, which the row holds
// (m is a multiple of 8).
struct RowsOnebit : Scaled<host::OnebitRows, 8> {
  static constexpr int kElems = 32, kBytes = 4;
  static constexpr int kMinBlocks = 4;  // 64 registers a thread

  __device__ const uint8_t* codes(int64_t r, int64_t i) const { return bits + r * ld + i / 8; }
  __device__ static float value(const Raw<kBytes>& raw, int k, float s) {
    return ((raw.w[0] >> k) & 1u) ? s : -s;
  }
};

// Rows fetched per step: their loads are in flight together, their sums still in row order.
// Runs that cross codec blocks (block % kElems != 0, small or odd blocks) take one row at a
// time: looking up each element's scale for 4 rows at once took 176-206 registers a thread.
constexpr int kRowsAtOnce = 4;

// Each Rows type's kMinBlocks is the blocks of kThreads an SM should hold at once: the
// decoders' __launch_bounds__, which cap their registers at 65536 / (kThreads * kMinBlocks) a
// thread (64 for 4 blocks, 50% of an sm_80/sm_90 SM's threads). Runs crossing codec blocks
// hold each element's scale lookup too: kCrossingMinBlocks, 128 registers. ptxas -v shows no
// spills at these bounds (README.md).
constexpr int kCrossingMinBlocks = 2;

// The E elements of v to out, 16 bytes at a time when out is aligned to them and all count.
template <int E, typename out_t>
__device__ __forceinline__ void store_run(out_t* out, const float (&v)[E], int count) {
  constexpr int kPer = 16 / sizeof(out_t);
  static_assert(E % kPer == 0, "a run is whole 16-byte stores");
  if (count == E && aligned(out, 16)) {
#pragma unroll
    for (int k = 0; k < E; k += kPer) {
      Vec<out_t, kPer> u;
#pragma unroll
      for (int j = 0; j < kPer; ++j) u.v[j] = static_cast<out_t>(v[k + j]);
      store_vec<out_t, kPer>(out + k, u);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < E; ++k) {
    if (k < count) out[k] = static_cast<out_t>(v[k]);
  }
}

// Elements of a decoder's grid-stride loop that one block covers per pass.
template <typename Rows>
constexpr int64_t decode_per_block() {
  return int64_t{kThreads} * Rows::kElems;
}

// out[i] = round(scale * sum over rows, in row order, of rows' element i) for i < m_out, in a
// grid-stride loop; partial[blockIdx.x] = sum of out^2 over this block's finite out,
// partial[gridDim.x + blockIdx.x] = count of its non-finite out. kOneScale: every run lies
// inside one codec block (block % kElems == 0, or no scales), so a row's run has one scale.
template <typename out_t, typename Rows, bool kOneScale>
__global__ void __launch_bounds__(kThreads, kOneScale ? Rows::kMinBlocks : kCrossingMinBlocks)
    sum_rows_kernel(Rows rows, int64_t nrows, float scale, out_t* out, int64_t m_out,
                    double* partial) {
  constexpr int E = Rows::kElems;
  constexpr int kRows = kOneScale ? kRowsAtOnce : 1;
  int64_t block = 1;
  if constexpr (Rows::kScaled) block = rows.block;
  double sq = 0.0, bad = 0.0;
  const int64_t stride = int64_t{gridDim.x} * decode_per_block<Rows>();
  for (int64_t i = (int64_t{blockIdx.x} * kThreads + threadIdx.x) * E; i < m_out; i += stride) {
    const int count = static_cast<int>(std::min<int64_t>(E, m_out - i));
    // runs crossing codec blocks: bit k set where element k (< count) starts the next codec
    // block (found once for all rows; each element starts at most one, as block >= 1)
    uint32_t starts = 0;
    if constexpr (!kOneScale) {
      int64_t next = (i / block + 1) * block;
#pragma unroll
      for (int k = 1; k < E; ++k) {
        if (k < count && i + k >= next) {
          starts |= 1u << k;
          next += block;
        }
      }
    }
    float acc[E];
    for (int64_t r0 = 0; r0 < nrows; r0 += kRows) {
      Raw<Rows::kBytes> raw[kRows];
      float s[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        if (r0 + u < nrows) {
          raw[u] = fetch<Rows::kBytes>(rows.codes(r0 + u, i), Rows::bytes_of(count));
          s[u] = Rows::kScaled && kOneScale ? rows.scale(r0 + u, i / block) : 1.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        if (r0 + u >= nrows) break;
        // the first row adds to +0, as the reference's zeros do (0 + -0 is +0)
        const bool first = r0 + u == 0;
        if constexpr (kOneScale) {
#pragma unroll
          for (int k = 0; k < E; ++k) {
            acc[k] = fadd(first ? 0.0f : acc[k], Rows::value(raw[u], k, s[u]));
          }
        } else {  // runs crossing codec blocks: the scale of each element's block
          int64_t b = i / block;
          float sb = rows.scale(r0 + u, b);
#pragma unroll
          for (int k = 0; k < E; ++k) {
            if ((starts >> k) & 1u) sb = rows.scale(r0 + u, ++b);
            acc[k] = fadd(first ? 0.0f : acc[k], Rows::value(raw[u], k, sb));
          }
        }
      }
    }
    float v[E];
#pragma unroll
    for (int k = 0; k < E; ++k) v[k] = fmul(acc[k], scale);
    store_run<E>(out + i, v, count);
    // loops to E with a guard, not to count: constant indices keep the arrays in registers
#pragma unroll
    for (int k = 0; k < E; ++k) {
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

// out: contiguous out_t, its numel() > 0 elements written from rows; stats: fp64 [2] on out's
// device = (squared norm, non-finite count) of out (docs/custom_hooks.md, "The decode contract").
template <typename out_t, typename Rows, bool kOneScale>
void launch_sum_rows_as(const Rows& rows, int64_t nrows, float scale, const at::Tensor& out,
                        const at::Tensor& stats) {
  constexpr auto kernel = sum_rows_kernel<out_t, Rows, kOneScale>;
  const int64_t m_out = out.numel();
  const Stream stream = current_stream();
  // one wave at the kernel's own occupancy (its registers decide how many blocks an SM holds)
  const int64_t grid = blocks_for<kernel>(m_out, decode_per_block<Rows>());
  at::Tensor partial = at::empty({2 * grid}, stats.options());
  PYCOMM_LAUNCH(static_cast<unsigned>(grid), kThreads, stream, kernel)(
      rows, nrows, scale, out.data_ptr<out_t>(), m_out, partial.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  PYCOMM_LAUNCH(1, kThreads, stream, finish_stats_kernel)(partial.const_data_ptr<double>(), grid,
                                                          stats.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The kernel for rows' codec blocks: runs of one scale, or runs crossing codec blocks.
template <typename out_t, typename Rows>
void launch_sum_rows(const Rows& rows, int64_t nrows, float scale, const at::Tensor& out,
                     const at::Tensor& stats) {
  if constexpr (Rows::kScaled) {
    if (rows.block % Rows::kElems != 0) {
      launch_sum_rows_as<out_t, Rows, false>(rows, nrows, scale, out, stats);
      return;
    }
  }
  launch_sum_rows_as<out_t, Rows, true>(rows, nrows, scale, out, stats);
}

// The CUDA kernels' launches, behind the codecs' host entries (csrc/host/codecs.h: checks,
// allocation, empty case, dtype dispatch), on the current stream of the guarded device.
struct Cuda {
  using Guard = DeviceGuard;

  template <typename T, typename R, typename out_t>
  static void encode16(const host::Encoding<T, R>& e, out_t* out, int64_t numel) {
    constexpr auto kernel = encode16_kernel<T, R, out_t>;
    PYCOMM_LAUNCH(blocks_for<kernel>(numel), kThreads, current_stream(), kernel)(Source<T, R>{e},
                                                                                 out, numel);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T, typename R>
  static void quantize_int8(const host::Encoding<T, R>& e, int8_t* codes, float* scales,
                            int64_t block, int64_t numel) {
    encode_blocks(Source<T, R>{e}, Int8Codec<R>{codes, scales, e.r_out}, numel, block,
                  current_stream());
  }

  template <typename T, typename R, typename S>
  static void quantize_int4(const host::Encoding<T, R>& e, uint8_t* codes, S* scales,
                            int64_t block, int64_t numel) {
    encode_blocks(Source<T, R>{e}, Int4Codec<R, S>{codes, scales, e.r_out}, numel, block,
                  current_stream());
  }

  template <typename T, typename R>
  static void quantize_fp8(const host::Encoding<T, R>& e, uint8_t* codes, float* scales,
                           int64_t block, int64_t numel) {
    encode_blocks(Source<T, R>{e}, Fp8Codec<R>{codes, scales, e.r_out}, numel, block,
                  current_stream());
  }

  template <typename T, typename R>
  static void quantize_onebit(const host::Encoding<T, R>& e, uint8_t* bits,
                              at::BFloat16* scales, int64_t block, int64_t numel) {
    encode_blocks(Source<T, R>{e}, OnebitCodec<R>{bits, scales, e.r_out, block}, numel, block,
                  current_stream());
  }

  // the decoders: each kind of rows read by its device-side Rows type
  template <typename out_t, typename T>
  static void sum_rows(const host::Chunks16<T>& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    launch_sum_rows<out_t>(Rows16<T>{in}, rows, s, out, stats);
  }
  template <typename out_t>
  static void sum_rows(const host::Int8Rows& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    launch_sum_rows<out_t>(RowsInt8{in}, rows, s, out, stats);
  }
  template <typename out_t, typename S>
  static void sum_rows(const host::Int4Rows<S>& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    launch_sum_rows<out_t>(RowsInt4<S>{in}, rows, s, out, stats);
  }
  template <typename out_t>
  static void sum_rows(const host::Fp8Rows& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    launch_sum_rows<out_t>(RowsFp8{in}, rows, s, out, stats);
  }
  template <typename out_t>
  static void sum_rows(const host::OnebitRows& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    launch_sum_rows<out_t>(RowsOnebit{in}, rows, s, out, stats);
  }
};

}  // namespace

PYCOMM_CUDA_LIBRARY_IMPL(m) { host::register_codecs<Cuda>(m); }

}  // namespace pycomm::cuda
