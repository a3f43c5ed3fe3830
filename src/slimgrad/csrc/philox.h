// The "seed" dropout policy's mask as a pure function of (seed, element index, p): Philox4x32-10, the stream
// Triton's `tl.rand(seed, offsets)` draws (triton/language/random.py), so the core's kernels, the Triton kernels
// and the torch reference (slimgrad.kernels.dropout.philox_keep) keep the same elements, bit for bit, on any device.
//
// Counter (index mod 2**32, index >> 32, 0, 0), key (seed mod 2**32, seed >> 32) with the int64 seed read as
// unsigned; ten rounds; the first output word x, read as int32, folded to x < 0 ? ~x : x, times 4.6566127342e-10f
// (in float) is the uniform draw u; an element is kept where u >= p (p rounded to float), with probability 1 - p.
// Triton's kernels index with int32 offsets, whose high counter word is 0: the same as here below 2**31 elements.
//
// Written once for host and device: the CPU kernels (dropout_seed.cpp) include it now; a CUDA kernel compiled by
// nvcc includes the same function, so what the CPU tests check is what the GPU runs.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SLIMGRAD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SLIMGRAD_HOST_DEVICE inline
#endif

namespace slimgrad::philox {

constexpr uint32_t kRoundA = 0xD2511F53u;
constexpr uint32_t kRoundB = 0xCD9E8D57u;
constexpr uint32_t kKeyA = 0x9E3779B9u;
constexpr uint32_t kKeyB = 0xBB67AE85u;
constexpr float kUniformScale = 4.6566127342e-10f;  // the largest s with (2**31 - 1) * s < 1 in float

SLIMGRAD_HOST_DEVICE uint32_t mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// The first word of Philox4x32-10 for counter (c0, c1, 0, 0) and key (k0, k1): triton's randint.
SLIMGRAD_HOST_DEVICE uint32_t first_word(uint32_t c0, uint32_t c1, uint32_t k0, uint32_t k1) {
  uint32_t c2 = 0, c3 = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint32_t a0 = c0, a2 = c2;
    c0 = mulhi(kRoundB, a2) ^ c1 ^ k0;
    c2 = mulhi(kRoundA, a0) ^ c3 ^ k1;
    c1 = kRoundB * a2;
    c3 = kRoundA * a0;
    k0 += kKeyA;
    k1 += kKeyB;
  }
  return c0;
}

// triton's uint_to_uniform_float for a 32-bit word.
SLIMGRAD_HOST_DEVICE float uniform(uint32_t word) {
  int32_t x = static_cast<int32_t>(word);
  x = x < 0 ? ~x : x;
  return static_cast<float>(x) * kUniformScale;
}

// Whether element `index` is kept for `seed` (the int64 seed tensor's value) at probability p (as a float).
SLIMGRAD_HOST_DEVICE bool keep(int64_t seed, int64_t index, float p) {
  const auto s = static_cast<uint64_t>(seed);
  const auto i = static_cast<uint64_t>(index);
  return uniform(first_word(static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), static_cast<uint32_t>(s),
                            static_cast<uint32_t>(s >> 32))) >= p;
}

}  // namespace slimgrad::philox
