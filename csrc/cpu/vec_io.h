// Element loops shared by the CPU kernels: every op computes in fp32 whatever its storage
// dtype, loading and storing 2 x Vectorized<float>::size() elements per step through at::vec.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <tuple>

namespace pycomm::cpu {

using at::vec::Vectorized;
using FVec = Vectorized<float>;
constexpr int64_t kStep = 2 * FVec::size();

template <typename T>
struct VecIO {
  // Half and BFloat16: one reduced-precision vector widens into two fp32 vectors.
  static_assert(Vectorized<T>::size() == kStep, "reduced vector must hold two fp32 vectors");
  static void load(const T* p, FVec& a, FVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
  }
  static void store(T* p, const FVec& a, const FVec& b) {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
};

template <>
struct VecIO<float> {
  static void load(const float* p, FVec& a, FVec& b) {
    a = FVec::loadu(p);
    b = FVec::loadu(p + FVec::size());
  }
  static void store(float* p, const FVec& a, const FVec& b) {
    a.store(p);
    b.store(p + FVec::size());
  }
};

// dst[i] = src[i] * s for contiguous dst and src.
template <typename out_t, typename in_t>
void scaled_copy(out_t* dst, const in_t* src, int64_t n, float s) {
  if constexpr (std::is_same_v<out_t, in_t>) {
    if (s == 1.0f) {
      std::memcpy(dst, src, n * sizeof(out_t));
      return;
    }
  }
  const FVec vs(s);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    FVec a, b;
    VecIO<in_t>::load(src + i, a, b);
    VecIO<out_t>::store(dst + i, a * vs, b * vs);
  }
  for (; i < n; ++i) dst[i] = static_cast<out_t>(static_cast<float>(src[i]) * s);
}

// dst[i] += alpha * src[i] for contiguous dst and src.
template <typename dst_t, typename src_t>
void axpy(dst_t* dst, const src_t* src, int64_t n, float alpha) {
  const FVec va(alpha);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    FVec d0, d1, s0, s1;
    VecIO<dst_t>::load(dst + i, d0, d1);
    VecIO<src_t>::load(src + i, s0, s1);
    VecIO<dst_t>::store(dst + i, d0 + s0 * va, d1 + s1 * va);
  }
  for (; i < n; ++i) {
    dst[i] = static_cast<dst_t>(static_cast<float>(dst[i]) + static_cast<float>(src[i]) * alpha);
  }
}

using DVec = Vectorized<double>;

// The fp32 lanes of v as fp64: lanes [0, 4) in lo, [4, 8) in hi. Exact.
inline void widen(const FVec& v, DVec& lo, DVec& hi) {
  static_assert(FVec::size() == 2 * DVec::size(), "one fp32 vector must widen into two");
#ifdef CPU_CAPABILITY_AVX2
  const __m256 w = v;
  lo = _mm256_cvtps_pd(_mm256_castps256_ps128(w));
  hi = _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1));
#else
  float f[FVec::size()];
  v.store(f);
  double d[FVec::size()];
  for (int64_t k = 0; k < FVec::size(); ++k) d[k] = f[k];
  lo = DVec::loadu(d);
  hi = DVec::loadu(d + DVec::size());
#endif
}

}  // namespace pycomm::cpu
