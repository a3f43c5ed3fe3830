// Dropout in the compiled core: stock's own draw, one pass after it, one bit per element kept.
//
// Stock's CPU dropout is `noise = empty_like(x).bernoulli_(1 - p).div_(1 - p); out = x * noise` and keeps the
// float noise. Here the mask is drawn by the same aten call into `empty_like(x, uint8)` (aten's CPU bernoulli
// consumes the default generator identically whatever the output dtype: one draw per element on the default
// path, one seed on the MKL path), so the mask, the output, the gradient and the generator's state afterwards
// are stock's. One parallel pass then writes `x * (keep ? scale : 0)` (rounded once in x's dtype, bf16/fp16 in
// fp32, as stock's mul) and packs the mask to bits (slimgrad.functional._bitmask's format). The scale is stock's
// `ones(dtype).div_(1 - p)`, computed once per (p, dtype). Layouts, the no-gradient path, p == 1, in-place and
// the gradient's strides follow slimgrad.functional.dropout's Python Function step for step.
#include "common.h"
#include "dropout.h"
#include "layout.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/autograd/grad_mode.h>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

namespace slimgrad {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using fVec = at::vec::Vectorized<float>;
using dVec = at::vec::Vectorized<double>;

constexpr int64_t kGrainBytes = 4096;  // 32768 elements: aten's GRAIN_SIZE

// 0/1 for each bit of a byte (LSB first), as floats and doubles: the noise of 8 elements is one load.
// Per mask byte, eight lanes of all-ones bits (kept) or +0 (dropped): `lanes & scale` is the noise, the scale or +0.
// (A 0/1 table times the scale made 0 * inf = NaN where fp16 rounds 1 / (1 - p) to inf, p > 1 - 1/65504: stock's
// noise, bernoulli_ then div_, is 0 there; the degenerate-shapes sweep.)
struct BitTable {
  alignas(64) float f[256][8];
  alignas(64) double d[256][8];
  BitTable() {
    const uint32_t ones32 = 0xFFFFFFFFu;
    const uint64_t ones64 = ~uint64_t{0};
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) {
        f[b][j] = 0.0f;
        d[b][j] = 0.0;
        if ((b >> j) & 1) {
          std::memcpy(&f[b][j], &ones32, sizeof(float));
          std::memcpy(&d[b][j], &ones64, sizeof(double));
        }
      }
  }
};

const BitTable& table() {
  static const BitTable t;
  return t;
}

// Eight 0/1 bytes -> one byte, element j in bit j (little-endian load; each product bit has one source).
inline uint8_t pack8(const uint8_t* k) {
  uint64_t v;
  std::memcpy(&v, k, 8);
  return static_cast<uint8_t>((v * 0x0102040810204080ULL) >> 56);
}

// Eight draws of bernoulli_ in x's dtype (exactly 0 or 1) -> one byte, element j in bit j.
template <typename scalar_t>
inline uint8_t pack8_nonzero(const scalar_t* k) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, float>) {
    return static_cast<uint8_t>(
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(k), _mm256_setzero_ps(), _CMP_NEQ_OQ)));
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    const int lo = _mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(k), _mm256_setzero_pd(), _CMP_NEQ_OQ));
    const int hi = _mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(k + 4), _mm256_setzero_pd(), _CMP_NEQ_OQ));
    return static_cast<uint8_t>(lo | (hi << 4));
  } else {  // 16-bit floats: a draw is +0 or 1.0, so "bits == 0" is "not kept"
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k));
    const __m128i zero = _mm_cmpeq_epi16(v, _mm_setzero_si128());
    return static_cast<uint8_t>(~_mm_movemask_epi8(_mm_packs_epi16(zero, zero)));
  }
#else
  uint8_t byte = 0;
  for (int j = 0; j < 8; ++j) byte |= static_cast<uint8_t>((static_cast<double>(k[j]) != 0) << j);
  return byte;
#endif
}

template <typename scalar_t>
using opmath = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// out[i] = x[i] * (bit i ? scale : 0) for the bytes [b0, b1) of the mask; `bits(b)` gives byte b (packing it
// on the way when `keep` is given). n: elements in all.
template <typename scalar_t, typename Bits>
void apply_block(const scalar_t* x, scalar_t* out, int64_t b0, int64_t b1, int64_t n, opmath<scalar_t> scale,
                 Bits bits) {
  const BitTable& t = table();
  const int64_t full = std::min(b1, n / 8);  // bytes whose 8 elements all exist
  int64_t b = b0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    const fVec vs(scale);
    for (; b < full; ++b) {
      const int64_t i = 8 * b;
      const fVec noise = fVec::loadu(t.f[bits(b)]) & vs;
      (fVec::loadu(x + i) * noise).store(out + i);
    }
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    const dVec vs(scale);
    for (; b < full; ++b) {
      const int64_t i = 8 * b;
      const uint8_t byte = bits(b);
      (dVec::loadu(x + i) * (dVec::loadu(t.d[byte]) & vs)).store(out + i);
      (dVec::loadu(x + i + 4) * (dVec::loadu(t.d[byte] + 4) & vs)).store(out + i + 4);
    }
  } else {  // bf16 / fp16: 16 elements (two bytes) per step, in fp32, rounded once
    using rVec = at::vec::Vectorized<scalar_t>;
    static_assert(rVec::size() == 2 * fVec::size() && fVec::size() == 8, "16 reduced floats per vector");
    const fVec vs(scale);
    for (; b + 1 < full; b += 2) {
      const int64_t i = 8 * b;
      const uint8_t lo_bits = bits(b), hi_bits = bits(b + 1);
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(rVec::loadu(x + i));
      lo = lo * (fVec::loadu(t.f[lo_bits]) & vs);
      hi = hi * (fVec::loadu(t.f[hi_bits]) & vs);
      at::vec::convert_from_float<scalar_t>(lo, hi).store(out + i);
    }
  }
  for (; b < b1; ++b) {  // the rest, one element at a time
    const uint8_t byte = bits(b);
    const int64_t end = std::min<int64_t>(8 * b + 8, n);
    for (int64_t i = 8 * b; i < end; ++i) {
      const opmath<scalar_t> noise = (byte >> (i - 8 * b)) & 1 ? scale : opmath<scalar_t>(0);
      out[i] = static_cast<scalar_t>(static_cast<opmath<scalar_t>>(x[i]) * noise);
    }
  }
}

// out (float) = float(x[i]) * (bit i ? scale : 0) for 16-bit x: the cast and the dropout of one pass.
template <typename in_t, typename Bits>
void apply_block_to_float(const in_t* x, float* out, int64_t b0, int64_t b1, int64_t n, float scale, Bits bits) {
  using rVec = at::vec::Vectorized<in_t>;
  const BitTable& t = table();
  const int64_t full = std::min(b1, n / 8);
  const fVec vs(scale);
  int64_t b = b0;
  for (; b + 1 < full; b += 2) {
    const int64_t i = 8 * b;
    const uint8_t lo_bits = bits(b), hi_bits = bits(b + 1);
    auto [lo, hi] = at::vec::convert_to_float<in_t>(rVec::loadu(x + i));
    (lo * (fVec::loadu(t.f[lo_bits]) & vs)).store(out + i);
    (hi * (fVec::loadu(t.f[hi_bits]) & vs)).store(out + i + 8);
  }
  for (; b < b1; ++b) {
    const uint8_t byte = bits(b);
    const int64_t end = std::min<int64_t>(8 * b + 8, n);
    for (int64_t i = 8 * b; i < end; ++i)
      out[i] = static_cast<float>(x[i]) * ((byte >> (i - 8 * b)) & 1 ? scale : 0.0f);
  }
}

// The dropout_bits kernel contract (slimgrad.kernels.dropout): x, keep contiguous, same shape.
std::tuple<at::Tensor, at::Tensor> bits_forward(const at::Tensor& x, const at::Tensor& keep, double scale,
                                                bool inplace) {
  TORCH_CHECK(x.is_contiguous() && keep.is_contiguous() && keep.scalar_type() == at::kByte &&
                  keep.numel() == x.numel(),
              "dropout_bits_forward: x and keep (uint8) must be contiguous and of one size");
  const int64_t n = x.numel();
  const int64_t nbytes = (n + 7) / 8;
  at::Tensor out = inplace ? x : at::empty_like(x);
  at::Tensor packed = at::empty({nbytes}, x.options().dtype(at::kByte));
  const uint8_t* k = keep.const_data_ptr<uint8_t>();
  uint8_t* pk = packed.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "dropout_bits_forward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const auto s = static_cast<opmath<scalar_t>>(scale);
    at::parallel_for(0, nbytes, kGrainBytes, [&](int64_t b0, int64_t b1) {
      apply_block<scalar_t>(xp, op, b0, b1, n, s, [&](int64_t b) -> uint8_t {
        uint8_t byte;
        if (8 * b + 8 <= n) {
          byte = pack8(k + 8 * b);
        } else {
          byte = 0;
          for (int64_t i = 8 * b; i < n; ++i) byte |= static_cast<uint8_t>((k[i] != 0) << (i - 8 * b));
        }
        pk[b] = byte;
        return byte;
      });
    });
  });
  return {out, packed};
}

// As bits_forward, with the mask drawn in x's dtype (stock's own `empty_like(x).bernoulli_`, measured faster than
// a uint8 draw on CPU), exactly 0 or 1 per element.
std::tuple<at::Tensor, at::Tensor> noise_forward(const at::Tensor& x, const at::Tensor& keep, double scale,
                                                 bool inplace) {
  const int64_t n = x.numel();
  const int64_t nbytes = (n + 7) / 8;
  at::Tensor out = inplace ? x : at::empty_like(x);
  at::Tensor packed = at::empty({nbytes}, x.options().dtype(at::kByte));
  uint8_t* pk = packed.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "dropout_noise_forward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* k = keep.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const auto s = static_cast<opmath<scalar_t>>(scale);
    at::parallel_for(0, nbytes, kGrainBytes, [&](int64_t b0, int64_t b1) {
      apply_block<scalar_t>(xp, op, b0, b1, n, s, [&](int64_t b) -> uint8_t {
        uint8_t byte;
        if (8 * b + 8 <= n) {
          byte = pack8_nonzero<scalar_t>(k + 8 * b);
        } else {
          byte = 0;
          for (int64_t i = 8 * b; i < n; ++i)
            byte |= static_cast<uint8_t>((static_cast<opmath<scalar_t>>(k[i]) != 0) << (i - 8 * b));
        }
        pk[b] = byte;
        return byte;
      });
    });
  });
  return {out, packed};
}

at::Tensor bits_backward(const at::Tensor& grad, const at::Tensor& packed, double scale,
                         const std::optional<at::Tensor>& out_opt) {
  TORCH_CHECK(grad.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.numel() == (grad.numel() + 7) / 8,
              "dropout_bits_backward: grad must be contiguous and packed hold ceil(numel / 8) bytes");
  const int64_t n = grad.numel();
  const int64_t nbytes = (n + 7) / 8;
  at::Tensor out = out_opt.has_value() && out_opt->defined() ? *out_opt : at::empty_like(grad);
  TORCH_CHECK(out.is_contiguous() && out.numel() == n && out.scalar_type() == grad.scalar_type(),
              "dropout_bits_backward: out must be contiguous, of grad's size and dtype");
  const at::Tensor pc = packed.contiguous();
  const uint8_t* pk = pc.const_data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "dropout_bits_backward", [&] {
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const auto s = static_cast<opmath<scalar_t>>(scale);
    at::parallel_for(0, nbytes, kGrainBytes, [&](int64_t b0, int64_t b1) {
      apply_block<scalar_t>(gp, op, b0, b1, n, s, [&](int64_t b) -> uint8_t { return pk[b]; });
    });
  });
  return out;
}

// The noise itself (scale or 0 per element, x's dtype): for a backward that must stay differentiable in grad.
at::Tensor unpack_noise(const at::Tensor& packed, at::IntArrayRef shape, const at::TensorOptions& opts,
                        double scale) {
  at::Tensor noise = at::empty(shape, opts);
  const int64_t n = noise.numel();
  const uint8_t* pk = packed.const_data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, noise.scalar_type(), "dropout_unpack", [&] {
    scalar_t* np = noise.data_ptr<scalar_t>();
    const auto s = static_cast<scalar_t>(scale);
    const auto z = static_cast<scalar_t>(0);
    at::parallel_for(0, n, 8 * kGrainBytes, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) np[i] = (pk[i >> 3] >> (i & 7)) & 1 ? s : z;
    });
  });
  return noise;
}

// Stock's noise value at kept elements, `ones((), dtype).div_(1 - p)`, once per (p, dtype).
double noise_scale(double p, at::ScalarType dtype) {
  static std::mutex mu;
  static std::map<std::pair<double, int>, double> cache;
  const auto key = std::make_pair(p, static_cast<int>(dtype));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const double s = at::ones({}, at::TensorOptions().dtype(dtype)).div_(1 - p).item<double>();
  cache.emplace(key, s);
  return s;
}

// --- layouts (slimgrad.functional.dropout's _memory_order / _canonical / _finish, and _layout.conform) ---

std::vector<int64_t> memory_order(const at::Tensor& t) {
  if (t.is_contiguous()) return {};
  std::vector<int64_t> perm(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) perm[d] = d;
  const auto st = t.strides();
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return st[a] > st[b]; });
  return perm;
}

std::vector<int64_t> inverse(const std::vector<int64_t>& perm) {
  std::vector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
  return inv;
}

at::Tensor canonical(const at::Tensor& t, const std::vector<int64_t>& perm) {
  at::Tensor v = perm.empty() ? t : t.permute(perm);
  return v.is_contiguous() ? v : v.contiguous();
}

using dropout_core::Forward;
using dropout_core::draw_and_apply;

at::Tensor zero_like_scalar(const at::Tensor& t) { return at::zeros({}, t.options()); }

struct DropoutFunction : public torch::autograd::Function<DropoutFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, double p, bool inplace) {
    at::Tensor out;
    if (p == 1) {  // stock multiplies by a zero scalar, drawing nothing
      ctx->saved_data["zero"] = true;
      out = inplace ? input.mul_(zero_like_scalar(input)) : input * zero_like_scalar(input);
    } else {
      Forward f = draw_and_apply(input, p, inplace);
      ctx->saved_data["zero"] = false;
      ctx->saved_data["perm"] = f.perm;
      ctx->saved_data["noise_strides"] = f.noise_strides;
      ctx->saved_data["noise_contiguous"] = f.noise_contiguous;
      ctx->saved_data["scale"] = f.scale;
      ctx->save_for_backward({f.packed});
      out = f.out;
    }
    if (inplace) {
      ctx->mark_dirty({input});
      return input;
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    const at::Tensor& grad = grads[0];
    if (ctx->saved_data["zero"].toBool()) return {grad * zero_like_scalar(grad), at::Tensor(), at::Tensor()};
    const at::Tensor packed = ctx->get_saved_variables()[0];
    const auto perm = ctx->saved_data["perm"].toIntVector();
    const auto noise_strides = ctx->saved_data["noise_strides"].toIntVector();
    const double scale = ctx->saved_data["scale"].toDouble();
    at::Tensor g = canonical(grad, perm);
    at::Tensor gi;
    if (grad.requires_grad()) {  // double backward: differentiable in grad, as the Python Function
      gi = g * unpack_noise(packed, g.sizes(), g.options(), scale);
    } else {
      gi = bits_backward(g, packed, scale, std::nullopt);
    }
    if (!perm.empty()) gi = gi.permute(inverse(perm));
    gi = masks::conform(gi, dropout_core::product_strides(grad, noise_strides,
                                                          ctx->saved_data["noise_contiguous"].toBool()));
    return {gi, at::Tensor(), at::Tensor()};
  }
};

const char* kLeafInplace = "a leaf Variable that requires grad is being used in an in-place operation.";

// dropout(input, p, training=True, inplace) for 0 < p <= 1 and a non-empty floating input, policy "bits".
at::Tensor dropout(const at::Tensor& input, double p, bool inplace) {
  if (at::GradMode::is_enabled() && input.requires_grad()) {
    if (inplace && input.is_leaf()) throw std::runtime_error(kLeafInplace);
    return DropoutFunction::apply(input, p, inplace);
  }
  // No gradient reads a mask: stock's op itself (the same draw, so a reentrant checkpoint's recomputation with grad
  // draws this very mask), nothing packed: a packed mask beside stock's noise put the step's peak above stock's
  // (a dropout before a trainable conv on an input needing no gradient)
  at::Tensor self = input;
  return inplace ? at::dropout_(self, p, true) : at::dropout(input, p, true);
}

// The forward as functional.dropout.bits_forward returns it: (out, packed, perm or None, scale); for LoRA.
pybind11::tuple forward_parts(const at::Tensor& input, double p, bool inplace) {
  Forward f = draw_and_apply(input, p, inplace);
  pybind11::object perm = pybind11::none();
  if (!f.perm.empty()) perm = pybind11::tuple(pybind11::cast(f.perm));
  return pybind11::make_tuple(f.out, f.packed, perm, f.scale);
}

}  // namespace

namespace dropout_core {

// The Python Function's "bits" forward for 0 < p < 1 (bits_forward): draw, canonical layout, one pass, back.
Forward draw_and_apply(const at::Tensor& input, double p, bool inplace) {
  Forward f;
  // stock's draw itself (into x's dtype; the Python Function draws into uint8: the same mask, the same generator
  // consumption, slower)
  at::Tensor keep = at::empty_like(input).bernoulli_(1 - p);
  f.noise_strides = keep.strides().vec();  // stock's noise is empty_like(input): these strides
  f.noise_contiguous = keep.is_contiguous();
  f.perm = memory_order(keep);
  keep = canonical(keep, f.perm);
  f.scale = noise_scale(p, input.scalar_type());
  at::Tensor xc = canonical(input, f.perm);
  at::Tensor out;
  std::tie(out, f.packed) = noise_forward(xc, keep, f.scale, inplace);
  if (inplace) {
    at::Tensor view = f.perm.empty() ? input : input.permute(f.perm);
    if (out.data_ptr() != view.data_ptr() || out.strides() != view.strides()) view.copy_(out);
    f.out = input;
  } else {
    f.out = f.perm.empty() ? out : not_a_view(out.permute(inverse(f.perm)));
  }
  return f;
}

at::Tensor apply_packed(const at::Tensor& grad, const at::Tensor& packed, const std::vector<int64_t>& perm,
                        double scale, bool inplace) {
  at::Tensor g = canonical(grad, perm);
  std::optional<at::Tensor> out;
  if (inplace && g.data_ptr() == grad.data_ptr()) out = g;
  at::Tensor gi = bits_backward(g, packed, scale, out);
  return perm.empty() ? gi : gi.permute(inverse(perm));
}

std::vector<int64_t> product_strides(const at::Tensor& grad, const std::vector<int64_t>& noise_strides,
                                     bool noise_contiguous) {
  if (grad.is_contiguous() && noise_contiguous) {
    std::vector<int64_t> st(grad.dim());
    int64_t s = 1;
    for (int64_t d = grad.dim() - 1; d >= 0; --d) {
      st[d] = s;
      s *= std::max<int64_t>(grad.size(d), 1);
    }
    return st;
  }
  if (grad.strides() == at::IntArrayRef(noise_strides) && grad.is_non_overlapping_and_dense()) return noise_strides;
  // TensorIterator's rule in C++ (a meta-device mul ran torch's Python meta kernel: ~90 µs a call)
  return masks::binary_strides(grad.sizes(), grad.strides(), noise_strides);
}

double noise_scale(double p, at::ScalarType dtype) { return slimgrad::noise_scale(p, dtype); }

bool fuses_cast(const at::Tensor& x, at::ScalarType dtype) {
  return dtype == at::kFloat && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) &&
         x.is_contiguous();
}

Forward draw_and_apply_to(const at::Tensor& x, double p, at::ScalarType dtype) {
  TORCH_CHECK(fuses_cast(x, dtype), "dropout draw_and_apply_to: a contiguous bf16/fp16 x to float32");
  Forward f;
  at::Tensor keep = at::empty_like(x, x.options().dtype(dtype)).bernoulli_(1 - p);  // empty_like(x.to(dtype))
  f.noise_strides = keep.strides().vec();
  f.noise_contiguous = true;
  f.scale = noise_scale(p, dtype);
  const int64_t n = x.numel();
  const int64_t nbytes = (n + 7) / 8;
  f.out = at::empty_like(keep);
  f.packed = at::empty({nbytes}, x.options().dtype(at::kByte));
  uint8_t* pk = f.packed.data_ptr<uint8_t>();
  const float* k = keep.const_data_ptr<float>();
  float* op = f.out.data_ptr<float>();
  const auto s = static_cast<float>(f.scale);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "dropout_draw_and_apply_to", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, nbytes, kGrainBytes, [&](int64_t b0, int64_t b1) {
      apply_block_to_float<scalar_t>(xp, op, b0, b1, n, s, [&](int64_t b) -> uint8_t {
        uint8_t byte;
        if (8 * b + 8 <= n) {
          byte = pack8_nonzero<float>(k + 8 * b);
        } else {
          byte = 0;
          for (int64_t i = 8 * b; i < n; ++i) byte |= static_cast<uint8_t>((k[i] != 0) << (i - 8 * b));
        }
        pk[b] = byte;
        return byte;
      });
    });
  });
  return f;
}

at::Tensor apply_packed_to(const at::Tensor& x, const at::Tensor& packed, double scale, at::ScalarType dtype) {
  TORCH_CHECK(fuses_cast(x, dtype), "dropout apply_packed_to: a contiguous bf16/fp16 x to float32");
  const int64_t n = x.numel();
  at::Tensor out = at::empty_like(x, x.options().dtype(dtype));
  const uint8_t* pk = packed.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const auto s = static_cast<float>(scale);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "dropout_apply_packed_to", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, (n + 7) / 8, kGrainBytes, [&](int64_t b0, int64_t b1) {
      apply_block_to_float<scalar_t>(xp, op, b0, b1, n, s, [&](int64_t b) -> uint8_t { return pk[b]; });
    });
  });
  return out;
}

}  // namespace dropout_core

static Register reg_dropout([](pybind11::module_& m) {
  m.def("dropout_apply", &dropout, "slimgrad dropout (policy bits): one C++ autograd Function call");
  m.def("dropout_scale", [](double p, at::ScalarType dtype) { return noise_scale(p, dtype); });
  m.def("dropout_bits_forward", &bits_forward);
  m.def("dropout_bits_backward", &bits_backward, pybind11::arg("grad"), pybind11::arg("packed"),
        pybind11::arg("scale"), pybind11::arg("out") = pybind11::none());
  m.def("dropout_forward_parts", &forward_parts);
});

}  // namespace slimgrad
