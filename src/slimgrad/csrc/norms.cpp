// The norms' eager CPU path: RMSNorm (torch.rms_norm and the Hugging Face casting styles), FusedAddRMSNorm,
// LayerNorm and GroupNorm as one C++ torch::autograd::Function each, called once from the module's forward (issue 22:
// a Python Function cost more per call than stock's whole op on small tensors).
//
// Each Function takes its Python Function's decisions (slimgrad/functional/norms.py: what to keep per
// requires_grad combination, so the same saved bytes) and computes what it computes, bit for bit and with the same
// output/gradient layouts:
// - LayerNorm, GroupNorm, and RMSNorm on non-contiguous inputs or unusual dtype mixes: the same aten ops in the same
//   order, dtypes and operand order.
// - RMSNorm on contiguous fp32/bf16/fp16 (weight in x's dtype): one pass per step around aten's own reductions,
//   instead of a pass and a temporary per aten op (rms_forward_fast / rms_backward_fast, which say why the bits are
//   the same).
//
// Entry points return None (the caller then runs the Python Function, which raises the errors or handles the
// case) for anything not plain: wrong types or shapes, autocast on, non-CPU parameters, tensor subclasses.
#include "common.h"

#include <ATen/Dispatch.h>
#include <ATen/autocast_mode.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/autograd/python_variable.h>

#include <limits>
#include <optional>
#include <vector>

namespace slimgrad {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace py = pybind11;

// RMS_STYLES of functional/norms.py, in order.
enum Style : int64_t { kTorch = 0, kLlama = 1, kOlmo2 = 2, kGemma = 3, kT5 = 4 };

at::ScalarType opmath(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

bool is_half(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Whether the last forward on this thread kept its input (the Python caller then runs note_input_kept).
thread_local bool last_kept_x = false;

std::vector<int64_t> trailing_dims(const Tensor& x, int64_t ndim) {
  std::vector<int64_t> dims;
  for (int64_t d = x.dim() - ndim; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// ------------------------------------------------------------------------------------------------ RMSNorm
struct RmsForward {
  Tensor out, rstd, normed;
};

// The mean of t² over `dims`, the square freed before the mean's caller allocates again (as the Python path's
// temporaries go): a C++ temporary lives to the end of its full expression, one x-sized fp32 tensor more at the
// next allocation (slimgrad.estimate, which simulates the Python path's ops on fake tensors, counts theirs).
Tensor mean_of_square(const Tensor& t, at::IntArrayRef dims) {
  Tensor sq = t.pow(2);
  return sq.mean(dims, true);
}

bool cast_last(int64_t style) { return style == kTorch || style == kOlmo2 || style == kGemma; }

// functional/norms.py's _finish_output: the final cast of a cast_last style's output (a no-op on a finished one).
Tensor finish_output(const Tensor& out, const Tensor& x, int64_t style) {
  auto o = out.type_as(x);
  if (style == kTorch && x.suggest_memory_format() == at::MemoryFormat::Contiguous) o = o.contiguous();
  return o;
}

// _rms_forward_impl (statement by statement where the Python expression frees a temporary before the next op
// allocates: the same ops, values and allocations); cast=false: a cast_last style's output before its final cast
RmsForward rms_forward(const Tensor& x, const Tensor& w, double eps, int64_t ndim, int64_t style, bool cast = true) {
  if (style == kTorch) {
    auto up = x.to(opmath(x.scalar_type()));
    auto rstd = at::rsqrt(mean_of_square(up, trailing_dims(x, ndim)).add_(eps));
    auto h = up * rstd;
    up.reset();  // (x's upcast copy, freed before the output is made, as _rms_forward_impl's del)
    auto out = w.defined() ? h * w : h;
    return {cast ? finish_output(out, x, style) : out, rstd, h};
  }
  if (style == kT5) {
    Tensor shifted;
    {
      Tensor sq = x.to(at::kFloat);
      sq = sq.pow(2);  // (the fp32 copy freed as the square is made, as Python's chain frees it)
      Tensor m = sq.mean({-1}, true);
      sq.reset();
      shifted = m + eps;
    }
    auto rstd = at::rsqrt(shifted);
    shifted.reset();
    auto h = x * rstd;
    if (is_half(w.scalar_type())) h = h.to(w.scalar_type());
    return {w * h, rstd, h};
  }
  auto up = x.to(at::kFloat);
  Tensor shifted;
  {
    Tensor m = mean_of_square(up, {-1});
    shifted = m + eps;
  }
  auto rstd = at::rsqrt(shifted);
  shifted.reset();
  auto h = up * rstd;
  up.reset();
  if (style == kLlama) {
    auto normed = h.to(x.scalar_type());
    h.reset();
    return {w * normed, rstd, normed};
  }
  auto out = style == kOlmo2 ? w * h : h * w.to(at::kFloat).add(1.0);  // gemma: Python's 1.0 + w.float()
  return {cast ? finish_output(out, x, style) : out, rstd, h};
}

Tensor upstream_of_product(const Tensor& dy, int64_t style, const Tensor& w, at::ScalarType h_dtype) {
  if (style == kLlama || style == kT5) return dy;
  if (style == kGemma) return dy.to(at::kFloat);
  return dy.to(at::promote_types(w.scalar_type(), h_dtype));
}

bool plain_contiguous(const Tensor& t);

// (the product freed before the cast allocates, as Python's temporary is and as stock's engine frees its product
// after the reduction: a C++ temporary would live to the end of the full expression)
Tensor weight_grad(const Tensor& g, const Tensor& h, const Tensor& w) {
  Tensor reduced;
  {
    auto product = g * h;
    reduced = product.sum_to_size(w.sizes());
  }
  return reduced.to(w.scalar_type());
}

// functional/norms.py's _weight_grad with h_is_temporary: h, made by this backward (and handed over), holds the
// product where it has the product's dtype and g's layout (h plain contiguous: the out-of-place product's layout, so
// the same reduction), freed before the cast as Python frees it
Tensor weight_grad_into(const Tensor& g, Tensor h, const Tensor& w) {
  if (!(h.sizes() == g.sizes() && h.scalar_type() == at::promote_types(g.scalar_type(), h.scalar_type()) &&
        h.strides() == g.strides() && plain_contiguous(h)))
    return weight_grad(g, h, w);
  h.mul_(g);
  Tensor reduced = h.sum_to_size(w.sizes());
  h.reset();
  return reduced.to(w.scalar_type());
}

// _normalised: x.to(hd) * rstd, into x's copy where the cast made one
Tensor normalised(const Tensor& x, at::ScalarType hd, const Tensor& rstd) {
  auto up = x.to(hd);
  if (!up.is_same(x) && plain_contiguous(up)) return up.mul_(rstd);
  return up * rstd;
}

// _variance_row_factor and _variance_path_grad of functional/norms.py, each temporary freed where Python frees it.
Tensor variance_row_factor(const Tensor& d_rstd, const Tensor& rstd, int64_t n) {
  auto a = d_rstd * -0.5;
  auto b = rstd.pow(3);
  auto d_var = a * b;
  a.reset();
  b.reset();
  return d_var / n;
}

// (in one x-sized temporary where it may be written in place, as the Python function does)
Tensor variance_path_grad(const Tensor& c, const Tensor& up) {
  auto t = up.pow(1);
  if (t.scalar_type() == at::promote_types(t.scalar_type(), c.scalar_type()) && plain_contiguous(t))
    return t.mul_(2.0).mul_(c);
  auto two_up = t * 2.0;
  t.reset();  // (freed here, as Python's 2.0 * t drops it)
  return c * two_up;
}

// functional/norms.py's _rms_backward, op for op and temporary for temporary (slimgrad.estimate simulates this path
// with the Python code): each temporary made no earlier than needed and freed after its last use. split (where stock
// hands x two gradients: stock_hands_two): dX's second term, the square's, goes to *split and the first is returned
// unsummed.
std::pair<Tensor, Tensor> rms_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w,
                                       int64_t ndim, int64_t style, bool need_x, bool need_w,
                                       at::ScalarType x_dtype, Tensor* split = nullptr) {
  int64_t n = 1;
  for (int64_t d = x.dim() - ndim; d < x.dim(); ++d) n *= x.size(d);
  Tensor dx, dw;
  if (style == kT5) {
    const auto hd = at::promote_types(x.scalar_type(), rstd.scalar_type());  // x * rstd's dtype
    const auto ht = is_half(w.scalar_type()) ? w.scalar_type() : hd;
    if (need_w) {
      Tensor normed;
      {
        Tensor h = normalised(x, hd, rstd);  // (freed as the cast returns, as Python's temporary is)
        normed = h.to(ht);
      }
      dw = weight_grad_into(dy, std::move(normed), w);
    }
    if (!need_x) return {dx, dw};
    Tensor dh;
    {
      Tensor low = (dy * w).to(ht);  // dy * w freed before the next cast allocates (Python's order)
      dh = low.to(hd);
    }
    Tensor c;  // before dX's first term, as Python's order: the two x-sized temporaries never live together
    {
      Tensor s;
      {
        auto t = dh * x;
        s = t.sum({-1}, true);
      }
      s = s.to(rstd.scalar_type());
      c = variance_row_factor(s, rstd, n);
    }
    auto dx1 = (dh * rstd).to(x.scalar_type());
    dh.reset();
    Tensor dx2;
    {
      auto xf = x.to(at::kFloat);
      dx2 = variance_path_grad(c, xf);
    }
    dx2 = dx2.to(x.scalar_type());
    if (split) {
      *split = dx2;
      return {dx1, dw};
    }
    return {dx1.add_(dx2), dw};
  }
  const auto hd = rstd.scalar_type();  // the normalised input's: up (x in rstd's dtype) times rstd
  Tensor g_h;
  if (!w.defined()) {
    g_h = dy.to(hd);
  } else if (style == kLlama) {
    if (need_w) {
      Tensor normed;
      {
        Tensor h = normalised(x, hd, rstd);  // (freed as the cast returns, as Python's temporary is)
        normed = h.to(x_dtype);
      }
      dw = weight_grad_into(dy, std::move(normed), w);
    }
    if (need_x) {
      Tensor low = (dy * w).to(x_dtype);  // dy * w freed before the next cast allocates (Python's order)
      g_h = low.to(hd);
    }
  } else {
    auto g = upstream_of_product(dy, style, w, hd);
    if (need_w) {
      dw = weight_grad_into(g, normalised(x, hd, rstd), w);
    }
    if (need_x) g_h = style == kGemma ? g * w.to(at::kFloat).add(1.0) : (g * w).to(hd);
  }
  if (need_x) {
    auto up = x.to(hd);  // x itself where x has rstd's dtype
    Tensor c;
    {
      Tensor s;
      {
        auto t = g_h * up;
        s = t.sum(trailing_dims(x, ndim), true);
      }
      c = variance_row_factor(s, rstd, n);
    }
    dx = g_h * rstd;
    g_h.reset();
    if (split) {  // (up is x)
      *split = variance_path_grad(c, up);
      return {dx, dw};
    }
    dx.add_(variance_path_grad(c, up));
    up.reset();
    dx = dx.to(x_dtype);
  }
  return {dx, dw};
}


// ------------------------------------------------------------------------------ RMSNorm: one-pass kernels
// Where x (and dY) are plain contiguous, x is fp32/bf16/fp16 and the weight has x's dtype, the element-wise part of
// the sequence above runs as one pass per step instead of one aten op per step. Every element-wise op there is one
// IEEE operation in fp32 rounded once (a bf16/fp16 product: both operands widened, multiplied in fp32, rounded to
// the half type; a cast: round to nearest even), which these loops repeat in the same order (built with
// -ffp-contract=off: no fused multiply-add), so the values are the same bits. The reductions stay aten's: the
// row sums (mean, sum) and the weight gradient's sum over rows run as the same aten op on a tensor of the same
// shape, layout and values as the Python path's operand, which fixes their summation order.

bool plain_contiguous(const Tensor& t) {
  if (t.layout() != at::kStrided) return false;
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {  // exactly the row-major strides (size-1 dims included)
    if (t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

bool rms_fast_ok(const Tensor& x, const Tensor& w, int64_t style) {
  auto t = x.scalar_type();
  if (!(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf)) return false;
  if (x.numel() == 0 || !plain_contiguous(x)) return false;
  if (!w.defined()) return style == kTorch;
  return w.scalar_type() == t && w.is_contiguous();
}

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void from_float(const float* src, T* dst, int64_t n) {
  at::vec::convert(src, dst, n);
}

template <>
void from_float<float>(const float* src, float* dst, int64_t n) {
  std::copy(src, src + n, dst);
}

// v rounded to T and widened back (Llama's casts of x·rstd and dY·w to x's dtype); the identity for fp32.
template <typename T>
void round_through(float* v, T* tmp, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    from_float(v, tmp, n);
    to_float(tmp, v, n);
  }
}

struct RowScratch {
  std::vector<float> a, b, c;
  explicit RowScratch(int64_t n) : a(n), b(n), c(n) {}
};

template <typename F>
void for_rows(int64_t rows, int64_t n, F f) {
  int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    RowScratch s(n);
    for (int64_t r = begin; r < end; ++r) f(r, s);
  });
}

// The weight widened to fp32 (Gemma: 1 + w, as w.float() + 1.0 computes it).
std::vector<float> widened_weight(const Tensor& w, int64_t style, int64_t n) {
  std::vector<float> wf(n);
  if (!w.defined()) return wf;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "slimgrad_rms_w", [&] {
    to_float(w.data_ptr<scalar_t>(), wf.data(), n);
  });
  if (style == kGemma)
    for (auto& v : wf) v = v + 1.0f;
  return wf;
}

// Forward: sq = x² (fp32, the operand of the Python path's mean), rstd by aten's ops on it, then y (and the
// normalised input where it is kept) in one pass.
RmsForward rms_forward_fast(const Tensor& x, const Tensor& w, double eps, int64_t ndim, int64_t style,
                            bool keep_normed, at::ScalarType normed_dtype) {
  const int64_t n = x.numel() == 0 ? 0 : [&] {
    int64_t k = 1;
    for (int64_t d = x.dim() - ndim; d < x.dim(); ++d) k *= x.size(d);
    return k;
  }();
  const int64_t rows = x.numel() / n;
  // The squares are freed before the output and the normalised input are made: x, the squares and the row
  // statistics, then x, the output and the normalised input (stock's expression never holds more than three of
  // x's size at once; made together they were four)
  auto sq = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  Tensor out, normed;
  Tensor rstd;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "slimgrad_rms_fwd", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    float* sqp = sq.data_ptr<float>();
    for_rows(rows, n, [&](int64_t r, RowScratch& s) {
      float* xf = s.a.data();
      to_float(xp + r * n, xf, n);
      float* o = sqp + r * n;
      for (int64_t j = 0; j < n; ++j) o[j] = xf[j] * xf[j];
    });
    if (style == kTorch) {
      rstd = at::rsqrt(sq.mean(trailing_dims(x, ndim), true).add_(eps));
    } else {
      rstd = at::rsqrt(sq.mean({-1}, true) + eps);
    }
    sq.reset();
    out = at::empty(x.sizes(), x.options());
    if (keep_normed) normed = at::empty(x.sizes(), x.options().dtype(normed_dtype));
    const float* rp = rstd.data_ptr<float>();
    const auto wf = widened_weight(w, style, n);
    const bool has_w = w.defined();
    T* op = out.data_ptr<T>();
    for_rows(rows, n, [&](int64_t r, RowScratch& s) {
      float *xf = s.a.data(), *h = s.b.data(), *y = s.c.data();
      to_float(xp + r * n, xf, n);
      const float rs = rp[r];
      for (int64_t j = 0; j < n; ++j) h[j] = xf[j] * rs;
      if (style == kLlama || style == kT5) {  // T5 with w in x's dtype: the same casts as Llama
        T* nb = keep_normed ? normed.data_ptr<T>() + r * n : reinterpret_cast<T*>(xf);  // x's row is done
        from_float(h, nb, n);
        to_float(nb, h, n);
        for (int64_t j = 0; j < n; ++j) y[j] = wf[j] * h[j];
      } else {
        if (keep_normed) std::copy(h, h + n, normed.data_ptr<float>() + r * n);
        if (style == kGemma) {
          for (int64_t j = 0; j < n; ++j) y[j] = h[j] * wf[j];
        } else if (style == kOlmo2) {
          for (int64_t j = 0; j < n; ++j) y[j] = wf[j] * h[j];
        } else if (has_w) {
          for (int64_t j = 0; j < n; ++j) y[j] = h[j] * wf[j];
        } else {
          std::copy(h, h + n, y);
        }
      }
      from_float(y, op + r * n, n);
    });
  });
  return {out, rstd, normed};
}

// Backward, dX and/or dW: pass 1 makes the operands of the Python path's reductions (g_h·x for d_rstd; dY·x̂ for dW,
// in the dtype the reference multiplies them in), aten reduces them, pass 2 writes dX.
// split: as rms_backward's (pass 2 then writes the two terms, each rounded to x's dtype, instead of their sum).
std::pair<Tensor, Tensor> rms_backward_fast(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& w,
                                            int64_t ndim, int64_t style, bool need_x, bool need_w,
                                            Tensor* split = nullptr) {
  int64_t n = 1;
  for (int64_t d = x.dim() - ndim; d < x.dim(); ++d) n *= x.size(d);
  const int64_t rows = x.numel() / n;
  const bool has_w = w.defined();
  const auto wf = need_x ? widened_weight(w, style, n) : std::vector<float>();  // only dX reads w's values
  Tensor p = need_x ? at::empty(x.sizes(), x.options().dtype(at::kFloat)) : Tensor();
  const bool half_product = style == kLlama || style == kT5;
  Tensor q = need_w ? at::empty(x.sizes(), x.options().dtype(half_product ? x.scalar_type() : at::kFloat))
                    : Tensor();
  Tensor dx, dw;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "slimgrad_rms_bwd", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    const T* dyp = dy.data_ptr<T>();
    const float* rp = rstd.data_ptr<float>();
    // g_h, the gradient reaching x·rstd: dY·w (Llama: rounded to x's dtype; Gemma: dY·(1 + w)), or dY
    auto grad_h = [&](const float* dyf, float* gh, T* tmp) {
      if (has_w) {
        for (int64_t j = 0; j < n; ++j) gh[j] = dyf[j] * wf[j];
        if (style == kLlama || style == kT5) round_through(gh, tmp, n);
      } else {
        std::copy(dyf, dyf + n, gh);
      }
    };
    for_rows(rows, n, [&](int64_t r, RowScratch& s) {
      float *xf = s.a.data(), *dyf = s.b.data(), *t = s.c.data();
      to_float(xp + r * n, xf, n);
      to_float(dyp + r * n, dyf, n);
      if (need_w) {
        const float rs = rp[r];
        for (int64_t j = 0; j < n; ++j) t[j] = xf[j] * rs;
        if (style == kLlama || style == kT5) {  // dY · (x·rstd).to(x's dtype), a product in x's dtype
          T* qr = q.data_ptr<T>() + r * n;
          round_through(t, qr, n);
          for (int64_t j = 0; j < n; ++j) t[j] = dyf[j] * t[j];
          from_float(t, qr, n);
        } else {
          float* qr = q.data_ptr<float>() + r * n;
          for (int64_t j = 0; j < n; ++j) qr[j] = dyf[j] * t[j];
        }
      }
      if (need_x) {
        float* pr = p.data_ptr<float>() + r * n;
        grad_h(dyf, t, reinterpret_cast<T*>(pr));
        for (int64_t j = 0; j < n; ++j) pr[j] = t[j] * xf[j];
      }
    });
    if (need_w) dw = q.sum_to_size(w.sizes()).to(w.scalar_type());
    if (!need_x) return;
    q.reset();
    auto d_rstd = style == kTorch ? p.sum(trailing_dims(x, ndim), true) : p.sum({-1}, true);
    p.reset();
    auto c = ((d_rstd * -0.5) * rstd.pow(3)) / n;  // variance_path_grad's per-row factor (d_var / n)
    const float* cp = c.data_ptr<float>();
    dx = at::empty(x.sizes(), x.options());
    if (split) *split = at::empty(x.sizes(), x.options());
    T* dxp = dx.data_ptr<T>();
    T* dx2p = split ? split->data_ptr<T>() : nullptr;
    for_rows(rows, n, [&](int64_t r, RowScratch& s) {
      float *xf = s.a.data(), *dyf = s.b.data(), *gh = s.c.data();
      to_float(xp + r * n, xf, n);
      to_float(dyp + r * n, dyf, n);
      grad_h(dyf, gh, reinterpret_cast<T*>(dyf));
      const float rs = rp[r], cr = cp[r];
      if (dx2p) {  // the two terms, each rounded to x's dtype (T5: its casts; else x is fp32)
        for (int64_t j = 0; j < n; ++j) {
          xf[j] = cr * (xf[j] * 2.0f);
          gh[j] = gh[j] * rs;
        }
        from_float(xf, dx2p + r * n, n);
      } else if (style == kT5) {  // T5 casts both terms to x's dtype, then adds them (dx1.add_(dx2))
        float* t2 = xf;
        for (int64_t j = 0; j < n; ++j) {
          t2[j] = cr * (xf[j] * 2.0f);
          gh[j] = gh[j] * rs;
        }
        T* tmp = reinterpret_cast<T*>(dyf);
        round_through(t2, tmp, n);
        round_through(gh, tmp, n);
        for (int64_t j = 0; j < n; ++j) gh[j] = gh[j] + t2[j];
      } else {
        for (int64_t j = 0; j < n; ++j) gh[j] = gh[j] * rs + cr * (xf[j] * 2.0f);
      }
      from_float(gh, dxp + r * n, n);
    });
  });
  return {dx, dw};
}

// The dtype of the normalised input as the reference multiplies the weight by it (what only-dW keeps).
at::ScalarType rms_normed_dtype(const Tensor& x, const Tensor& w, int64_t style) {
  if (style == kTorch) return opmath(x.scalar_type());
  if (style == kLlama) return x.scalar_type();
  if (style == kT5)
    return is_half(w.scalar_type()) ? w.scalar_type() : at::promote_types(x.scalar_type(), at::kFloat);
  return at::kFloat;
}

struct RMSNormFn : public torch::autograd::Function<RMSNormFn> {
  // weight/bias as optionals: an undefined Tensor argument would count as a variable input
  // again: x once more where stock hands x two gradients (stock_hands_two): the square's term goes there, the
  // product's to x itself, so that autograd adds them in stock's order (RMSNormFunction's docstring)
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& w_opt, double eps,
                        int64_t ndim, int64_t style, bool need_x, bool need_w, const std::optional<Tensor>& again) {
    const Tensor w = w_opt.value_or(Tensor());
    ctx->saved_data["split"] = again.has_value();
    ctx->saved_data["need_x"] = need_x;
    ctx->saved_data["need_w"] = need_w;
    ctx->saved_data["ndim"] = ndim;
    ctx->saved_data["style"] = style;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["has_w"] = w.defined();
    if (w.defined()) {
      ctx->saved_data["w_shape"] = w.sizes().vec();
      ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    }
    // save_rms: x in its own dtype (or its fp32 copy for an fp64 input in the fp32 styles) and rstd, or, where
    // only dW is requested, the normalised input when it is no bigger (a view pins its whole storage).
    auto stat_dtype = style == kTorch ? opmath(x.scalar_type()) : at::kFloat;
    auto normed_dtype = rms_normed_dtype(x, w, style);
    int64_t stat_size = static_cast<int64_t>(c10::elementSize(stat_dtype));
    bool narrow = (style == kLlama || style == kOlmo2 || style == kGemma) &&
                  static_cast<int64_t>(x.element_size()) > stat_size;
    int64_t kept_bytes = x.numel() * (narrow ? stat_size : static_cast<int64_t>(x.element_size()));
    if (!narrow) kept_bytes = std::max<int64_t>(kept_bytes, static_cast<int64_t>(x.storage().nbytes()));
    int64_t rows = 1;
    for (int64_t d = 0; d < x.dim() - ndim; ++d) rows *= x.size(d);
    // (narrow: kept too, as save_rms says why)
    bool keep_normed = !need_x && (narrow || x.numel() * static_cast<int64_t>(c10::elementSize(normed_dtype)) <=
                                                 kept_bytes + rows * stat_size);
    // (the aten path leaves a cast_last style's final cast to rms(), after the Function: _finish_output says why)
    auto f = rms_fast_ok(x, w, style) ? rms_forward_fast(x, w, eps, ndim, style, keep_normed, normed_dtype)
                                      : rms_forward(x, w, eps, ndim, style, false);
    if (keep_normed) {
      ctx->save_for_backward({Tensor(), Tensor(), Tensor(), f.normed});
    } else {
      const auto& rstd = f.rstd;
      // A reduced-precision x that views a wider storage (q from a fused qkv projection): a compact copy, as
      // save_rms (stock keeps its fp32 copy of x's own size; the view would pin the whole base)
      const bool wider = !narrow && x.element_size() < c10::elementSize(rstd.scalar_type()) &&
                         static_cast<int64_t>(x.storage().nbytes()) > x.numel() * static_cast<int64_t>(x.element_size());
      last_kept_x = !narrow && !wider;
      ctx->save_for_backward({narrow ? x.to(rstd.scalar_type()) : wider ? x.clone(at::MemoryFormat::Preserve) : x,
                              rstd, need_x ? w : Tensor(), Tensor()});
    }
    return f.out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    bool need_x = ctx->saved_data["need_x"].toBool(), need_w = ctx->saved_data["need_w"].toBool();
    variable_list result(8);
    if (!(need_x || need_w)) return result;
    Tensor dx, dw, dx2;
    const bool split = ctx->saved_data["split"].toBool();  // (need_x)
    {
      at::NoGradGuard no_grad;
      auto saved = ctx->get_saved_variables();
      Tensor x = saved[0], rstd = saved[1], w = saved[2], normed = saved[3];
      const auto& dy = grads[0];
      int64_t style = ctx->saved_data["style"].toInt();
      if (!w.defined() && ctx->saved_data["has_w"].toBool()) {  // the weight's shape and dtype are all dW reads:
        // a meta tensor carries them without allocating (functional/norms.py's _WeightShape)
        auto dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
        w = at::empty({}, at::TensorOptions().dtype(dtype).device(at::kMeta))
                .expand(ctx->saved_data["w_shape"].toIntVector());
      }
      if (normed.defined()) {
        dw = weight_grad(upstream_of_product(dy, style, w, normed.scalar_type()), normed, w);
      } else {
        auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
        auto ndim = ctx->saved_data["ndim"].toInt();
        // the forward's conditions, on the saved x (not its fp32 copy) and a plain contiguous dY of x's dtype; the
        // weight's values are read only for dX (only dW: a shape-and-dtype stand-in)
        bool fast = x.scalar_type() == x_dtype && dy.scalar_type() == x_dtype && plain_contiguous(dy) &&
                    dy.sizes() == x.sizes() && rms_fast_ok(x, Tensor(), kTorch) &&
                    (w.defined() ? w.scalar_type() == x_dtype && (!need_x || w.is_contiguous()) : style == kTorch);
        if (fast) {
          std::tie(dx, dw) = rms_backward_fast(dy, x, rstd, w, ndim, style, need_x, need_w, split ? &dx2 : nullptr);
        } else {
          std::tie(dx, dw) = rms_backward(dy, x, rstd, w, ndim, style, need_x, need_w, x_dtype,
                                          split ? &dx2 : nullptr);
        }
      }
    }
    result[0] = need_x ? dx : Tensor();
    result[1] = need_w ? dw : Tensor();
    result[7] = dx2;
    return once_differentiable(std::move(result), grads, "RMSNormFunction");
  }
};

// ------------------------------------------------------------------------------------------- FusedAddRMSNorm
// FusedAddRMSNormFunction (functional/norms.py): s = x + r, (rms_norm_hf(s), s); keeps s and rstd (and the weight),
// dX = dR = dRMSNorm(s) + dS cast to each input's dtype. The RMSNorm steps are RMSNormFn's (the one-pass kernels
// where they apply: the same bits as the aten sequence the Python Function runs).
struct FusedAddRMSNormFn : public torch::autograd::Function<FusedAddRMSNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& w, double eps,
                               int64_t style) {
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined (no dW from zeros)
    auto s = x + r;
    auto f = rms_fast_ok(s, w, style) ? rms_forward_fast(s, w, eps, 1, style, false, at::kFloat)
                                      : rms_forward(s, w, eps, 1, style);
    ctx->saved_data["style"] = style;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["r_dtype"] = static_cast<int64_t>(r.scalar_type());
    ctx->save_for_backward({s, f.rstd, w});
    return {f.out, s};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    const bool need_x = ctx->needs_input_grad(0), need_r = ctx->needs_input_grad(1), need_w = ctx->needs_input_grad(2);
    variable_list result(5);
    if (!(need_x || need_r || need_w)) return result;
    const bool need_s = need_x || need_r;
    Tensor ds, dw;
    {
      at::NoGradGuard no_grad;
      auto saved = ctx->get_saved_variables();
      const Tensor &s = saved[0], &rstd = saved[1], &w = saved[2];
      const Tensor &dy = grads[0], &grad_s = grads[1];
      const int64_t style = ctx->saved_data["style"].toInt();
      if (dy.defined()) {
        const auto s_dtype = s.scalar_type();
        // RMSNormFn's conditions for the one-pass backward, on s
        const bool fast = dy.scalar_type() == s_dtype && plain_contiguous(dy) && dy.sizes() == s.sizes() &&
                          rms_fast_ok(s, Tensor(), kTorch) && w.scalar_type() == s_dtype &&
                          (!need_s || w.is_contiguous());
        if (fast) {
          std::tie(ds, dw) = rms_backward_fast(dy, s, rstd, w, 1, style, need_s, need_w);
        } else {
          std::tie(ds, dw) = rms_backward(dy, s, rstd, w, 1, style, need_s, need_w, s_dtype);
        }
      }
      if (need_s && grad_s.defined()) ds = ds.defined() ? ds + grad_s : grad_s;
      if (need_s && !ds.defined()) ds = at::zeros_like(s);
    }
    if (need_x) result[0] = ds.to(static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt()));
    if (need_r) result[1] = ds.to(static_cast<at::ScalarType>(ctx->saved_data["r_dtype"].toInt()));
    if (need_w) result[2] = dw;
    return once_differentiable(std::move(result), grads, "FusedAddRMSNormFunction");
  }
};

// ------------------------------------------------------------------------------------- LayerNorm / GroupNorm
struct LayerNormFn : public torch::autograd::Function<LayerNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& w_opt,
                        const std::optional<Tensor>& b_opt, std::vector<int64_t> shape, double eps, bool need_x,
                        bool need_w, bool need_b) {
    const Tensor w = w_opt.value_or(Tensor()), b = b_opt.value_or(Tensor());
    auto [out, mean, rstd] = at::native_layer_norm(x, shape, w, b, eps);
    ctx->saved_data["mask"] = std::vector<bool>{need_x, need_w, need_b};
    bool keep = need_x || need_w;
    if (keep || need_b) {
      ctx->saved_data["shape"] = shape;
      ctx->saved_data["stat_shape"] = mean.sizes().vec();
      ctx->saved_data["stat_dtype"] = static_cast<int64_t>(mean.scalar_type());
      last_kept_x = keep;
      ctx->save_for_backward({keep ? x : Tensor(), keep ? mean : Tensor(), keep ? rstd : Tensor(), w, b});
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    auto mask = ctx->saved_data["mask"].toBoolList();
    bool need_x = mask[0], need_w = mask[1], need_b = mask[2];
    variable_list result(8);
    if (!(need_x || need_w || need_b)) return result;
    {
      at::NoGradGuard no_grad;
      auto saved = ctx->get_saved_variables();
      Tensor x = saved[0], mean = saved[1], rstd = saved[2];
      Tensor dy = grads[0];
      if (!x.defined()) {  // only dB: dY stands in for x (the kernel reads only its shape then)
        dy = dy.contiguous();
        x = dy;
        mean = rstd = at::zeros(ctx->saved_data["stat_shape"].toIntVector(),
                                dy.options().dtype(static_cast<at::ScalarType>(
                                    ctx->saved_data["stat_dtype"].toInt())));
      }
      auto [dx, dw, db] = at::native_layer_norm_backward(dy, x, ctx->saved_data["shape"].toIntVector(), mean, rstd,
                                                         saved[3], saved[4], {need_x, need_w, need_b});
      result[0] = need_x ? dx : Tensor();
      result[1] = need_w ? dw : Tensor();
      result[2] = need_b ? db : Tensor();
    }
    return once_differentiable(std::move(result), grads, "LayerNormFunction");
  }
};

// _suggest_memory_format of functional/norms.py: asked only where x is 4-d/5-d and not plain contiguous.
at::MemoryFormat group_norm_format(const Tensor& x) {
  if ((x.dim() != 4 && x.dim() != 5) || x.is_contiguous()) return at::MemoryFormat::Contiguous;
  return x.suggest_memory_format();
}

struct GroupNormFn : public torch::autograd::Function<GroupNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& w_opt,
                        const std::optional<Tensor>& b_opt, int64_t groups, double eps, bool need_x, bool need_w,
                        bool need_b) {
    const Tensor w = w_opt.value_or(Tensor()), b = b_opt.value_or(Tensor());
    int64_t n = x.size(0), c = x.size(1);
    int64_t hxw = n * c ? x.numel() / (n * c) : 1;
    auto fmt = group_norm_format(x);
    auto xc = x.contiguous(fmt);
    auto [out, mean, rstd] = at::native_group_norm(xc, w, b, n, c, hxw, groups, eps);
    ctx->saved_data["mask"] = std::vector<bool>{need_x, need_w, need_b};
    bool keep = need_x || need_w;
    if (keep || need_b) {
      ctx->saved_data["dims"] = std::vector<int64_t>{n, c, hxw, groups};
      ctx->saved_data["channels_last"] = fmt != at::MemoryFormat::Contiguous;
      ctx->saved_data["fmt"] = static_cast<int64_t>(fmt);
      ctx->saved_data["stat_shape"] = mean.sizes().vec();
      ctx->saved_data["stat_dtype"] = static_cast<int64_t>(mean.scalar_type());
      last_kept_x = keep;
      ctx->save_for_backward({keep ? xc : Tensor(), keep ? mean : Tensor(), keep ? rstd : Tensor(), w});
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    auto mask = ctx->saved_data["mask"].toBoolList();
    bool need_x = mask[0], need_w = mask[1], need_b = mask[2];
    variable_list result(8);
    if (!(need_x || need_w || need_b)) return result;
    {
      at::NoGradGuard no_grad;
      auto saved = ctx->get_saved_variables();
      Tensor x = saved[0], mean = saved[1], rstd = saved[2];
      auto fmt = static_cast<at::MemoryFormat>(ctx->saved_data["fmt"].toInt());
      if (!need_x && fmt != at::MemoryFormat::Contiguous) {
        // torch 2.13's channels-last CPU kernel writes dX unconditionally (stock segfaults when dX is not
        // requested): the contiguous kernel computes dW/dB, as the Python path does.
        fmt = at::MemoryFormat::Contiguous;
        if (x.defined()) x = x.contiguous();
      }
      auto dy = grads[0].contiguous(fmt);
      if (!x.defined()) {
        x = dy;
        mean = rstd = at::zeros(ctx->saved_data["stat_shape"].toIntVector(),
                                dy.options().dtype(static_cast<at::ScalarType>(
                                    ctx->saved_data["stat_dtype"].toInt())));
      }
      auto d = ctx->saved_data["dims"].toIntVector();
      auto [dx, dw, db] = at::native_group_norm_backward(dy, x, mean, rstd, saved[3], d[0], d[1], d[2], d[3],
                                                         {need_x, need_w, need_b});
      result[0] = need_x ? dx : Tensor();
      result[1] = need_w ? dw : Tensor();
      result[2] = need_b ? db : Tensor();
    }
    return once_differentiable(std::move(result), grads, "GroupNormFunction");
  }
};

// ---------------------------------------------------------------------------------------- Python entry points
// Argument reading that refuses (nullopt) instead of raising: the Python path then gives the exact error.
std::optional<Tensor> cpu_tensor(py::handle obj, bool allow_none) {
  if (obj.is_none()) return allow_none ? std::optional<Tensor>(Tensor()) : std::nullopt;
  // exactly torch.Tensor or nn.Parameter: a subclass may override __torch_function__ (the Python path honours it)
  auto type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  if (type != THPVariableClass && type != ParameterClass) return std::nullopt;
  const auto& t = THPVariable_Unpack(obj.ptr());
  if (!t.defined() || t.device().type() != at::kCPU || t.layout() != at::kStrided) return std::nullopt;
  return t;
}

std::optional<double> nonnegative(py::handle obj) {
  if (PyBool_Check(obj.ptr()) || !(PyFloat_Check(obj.ptr()) || PyLong_Check(obj.ptr()))) return std::nullopt;
  double v = PyFloat_Check(obj.ptr()) ? PyFloat_AS_DOUBLE(obj.ptr()) : obj.cast<double>();
  if (!(v >= 0)) return std::nullopt;
  return v;
}

std::optional<std::vector<int64_t>> int_list(py::handle obj) {
  std::vector<int64_t> out;
  if (PyLong_Check(obj.ptr()) && !PyBool_Check(obj.ptr())) {
    out.push_back(obj.cast<int64_t>());
    return out;
  }
  if (!PyTuple_Check(obj.ptr()) && !PyList_Check(obj.ptr())) return std::nullopt;
  for (auto item : obj) {
    if (!PyLong_Check(item.ptr()) || PyBool_Check(item.ptr())) return std::nullopt;
    out.push_back(item.cast<int64_t>());
  }
  return out;
}

bool ends_in(const Tensor& x, const std::vector<int64_t>& shape) {
  int64_t k = static_cast<int64_t>(shape.size());
  if (x.dim() < k) return false;
  for (int64_t i = 0; i < k; ++i)
    if (x.size(x.dim() - k + i) != shape[i]) return false;
  return true;
}

bool param_fits(const Tensor& p, const Tensor& x, at::IntArrayRef shape) {
  return !p.defined() || (p.sizes() == shape && p.device() == x.device());
}

py::object wrap(Tensor out, py::handle x, py::handle note) {
  if (last_kept_x && !note.is_none()) note(x);
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
}

bool grad_on(const Tensor& t) { return t.defined() && t.requires_grad(); }

// rms_norm (style 0; shape: normalized_shape, eps None: the opmath dtype's machine epsilon) and rms_norm_hf
// (styles 1-4; shape None: the weight's size over the last dim).
py::object rms(py::handle x_obj, py::handle w_obj, py::handle eps_obj, py::handle shape_obj, int64_t style,
               py::handle note) {
  last_kept_x = false;
  if (at::autocast::is_autocast_enabled(at::kCPU) || style < kTorch || style > kT5) return py::none();
  auto x = cpu_tensor(x_obj, false);
  auto w = cpu_tensor(w_obj, style == kTorch);
  if (!x || !w || !x->is_floating_point() || (w->defined() && !w->is_floating_point())) return py::none();
  std::vector<int64_t> shape;
  if (style == kTorch) {
    auto s = int_list(shape_obj);
    if (!s) return py::none();
    shape = std::move(*s);
  } else {
    if (!w->defined() || w->dim() != 1) return py::none();
    shape = {w->size(0)};
  }
  if (!ends_in(*x, shape) || !param_fits(*w, *x, shape)) return py::none();
  double eps;
  if (eps_obj.is_none() && style == kTorch) {
    eps = opmath(x->scalar_type()) == at::kDouble ? std::numeric_limits<double>::epsilon()
                                                  : std::numeric_limits<float>::epsilon();
  } else {
    auto e = nonnegative(eps_obj);
    if (!e) return py::none();
    eps = *e;
  }
  int64_t ndim = static_cast<int64_t>(shape.size());
  bool grad = at::GradMode::is_enabled();
  bool need_x = grad && x->requires_grad(), need_w = grad && grad_on(*w);
  if (!(need_x || need_w)) {
    auto f = rms_fast_ok(*x, *w, style) ? rms_forward_fast(*x, *w, eps, ndim, style, false, at::kFloat)
                                        : rms_forward(*x, *w, eps, ndim, style);
    return wrap(f.out, x_obj, note);
  }
  // only dX of an fp64 x in Llama/Olmo2 style: nothing to save, stock's ops run (functional/norms.py's _apply_rms
  // says why)
  if (need_x && !need_w && x->scalar_type() == at::kDouble && (style == kLlama || style == kOlmo2))
    return py::none();
  // stock_hands_two (functional/norms.py): T5 style, or x already in the statistics' dtype
  bool split = need_x && (style == kT5 || x->scalar_type() == (style == kTorch ? opmath(x->scalar_type()) : at::kFloat));
  auto out = RMSNormFn::apply(*x, std::optional<Tensor>(*w), eps, ndim, style, need_x, need_w,
                              split ? std::optional<Tensor>(*x) : std::nullopt);
  if (cast_last(style) && !rms_fast_ok(*x, *w, style)) out = finish_output(out, *x, style);
  return wrap(out, x_obj, note);
}

// fused_add_rms_norm (styles 1-4): (out, s), or None.
py::object fused_add_rms(py::handle x_obj, py::handle r_obj, py::handle w_obj, py::handle eps_obj, int64_t style) {
  if (at::autocast::is_autocast_enabled(at::kCPU) || style <= kTorch || style > kT5) return py::none();
  auto x = cpu_tensor(x_obj, false);
  auto r = cpu_tensor(r_obj, false);
  auto w = cpu_tensor(w_obj, false);
  auto eps = nonnegative(eps_obj);
  if (!x || !r || !w || !eps || !x->is_floating_point() || !r->is_floating_point() || !w->is_floating_point())
    return py::none();
  if (x->dim() < 1 || r->sizes() != x->sizes() || w->dim() != 1 || w->size(0) != x->size(-1)) return py::none();
  variable_list out;
  const bool grad = at::GradMode::is_enabled() && (x->requires_grad() || r->requires_grad() || w->requires_grad());
  // an fp64 sum in the styles that compute in fp32: the Python Function keeps s's fp32 copy (half of s, what
  // stock's norm keeps), which this Function does not
  if (grad && style != kT5 && at::promote_types(x->scalar_type(), r->scalar_type()) == at::kDouble)
    return py::none();
  if (!grad) {
    auto s = *x + *r;
    auto f = rms_fast_ok(s, *w, style) ? rms_forward_fast(s, *w, *eps, 1, style, false, at::kFloat)
                                       : rms_forward(s, *w, *eps, 1, style);
    out = {f.out, s};
  } else {
    out = FusedAddRMSNormFn::apply(*x, *r, *w, *eps, style);
  }
  return py::make_tuple(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[0]))),
                        py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[1]))));
}

py::object layer(py::handle x_obj, py::handle shape_obj, py::handle w_obj, py::handle b_obj, py::handle eps_obj,
                 py::handle note) {
  last_kept_x = false;
  if (at::autocast::is_autocast_enabled(at::kCPU)) return py::none();
  auto x = cpu_tensor(x_obj, false);
  auto w = cpu_tensor(w_obj, true);
  auto b = cpu_tensor(b_obj, true);
  auto shape = int_list(shape_obj);
  auto eps = nonnegative(eps_obj);
  if (!x || !w || !b || !shape || !eps || !x->is_floating_point()) return py::none();
  if (!ends_in(*x, *shape) || !param_fits(*w, *x, *shape) || !param_fits(*b, *x, *shape)) return py::none();
  bool grad = at::GradMode::is_enabled();
  bool need_x = grad && x->requires_grad(), need_w = grad && grad_on(*w), need_b = grad && grad_on(*b);
  if (!(need_x || need_w || need_b))
    return wrap(std::get<0>(at::native_layer_norm(*x, *shape, *w, *b, *eps)), x_obj, note);
  if (need_x || need_w) {  // stock keeps x, mean and rstd here too: its own op and node, no Function's cost
    last_kept_x = true;
    return wrap(at::layer_norm(*x, *shape, *w, *b, *eps), x_obj, note);
  }
  auto out = LayerNormFn::apply(*x, std::optional<Tensor>(*w), std::optional<Tensor>(*b), *shape, *eps, need_x,
                                need_w, need_b);
  return wrap(std::move(out), x_obj, note);
}

py::object group(py::handle x_obj, py::handle groups_obj, py::handle w_obj, py::handle b_obj, py::handle eps_obj,
                 py::handle note) {
  last_kept_x = false;
  if (at::autocast::is_autocast_enabled(at::kCPU)) return py::none();
  auto x = cpu_tensor(x_obj, false);
  auto w = cpu_tensor(w_obj, true);
  auto b = cpu_tensor(b_obj, true);
  auto eps = nonnegative(eps_obj);
  if (!x || !w || !b || !eps || !x->is_floating_point() || x->dim() < 2) return py::none();
  if (!PyLong_Check(groups_obj.ptr()) || PyBool_Check(groups_obj.ptr())) return py::none();
  int64_t groups = groups_obj.cast<int64_t>();
  int64_t c = x->size(1);
  if (groups <= 0 || c % groups) return py::none();
  if (!param_fits(*w, *x, {c}) || !param_fits(*b, *x, {c})) return py::none();
  bool grad = at::GradMode::is_enabled();
  bool need_x = grad && x->requires_grad(), need_w = grad && grad_on(*w), need_b = grad && grad_on(*b);
  if (!(need_x || need_w || need_b)) {
    int64_t n = x->size(0);
    auto xc = x->contiguous(group_norm_format(*x));
    return wrap(std::get<0>(at::native_group_norm(xc, *w, *b, n, c, n * c ? x->numel() / (n * c) : 1, groups, *eps)),
                x_obj, note);
  }
  // Where stock keeps what GroupNormFn would (x's copy, mean, rstd), stock's op and node run. Not for a dW-only
  // call on a channels-last x: torch 2.13's channels-last CPU backward then writes an unrequested dX and crashes.
  if (need_x || (need_w && x->suggest_memory_format() == at::MemoryFormat::Contiguous)) {
    last_kept_x = true;
    return wrap(at::group_norm(*x, groups, *w, *b, *eps), x_obj, note);
  }
  auto out = GroupNormFn::apply(*x, std::optional<Tensor>(*w), std::optional<Tensor>(*b), groups, *eps, need_x,
                                need_w, need_b);
  return wrap(std::move(out), x_obj, note);
}

}  // namespace

static Register reg_norms([](py::module_& m) {
  m.def("norms_rms", &rms, "RMSNorm (style 0: torch.rms_norm; 1-4: llama, olmo2, gemma, t5), or None",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("normalized_shape"), py::arg("style"),
        py::arg("note"));
  m.def("norms_fused_add_rms", &fused_add_rms,
        "FusedAddRMSNorm (styles 1-4: llama, olmo2, gemma, t5): (out, input + residual), or None", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("style"));
  m.def("norms_layer", &layer, "LayerNorm (native_layer_norm), or None", py::arg("x"), py::arg("normalized_shape"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("note"));
  m.def("norms_group", &group, "GroupNorm (native_group_norm), or None", py::arg("x"), py::arg("num_groups"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("note"));
});

}  // namespace slimgrad
