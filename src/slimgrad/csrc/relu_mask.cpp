// ReLU / LeakyReLU in the compiled core: one pass writes the output and the 1-bit mask, one pass reads them back.
//
// Stock relu keeps its float output, leaky_relu its float input; backward reads only their sign. The Python
// path (slimgrad.functional.activation._ReLUFunction) ran torch's relu, then a second pass packing the mask
// (20 bytes moved per fp32 element over forward + backward); here forward reads x once and writes the output and
// the packed mask in the same pass, backward reads the gradient and the mask once (16.25 bytes), both parallel
// over mask bytes and vectorised (AVX2) for fp32 and the 16-bit dtypes. The kernels follow the contract of
// slimgrad.kernels.relu_mask to the bit (NaN, -0.0, -inf, the slope's rounding), and are registered there as its
// "core" backend, so the Python Function runs them too. Layouts, the kept tensors, the gradient's strides and
// double backward follow the Python Function step for step (see activation.py).
//
// This file also holds the layout helpers the clamp family (range_mask.cpp) shares: stock's gradient strides
// (a port of slimgrad.functional._layout.binary_strides), memory order, conform, the bit select kernel.
#include "common.h"
#include "simd16.h"
#ifdef SLIMGRAD_CUDA_KERNELS
#include "cuda_kernels.h"
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace slimgrad {
namespace masks {

constexpr int64_t kGrainBytes = 4096;  // 32768 elements: aten's GRAIN_SIZE

using Strides = std::vector<int64_t>;

Strides row_major_strides(at::IntArrayRef shape) {
  Strides s(shape.size());
  int64_t step = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    s[d] = step;
    step *= shape[d];
  }
  return s;
}

namespace {

bool is_contiguous(at::IntArrayRef shape, at::IntArrayRef strides) {
  int64_t expected = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    if (shape[d] != 1) {
      if (strides[d] != expected) return false;
      expected *= shape[d];
    }
  }
  return true;
}

bool is_channels_last(at::IntArrayRef shape, at::IntArrayRef strides) {
  if (shape.size() != 4) return false;
  int64_t expected = 1;
  for (int d : {1, 3, 2, 0}) {
    if (shape[d] != 1) {
      if (strides[d] != expected) return false;
      expected *= shape[d];
    }
  }
  return true;
}

Strides channels_last_strides(at::IntArrayRef shape) {
  const int64_t w = shape[1], h = w * shape[3], n = h * shape[2];
  return {n, 1, h, w};
}

bool is_dense(at::IntArrayRef shape, at::IntArrayRef strides) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  if (nd == 1) return shape[0] < 2 || strides[0] == 1;
  std::vector<int64_t> order(nd);
  for (int64_t d = 0; d < nd; ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return strides[a] != strides[b] ? strides[a] < strides[b] : shape[a] < shape[b];
  });
  int64_t expected = 1;
  for (int64_t d : order) {
    if (shape[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

}  // namespace

// The strides of a new output TensorIterator allocates for a binary element-wise op whose operands, in this
// order, have `shape` and these strides: slimgrad.functional._layout._binary_strides, line for line.
Strides binary_strides(at::IntArrayRef shape, at::IntArrayRef first, at::IntArrayRef second) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  if (nd == 0 || std::any_of(shape.begin(), shape.end(), [](int64_t s) { return s == 0; }))
    return row_major_strides(shape);
  if (is_contiguous(shape, first) && is_contiguous(shape, second)) return row_major_strides(shape);
  if (is_channels_last(shape, first) && is_channels_last(shape, second)) return channels_last_strides(shape);
  if (is_dense(shape, first) && is_dense(shape, second) && first.equals(second)) return first.vec();
  if (nd == 1) return {1};
  std::vector<int64_t> perm(nd);
  for (int64_t i = 0; i < nd; ++i) perm[i] = nd - 1 - i;
  auto should_swap = [&](int64_t d0, int64_t d1) {
    for (at::IntArrayRef s : {first, second}) {
      const int64_t s0 = s[d0], s1 = s[d1];
      if (s0 == 0 || s1 == 0) continue;
      if (s0 < s1) return -1;
      if (s0 > s1) return 1;
      if (shape[d0] > shape[d1]) return 1;
    }
    return 0;
  };
  for (int64_t i = 1; i < nd; ++i) {
    int64_t d1 = i;
    for (int64_t d0 = i - 1; d0 >= 0; --d0) {
      const int c = should_swap(perm[d0], perm[d1]);
      if (c > 0) {
        std::swap(perm[d0], perm[d1]);
        d1 = d0;
      } else if (c < 0) {
        break;
      }
    }
  }
  bool reversed = true;
  for (int64_t i = 0; i < nd; ++i) reversed = reversed && perm[i] == nd - 1 - i;
  if (reversed) return row_major_strides(shape);
  Strides strides(nd);
  int64_t step = 1;
  for (int64_t d : perm) {
    strides[d] = step;
    step *= shape[d];
  }
  return strides;
}

// The strides of empty_like(t) (and t.clone()): _layout.like_strides.
Strides like_strides(const at::Tensor& t) {
  if (t.is_contiguous() || is_dense(t.sizes(), t.strides())) return t.strides().vec();
  return at::empty_like(t, t.options().device(at::kMeta)).strides().vec();
}

// `t` with these strides: itself, a view where only size-1 dimensions' strides differ, else a copy.
at::Tensor conform(const at::Tensor& t, const Strides& strides) {
  const auto ts = t.strides();
  if (ts.equals(strides)) return t;
  bool views = true;
  for (int64_t d = 0; d < t.dim(); ++d) views = views && (t.size(d) == 1 || ts[d] == strides[d]);
  if (views) return t.as_strided(t.sizes(), strides);
  return at::empty_strided(t.sizes(), strides, t.options()).copy_(t);
}

// The permutation that makes `t` contiguous (_memory_order: dimensions by decreasing stride, ties in order);
// empty when t is contiguous; `dense` false when no permutation does.
Strides memory_order(const at::Tensor& t, bool& dense) {
  dense = true;
  if (t.is_contiguous()) return {};
  const int64_t nd = t.dim();
  Strides perm(nd);
  for (int64_t d = 0; d < nd; ++d) perm[d] = d;
  const auto st = t.strides();
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return st[a] > st[b]; });
  if (!t.permute(perm).is_contiguous()) {
    dense = false;
    return {};
  }
  return perm;
}

Strides inverse(const Strides& perm) {
  Strides inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
  return inv;
}

// The bool mask of `shape` from a packed mask (for double backward, through differentiable at:: ops).
at::Tensor unpack(const at::Tensor& packed, at::IntArrayRef shape) {
  int64_t numel = 1;
  for (auto s : shape) numel *= s;
  auto shifts = at::arange(8, packed.options());
  return packed.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(1).to(at::kBool).reshape({-1})
      .narrow(0, 0, numel).view(shape);
}

namespace {

// out[i] = bit i ? g[i] : 0 on the integer view (so +0.0 where the bit is clear, whatever g holds).
template <typename I>
void select_block(const I* g, const uint8_t* m, I* out, int64_t b0, int64_t b1, int64_t n) {
  int64_t b = b0;
  const int64_t full = std::min(b1, n / 8);
#if defined(__AVX2__)
  if constexpr (sizeof(I) == 4) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (; b < full; ++b) {
      const __m256i bm = _mm256_set1_epi32(m[b]);
      const __m256i keep = _mm256_cmpeq_epi32(_mm256_and_si256(bm, sel), sel);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 8 * b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * b), _mm256_and_si256(keep, v));
    }
  } else if constexpr (sizeof(I) == 2) {
    const __m256i sel = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          static_cast<int16_t>(0x8000));
    for (; b + 1 < full; b += 2) {
      const int mm = m[b] | (m[b + 1] << 8);
      const __m256i bm = _mm256_set1_epi16(static_cast<int16_t>(mm));
      const __m256i keep = _mm256_cmpeq_epi16(_mm256_and_si256(bm, sel), sel);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 8 * b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * b), _mm256_and_si256(keep, v));
    }
  }
#endif
  for (; b < b1; ++b) {
    const int byte = m[b];
    const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
    for (int64_t j = 0; j < cnt; ++j) out[base + j] = ((byte >> j) & 1) ? g[base + j] : I(0);
  }
}

template <typename I>
void select_bits(const at::Tensor& grad, const at::Tensor& packed, at::Tensor& out) {
  const int64_t n = grad.numel(), nb = packed.numel();
  const I* g = reinterpret_cast<const I*>(grad.const_data_ptr());
  const uint8_t* m = packed.const_data_ptr<uint8_t>();
  I* o = reinterpret_cast<I*>(out.mutable_data_ptr());
  at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) { select_block<I>(g, m, o, b0, b1, n); });
}

}  // namespace

// `bit ? grad : +0` for a contiguous gradient: a new contiguous tensor (the range_mask contract's select, and
// relu's backward).
at::Tensor select(const at::Tensor& grad, const at::Tensor& packed) {
  auto out = at::empty(grad.sizes(), grad.options());
  switch (grad.element_size()) {
    case 8: select_bits<int64_t>(grad, packed, out); break;
    case 4: select_bits<int32_t>(grad, packed, out); break;
    case 2: select_bits<int16_t>(grad, packed, out); break;
    default: TORCH_CHECK(false, "slimgrad: mask select: unsupported element size");
  }
  return out;
}

}  // namespace masks

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using masks::kGrainBytes;
using masks::Strides;

#if defined(__AVX2__)
using simd::load8f;
using simd::store8f;
#endif

// ---------------------------------------------------------------------------------------------- forward kernels
// Bytes [b0, b1) of the mask and their elements; n elements in all. relu: out = x < 0 ? +0 : x, bit out != 0;
// leaky: out = x > 0 ? x : x * slope (16-bit: in fp32, rounded once), bit x > 0.

template <typename T>
void relu_block(const T* x, T* out, uint8_t* m, int64_t b0, int64_t b1, int64_t n) {
  int64_t b = b0;
  const int64_t full = std::min(b1, n / 8);
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 zero = _mm256_setzero_ps();
    for (; b < full; ++b) {
      const __m256 v = _mm256_loadu_ps(x + 8 * b);
      const __m256 o = _mm256_max_ps(zero, v);  // the second operand where NaN or both zero: x < 0 ? +0 : x
      _mm256_storeu_ps(out + 8 * b, o);
      m[b] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(o, zero, _CMP_NEQ_UQ)));
    }
  }
#endif
  for (; b < b1; ++b) {
    const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
    int byte = 0;
    for (int64_t j = 0; j < cnt; ++j) {
      const T v = x[base + j];
      const T o = v < T(0) ? T(0) : v;
      out[base + j] = o;
      byte |= (o != T(0)) << j;
    }
    m[b] = static_cast<uint8_t>(byte);
  }
}

// 16-bit floats on their integer bits: negative, non-zero, not NaN <=> -32768 < h <= `lowest` (-inf's bits).
template <int16_t lowest>
void relu16_block(const int16_t* x, int16_t* out, uint8_t* m, int64_t b0, int64_t b1, int64_t n) {
  int64_t b = b0;
  const int64_t full = std::min(b1, n / 8);
#if defined(__AVX2__)
  const __m256i min16 = _mm256_set1_epi16(static_cast<int16_t>(-32768));
  const __m256i above = _mm256_set1_epi16(static_cast<int16_t>(lowest + 1));
  const __m256i magnitude = _mm256_set1_epi16(0x7FFF);
  const __m256i zero = _mm256_setzero_si256();
  for (; b + 1 < full; b += 2) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * b));
    const __m256i neg = _mm256_and_si256(_mm256_cmpgt_epi16(h, min16), _mm256_cmpgt_epi16(above, h));
    const __m256i o = _mm256_andnot_si256(neg, h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * b), o);
    const __m256i z = _mm256_cmpeq_epi16(_mm256_and_si256(o, magnitude), zero);
    const __m128i p = _mm_packs_epi16(_mm256_castsi256_si128(z), _mm256_extracti128_si256(z, 1));
    const int bits = ~_mm_movemask_epi8(p);
    m[b] = static_cast<uint8_t>(bits);
    m[b + 1] = static_cast<uint8_t>(bits >> 8);
  }
#endif
  for (; b < b1; ++b) {
    const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
    int byte = 0;
    for (int64_t j = 0; j < cnt; ++j) {
      const int16_t h = x[base + j];
      const int16_t o = (h > -32768 && h <= lowest) ? int16_t(0) : h;
      out[base + j] = o;
      byte |= ((o & 0x7FFF) != 0) << j;
    }
    m[b] = static_cast<uint8_t>(byte);
  }
}

// Returns whether a bf16 NaN was seen (its rounding is position-dependent in stock: see forward_kernel).
template <typename T>
bool leaky_block(const T* x, T* out, uint8_t* m, int64_t b0, int64_t b1, int64_t n, double slope_) {
  int nan = 0;
  int64_t b = b0;
  const int64_t full = std::min(b1, n / 8);
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    const T slope = static_cast<T>(slope_);  // stock: negval.to<scalar_t>()
#if defined(__AVX2__)
    if constexpr (std::is_same_v<T, float>) {
      const __m256 zero = _mm256_setzero_ps(), s = _mm256_set1_ps(slope);
      for (; b < full; ++b) {
        const __m256 v = _mm256_loadu_ps(x + 8 * b);
        const __m256 pos = _mm256_cmp_ps(v, zero, _CMP_GT_OQ);
        _mm256_storeu_ps(out + 8 * b, _mm256_blendv_ps(_mm256_mul_ps(v, s), v, pos));
        m[b] = static_cast<uint8_t>(_mm256_movemask_ps(pos));
      }
    }
#endif
    for (; b < b1; ++b) {
      const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
      int byte = 0;
      for (int64_t j = 0; j < cnt; ++j) {
        const T v = x[base + j];
        const bool pos = v > T(0);
        out[base + j] = pos ? v : v * slope;
        byte |= pos << j;
      }
      m[b] = static_cast<uint8_t>(byte);
    }
  } else {  // bf16 / fp16: stock computes in fp32 with the slope as a float, and rounds once
    const float slope = static_cast<float>(slope_);
#if defined(__AVX2__)
    const __m256 zero = _mm256_setzero_ps(), s = _mm256_set1_ps(slope);
    __m256 nans = zero;  // NaN lanes seen, folded once at the end (not a mask extraction per step)
    for (; b + 1 < full; b += 2) {  // 16 elements: one pack and one store for the output (as aten's 16 lanes)
      const __m256 v0 = load8f(x + 8 * b), v1 = load8f(x + 8 * b + 8);
      const __m256 p0 = _mm256_cmp_ps(v0, zero, _CMP_GT_OQ), p1 = _mm256_cmp_ps(v1, zero, _CMP_GT_OQ);
      simd::store16f(out + 8 * b, _mm256_blendv_ps(_mm256_mul_ps(v0, s), v0, p0),
                     _mm256_blendv_ps(_mm256_mul_ps(v1, s), v1, p1));
      m[b] = static_cast<uint8_t>(_mm256_movemask_ps(p0));
      m[b + 1] = static_cast<uint8_t>(_mm256_movemask_ps(p1));
      nans = _mm256_or_ps(nans, _mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)));
    }
    for (; b < full; ++b) {
      const __m256 v = load8f(x + 8 * b);
      const __m256 pos = _mm256_cmp_ps(v, zero, _CMP_GT_OQ);
      store8f(out + 8 * b, _mm256_blendv_ps(_mm256_mul_ps(v, s), v, pos));
      m[b] = static_cast<uint8_t>(_mm256_movemask_ps(pos));
      nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan |= _mm256_movemask_ps(nans);
#endif
    for (; b < b1; ++b) {
      const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
      int byte = 0;
      for (int64_t j = 0; j < cnt; ++j) {
        const T v = x[base + j];
        const float f = static_cast<float>(v);
        const bool pos = f > 0.0f;
        out[base + j] = pos ? v : static_cast<T>(f * slope);
        byte |= pos << j;
        nan |= std::isnan(f);
      }
      m[b] = static_cast<uint8_t>(byte);
    }
  }
  return nan != 0 && std::is_same_v<T, at::BFloat16>;
}

// ---------------------------------------------------------------------------------------------- backward kernel
// leaky: bit ? g : g * slope (16-bit: in fp32, rounded once). relu's backward is masks::select.
template <typename T>
bool leaky_bwd_block(const T* g, const uint8_t* m, T* out, int64_t b0, int64_t b1, int64_t n, double slope_) {
  int nan = 0;
  int64_t b = b0;
  const int64_t full = std::min(b1, n / 8);
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    const T slope = static_cast<T>(slope_);
#if defined(__AVX2__)
    if constexpr (std::is_same_v<T, float>) {
      const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      const __m256 s = _mm256_set1_ps(slope);
      for (; b < full; ++b) {
        const __m256i bm = _mm256_set1_epi32(m[b]);
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bm, sel), sel));
        const __m256 v = _mm256_loadu_ps(g + 8 * b);
        _mm256_storeu_ps(out + 8 * b, _mm256_blendv_ps(_mm256_mul_ps(v, s), v, keep));
      }
    }
#endif
    for (; b < b1; ++b) {
      const int byte = m[b];
      const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
      for (int64_t j = 0; j < cnt; ++j) {
        const T v = g[base + j];
        out[base + j] = ((byte >> j) & 1) ? v : v * slope;
      }
    }
  } else {
    const float slope = static_cast<float>(slope_);
#if defined(__AVX2__)
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 s = _mm256_set1_ps(slope);
    for (; b < full; ++b) {
      const __m256i bm = _mm256_set1_epi32(m[b]);
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bm, sel), sel));
      const __m256 v = load8f(g + 8 * b);
      store8f(out + 8 * b, _mm256_blendv_ps(_mm256_mul_ps(v, s), v, keep));
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
#endif
    for (; b < b1; ++b) {
      const int byte = m[b];
      const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
      for (int64_t j = 0; j < cnt; ++j) {
        const T v = g[base + j];
        const float f = static_cast<float>(v);
        out[base + j] = ((byte >> j) & 1) ? v : static_cast<T>(f * slope);
        nan |= std::isnan(f);
      }
    }
  }
  return nan != 0 && std::is_same_v<T, at::BFloat16>;
}

// --------------------------------------------------------------------------------------------- the aten route
// CUDA tensors (the core is built without a CUDA compiler) run the same contract as a few aten kernels launched
// from C++: stock's own relu / leaky_relu for the output, a compare for the bits, a multiply and a byte sum packing
// them (bit j of byte b is element 8b + j, as the CPU kernels and unpack lay it out); backward isolates each bit
// with an and, then runs stock's threshold_backward / leaky_relu_backward on it (aten_backward).
// About twice the bytes stock's relu moves, in four small launches, but no Python Function and no Python Triton
// launch: for the small tensors of host-bound CUDA steps (slimgrad.functional.activation sends larger ones to the
// Triton kernels). `relu_mask_force_aten` runs it on CPU tensors too, so CPU tests check it against the kernels.
// Where the core is built with nvcc (cuda_kernels.h), CUDA tensors run one kernel each way instead (cuda_route).
bool g_force_aten = false;

bool aten_route(const at::Tensor& t) { return !t.is_cpu() || g_force_aten; }

// Whether t runs the core's own CUDA kernels (relu_mask_cuda.cu): compiled in, and t on CUDA.
bool cuda_route(const at::Tensor& t) {
#ifdef SLIMGRAD_CUDA_KERNELS
  return t.is_cuda();
#else
  (void)t;
  return false;
#endif
}

// 1, 2, 4, ..., 128 as bytes on t's device, made once per device (never freed: a CUDA tensor must not outlive
// its context in a static destructor at exit)
at::Tensor bit_values(const at::Tensor& t) {
  static std::mutex lock;
  static auto* cache = new std::vector<std::pair<at::Device, at::Tensor>>();
  std::lock_guard<std::mutex> guard(lock);
  for (const auto& [device, values] : *cache)
    if (device == t.device()) return values;
  at::NoGradGuard no_grad;
  cache->emplace_back(t.device(), at::bitwise_left_shift(at::ones({8}, t.options().dtype(at::kByte)),
                                                         at::arange(8, t.options().dtype(at::kByte))));
  return cache->back().second;
}

// The packed bits of a 0/1 byte tensor of 8 * packed.numel() elements (weighted by their bit values in place,
// then summed by eights), written into packed.
void pack_bytes_into(at::Tensor& bits, at::Tensor& packed) {
  at::Tensor eights = bits.view({packed.numel(), 8});
  eights.mul_(bit_values(bits));
  at::sum_out(packed, eights, {1}, false, at::kByte);
}

// x contiguous; out is x (in place) or undefined (made here); packed preallocated.
at::Tensor aten_forward(const at::Tensor& x, bool inplace, at::Tensor& packed, std::optional<double> slope) {
  const int64_t n = x.numel(), nb = packed.numel();
  at::Tensor bits = at::empty({nb * 8}, x.options().dtype(at::kByte));
  if (nb * 8 != n) bits.narrow(0, n, nb * 8 - n).zero_();
  at::Tensor head = bits.narrow(0, 0, n).view(x.sizes());
  at::Tensor out;
  if (!slope) {
    // bit out != 0: NaN keeps its gradient, +-0 does not (stock's threshold_backward reads out <= 0)
    out = inplace ? at::relu_(const_cast<at::Tensor&>(x)) : at::relu(x);
    at::ne_out(head, out, 0);
  } else {
    at::gt_out(head, x, 0);  // read before an in-place op overwrites x
    out = inplace ? at::leaky_relu_(const_cast<at::Tensor&>(x), *slope) : at::leaky_relu(x, *slope);
  }
  pack_bytes_into(bits, packed);
  return out;
}

// Each element's bit, left in place in its byte (0, or a power of two): stock's own backward kernels read it where
// they would read the output (relu: `bits <= 0 ? +0 : grad`) or the input (leaky: `bits > 0 ? grad : grad * slope`),
// in grad's dtype, with no scalar scratch tensor.
at::Tensor aten_backward(const at::Tensor& grad, const at::Tensor& packed, std::optional<double> slope) {
  at::Tensor bits = at::bitwise_and(packed.unsqueeze(-1), bit_values(packed)).view({-1})
                        .narrow(0, 0, grad.numel()).view(grad.sizes());
  if (!slope) return at::threshold_backward(grad, bits, 0);
  return at::leaky_relu_backward(grad, bits, *slope, false);
}

// The contract's forward on contiguous tensors: out (may be x itself) and the packed mask, one pass.
void forward_kernel(const at::Tensor& x, at::Tensor& out, at::Tensor& packed, std::optional<double> slope) {
  const int64_t n = x.numel(), nb = packed.numel();
  uint8_t* m = packed.mutable_data_ptr<uint8_t>();
  const auto dtype = x.scalar_type();
  if (!slope) {
    if (dtype == at::kBFloat16 || dtype == at::kHalf) {
      const int16_t* xp = reinterpret_cast<const int16_t*>(x.const_data_ptr());
      int16_t* op = reinterpret_cast<int16_t*>(out.mutable_data_ptr());
      if (dtype == at::kBFloat16) {
        at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) {
          relu16_block<static_cast<int16_t>(-128)>(xp, op, m, b0, b1, n);  // -inf: 0xFF80
        });
      } else {
        at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) {
          relu16_block<static_cast<int16_t>(-1024)>(xp, op, m, b0, b1, n);  // -inf: 0xFC00
        });
      }
      return;
    }
    AT_DISPATCH_FLOATING_TYPES(dtype, "relu_mask_forward", [&] {
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      scalar_t* op = out.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) { relu_block(xp, op, m, b0, b1, n); });
    });
    return;
  }
  const double s = *slope;
  std::atomic<int> nan{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "leaky_relu_mask_forward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) {
      if (leaky_block(xp, op, m, b0, b1, n, s)) nan.fetch_or(1, std::memory_order_relaxed);
    });
  });
  if (nan.load()) {
    // bf16 NaN: stock's vectorised body rounds it to 0xFFFF, its scalar tail to 0x7FC0, so which one an element
    // gets depends on its position; stock's own op, for these rare calls, gives its bits.
    if (out.is_same(x)) {
      at::Tensor xm = x;
      xm.copy_(at::where(at::isnan(x), at::leaky_relu(x, s), x));  // NaN stays NaN whatever its payload
    } else {
      out.copy_(at::leaky_relu(x, s));
    }
  }
}

at::Tensor backward_kernel(const at::Tensor& grad, const at::Tensor& packed, std::optional<double> slope) {
  if (!slope) return masks::select(grad, packed);
  auto out = at::empty(grad.sizes(), grad.options());
  const int64_t n = grad.numel(), nb = packed.numel();
  const uint8_t* m = packed.const_data_ptr<uint8_t>();
  const double s = *slope;
  std::atomic<int> nan{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "leaky_relu_mask_backward", [&] {
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) {
      if (leaky_bwd_block(gp, m, op, b0, b1, n, s)) nan.fetch_or(1, std::memory_order_relaxed);
    });
  });
  if (nan.load()) {  // bf16 NaN gradients: stock's position-dependent rounding, from its own kernel on the mask
    return at::leaky_relu_backward(grad, masks::unpack(packed, grad.sizes()).view(at::kByte), s, false);
  }
  return out;
}

// The contract's forward on a contiguous xc, by the CPU kernels or the aten route: the output (xc itself in place),
// the mask written into packed.
at::Tensor forward_contiguous(const at::Tensor& xc, bool inplace, at::Tensor& packed, std::optional<double> slope) {
  if (cuda_route(xc)) {  // the mask, then the output: the allocations of the CPU kernels (CORE_SIMULATION)
    at::Tensor oc = inplace ? xc : at::empty(xc.sizes(), xc.options());
#ifdef SLIMGRAD_CUDA_KERNELS
    cuda_kernels::relu_mask_forward(xc, oc, packed, slope);
#endif
    return oc;
  }
  if (aten_route(xc)) return aten_forward(xc, inplace, packed, slope);
  at::Tensor oc = inplace ? xc : at::empty(xc.sizes(), xc.options());
  forward_kernel(xc, oc, packed, slope);
  return oc;
}

at::Tensor new_packed(const at::Tensor& x) {
  return at::empty({(x.numel() + 7) / 8}, x.options().dtype(at::kByte));
}

// --------------------------------------------------------------------------------------------------- Function
// _ReLUFunction's mask and output modes (the refused in-place negative-slope case stays in Python).
struct ReluMaskFunction : public torch::autograd::Function<ReluMaskFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::optional<double> slope, bool inplace,
                            bool keep_output, Strides perm, bool dense) {
    const bool relu = !slope.has_value();
    const bool output_mode = keep_output && (relu || *slope >= 0);
    ctx->saved_data["slope"] = relu ? std::nan("") : *slope;
    ctx->saved_data["flags"] = static_cast<int64_t>(relu) | (static_cast<int64_t>(inplace) << 1) |
                               (static_cast<int64_t>(output_mode) << 2);
    ctx->saved_data["xs"] = x.strides().vec();
    at::Tensor out;
    if (output_mode) {
      if (inplace)
        out = relu ? at::relu_(const_cast<at::Tensor&>(x)) : at::leaky_relu_(const_cast<at::Tensor&>(x), *slope);
      else
        out = relu ? at::relu(x) : at::leaky_relu(x, *slope);
      ctx->save_for_backward({out});
    } else {
      ctx->saved_data["perm"] = perm;
      at::Tensor packed = new_packed(x);
      if (dense) {
        at::Tensor xc = perm.empty() ? x : x.permute(perm);
        at::Tensor oc = forward_contiguous(xc, inplace, packed, slope);
        out = inplace ? x : (perm.empty() ? oc : not_a_view(oc.permute(masks::inverse(perm))));
      } else {  // a slice: the kernels take contiguous tensors
        at::Tensor xc = x.contiguous();
        at::Tensor oc = forward_contiguous(xc, inplace, packed, slope);
        if (inplace) const_cast<at::Tensor&>(x).copy_(oc);
        out = inplace ? x : oc;
      }
      ctx->save_for_backward({packed});
    }
    if (inplace) {
      ctx->mark_dirty({x});
      return x;
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    const at::Tensor& grad = grads[0];
    const int64_t flags = ctx->saved_data["flags"].toInt();
    const bool relu = flags & 1, inplace = flags & 2, output_mode = flags & 4;
    const std::optional<double> slope =
        relu ? std::nullopt : std::optional<double>(ctx->saved_data["slope"].toDouble());
    const at::Tensor saved = ctx->get_saved_variables()[0];
    at::Tensor gi;
    if (output_mode) {
      gi = relu ? at::threshold_backward(grad, saved, 0) : at::leaky_relu_backward(grad, saved, *slope, true);
    } else {
      const Strides perm = ctx->saved_data["perm"].toIntVector();
      at::Tensor g = perm.empty() ? grad : grad.permute(perm);
      if (grad.requires_grad()) {  // double backward: stay differentiable in grad, as the Python path
        at::Tensor mask = masks::unpack(saved, g.sizes());
        gi = relu ? at::where(mask, g, at::Scalar(0)) : at::where(mask, g, g * *slope);
      } else if (cuda_route(g)) {
#ifdef SLIMGRAD_CUDA_KERNELS
        gi = cuda_kernels::relu_mask_backward(g.contiguous(), saved, slope);
#endif
      } else if (aten_route(g)) {
        gi = aten_backward(g.contiguous(), saved, slope);
      } else {
        gi = backward_kernel(g.contiguous(), saved, slope);
      }
      if (!perm.empty()) gi = gi.permute(masks::inverse(perm));
    }
    // Stock's threshold_backward(grad, result) / leaky_relu_backward(grad, x): the result's or x's layout leads.
    const Strides xs = ctx->saved_data["xs"].toIntVector();
    const auto shape = grad.sizes();
    const Strides operand = (relu && !inplace) ? masks::binary_strides(shape, xs, xs) : xs;
    gi = masks::conform(gi, masks::binary_strides(shape, operand, grad.strides()));
    return {gi, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

bool supported_dtype(const at::Tensor& x) {
  const auto t = x.scalar_type();
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

// The core's call for slimgrad.functional.activation: the Function's result, or None where the Python Function
// must run (an unsupported dtype, the in-place negative-slope refusal).
std::optional<at::Tensor> relu_mask_apply(const at::Tensor& x, std::optional<double> slope, bool inplace,
                                          bool keep_output) {
  if (!supported_dtype(x) || (inplace && slope && *slope < 0)) return std::nullopt;
  bool dense = true;
  Strides perm = masks::memory_order(x, dense);
  return ReluMaskFunction::apply(x, slope, inplace, keep_output, std::move(perm), dense);
}

// The kernel family's contract (slimgrad.kernels.relu_mask) on contiguous tensors.
std::tuple<at::Tensor, at::Tensor> relu_mask_forward(const at::Tensor& x, std::optional<double> slope,
                                                     bool inplace) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && supported_dtype(x), "relu_mask_forward: contiguous "
              "CPU floating tensor expected");
  at::Tensor packed = new_packed(x);
  at::Tensor out = inplace ? x : at::empty(x.sizes(), x.options());
  {
    at::NoGradGuard guard;
    forward_kernel(x, out, packed, slope);
  }
  return {out, packed};
}

at::Tensor relu_mask_backward(const at::Tensor& grad, const at::Tensor& packed, std::optional<double> slope) {
  TORCH_CHECK(grad.is_contiguous() && grad.device().is_cpu() && supported_dtype(grad), "relu_mask_backward: "
              "contiguous CPU floating tensor expected");
  return backward_kernel(grad, packed, slope);
}

}  // namespace

static Register reg_relu_mask([](pybind11::module_& m) {
  m.def("relu_mask_apply", &relu_mask_apply);
  m.def("relu_mask_force_aten", [](bool flag) {
    const bool old = g_force_aten;
    g_force_aten = flag;
    return old;
  }, "tests: run the aten route (CUDA's) on CPU tensors too; returns the previous setting");
  m.def("relu_mask_forward", &relu_mask_forward);
  m.def("relu_mask_backward", &relu_mask_backward);
});

}  // namespace slimgrad
