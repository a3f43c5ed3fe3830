// ReLU6 / Hardtanh / Threshold / Hardsigmoid in the compiled core: a 1-bit pass mask instead of stock's float
// tensor, made in one parallel pass over x and read in one pass over the gradient.
//
// slimgrad.functional.clamp.RangeMaskFunction, step for step, as one C++ autograd Function: the mask of the
// pass region ("inside": lo < x < hi, NaN clear; "above": not x <= lo, NaN set) is packed in x's memory order by
// a vectorised kernel (the contract of slimgrad.kernels.range_mask, registered there as its "core" backend).
// The output is made in the same pass where that gives stock's bits: fp32 hardtanh/relu6 and hardsigmoid (stock's
// own op then finishes the rare elements, NaN or a zero of the other sign than a zero bound, whose bits its
// vectorised and scalar paths disagree on) and fp32/fp64 threshold; elsewhere it is stock's op. Backward is
// `bit ? grad : +0` in one pass (hardsigmoid: times stock's fp32 factor 1/6 in the same pass). The kept tensors,
// the output-kept mode, the gradient's strides and double backward are the Python Function's. Layout helpers are
// shared with relu_mask.cpp (namespace slimgrad::masks), so this file is built together with it.
#include "common.h"
#include "simd16.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "layout.h"

namespace slimgrad {
namespace masks {  // defined in relu_mask.cpp
at::Tensor unpack(const at::Tensor& packed, at::IntArrayRef shape);
at::Tensor select(const at::Tensor& grad, const at::Tensor& packed);
}  // namespace masks

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using masks::Strides;

constexpr int64_t kGrainBytes = 4096;  // 32768 elements: aten's GRAIN_SIZE
enum Kind : int64_t { kHardtanh = 0, kThreshold = 1, kHardsigmoid = 2 };

// ------------------------------------------------------------------------------------------------ pack kernel
// Bit of element i: inside: lo < x < hi; above: !(x <= lo). C: the comparison type (double for fp64, else fp32).
template <typename T, bool Above>
void pack_block(const T* x, uint8_t* m, int64_t b0, int64_t b1, int64_t n, double lo_, double hi_) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const C lo = static_cast<C>(lo_), hi = static_cast<C>(hi_);
  int64_t b = b0;
  const int64_t full = std::min(b1, n / 8);
#if defined(__AVX2__)
  if constexpr (!std::is_same_v<T, double>) {
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    for (; b < full; ++b) {
      __m256 v;
      if constexpr (std::is_same_v<T, float>) {
        v = _mm256_loadu_ps(x + 8 * b);
      } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * b));
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
          v = _mm256_cvtph_ps(h);  // exact
        }
      }
      __m256 bit;
      if constexpr (Above) {
        bit = _mm256_cmp_ps(v, vlo, _CMP_NLE_UQ);
      } else {
        bit = _mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GT_OQ), _mm256_cmp_ps(v, vhi, _CMP_LT_OQ));
      }
      m[b] = static_cast<uint8_t>(_mm256_movemask_ps(bit));
    }
  }
#endif
  for (; b < b1; ++b) {
    const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
    int byte = 0;
    for (int64_t j = 0; j < cnt; ++j) {
      const C v = static_cast<C>(x[base + j]);
      const bool bit = Above ? !(v <= lo) : (v > lo && v < hi);
      byte |= bit << j;
    }
    m[b] = static_cast<uint8_t>(byte);
  }
}

// hardtanh / relu6 on fp32 in one pass: out = min(max(x, lo), hi) and the "inside" bit (lo < x < hi). Elements
// stock's clamp may treat differently on its vectorised and scalar paths (NaN; a zero of the other sign than a
// zero bound, where max/min may return either operand) are copied unchanged, and the caller lets stock's own
// hardtanh_ finish the output when any was seen (it leaves the clamped elements as they are, bit for bit).
// zmode: 0 no zero bound; 1 special where x's bits are `zbits`; 2 special where x == 0.
bool hardtanh_fp32(const float* x, float* out, uint8_t* m, int64_t nb, int64_t n, float lo, float hi, int zmode,
                   int32_t zbits) {
  std::atomic<int> any{0};
  at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) {
    int seen = 0;
    int64_t b = b0;
    const int64_t full = std::min(b1, n / 8);
#if defined(__AVX2__)
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), zero = _mm256_setzero_ps();
    const __m256i vz = _mm256_set1_epi32(zbits);
    __m256 seen_v = zero;  // special lanes seen, folded once at the end
    for (; b < full; ++b) {
      const __m256 v = _mm256_loadu_ps(x + 8 * b);
      const __m256 inside = _mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GT_OQ), _mm256_cmp_ps(v, vhi, _CMP_LT_OQ));
      m[b] = static_cast<uint8_t>(_mm256_movemask_ps(inside));
      __m256 sp = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
      if (zmode == 1) sp = _mm256_or_ps(sp, _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_castps_si256(v), vz)));
      if (zmode == 2) sp = _mm256_or_ps(sp, _mm256_cmp_ps(v, zero, _CMP_EQ_OQ));
      const __m256 o = _mm256_min_ps(_mm256_max_ps(v, vlo), vhi);
      _mm256_storeu_ps(out + 8 * b, _mm256_blendv_ps(o, v, sp));
      seen_v = _mm256_or_ps(seen_v, sp);
    }
    seen |= _mm256_movemask_ps(seen_v);
#endif
    for (; b < b1; ++b) {
      const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
      int byte = 0;
      for (int64_t j = 0; j < cnt; ++j) {
        const float v = x[base + j];
        int32_t vb;
        std::memcpy(&vb, &v, 4);
        const bool special = std::isnan(v) || (zmode == 1 && vb == zbits) || (zmode == 2 && v == 0.0f);
        seen |= special;
        byte |= (v > lo && v < hi) << j;
        out[base + j] = special ? v : std::min(std::max(v, lo), hi);
      }
      m[b] = static_cast<uint8_t>(byte);
    }
    if (seen) any.fetch_or(1, std::memory_order_relaxed);
  });
  return any.load() != 0;
}

#if defined(__AVX2__)
using simd::load8f;
using simd::store8f;
#endif

// hardsigmoid in one pass: out = min(max(x + 3, 0), 6) / 6 (fp32 for fp32 and the 16-bit dtypes, rounded once;
// fp64 in fp64: stock's formula, checked bitwise) and the bit -3 < x < 3. NaN inputs are copied unchanged and
// reported: stock's NaN bits differ between its vectorised and scalar paths, so its own op finishes them.
template <typename T>
bool hardsigmoid_fwd(const T* x, T* out, uint8_t* m, int64_t nb, int64_t n) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  std::atomic<int> any{0};
  at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) {
    int nan = 0;
    int64_t b = b0;
    const int64_t full = std::min(b1, n / 8);
#if defined(__AVX2__)
    if constexpr (!std::is_same_v<T, double>) {
      const __m256 three = _mm256_set1_ps(3.0f), zero = _mm256_setzero_ps(), six = _mm256_set1_ps(6.0f),
                   sign = _mm256_set1_ps(-0.0f);
      __m256 nans = zero;  // NaN lanes seen, folded once at the end
      // out and the bit -3 < x < 3 (as |x| < 3: the same for every value, NaN included) for 8 lanes
      auto eight = [&](__m256 v, int64_t j) {
        m[j] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v), three, _CMP_LT_OQ)));
        const __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
        nans = _mm256_or_ps(nans, isnan);
        const __m256 o = _mm256_div_ps(_mm256_min_ps(_mm256_max_ps(_mm256_add_ps(v, three), zero), six), six);
        return _mm256_blendv_ps(o, v, isnan);
      };
      if constexpr (!std::is_same_v<T, float>) {
        for (; b + 1 < full; b += 2) {  // 16 elements: one pack and one store for the output
          const __m256 o0 = eight(load8f(x + 8 * b), b);
          const __m256 o1 = eight(load8f(x + 8 * b + 8), b + 1);
          simd::store16f(out + 8 * b, o0, o1);
        }
      }
      for (; b < full; ++b) {
        if constexpr (std::is_same_v<T, float>) {
          _mm256_storeu_ps(out + 8 * b, eight(_mm256_loadu_ps(x + 8 * b), b));
        } else {
          store8f(out + 8 * b, eight(load8f(x + 8 * b), b));
        }
      }
      nan |= _mm256_movemask_ps(nans);
    }
#endif
    for (; b < b1; ++b) {
      const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
      int byte = 0;
      for (int64_t j = 0; j < cnt; ++j) {
        const C v = static_cast<C>(x[base + j]);
        byte |= (v > C(-3) && v < C(3)) << j;
        const bool isnan = std::isnan(v);
        nan |= isnan;
        out[base + j] = isnan ? x[base + j] : static_cast<T>(std::min(std::max(v + C(3), C(0)), C(6)) / C(6));
      }
      m[b] = static_cast<uint8_t>(byte);
    }
    if (nan) any.fetch_or(1, std::memory_order_relaxed);
  });
  return any.load() != 0;
}

// hardsigmoid's backward in one pass: bit ? grad * (1/6 as fp32) : +0 (stock's hardsigmoid_backward, fp32 math
// for the 16-bit dtypes). Returns whether a 16-bit NaN gradient was seen (position-dependent rounding in stock: the
// caller then runs the Python path's two steps).
template <typename T>
bool hardsigmoid_bwd(const T* g, const uint8_t* m, T* out, int64_t nb, int64_t n) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const C sixth = static_cast<C>(1.0f / 6.0f);
  std::atomic<int> any{0};
  at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) {
    int nan = 0;
    int64_t b = b0;
    const int64_t full = std::min(b1, n / 8);
#if defined(__AVX2__)
    if constexpr (!std::is_same_v<T, double>) {
      const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      const __m256 vs = _mm256_set1_ps(sixth);
      for (; b < full; ++b) {
        const __m256i bm = _mm256_set1_epi32(m[b]);
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bm, sel), sel));
        __m256 v;
        if constexpr (std::is_same_v<T, float>) v = _mm256_loadu_ps(g + 8 * b); else v = load8f(g + 8 * b);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 o = _mm256_and_ps(keep, _mm256_mul_ps(v, vs));
        if constexpr (std::is_same_v<T, float>) _mm256_storeu_ps(out + 8 * b, o); else store8f(out + 8 * b, o);
      }
    }
#endif
    for (; b < b1; ++b) {
      const int byte = m[b];
      const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
      for (int64_t j = 0; j < cnt; ++j) {
        const C v = static_cast<C>(g[base + j]);
        nan |= std::isnan(v);
        out[base + j] = ((byte >> j) & 1) ? static_cast<T>(v * sixth) : static_cast<T>(C(0));
      }
    }
    if (nan) any.fetch_or(1, std::memory_order_relaxed);
  });
  return any.load() != 0 && sizeof(T) == 2;
}

// threshold on fp32/fp64 in one pass: the bit is !(x <= th) (th in x's dtype, as stock compares), and the output
// is x where the bit is set, else `value` in x's dtype: stock's `x <= th ? value : x`, bit for bit (NaN and signed
// zeros are never rewritten, on either of stock's paths).
template <typename T>
void threshold_fwd(const T* x, T* out, uint8_t* m, int64_t nb, int64_t n, T th, T value) {
  at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
    const int64_t full = std::min(b1, n / 8);
#if defined(__AVX2__)
    if constexpr (std::is_same_v<T, float>) {
      const __m256 vth = _mm256_set1_ps(th), vval = _mm256_set1_ps(value);
      for (; b < full; ++b) {
        const __m256 v = _mm256_loadu_ps(x + 8 * b);
        const __m256 bit = _mm256_cmp_ps(v, vth, _CMP_NLE_UQ);
        m[b] = static_cast<uint8_t>(_mm256_movemask_ps(bit));
        _mm256_storeu_ps(out + 8 * b, _mm256_blendv_ps(vval, v, bit));
      }
    }
#endif
    for (; b < b1; ++b) {
      const int64_t base = 8 * b, cnt = std::min<int64_t>(8, n - base);
      int byte = 0;
      for (int64_t j = 0; j < cnt; ++j) {
        const T v = x[base + j];
        const bool bit = !(v <= th);
        byte |= bit << j;
        out[base + j] = bit ? v : value;
      }
      m[b] = static_cast<uint8_t>(byte);
    }
  });
}

bool supported_dtype(const at::Tensor& x) {
  const auto t = x.scalar_type();
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

// The contract's pack on a contiguous x (bounds already as stock's backward compares them).
at::Tensor pack(const at::Tensor& x, bool above, double lo, double hi) {
  auto packed = at::empty({(x.numel() + 7) / 8}, x.options().dtype(at::kByte));
  const int64_t n = x.numel(), nb = packed.numel();
  uint8_t* m = packed.mutable_data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "range_mask_pack", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, nb, kGrainBytes, [&](int64_t b0, int64_t b1) {
      if (above)
        pack_block<scalar_t, true>(xp, m, b0, b1, n, lo, hi);
      else
        pack_block<scalar_t, false>(xp, m, b0, b1, n, lo, hi);
    });
  });
  return packed;
}

// The bounds as stock's backward compares them (clamp._bounds): in x's dtype for fp32/fp64, in fp32 for halves.
double round_bound(double v, at::ScalarType dtype) {
  return dtype == at::kDouble ? v : static_cast<double>(static_cast<float>(v));
}

at::Tensor stock_op(const at::Tensor& x, int64_t kind, double lo, double hi, double value, bool inplace) {
  at::Tensor& xm = const_cast<at::Tensor&>(x);
  if (kind == kHardtanh) return inplace ? at::hardtanh_(xm, lo, hi) : at::hardtanh(x, lo, hi);
  if (kind == kThreshold) return inplace ? at::threshold_(xm, lo, value) : at::threshold(x, lo, value);
  return inplace ? at::hardsigmoid_(xm) : at::hardsigmoid(x);
}

// hardsigmoid's backward in one pass over the gradient in the mask's memory order; false (nothing done) where a
// 16-bit NaN gradient needs stock's own kernel first.
bool hardsigmoid_one_pass(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& packed, at::Tensor& dx) {
  const Strides perm = ctx->saved_data["perm"].toIntVector();
  const at::Tensor g = (perm.empty() ? grad : grad.permute(perm)).contiguous();
  at::Tensor out = at::empty(g.sizes(), g.options());
  bool nan = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "hardsigmoid_mask_backward", [&] {
    nan = hardsigmoid_bwd(g.const_data_ptr<scalar_t>(), packed.const_data_ptr<uint8_t>(),
                          out.mutable_data_ptr<scalar_t>(), packed.numel(), g.numel());
  });
  if (nan) return false;
  dx = perm.empty() ? out : out.permute(masks::inverse(perm));
  return true;
}

// ------------------------------------------------------------------------------------------------- Function
struct RangeMaskFunction : public torch::autograd::Function<RangeMaskFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t kind, double lo, double hi,
                            double value, bool inplace, bool keep_output, Strides perm, bool dense) {
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["lo"] = lo;
    ctx->saved_data["hi"] = hi;
    ctx->saved_data["keep"] = keep_output;
    ctx->saved_data["xs"] = (inplace && kind != kHardtanh) ? masks::like_strides(x) : x.strides().vec();
    at::Tensor packed, out;
    if (!keep_output && kind == kHardtanh && dense && x.scalar_type() == at::kFloat) {
      // One pass for output and mask, in x's memory order (as the Python path packs).
      const float flo = static_cast<float>(lo), fhi = static_cast<float>(hi);
      int zmode = 0;
      int32_t zbits = 0;
      const bool lz = flo == 0.0f, hz = fhi == 0.0f;
      if (lz || hz) {
        const bool lneg = lz && std::signbit(flo), hneg = hz && std::signbit(fhi);
        const bool mixed = lz && hz && lneg != hneg;
        zmode = mixed ? 2 : 1;
        const float other = (lz ? lneg : hneg) ? 0.0f : -0.0f;  // the zero of the other sign
        std::memcpy(&zbits, &other, 4);
      }
      at::Tensor xc = perm.empty() ? x : x.permute(perm);
      at::Tensor oc = inplace ? xc : at::empty(xc.sizes(), xc.options());
      packed = at::empty({(x.numel() + 7) / 8}, x.options().dtype(at::kByte));
      const bool special = hardtanh_fp32(xc.const_data_ptr<float>(), oc.mutable_data_ptr<float>(),
                                         packed.mutable_data_ptr<uint8_t>(), packed.numel(), x.numel(), flo, fhi,
                                         zmode, zbits);
      out = inplace ? x : (perm.empty() ? oc : not_a_view(oc.permute(masks::inverse(perm))));
      if (special) at::hardtanh_(out, lo, hi);  // stock's bits where its paths differ
      ctx->saved_data["perm"] = perm;
      ctx->saved_data["pshape"] = xc.sizes().vec();
      if (inplace) ctx->mark_dirty({x});
      ctx->save_for_backward({packed});
      return out;
    }
    if (!keep_output && kind == kThreshold && dense &&
        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble)) {
      // One pass for output and mask, in x's memory order.
      at::Tensor xc = perm.empty() ? x : x.permute(perm);
      at::Tensor oc = inplace ? xc : at::empty(xc.sizes(), xc.options());
      packed = at::empty({(x.numel() + 7) / 8}, x.options().dtype(at::kByte));
      AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "threshold_mask", [&] {
        const at::Scalar th(lo), val(value);
        threshold_fwd(xc.const_data_ptr<scalar_t>(), oc.mutable_data_ptr<scalar_t>(),
                      packed.mutable_data_ptr<uint8_t>(), packed.numel(), x.numel(), th.to<scalar_t>(),
                      val.to<scalar_t>());
      });
      out = inplace ? x : (perm.empty() ? oc : not_a_view(oc.permute(masks::inverse(perm))));
      ctx->saved_data["perm"] = perm;
      ctx->saved_data["pshape"] = xc.sizes().vec();
      if (inplace) ctx->mark_dirty({x});
      ctx->save_for_backward({packed});
      return out;
    }
    if (!keep_output && kind == kHardsigmoid && dense) {
      // One pass for output and mask, in x's memory order.
      at::Tensor xc = perm.empty() ? x : x.permute(perm);
      at::Tensor oc = inplace ? xc : at::empty(xc.sizes(), xc.options());
      packed = at::empty({(x.numel() + 7) / 8}, x.options().dtype(at::kByte));
      bool nan = false;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "hardsigmoid_mask", [&] {
        nan = hardsigmoid_fwd(xc.const_data_ptr<scalar_t>(), oc.mutable_data_ptr<scalar_t>(),
                              packed.mutable_data_ptr<uint8_t>(), packed.numel(), x.numel());
      });
      out = inplace ? x : (perm.empty() ? oc : not_a_view(oc.permute(masks::inverse(perm))));
      if (nan) {  // stock's bits at NaN inputs (which do not depend on the NaN's payload but on its position)
        if (inplace)
          out.copy_(at::where(at::isnan(out), at::hardsigmoid(out), out));
        else
          out.copy_(at::hardsigmoid(x));
      }
      ctx->saved_data["perm"] = perm;
      ctx->saved_data["pshape"] = xc.sizes().vec();
      if (inplace) ctx->mark_dirty({x});
      ctx->save_for_backward({packed});
      return out;
    }
    if (!keep_output) {  // before an in-place op overwrites the input
      const double rlo = round_bound(lo, x.scalar_type()), rhi = round_bound(hi, x.scalar_type());
      at::Tensor xc = dense ? (perm.empty() ? x : x.permute(perm)) : x.contiguous();
      packed = pack(xc, kind == kThreshold, rlo, rhi);
      ctx->saved_data["perm"] = perm;
      ctx->saved_data["pshape"] = xc.sizes().vec();
    }
    out = stock_op(x, kind, lo, hi, value, inplace);
    if (inplace) {
      ctx->mark_dirty({x});
      out = x;
    }
    ctx->save_for_backward({keep_output ? out : packed});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    at::Tensor grad = grads[0];
    const int64_t kind = ctx->saved_data["kind"].toInt();
    const double lo = ctx->saved_data["lo"].toDouble(), hi = ctx->saved_data["hi"].toDouble();
    const bool keep_output = ctx->saved_data["keep"].toBool();
    const at::Tensor saved = ctx->get_saved_variables()[0];
    const Strides xs = ctx->saved_data["xs"].toIntVector();
    const auto shape = grad.sizes().vec();
    const Strides target = kind == kThreshold ? masks::binary_strides(shape, xs, grad.strides())
                                              : masks::binary_strides(shape, grad.strides(), xs);
    at::Tensor dx;
    if (keep_output && kind == kThreshold) {
      dx = at::threshold_backward(grad, saved, lo);
    } else if (kind == kHardsigmoid && !grad.requires_grad() && hardsigmoid_one_pass(ctx, grad, saved, dx)) {
      // done: factor and mask in one pass
    } else {
      if (kind == kHardsigmoid) {
        // Stock's kernel applies its factor (a zero stand-in lies inside the pass region everywhere).
        grad = at::hardsigmoid_backward(grad, at::zeros({}, grad.options()).expand(grad.sizes()));
      }
      if (keep_output || grad.requires_grad()) {
        at::Tensor mask;
        if (keep_output) {
          // hardtanh with its output kept: the pass test on the output, in its own dtype (the output stands in
          // only where both bounds are exact in it, slimgrad.functional.clamp.output_can_stand_in), the mask
          // formed in place: one bool temporary, no float copy (range_mask.mask_torch, the Python path's test)
          mask = at::gt(saved, lo).logical_and_(at::lt(saved, hi));
        } else {
          const Strides perm = ctx->saved_data["perm"].toIntVector();
          mask = masks::unpack(saved, ctx->saved_data["pshape"].toIntVector());
          if (!perm.empty()) mask = mask.permute(masks::inverse(perm));
        }
        if (grad.requires_grad()) {
          dx = at::where(mask, grad, at::Scalar(0));
        } else {
          // `where` on the gradient's bits (+0 where the test fails); a product would widen the bool mask to a
          // full-size integer copy on CPU
          const auto itype = grad.element_size() == 8 ? at::kLong : grad.element_size() == 4 ? at::kInt : at::kShort;
          dx = at::where(mask, grad.view(itype), at::Scalar(0)).view(grad.scalar_type());
        }
      } else {
        const Strides perm = ctx->saved_data["perm"].toIntVector();
        at::Tensor g = perm.empty() ? grad : grad.permute(perm);
        g = masks::select(g.contiguous(), saved);
        dx = perm.empty() ? g : g.permute(masks::inverse(perm));
      }
    }
    dx = masks::conform(dx, target);
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// The core's call for slimgrad.functional.clamp.apply (after its argument checks): the Function's result, or
// None where the Python Function must run.
std::optional<at::Tensor> range_mask_apply(const at::Tensor& x, int64_t kind, double lo, double hi, double value,
                                           bool inplace, bool keep_output) {
  if (!supported_dtype(x)) return std::nullopt;
  bool dense = true;
  Strides perm = masks::memory_order(x, dense);
  return RangeMaskFunction::apply(x, kind, lo, hi, value, inplace, keep_output, std::move(perm), dense);
}

at::Tensor range_mask_pack(const at::Tensor& x, const std::string& rule, double lo, std::optional<double> hi) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && supported_dtype(x), "range_mask_pack: contiguous CPU "
              "floating tensor expected");
  TORCH_CHECK(rule == "inside" || rule == "above", "range_mask_pack: rule must be 'inside' or 'above'");
  return pack(x, rule == "above", lo, hi.value_or(0.0));
}

at::Tensor range_mask_select(const at::Tensor& grad, const at::Tensor& packed) {
  TORCH_CHECK(grad.is_contiguous() && grad.device().is_cpu(), "range_mask_select: contiguous CPU tensor expected");
  return masks::select(grad, packed);
}

}  // namespace

static Register reg_range_mask([](pybind11::module_& m) {
  m.def("range_mask_apply", &range_mask_apply);
  m.def("range_mask_pack", &range_mask_pack);
  m.def("range_mask_select", &range_mask_select);
});

}  // namespace slimgrad
