// Compression codecs on the CPU: the kernels of the encoders encode16, quantize_int8,
// quantize_int4, quantize_fp8, quantize_onebit and the decoders decode16_sum,
// dequantize_int8_sum, dequantize_int4_sum, dequantize_fp8_sum, dequantize_onebit_sum (their
// host entries, shared with CUDA, are csrc/host/codecs.h).
//
// Every op is one pass over memory. An encoder stages a tile of y = x * scale + residual on the
// stack (fp32, L1-resident), takes each block's statistic (absmax, mean |y|) from the tile and
// writes the block's codes, scale and new residual from it: x and the residual are read once,
// the outputs written once. A decoder keeps a tile of the fp32 sum over rows on the stack, adds
// every row's piece of it in row order, then scales it, rounds it into out, and takes out's
// squared norm from the values stored. Blocks longer than a tile are the exception: their
// statistic needs a first sweep over x and the residual, their codes a second.
//
// The arithmetic is pycomm.reference's, operation for operation (the build disables FMA
// contraction), so the outputs match it bit for bit. Two fp64 sums are taken in another order
// than torch's: a 1-bit block's sum of |y| (exact, hence equal, unless one block spans more
// than ~2^(29 - log2 block) in magnitude) and the decoders' squared norm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu/vec_io.h"
#include "host/codecs.h"

namespace pycomm::cpu {
namespace {

// Elements per parallel task: large enough that a task costs more than its scheduling.
constexpr int64_t kGrain = 32768;
// Elements staged on the stack per step: 8 KB of fp32, a fraction of L1.
constexpr int64_t kTile = 2048;
constexpr float kMaxFinite = std::numeric_limits<float>::max();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One fp32 vector holds the 8 elements of one byte of sign bits, and 8 int8 codes.
static_assert(FVec::size() == 8, "the codecs assume 8 fp32 lanes per vector");
static_assert(kGrain % kTile == 0 && kTile % kStep == 0, "tiles must split tasks evenly");

// NaN-propagating max(m, |v|), as torch's amax.
inline float absmax_step(float m, float v) {
  const float a = std::abs(v);
  return (std::isnan(a) || a > m) ? a : m;
}

// 8 int8 codes as fp32 (exact).
inline FVec load_codes(const int8_t* p) {
#ifdef CPU_CAPABILITY_AVX2
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
#else
  float f[8];
  for (int k = 0; k < 8; ++k) f[k] = static_cast<float>(p[k]);
  return FVec::loadu(f);
#endif
}

// Stores 16 integral fp32 values in [-127, 127] as int8 (exact): a, then b.
inline void store_codes(int8_t* p, const FVec& a, const FVec& b) {
#ifdef CPU_CAPABILITY_AVX2
  // packs works within 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7], reordered to a0-7 b0-7
  const __m256i i16 = _mm256_permute4x64_epi64(
      _mm256_packs_epi32(_mm256_cvttps_epi32(a), _mm256_cvttps_epi32(b)), 0b11011000);
  const __m128i i8 =
      _mm_packs_epi16(_mm256_castsi256_si128(i16), _mm256_extracti128_si256(i16, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), i8);
#else
  float f[16];
  a.store(f);
  b.store(f + 8);
  for (int k = 0; k < 16; ++k) p[k] = static_cast<int8_t>(f[k]);
#endif
}

// Stores 8 integral fp32 values in [-127, 127] as int8 (exact).
inline void store_codes(int8_t* p, const FVec& q) {
#ifdef CPU_CAPABILITY_AVX2
  const __m256i i32 = _mm256_cvttps_epi32(q);
  const __m128i i16 =
      _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(i16, i16));
#else
  float f[8];
  q.store(f);
  for (int k = 0; k < 8; ++k) p[k] = static_cast<int8_t>(f[k]);
#endif
}

// Stores 16 integral fp32 values in [-7, 7] as 8 bytes of two's-complement nibbles: element 2k
// in the low nibble of byte k, a then b.
inline void store_nibbles(uint8_t* p, const FVec& a, const FVec& b) {
#ifdef CPU_CAPABILITY_AVX2
  // 16-bit lanes, within 128-bit halves: [a0-3 b0-3 | a4-7 b4-7], each code's low 4 bits
  const __m256i v = _mm256_and_si256(
      _mm256_packs_epi32(_mm256_cvttps_epi32(a), _mm256_cvttps_epi32(b)), _mm256_set1_epi16(15));
  // dword k holds codes 2k (bits 0-3) and 2k + 1 (bits 16-19): or-ing it shifted right by 12
  // makes its low byte the packed byte
  const __m256i t = _mm256_or_si256(v, _mm256_srli_epi32(v, 12));
  // the low bytes to their places: a's 4 bytes first, then b's (the low half holds bytes 0, 1,
  // 4, 5 of the result, the high half 2, 3, 6, 7), the two halves then or-ed together
  const __m256i pick = _mm256_setr_epi8(0, 4, -1, -1, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, -1, -1, 0, 4, -1, -1, 8, 12, -1, -1, -1, -1, -1, -1,
                                        -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(t, pick);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p),
                   _mm_or_si128(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)));
#else
  float f[16];
  a.store(f);
  b.store(f + 8);
  for (int k = 0; k < 8; ++k) {
    const auto lo = static_cast<uint8_t>(static_cast<int>(f[2 * k]) & 15);
    const auto hi = static_cast<uint8_t>(static_cast<int>(f[2 * k + 1]) & 15);
    p[k] = static_cast<uint8_t>(lo | (hi << 4));
  }
#endif
}

// kNibbles[b] = the two int4 codes of byte b as fp32: (low nibble, high nibble), sign-extended.
const std::array<std::array<float, 2>, 256> kNibbles = [] {
  std::array<std::array<float, 2>, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int lo = b & 15, hi = b >> 4;
    t[b] = {static_cast<float>(lo >= 8 ? lo - 16 : lo), static_cast<float>(hi >= 8 ? hi - 16 : hi)};
  }
  return t;
}();

// The 8 int4 codes of 4 bytes as fp32 (exact): element k in nibble k % 2 of byte k / 2.
inline FVec load_nibbles(const uint8_t* p) {
#ifdef CPU_CAPABILITY_AVX2
  int32_t w;
  std::memcpy(&w, p, 4);
  // element k is bits [4k, 4k + 4) of w: shifted to the top, then arithmetically back down
  const __m256i up = _mm256_sllv_epi32(_mm256_set1_epi32(w),
                                       _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(up, 28));
#else
  float f[8];
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = kNibbles[p[k]][0];
    f[2 * k + 1] = kNibbles[p[k]][1];
  }
  return FVec::loadu(f);
#endif
}

// The fp32 value of every float8 e4m3fn byte (c10's conversion: 0x7F and 0xFF are NaN).
const std::array<float, 256> kE4m3 = [] {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b),
                                                 c10::Float8_e4m3fn::from_bits()));
  }
  return t;
}();

// 8 finite fp32 values in [-448, 448] as float8 e4m3fn, rounded to nearest even as
// c10::Float8_e4m3fn(float) rounds (torch's cast): their bytes to p, their values returned.
inline FVec store_e4m3(uint8_t* p, const FVec& v) {
#ifdef CPU_CAPABILITY_AVX2
  const __m256i u = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(u, sign);  // |v|
  // |v| >= 2^-6, normal in e4m3: the mantissa rounded to 3 bits, to nearest even (a carry
  // into the exponent is the next binade, as it should be); rn holds exponent and mantissa
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  const __m256i rn = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFFF)), odd), 20);
  const __m256i normal_code = _mm256_sub_epi32(rn, _mm256_set1_epi32(120 << 3));
  const __m256 normal_val = _mm256_castsi256_ps(_mm256_slli_epi32(rn, 20));
  // |v| < 2^-6: a subnormal, code round_half_even(|v| * 2^9) (8 is 2^-6, the smallest normal)
  const __m256 sub = _mm256_round_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a);
  const __m256i code = _mm256_or_si256(
      _mm256_blendv_epi8(normal_code, _mm256_cvttps_epi32(sub), is_sub),
      _mm256_srli_epi32(sign, 24));
  const __m256 val = _mm256_blendv_ps(normal_val, _mm256_mul_ps(sub, _mm256_set1_ps(1.0f / 512)),
                                      _mm256_castsi256_ps(is_sub));
  // byte 0 of each dword, the low lane's 4 then the high lane's
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(code, pick);
  const int32_t lo = _mm256_extract_epi32(bytes, 0), hi = _mm256_extract_epi32(bytes, 4);
  std::memcpy(p, &lo, 4);
  std::memcpy(p + 4, &hi, 4);
  return _mm256_or_ps(val, _mm256_castsi256_ps(sign));
#else
  float f[8], d[8];
  v.store(f);
  for (int k = 0; k < 8; ++k) {
    const c10::Float8_e4m3fn c(f[k]);
    p[k] = c.x;
    d[k] = static_cast<float>(c);
  }
  return FVec::loadu(d);
#endif
}

// 8 float8 e4m3fn bytes as fp32 (exact; 0x7F and 0xFF NaN).
inline FVec load_e4m3(const uint8_t* p) {
#ifdef CPU_CAPABILITY_AVX2
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  // exponent and mantissa moved into an fp32's (exponent bias 127 for 7) and scaled by 2^120:
  // exact for normals and subnormals alike (an fp32 subnormal times 2^120 is normal)
  const __m256 val = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)),
                                   _mm256_set1_ps(0x1p120f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
  return _mm256_blendv_ps(_mm256_or_ps(val, _mm256_castsi256_ps(sign)), _mm256_set1_ps(kNaN),
                          nan);
#else
  float f[8];
  for (int k = 0; k < 8; ++k) f[k] = kE4m3[p[k]];
  return FVec::loadu(f);
#endif
}

// Bit k set where lane k of the comparison mask is set (element 8j+k at bit k of byte j).
inline uint8_t mask_bits(const FVec& mask) {
#ifdef CPU_CAPABILITY_AVX2
  return static_cast<uint8_t>(_mm256_movemask_ps(mask));
#else
  float f[8];
  mask.store(f);
  uint8_t byte = 0;
  for (int k = 0; k < 8; ++k) byte |= static_cast<uint8_t>((std::signbit(f[k]) ? 1 : 0) << k);
  return byte;
#endif
}

// kSigns[b][k] = +1 where bit k of b is set, else -1: ±1 * s is exactly ±s, NaN and 0 included.
const std::array<std::array<float, 8>, 256> kSigns = [] {
  std::array<std::array<float, 8>, 256> t{};
  for (int b = 0; b < 256; ++b)
    for (int k = 0; k < 8; ++k) t[b][k] = ((b >> k) & 1) ? 1.0f : -1.0f;
  return t;
}();

// A non-finite block keeps its residual: copied over when it is written to another tensor.
template <typename R>
void keep_residual(R* r, const R* r_in, int64_t i, int64_t len) {
  if (r != nullptr && r != r_in) std::memcpy(r + i, r_in + i, len * sizeof(R));
}

// The residual's 8 values v to p (R: float, or BFloat16 rounded to nearest even).
template <typename R>
void store8(R* p, const FVec& v) {
  if constexpr (std::is_same_v<R, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<R>(v, v).store(p, FVec::size());
  }
}

// y = x * s (+ r), x zero beyond its n elements: the references' y, staged a tile at a time.
// R: the residual's type, float or BFloat16 (widened exactly; y is fp32 either way).
template <typename T, typename R = float>
struct Source {
  using Residual = R;
  const T* x;  // [n], contiguous
  const R* r;  // [numel], or nullptr without error feedback
  int64_t n;
  float s;

  // y[0, len) = y of elements [i0, i0 + len).
  void load(int64_t i0, int64_t len, float* y) const {
    const int64_t nx = std::clamp<int64_t>(n - i0, 0, len);
    const T* xp = x + i0;
    const FVec vs(s);
    int64_t j = 0;
    if (r != nullptr) {
      const R* rp = r + i0;
      for (; j + kStep <= nx; j += kStep) {
        FVec a, b, ra, rb;
        VecIO<T>::load(xp + j, a, b);
        VecIO<R>::load(rp + j, ra, rb);
        VecIO<float>::store(y + j, a * vs + ra, b * vs + rb);
      }
      for (; j < nx; ++j) y[j] = static_cast<float>(xp[j]) * s + static_cast<float>(rp[j]);
      // padding: 0 + r, as the reference adds r to zeros (0 + -0 is +0)
      for (; j < len; ++j) y[j] = 0.0f + static_cast<float>(rp[j]);
      return;
    }
    for (; j + kStep <= nx; j += kStep) {
      FVec a, b;
      VecIO<T>::load(xp + j, a, b);
      VecIO<float>::store(y + j, a * vs, b * vs);
    }
    for (; j < nx; ++j) y[j] = static_cast<float>(xp[j]) * s;
    for (; j < len; ++j) y[j] = 0.0f;
  }
};

// Symmetric int8 per block: s = absmax / 127, q = round_half_even(y * inv) clamped to ±127.
template <typename R>
struct Int8Codec {
  int8_t* codes;       // [numel]
  float* scales;       // [numel / block]
  R* r;                // [numel] residual written, or nullptr
  const R* r_in;       // [numel] residual read (r itself when updated in place)
  using Stat = float;  // absmax, NaN-propagating: finite iff the block is
  struct Param {
    float s, inv;
    bool finite;
  };

  static float add(float m, const float* y, int64_t len) {
    constexpr int64_t W = FVec::size();
    // four independent chains: a NaN-propagating max is three dependent instructions
    FVec m0(m), m1(m), m2(m), m3(m);
    int64_t j = 0;
    for (; j + 4 * W <= len; j += 4 * W) {
      m0 = at::vec::maximum(m0, FVec::loadu(y + j).abs());
      m1 = at::vec::maximum(m1, FVec::loadu(y + j + W).abs());
      m2 = at::vec::maximum(m2, FVec::loadu(y + j + 2 * W).abs());
      m3 = at::vec::maximum(m3, FVec::loadu(y + j + 3 * W).abs());
    }
    for (; j + W <= len; j += W) m0 = at::vec::maximum(m0, FVec::loadu(y + j).abs());
    float lanes[W];
    at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3)).store(lanes);
    for (float v : lanes) m = absmax_step(m, v);
    for (; j < len; ++j) m = absmax_step(m, y[j]);
    return m;
  }

  // (s, inv) = (absmax / qmax, qmax / absmax), NaN and not finite for a non-finite absmax.
  static Param of(float absmax, float qmax) {
    if (!(absmax <= kMaxFinite)) return {kNaN, 0.0f, false};
    // The reference's `qmax / absmax` is Tensor.__rtruediv__: reciprocal(absmax) * qmax, two
    // roundings, kept here so that codes match it.
    float inv = absmax > 0.0f ? (1.0f / absmax) * qmax : 0.0f;
    // absmax below ~qmax / FLT_MAX: inv would be inf and y = 0 would give NaN codes; such a
    // block quantizes to 0 and keeps all of y in the residual.
    if (!std::isfinite(inv)) inv = 0.0f;
    return {absmax / qmax, inv, true};
  }

  Param finish(int64_t blk, float absmax) const {
    const Param p = of(absmax, 127.0f);
    scales[blk] = p.s;
    return p;
  }

  // Codes (and residual) of elements [i, i + len) of one block.
  void quant(int64_t i, const float* y, int64_t len, const Param& p) const {
    if (!p.finite) {
      std::memset(codes + i, 0, len);
      keep_residual(r, r_in, i, len);
      return;
    }
    constexpr int64_t W = FVec::size();
    const FVec vs(p.s), vinv(p.inv), lo(-127.0f), hi(127.0f);
    int8_t* c = codes + i;
    R* rp = r != nullptr ? r + i : nullptr;
    int64_t j = 0;
    for (; j + 2 * W <= len; j += 2 * W) {
      const FVec y0 = FVec::loadu(y + j), y1 = FVec::loadu(y + j + W);
      const FVec q0 = at::vec::clamp((y0 * vinv).round(), lo, hi);
      const FVec q1 = at::vec::clamp((y1 * vinv).round(), lo, hi);
      if (rp != nullptr) VecIO<R>::store(rp + j, y0 - q0 * vs, y1 - q1 * vs);
      store_codes(c + j, q0, q1);
    }
    for (; j < len; ++j) {
      const float q = std::min(std::max(std::nearbyint(y[j] * p.inv), -127.0f), 127.0f);
      if (rp != nullptr) rp[j] = static_cast<R>(y[j] - q * p.s);
      c[j] = static_cast<int8_t>(q);
    }
  }
};

// Symmetric int4 per block: s = absmax / 7 rounded to S (float or BFloat16), q =
// round_half_even(y * (1 / s)) clamped to ±7, two codes a byte.
template <typename R, typename S>
struct Int4Codec {
  uint8_t* codes;      // [numel / 2]
  S* scales;           // [numel / block]
  R* r;                // [numel] residual written, or nullptr
  const R* r_in;       // [numel] residual read (r itself when updated in place)
  using Stat = float;  // absmax, as int8's
  using Param = typename Int8Codec<R>::Param;

  static float add(float m, const float* y, int64_t len) { return Int8Codec<R>::add(m, y, len); }

  Param finish(int64_t blk, float absmax) const {
    if (!(absmax <= kMaxFinite)) {
      scales[blk] = static_cast<S>(kNaN);
      return {kNaN, 0.0f, false};
    }
    const S stored = static_cast<S>(absmax / 7.0f);
    const float s = static_cast<float>(stored);
    // the reference's 1.0 / s: one rounding; 0 for an all-zero block, and where it overflows
    float inv = s > 0.0f ? 1.0f / s : 0.0f;
    if (!std::isfinite(inv)) inv = 0.0f;
    scales[blk] = stored;
    return {s, inv, true};
  }

  // Codes (and residual) of elements [i, i + len) of one block; i and len are even.
  void quant(int64_t i, const float* y, int64_t len, const Param& p) const {
    uint8_t* c = codes + i / 2;
    if (!p.finite) {
      std::memset(c, 0, len / 2);
      keep_residual(r, r_in, i, len);
      return;
    }
    constexpr int64_t W = FVec::size();
    const FVec vs(p.s), vinv(p.inv);
    R* rp = r != nullptr ? r + i : nullptr;
    int64_t j = 0;
    // no clamp to ±7 here: |y| <= absmax and inv = 1 / s with s = absmax / 7 rounded (to fp32,
    // or bf16: 2^-6 relative at most, subnormals included, wherever inv is finite) keep
    // |y * inv| below 7.2, which rounds into [-7, 7] (the scalar tail clamps as the reference)
    for (; j + 2 * W <= len; j += 2 * W) {
      const FVec y0 = FVec::loadu(y + j), y1 = FVec::loadu(y + j + W);
      const FVec q0 = (y0 * vinv).round();
      const FVec q1 = (y1 * vinv).round();
      if (rp != nullptr) VecIO<R>::store(rp + j, y0 - q0 * vs, y1 - q1 * vs);
      store_nibbles(c + (j >> 1), q0, q1);
    }
    for (; j < len; j += 2) {
      uint8_t byte = 0;
      for (int k = 0; k < 2; ++k) {
        const float v = y[j + k];
        const float q = std::min(std::max(std::nearbyint(v * p.inv), -7.0f), 7.0f);
        if (rp != nullptr) rp[j + k] = static_cast<R>(v - q * p.s);
        byte |= static_cast<uint8_t>((static_cast<int>(q) & 15) << (4 * k));
      }
      c[j >> 1] = byte;
    }
  }
};

// float8 e4m3fn per block: s = absmax / 448, code = e4m3(clamp(y * inv, ±448)) with inv
// = (1 / absmax) * 448 (the reference's 448.0 / absmax: two roundings), decoded code * s.
template <typename R>
struct Fp8Codec {
  uint8_t* codes;      // [numel], e4m3fn bytes
  float* scales;       // [numel / block]
  R* r;                // [numel] residual written, or nullptr
  const R* r_in;       // [numel] residual read (r itself when updated in place)
  using Stat = float;  // absmax, as int8's
  using Param = typename Int8Codec<R>::Param;

  static float add(float m, const float* y, int64_t len) { return Int8Codec<R>::add(m, y, len); }

  Param finish(int64_t blk, float absmax) const {
    const Param p = Int8Codec<R>::of(absmax, 448.0f);
    scales[blk] = p.s;
    return p;
  }

  void quant(int64_t i, const float* y, int64_t len, const Param& p) const {
    uint8_t* c = codes + i;
    if (!p.finite) {
      std::memset(c, 0, len);
      keep_residual(r, r_in, i, len);
      return;
    }
    constexpr int64_t W = FVec::size();
    const FVec vs(p.s), vinv(p.inv), lo(-448.0f), hi(448.0f);
    R* rp = r != nullptr ? r + i : nullptr;
    int64_t j = 0;
    for (; j + 2 * W <= len; j += 2 * W) {
      const FVec y0 = FVec::loadu(y + j), y1 = FVec::loadu(y + j + W);
      const FVec d0 = store_e4m3(c + j, at::vec::clamp(y0 * vinv, lo, hi));
      const FVec d1 = store_e4m3(c + j + W, at::vec::clamp(y1 * vinv, lo, hi));
      if (rp != nullptr) VecIO<R>::store(rp + j, y0 - d0 * vs, y1 - d1 * vs);
    }
    for (; j < len; ++j) {
      const c10::Float8_e4m3fn q(std::min(std::max(y[j] * p.inv, -448.0f), 448.0f));
      c[j] = q.x;
      if (rp != nullptr) rp[j] = static_cast<R>(y[j] - static_cast<float>(q) * p.s);
    }
  }
};

// One sign bit per element (y >= 0), one bf16 scale per block: the mean |y| (fp64 sum).
template <typename R>
struct OnebitCodec {
  uint8_t* bits;         // [numel / 8]
  at::BFloat16* scales;  // [numel / block]
  R* r;                  // [numel] residual written, or nullptr
  const R* r_in;         // [numel] residual read (r itself when updated in place)
  int64_t block;
  using Stat = double;  // sum of |y|: finite iff the block is (no fp32 sum overflows fp64)
  struct Param {
    float s;
    bool finite;
  };

  static double add(double sum, const float* y, int64_t len) {
    constexpr int64_t W = FVec::size();
    DVec a0(0.0), a1(0.0), a2(0.0), a3(0.0);
    int64_t j = 0;
    for (; j + 2 * W <= len; j += 2 * W) {
      DVec lo, hi;
      widen(FVec::loadu(y + j).abs(), lo, hi);
      a0 = a0 + lo;
      a1 = a1 + hi;
      widen(FVec::loadu(y + j + W).abs(), lo, hi);
      a2 = a2 + lo;
      a3 = a3 + hi;
    }
    for (; j + W <= len; j += W) {
      DVec lo, hi;
      widen(FVec::loadu(y + j).abs(), lo, hi);
      a0 = a0 + lo;
      a1 = a1 + hi;
    }
    double lanes[DVec::size()];
    ((a0 + a1) + (a2 + a3)).store(lanes);
    for (double v : lanes) sum += v;
    for (; j < len; ++j) sum += std::abs(static_cast<double>(y[j]));
    return sum;
  }

  Param finish(int64_t blk, double sum) const {
    if (!std::isfinite(sum)) {
      scales[blk] = at::BFloat16(kNaN);
      return {kNaN, false};
    }
    const at::BFloat16 s(static_cast<float>(sum / static_cast<double>(block)));
    scales[blk] = s;
    return {static_cast<float>(s), true};
  }

  // Bits (and residual) of elements [i, i + len) of one block, i and len multiples of 8.
  void quant(int64_t i, const float* y, int64_t len, const Param& p) const {
    uint8_t* out = bits + i / 8;
    if (!p.finite) keep_residual(r, r_in, i, len);
    R* rp = (r != nullptr && p.finite) ? r + i : nullptr;
    constexpr int64_t W = FVec::size();
    const FVec zero(0.0f), pos_s(p.s), neg_s(-p.s);
    int64_t j = 0;
    for (; j + 2 * W <= len; j += 2 * W) {  // two vectors: one full store of a bf16 residual
      const FVec v0 = FVec::loadu(y + j), v1 = FVec::loadu(y + j + W);
      const FVec pos0 = v0 >= zero, pos1 = v1 >= zero;  // false for NaN, true for -0
      out[j / 8] = mask_bits(pos0);
      out[j / 8 + 1] = mask_bits(pos1);
      if (rp != nullptr) {
        VecIO<R>::store(rp + j, v0 - FVec::blendv(neg_s, pos_s, pos0),
                        v1 - FVec::blendv(neg_s, pos_s, pos1));
      }
    }
    for (; j < len; j += W) {
      const FVec vy = FVec::loadu(y + j);
      const FVec pos = vy >= zero;
      out[j / 8] = mask_bits(pos);
      if (rp != nullptr) store8(rp + j, vy - FVec::blendv(neg_s, pos_s, pos));
    }
  }
};

// Runs codec over blocks [0, nblocks) of y = src, in parallel over blocks.
template <typename T, typename R, typename Codec>
void encode_blocks(const Source<T, R>& src, int64_t nblocks, int64_t block, const Codec& codec) {
  const int64_t grain = std::max<int64_t>(1, kGrain / block);
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float y[kTile];
    if (block <= kTile) {
      const int64_t per_tile = kTile / block;
      for (int64_t b = b0; b < b1; b += per_tile) {
        const int64_t count = std::min(per_tile, b1 - b);
        src.load(b * block, count * block, y);
        for (int64_t k = 0; k < count; ++k) {
          const float* yk = y + k * block;
          const auto p = codec.finish(b + k, Codec::add(typename Codec::Stat{}, yk, block));
          codec.quant((b + k) * block, yk, block, p);
        }
      }
      return;
    }
    for (int64_t b = b0; b < b1; ++b) {
      typename Codec::Stat st{};
      for (int64_t o = 0; o < block; o += kTile) {
        const int64_t len = std::min(kTile, block - o);
        src.load(b * block + o, len, y);
        st = Codec::add(st, y, len);
      }
      const auto p = codec.finish(b, st);
      for (int64_t o = 0; o < block; o += kTile) {
        const int64_t len = std::min(kTile, block - o);
        src.load(b * block + o, len, y);
        codec.quant(b * block + o, y, len, p);
      }
    }
  });
}

// Sum of squares of the finite fp32 values fed to it, and the count of the others. Squares
// add up in fp32 lanes within a tile (at most kTile / (2 * FVec::size()) values per lane) and
// in fp64 across tiles: about 1e-7 relative, at a quarter of the cost of fp64 per element.
struct Norm {
  FVec fsq[2] = {FVec(0.0f), FVec(0.0f)};  // independent chains: the two halves of a step
  DVec sq[2] = {DVec(0.0), DVec(0.0)};
  FVec bad[2] = {FVec(0.0f), FVec(0.0f)};  // per lane, exact below 2^24: flushed every tile
  double sq_scalar = 0.0;
  int64_t bad_count = 0;

  void add(const FVec& v, int half) {
    const FVec finite = v.abs() <= FVec(kMaxFinite);
    const FVec f = v & finite;
    fsq[half] = fsq[half] + f * f;
    bad[half] = bad[half] + FVec::blendv(FVec(1.0f), FVec(0.0f), finite);
  }
  void add(float v) {
    if (std::isfinite(v)) {
      sq_scalar += static_cast<double>(v) * static_cast<double>(v);
    } else {
      ++bad_count;
    }
  }
  void flush() {
    float lanes[FVec::size()];
    (bad[0] + bad[1]).store(lanes);
    for (float c : lanes) bad_count += static_cast<int64_t>(c);
    bad[0] = bad[1] = FVec(0.0f);
    DVec lo0, hi0, lo1, hi1;
    widen(fsq[0], lo0, hi0);
    widen(fsq[1], lo1, hi1);
    sq[0] = sq[0] + (lo0 + lo1);
    sq[1] = sq[1] + (hi0 + hi1);
    fsq[0] = fsq[1] = FVec(0.0f);
  }
  double sum() const {
    double lanes[DVec::size()];
    (sq[0] + sq[1]).store(lanes);
    double s = sq_scalar;
    for (double v : lanes) s += v;
    return s;
  }
};

// out[i] = round(acc[i] * s) for i < len; feeds what was stored to norm.
template <typename out_t>
void store_scaled(out_t* out, const float* acc, int64_t len, float s, Norm& total) {
  Norm norm = total;  // a local copy stays in registers; stores to out cannot alias it
  const FVec vs(s);
  int64_t j = 0;
#ifdef CPU_CAPABILITY_AVX2
  if constexpr (std::is_same_v<out_t, float>) {
    // fp32 out: streaming stores skip reading out's lines before writing them (the decoders
    // write far more than they read), and the norm comes from the registers.
    for (; j < len && reinterpret_cast<uintptr_t>(out + j) % 32 != 0; ++j) {
      out[j] = acc[j] * s;
      norm.add(out[j]);
    }
    for (; j + kStep <= len; j += kStep) {
      const FVec a = FVec::loadu(acc + j) * vs, b = FVec::loadu(acc + j + FVec::size()) * vs;
      _mm256_stream_ps(out + j, a);
      _mm256_stream_ps(out + j + FVec::size(), b);
      norm.add(a, 0);
      norm.add(b, 1);
    }
  }
#endif
  for (; j + kStep <= len; j += kStep) {
    FVec a, b;
    VecIO<float>::load(acc + j, a, b);
    VecIO<out_t>::store(out + j, a * vs, b * vs);
    VecIO<out_t>::load(out + j, a, b);
    norm.add(a, 0);
    norm.add(b, 1);
  }
  for (; j < len; ++j) {
    out[j] = static_cast<out_t>(acc[j] * s);
    norm.add(static_cast<float>(out[j]));
  }
  norm.flush();
  total = norm;
}

// acc[j] + d, or 0 + d for the first row: the references start from zeros (0 + -0 is +0).
template <bool kFirst>
inline FVec acc_plus(const float* acc, const FVec& d) {
  if constexpr (kFirst) return FVec(0.0f) + d;
  return FVec::loadu(acc) + d;
}
template <bool kFirst>
inline float acc_plus(const float* acc, float d) {
  if constexpr (kFirst) return 0.0f + d;
  return *acc + d;
}

// out: contiguous out_t, numel() > 0 elements written. add_row(r, i, len, acc, first) adds row
// r's decoded elements [i, i + len) into acc[0, len) (first: std::true_type for row 0, whose
// acc holds nothing yet). stats: fp64 [2] = (squared norm, non-finite count) of out, as the
// decode contract states them (docs/custom_hooks.md, "The decode contract").
template <typename out_t, typename AddRow>
void sum_rows_of(int64_t rows, float s, const at::Tensor& out, const at::Tensor& stats,
                 const AddRow& add_row) {
  const int64_t m = out.numel();
  const int64_t chunks = (m + kGrain - 1) / kGrain;
  // per fixed chunk, so that the result does not depend on the thread count
  std::vector<double> sq(chunks, 0.0);
  std::vector<int64_t> bad(chunks, 0);
  out_t* o = out.data_ptr<out_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    alignas(64) float acc[kTile];
    for (int64_t c = c0; c < c1; ++c) {
      Norm norm;
      const int64_t end = std::min(m, (c + 1) * kGrain);
      for (int64_t i = c * kGrain; i < end; i += kTile) {
        const int64_t len = std::min(kTile, end - i);
        add_row(0, i, len, acc, std::true_type{});
        for (int64_t r = 1; r < rows; ++r) add_row(r, i, len, acc, std::false_type{});
        store_scaled(o + i, acc, len, s, norm);
      }
      sq[c] = norm.sum();
      bad[c] = norm.bad_count;
    }
#ifdef CPU_CAPABILITY_AVX2
    _mm_sfence();  // order store_scaled's streaming stores before the result is used
#endif
  });
  double total_sq = 0.0;
  int64_t total_bad = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    total_sq += sq[c];
    total_bad += bad[c];
  }
  stats.data_ptr<double>()[0] = total_sq;
  stats.data_ptr<double>()[1] = static_cast<double>(total_bad);
}

// The decoders of codes with a scale per block: out = s * the fp32 sum over rows, in row
// order, of code(r, e) * scale(r, e / block). scale_of(r, b): row r's scale of block b;
// codes8(r, e): row r's codes of elements [e, e + 8) as fp32 (e is a multiple of 8 from its
// block's start, and blocks of 1-bit codes are multiples of 8; tiles start at multiples of 8);
// code1(r, e): one code. Each element costs one multiply by its scale and one add. (e >= 0:
// the callers index bytes with shifts, which a signed e / 2 would not compile to.)
template <typename out_t, typename ScaleOf, typename Codes8, typename Code1>
void sum_scaled_rows(int64_t rows, int64_t block, float s, const at::Tensor& out,
                     const at::Tensor& stats, const ScaleOf& scale_of, const Codes8& codes8,
                     const Code1& code1) {
  sum_rows_of<out_t>(rows, s, out, stats, [&](int64_t r, int64_t i, int64_t len, float* acc,
                                           auto first) {
    constexpr bool kFirst = decltype(first)::value;
    int64_t blk = i / block;
    for (int64_t j = 0; j < len; ++blk) {
      const int64_t seg_end = std::min(len, (blk + 1) * block - i);
      const float sc = scale_of(r, blk);
      const FVec vs(sc);
      for (; j + FVec::size() <= seg_end; j += FVec::size()) {
        acc_plus<kFirst>(acc + j, codes8(r, i + j) * vs).store(acc + j);
      }
      for (; j < seg_end; ++j) acc[j] = acc_plus<kFirst>(acc + j, code1(r, i + j) * sc);
    }
  });
}

// The CPU kernels of the codecs, behind their host entries (csrc/host/codecs.h: checks,
// allocation, empty case, dtype dispatch).
struct Cpu {
  struct Guard {
    explicit Guard(const at::Device&) {}
  };

  // o[0, numel) = y rounded to out_t; the residual = y - o where o is finite, else kept.
  template <typename T, typename R, typename out_t>
  static void encode16(const host::Encoding<T, R>& e, out_t* o, int64_t numel) {
    const Source<T, R> src{e.x, e.r, e.n, e.s};
    R* r = e.r_out;
    const R* r_in = e.r;
    at::parallel_for(0, numel, kGrain, [&](int64_t b, int64_t e_) {
      alignas(64) float y[kTile];
      for (int64_t i = b; i < e_; i += kTile) {
        const int64_t len = std::min(kTile, e_ - i);
        src.load(i, len, y);
        out_t* dst = o + i;
        R* rp = r != nullptr ? r + i : nullptr;
        const R* rin = r != nullptr ? r_in + i : nullptr;
        int64_t j = 0;
        for (; j + kStep <= len; j += kStep) {
          FVec a, b2;
          VecIO<float>::load(y + j, a, b2);
          VecIO<out_t>::store(dst + j, a, b2);
          if (rp == nullptr) continue;
          FVec ba, bb;
          VecIO<out_t>::load(dst + j, ba, bb);
          const FVec lim(kMaxFinite);
          FVec old_a, old_b;
          VecIO<R>::load(rin + j, old_a, old_b);
          const FVec ra = FVec::blendv(old_a, a - ba, ba.abs() <= lim);
          const FVec rb = FVec::blendv(old_b, b2 - bb, bb.abs() <= lim);
          VecIO<R>::store(rp + j, ra, rb);
        }
        for (; j < len; ++j) {
          dst[j] = static_cast<out_t>(y[j]);
          if (rp == nullptr) continue;
          const float back = static_cast<float>(dst[j]);
          rp[j] = std::isfinite(back) ? static_cast<R>(y[j] - back) : rin[j];
        }
      }
    });
  }

  template <typename T, typename R>
  static void quantize_int8(const host::Encoding<T, R>& e, int8_t* codes, float* scales,
                            int64_t block, int64_t numel) {
    const Int8Codec<R> codec{codes, scales, e.r_out, e.r};
    encode_blocks(Source<T, R>{e.x, e.r, e.n, e.s}, numel / block, block, codec);
  }

  template <typename T, typename R, typename S>
  static void quantize_int4(const host::Encoding<T, R>& e, uint8_t* codes, S* scales,
                            int64_t block, int64_t numel) {
    const Int4Codec<R, S> codec{codes, scales, e.r_out, e.r};
    encode_blocks(Source<T, R>{e.x, e.r, e.n, e.s}, numel / block, block, codec);
  }

  template <typename T, typename R>
  static void quantize_fp8(const host::Encoding<T, R>& e, uint8_t* codes, float* scales,
                           int64_t block, int64_t numel) {
    const Fp8Codec<R> codec{codes, scales, e.r_out, e.r};
    encode_blocks(Source<T, R>{e.x, e.r, e.n, e.s}, numel / block, block, codec);
  }

  template <typename T, typename R>
  static void quantize_onebit(const host::Encoding<T, R>& e, uint8_t* bits,
                              at::BFloat16* scales, int64_t block, int64_t numel) {
    const OnebitCodec<R> codec{bits, scales, e.r_out, e.r, block};
    encode_blocks(Source<T, R>{e.x, e.r, e.n, e.s}, numel / block, block, codec);
  }

  // out = s * sum_r chunks[r, :out.numel()] (fp32, row order).
  template <typename out_t, typename T>
  static void sum_rows(const host::Chunks16<T>& ch, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    sum_rows_of<out_t>(rows, s, out, stats, [&](int64_t r, int64_t i, int64_t len, float* acc,
                                             auto first) {
      constexpr bool kFirst = decltype(first)::value;
      const T* p = ch.c + r * ch.ld + i;
      int64_t j = 0;
      for (; j + kStep <= len; j += kStep) {
        FVec d0, d1;
        VecIO<T>::load(p + j, d0, d1);
        VecIO<float>::store(acc + j, acc_plus<kFirst>(acc + j, d0),
                            acc_plus<kFirst>(acc + j + FVec::size(), d1));
      }
      for (; j < len; ++j) acc[j] = acc_plus<kFirst>(acc + j, static_cast<float>(p[j]));
    });
  }

  // out = s * sum_r codes[r] * scales[r] (per block).
  template <typename out_t>
  static void sum_rows(const host::Int8Rows& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    sum_scaled_rows<out_t>(
        rows, in.block, s, out, stats, [&](int64_t r, int64_t b) { return in.sc[r * in.lds + b]; },
        [&](int64_t r, int64_t e) { return load_codes(in.q + r * in.ld + e); },
        [&](int64_t r, int64_t e) { return static_cast<float>(in.q[r * in.ld + e]); });
  }

  // out = s * sum_r q[r] * scales[r] (per block). Element e is nibble e % 2 of byte e / 2.
  template <typename out_t, typename S>
  static void sum_rows(const host::Int4Rows<S>& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    sum_scaled_rows<out_t>(
        rows, in.block, s, out, stats,
        [&](int64_t r, int64_t b) { return static_cast<float>(in.sc[r * in.lds + b]); },
        [&](int64_t r, int64_t e) { return load_nibbles(in.q + r * in.ld + (e >> 1)); },
        [&](int64_t r, int64_t e) { return kNibbles[in.q[r * in.ld + (e >> 1)]][e & 1]; });
  }

  // out = s * sum_r codes[r] * scales[r] (per block), e4m3fn codes.
  template <typename out_t>
  static void sum_rows(const host::Fp8Rows& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    sum_scaled_rows<out_t>(
        rows, in.block, s, out, stats, [&](int64_t r, int64_t b) { return in.sc[r * in.lds + b]; },
        [&](int64_t r, int64_t e) { return load_e4m3(in.q + r * in.ld + e); },
        [&](int64_t r, int64_t e) { return kE4m3[in.q[r * in.ld + e]]; });
  }

  // out = s * sum_r (bit ? +scale : -scale). Element e is bit e % 8 of byte e / 8.
  template <typename out_t>
  static void sum_rows(const host::OnebitRows& in, int64_t rows, float s, const at::Tensor& out,
                       const at::Tensor& stats) {
    sum_scaled_rows<out_t>(
        rows, in.block, s, out, stats,
        [&](int64_t r, int64_t b) { return static_cast<float>(in.sc[r * in.lds + b]); },
        [&](int64_t r, int64_t e) {
          return FVec::loadu(kSigns[in.bits[r * in.ld + (e >> 3)]].data());
        },
        [&](int64_t r, int64_t e) { return kSigns[in.bits[r * in.ld + (e >> 3)]][e & 7]; });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(pycomm, CPU, m) { host::register_codecs<Cpu>(m); }

}  // namespace pycomm::cpu
