// AVX2 conversions between eight 16-bit floats and eight fp32 lanes, shared by the element-wise families.
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>

namespace slimgrad {
namespace simd {

// Eight 16-bit floats <-> eight fp32 lanes: widening is exact; narrowing rounds to nearest even as c10's vectorised
// conversions do (bf16: NaN -> 0xFFFF, as aten's cvtfp32_bf16; fp16: the F16C instruction aten uses).
template <typename T>
inline __m256 load8f(const T* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<T, at::BFloat16>)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else
    return _mm256_cvtph_ps(h);
}

template <typename T>
inline void store8f(T* p, __m256 v) {
  __m128i h;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i t = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
    t = _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), t, ordered);
    t = _mm256_permute4x64_epi64(_mm256_packus_epi32(t, t), 0x08);
    h = _mm256_castsi256_si128(t);
  } else {
    h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

// bf16 rounding of eight fp32 lanes, each in the low half of a 32-bit lane (store8f's steps before the pack).
inline __m256i round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i t = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), t, ordered);
}

// Sixteen 16-bit floats from two fp32 vectors (lo: the first eight): the same bits as two store8f calls, with one
// pack and one 32-byte store (aten's conversion of a 16-lane vector does the same).
template <typename T>
inline void store16f(T* p, __m256 lo, __m256 hi) {
  __m256i h;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    h = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(lo), round_bf16(hi)), 0xD8);
  } else {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    h = _mm256_set_m128i(_mm256_cvtps_ph(hi, mode), _mm256_cvtps_ph(lo, mode));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}

}  // namespace simd
}  // namespace slimgrad
#endif
