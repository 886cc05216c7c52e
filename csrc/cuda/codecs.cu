// Compression codecs on CUDA: the kernels of the encoders encode16, quantize_int8,
// quantize_onebit and the decoders decode16_sum, dequantize_int8_sum, dequantize_onebit_sum
// (their host entries, shared with the CPU, are csrc/host/codecs.h).
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

// --- decoders ----------------------------------------------------------------------------

// Each Rows::load(r, i, count, d) decodes elements [i, i + count) of row r into d (count >= 1,
// lanes past count 0); the kernel adds the rows in order.

// Rows of [R, m] 16-bit chunks.
template <typename T>
struct Rows16 : host::Chunks16<T> {  // c, ld: elements from one row to the next (rows may be
                                     // slices of wider rows)
  using host::Chunks16<T>::c;
  using host::Chunks16<T>::ld;

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
struct RowsInt8 : host::Int8Rows {  // ld, lds: row strides of the codes and of the scales

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
struct RowsOnebit : host::OnebitRows {  // ld, lds: row strides of the bits (bytes), scales

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

// out: contiguous out_t, its numel() > 0 elements written from rows; stats: fp64 [2] on out's
// device = (sum of out^2 over finite out, count of non-finite out).
template <typename out_t, typename Rows>
void launch_sum_rows(const Rows& rows, int64_t nrows, float scale, const at::Tensor& out,
                     const at::Tensor& stats) {
  const int64_t m_out = out.numel();
  const Stream stream = current_stream();
  const int64_t grid = blocks_for(m_out);
  at::Tensor partial = at::empty({2 * grid}, stats.options());
  PYCOMM_LAUNCH(static_cast<unsigned>(grid), kThreads, stream, sum_rows_kernel<out_t, Rows>)(
      rows, nrows, scale, out.data_ptr<out_t>(), m_out, partial.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  PYCOMM_LAUNCH(1, kThreads, stream, finish_stats_kernel)(partial.const_data_ptr<double>(), grid,
                                                          stats.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The CUDA kernels' launches, behind the codecs' host entries (csrc/host/codecs.h: checks,
// allocation, empty case, dtype dispatch), on the current stream of the guarded device.
struct Cuda {
  using Guard = DeviceGuard;

  template <typename T, typename R, typename out_t>
  static void encode16(const host::Encoding<T, R>& e, out_t* out, int64_t numel) {
    PYCOMM_LAUNCH(blocks_for(numel), kThreads, current_stream(), encode16_kernel<T, R, out_t>)(
        Source<T, R>{e}, out, numel);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename T, typename R>
  static void quantize_int8(const host::Encoding<T, R>& e, int8_t* codes, float* scales,
                            int64_t block, int64_t numel) {
    encode_blocks(Source<T, R>{e}, Int8Codec<R>{codes, scales, e.r_out}, numel, block,
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
  template <typename out_t>
  static void sum_rows(const host::OnebitRows& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    launch_sum_rows<out_t>(RowsOnebit{in}, rows, s, out, stats);
  }
};

}  // namespace

PYCOMM_CUDA_LIBRARY_IMPL(m) { host::register_codecs<Cuda>(m); }

}  // namespace pycomm::cuda
