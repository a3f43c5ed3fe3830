// LoRA on a convolution (peft's lora.Conv1d/2d/3d) in the compiled core: slimgrad.functional.lora_conv's
// LoraConvFunction as one C++ autograd Function, for eager CPU calls with the "bits" dropout policy (or no dropout).
//
// Why: the Python Function's per-call cost (its apply, setup_context and backward in Python) was most of a small
// LoRA-conv layer's time over peft's. Forward and backward are the Python Function's, op for op: the same aten calls
// in the same order and dtypes (at::conv{1,2,3}d, u.mul_(s), the left-to-right sum, convolution_backward where a
// weight gradient is requested, the transposed convolution for an input-only gradient, autograd's order of the
// adapters' input gradients), so the numbers are the Python path's and peft's. The adapters' dropout is stock's draw
// kept as bits (dropout.cpp, as lora.cpp's). What is saved is what the Python Function saves, in its order: x (only
// when some A trains), each adapter's t = A(drop(x')) only when its B trains, the packed masks only where dX or that
// dA is requested, and the adapters' weights. Double backward is refused with the Python Function's message.
#include "common.h"
#include "dropout.h"
#include "layout.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <optional>
#include <utility>
#include <vector>

namespace slimgrad {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One convolution's options, as ConvOptions: stride, padding, dilation (nd each), groups.
struct Opts {
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups = 1;
};

Opts unpack(const std::vector<int64_t>& v, int64_t nd) {
  Opts o;
  o.stride.assign(v.begin(), v.begin() + nd);
  o.padding.assign(v.begin() + nd, v.begin() + 2 * nd);
  o.dilation.assign(v.begin() + 2 * nd, v.begin() + 3 * nd);
  o.groups = v[3 * nd];
  return o;
}

std::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }

// lora_conv._conv: F.conv{1,2,3}d
at::Tensor conv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const Opts& o) {
  switch (w.dim()) {
    case 3: return at::conv1d(x, w, opt(bias), o.stride, o.padding, o.dilation, o.groups);
    case 4: return at::conv2d(x, w, opt(bias), o.stride, o.padding, o.dilation, o.groups);
    default: return at::conv3d(x, w, opt(bias), o.stride, o.padding, o.dilation, o.groups);
  }
}

// slimgrad.functional.conv._format (conv.cpp's conv_format): the layout aten's convolution reads from `t`.
at::MemoryFormat conv_format(const at::Tensor& t) {
  if (t.is_contiguous()) {
    const auto d = t.dim();
    if (d == 4 ? !t.is_contiguous(at::MemoryFormat::ChannelsLast)
               : (d == 5 ? !t.is_contiguous(at::MemoryFormat::ChannelsLast3d) : true))
      return at::MemoryFormat::Contiguous;
  }
  return t.suggest_memory_format();
}

// lora_conv._input_grad: dX of a convolution without its input, the transposed convolution slimgrad's conv uses.
at::Tensor input_grad(const at::Tensor& grad, at::Tensor w, const Opts& o, at::IntArrayRef in_shape,
                      at::MemoryFormat in_format) {
  const int64_t nd = w.dim() - 2;
  if (in_format != at::MemoryFormat::Contiguous) w = w.contiguous(in_format);  // stock's backend sees X so
  std::vector<int64_t> extra(nd);
  for (int64_t i = 0; i < nd; ++i)
    extra[i] = in_shape[2 + i] - ((grad.size(2 + i) - 1) * o.stride[i] - 2 * o.padding[i] +
                                  o.dilation[i] * (w.size(2 + i) - 1) + 1);
  switch (nd) {
    case 1: return at::conv_transpose1d(grad, w, std::nullopt, o.stride, o.padding, extra, o.groups, o.dilation);
    case 2: return at::conv_transpose2d(grad, w, std::nullopt, o.stride, o.padding, extra, o.groups, o.dilation);
    default: return at::conv_transpose3d(grad, w, std::nullopt, o.stride, o.padding, extra, o.groups, o.dilation);
  }
}

// lora_conv._backward: (dX, dW, dB) of conv(x, w, b, o) as autograd computes them; x unread when dW is not requested.
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_backward(const at::Tensor& grad, const at::Tensor& x,
                                                             const at::Tensor& w, const Opts& o, bool need_x,
                                                             bool need_w, bool need_b, at::IntArrayRef in_shape,
                                                             at::MemoryFormat in_format) {
  if (need_w) {
    const int64_t channels = w.size(0);
    at::OptionalIntArrayRef bias_sizes;
    if (need_b) bias_sizes = at::IntArrayRef(&channels, 1);
    std::vector<int64_t> zeros(w.dim() - 2, 0);
    return at::convolution_backward(grad, x, w, bias_sizes, o.stride, o.padding, o.dilation, false, zeros, o.groups,
                                    {need_x, true, need_b});
  }
  at::Tensor dx, db;
  if (need_x) dx = input_grad(grad, w, o, in_shape, in_format);
  if (need_b) {
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < grad.dim(); ++d) dims.push_back(d);
    db = grad.sum(dims);
  }
  return {dx, at::Tensor(), db};
}

constexpr size_t kAt = 2;  // tensors: x, base_out, then (A_i, B_i, bias_i)

// tensors: x, base_out, (A_i, B_i, bias_i) per adapter (bias undefined for None); need: requires-grad flags;
// opts: per adapter a's then b's options (stride, padding, dilation, groups).
at::Tensor lora_conv_forward(AutogradContext* ctx, const std::vector<at::Tensor>& t, const std::vector<bool>& need,
                             bool cast, const std::vector<double>& scalings, const std::vector<double>& ps,
                             const std::vector<std::vector<int64_t>>& opts) {
  const at::Tensor &x = t[0], &base_out = t[1];
  const size_t n = scalings.size();
  const int64_t nd = x.dim() - 2;
  const at::ScalarType a_dtype = t[kAt].scalar_type();
  at::Tensor xa = cast && x.scalar_type() != a_dtype ? x.to(a_dtype) : x;
  const bool need_x = need[0];
  at::Tensor result = base_out;
  std::vector<at::Tensor> ts(n), masks(n);
  std::vector<int64_t> dropping(n, 0), t_dtypes(n), t_formats(n);
  std::vector<std::vector<int64_t>> perms(n), t_shapes(n);
  std::vector<double> scales(n, 0.0);
  std::vector<int64_t> noise_strides;  // empty_like(xa)'s, every dropping adapter's noise (stock's dropout draws)
  bool noise_contiguous = true;
  at::ScalarType sum_dtype = base_out.scalar_type();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor &A = t[kAt + 3 * i], &B = t[kAt + 1 + 3 * i], &bias = t[kAt + 2 + 3 * i];
    const double p = ps[i];
    at::Tensor dropped, mask;
    if (p == 1) {
      dropped = xa * at::zeros({}, xa.options());
    } else if (p > 0 && !(need_x || need[kAt + 3 * i])) {
      // no gradient reads this adapter's mask (x and its A frozen): stock's op itself (peft's nn.Dropout), nothing
      // packed: a packed mask beside the draw put the step's peak a mask above peft's
      dropped = at::dropout(xa, p, true);
    } else if (p > 0) {  // stock's draw (peft's nn.Dropout), kept as bits
      dropout_core::Forward f = dropout_core::draw_and_apply(xa, p, false);
      dropped = std::move(f.out);
      mask = std::move(f.packed);
      perms[i] = std::move(f.perm);
      scales[i] = f.scale;
      noise_strides = std::move(f.noise_strides);
      noise_contiguous = f.noise_contiguous;
      dropping[i] = 1;
    } else {
      dropped = xa;
    }
    at::Tensor ti = conv(dropped, A, at::Tensor(), unpack(opts[2 * i], nd));
    dropped.reset();  // temporaries go as soon as they are read: the step's peak stays at peft's
    if (i == n - 1) xa.reset();
    at::Tensor u = conv(ti, B, bias, unpack(opts[2 * i + 1], nd));
    sum_dtype = at::promote_types(sum_dtype, ti.scalar_type());
    t_dtypes[i] = static_cast<int64_t>(ti.scalar_type());
    t_formats[i] = static_cast<int64_t>(conv_format(ti));
    t_shapes[i] = ti.sizes().vec();
    if (ctx != nullptr) {
      if (need[kAt + 1 + 3 * i]) ts[i] = ti;
      if (need_x || need[kAt + 3 * i]) masks[i] = mask;
    }
    ti.reset();  // t goes once B has read it unless B trains (kept), as stock frees it: the peak stays at peft's
    result = result + u.mul_(py_float(scalings[i]));  // u * s, in place on a tensor of our own (same bits)
    u.reset();
  }
  at::Tensor out = result.to(base_out.scalar_type());
  if (ctx == nullptr) return out;
  bool keep_x = false;
  for (size_t i = 0; i < n; ++i) keep_x = keep_x || need[kAt + 3 * i];
  auto& d = ctx->saved_data;
  d["cast"] = cast;
  d["scalings"] = scalings;
  d["ps"] = ps;
  c10::List<c10::List<int64_t>> opt_list, perm_list, shape_list;
  for (const auto& o : opts) opt_list.push_back(c10::List<int64_t>(o));
  for (const auto& pm : perms) perm_list.push_back(c10::List<int64_t>(pm));
  for (const auto& sh : t_shapes) shape_list.push_back(c10::List<int64_t>(sh));
  d["opts"] = opt_list;
  d["perms"] = perm_list;
  d["t_shapes"] = shape_list;
  d["t_dtypes"] = t_dtypes;
  d["t_formats"] = t_formats;
  d["dropping"] = dropping;
  d["scales"] = scales;
  d["noise_strides"] = noise_strides;
  d["noise_contiguous"] = noise_contiguous;
  d["sum_dtype"] = static_cast<int64_t>(sum_dtype);
  d["base_dtype"] = static_cast<int64_t>(base_out.scalar_type());
  d["x_shape"] = x.sizes().vec();
  d["x_format"] = static_cast<int64_t>(conv_format(x));
  d["x_dtype"] = static_cast<int64_t>(x.scalar_type());
  variable_list saved{keep_x ? x : at::Tensor()};
  for (auto& k : ts) saved.push_back(k);
  for (auto& m : masks) saved.push_back(m);
  for (size_t i = kAt; i < t.size(); ++i) saved.push_back(t[i]);
  ctx->save_for_backward(saved);
  return out;
}

struct LoraConvFunction : public torch::autograd::Function<LoraConvFunction> {
  // tensors: the defined ones of (x, base_out, A_0, B_0, bias_0, ...); present: which of those slots are.
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors, std::vector<int64_t> present, bool cast,
                               std::vector<double> scalings, std::vector<double> ps,
                               std::vector<std::vector<int64_t>> opts) {
    auto [t, need] = present_slots(tensors, present);
    ctx->saved_data["present"] = present;
    return {lora_conv_forward(ctx, t, need, cast, scalings, ps, opts)};
  }

  // (grads_in by reference: present_backward says why)
  static variable_list backward(AutogradContext* ctx, variable_list& grads_in) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads_in, backward)) return *batched;
    // 5 non-tensor arguments: present, cast, scalings, ps, opts
    return present_backward(ctx, grads_in, "LoraConvFunction", 5, [&](const std::vector<bool>& need, at::Tensor* dy) {
      return compute(ctx, grads_in[0], need, dy);
    });
  }

  // LoraConvFunction.backward (functional/lora_conv.py), op for op.
  // grad: a copy of dY's handle; dy: the engine's, both released after dY's last use (present_backward), or null
  static variable_list compute(AutogradContext* ctx, at::Tensor grad, const std::vector<bool>& need,
                               at::Tensor* dy) {
    auto& d = ctx->saved_data;
    const bool cast = d["cast"].toBool();
    const auto scalings = d["scalings"].toDoubleVector();
    const auto ps = d["ps"].toDoubleVector();
    const auto opt_list = d["opts"].toList();
    const auto perm_list = d["perms"].toList();
    const auto shape_list = d["t_shapes"].toList();
    const auto t_dtypes = d["t_dtypes"].toIntVector();
    const auto t_formats = d["t_formats"].toIntVector();
    const auto dropping = d["dropping"].toIntVector();
    const auto scales = d["scales"].toDoubleVector();
    const auto noise_strides = d["noise_strides"].toIntVector();
    const bool noise_contiguous = d["noise_contiguous"].toBool();
    const auto sum_dtype = static_cast<at::ScalarType>(d["sum_dtype"].toInt());
    const auto base_dtype = static_cast<at::ScalarType>(d["base_dtype"].toInt());
    const auto x_shape = d["x_shape"].toIntVector();
    const auto x_format = static_cast<at::MemoryFormat>(d["x_format"].toInt());
    const auto x_dtype = static_cast<at::ScalarType>(d["x_dtype"].toInt());
    const size_t n = scalings.size();
    const int64_t nd = static_cast<int64_t>(x_shape.size()) - 2;
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const auto kept = [&](size_t i) -> const at::Tensor& { return saved[1 + i]; };
    const auto mask = [&](size_t i) -> const at::Tensor& { return saved[1 + n + i]; };
    const auto adapter = [&](size_t j) -> const at::Tensor& { return saved[1 + 2 * n + j]; };
    const bool need_x = need[0];
    variable_list grads(kAt + 3 * n);

    at::Tensor g = grad.to(sum_dtype);
    // grad.to(sum_dtype).to(base_dtype) is grad itself: the sum's dtype holds every value of the base's
    if (need[1]) grads[1] = grad.scalar_type() == base_dtype ? grad : g.to(base_dtype);
    const bool g_own = !g.is_same(grad);  // the last adapter to run may scale g in place
    int64_t last = -1;
    for (int64_t i = static_cast<int64_t>(n) - 1; i >= 0; --i)
      if (need_x || need[kAt + 3 * i] || need[kAt + 1 + 3 * i] || need[kAt + 2 + 3 * i]) last = i;
    at::Tensor dxa;
    for (int64_t i = static_cast<int64_t>(n) - 1; i >= 0; --i) {  // autograd runs the last adapter's nodes first
      const at::Tensor &A = adapter(3 * i), &B = adapter(3 * i + 1), &bias = adapter(3 * i + 2);
      const bool need_a = need[kAt + 3 * i], need_b = need[kAt + 1 + 3 * i], need_bb = need[kAt + 2 + 3 * i];
      if (!(need_x || need_a || need_b || need_bb)) continue;
      const auto u_dtype = static_cast<at::ScalarType>(t_dtypes[i]);
      const Opts a = unpack(opt_list.get(2 * i).toIntVector(), nd);
      const Opts b = unpack(opt_list.get(2 * i + 1).toIntVector(), nd);
      at::Tensor g_u = (i == last && g_own && g.scalar_type() == u_dtype) ? g.mul_(py_float(scalings[i]))
                                                                          : g.to(u_dtype) * scalings[i];
      if (i == last) {
        g.reset();
        grad.reset();
        if (dy) dy->reset();  // dY's last reader: freed here unless the base's gradient or the caller holds it
      }
      const bool need_t = need_x || need_a;
      const auto t_shape = shape_list.get(i).toIntVector();
      auto [dt, dB, dBb] = conv_backward(g_u, kept(i), B, b, need_t, need_b, need_bb && bias.defined(), t_shape,
                                         static_cast<at::MemoryFormat>(t_formats[i]));
      grads[kAt + 1 + 3 * i] = dB;
      grads[kAt + 2 + 3 * i] = dBb;
      g_u.reset();
      if (!need_t) continue;
      const double p = ps[i];
      const bool bits = dropping[i] != 0;
      std::vector<int64_t> perm;
      if (bits) perm = perm_list.get(i).toIntVector();
      at::Tensor zero;
      if (p == 1) zero = at::zeros({}, A.options());
      if (need_a) {
        // dA first, with the rebuilt input freed before dX allocates
        at::Tensor xa = cast && x.scalar_type() != A.scalar_type() ? x.to(A.scalar_type()) : x;
        at::Tensor dropped;
        if (bits) {
          dropped = dropout_core::apply_packed(xa, mask(i), perm, scales[i], false);  // xa * noise, as in forward
        } else if (zero.defined()) {
          dropped = xa * zero;
        } else {
          dropped = xa;
        }
        xa.reset();
        grads[kAt + 3 * i] = std::get<1>(conv_backward(dt, dropped, A, a, false, true, false, x_shape, x_format));
      }
      if (need_x) {
        at::Tensor dd = input_grad(dt, A, a, x_shape, x_format);
        if (bits) {
          // made in the mask's memory order, handed on in the layout of stock's `dd * noise` (its input gradient's:
          // a non-contiguous x gave x's layout, and the next node's kernel, e.g. GELU's, rounded differently)
          const auto layout = dropout_core::product_strides(dd, noise_strides, noise_contiguous);
          dd = masks::conform(dropout_core::apply_packed(dd, mask(i), perm, scales[i], true), layout);
        } else if (zero.defined()) {
          dd = dd.mul_(zero);
        }
        dxa = dxa.defined() ? dxa.add_(dd) : dd;
      }
    }
    if (need_x && dxa.defined()) grads[0] = dxa.to(x_dtype);
    return grads;
  }
};

// One call of peft's LoRA-conv adapters: (output, whether x itself was saved for backward).
std::tuple<at::Tensor, bool> lora_conv(const std::vector<std::optional<at::Tensor>>& tensors, bool cast,
                                       const std::vector<double>& scalings, const std::vector<double>& ps,
                                       const std::vector<std::vector<int64_t>>& opts) {
  TORCH_CHECK(opts.size() == 2 * scalings.size() && ps.size() == scalings.size() &&
                  tensors.size() == kAt + 3 * scalings.size() && !scalings.empty(),
              "lora_conv_apply: one (A, B, bias), scaling, p and two option lists per adapter");
  std::vector<at::Tensor> t;
  t.reserve(tensors.size());
  bool any_grad = false;
  for (const auto& o : tensors) {
    t.push_back(o.has_value() ? *o : at::Tensor());
    any_grad = any_grad || (t.back().defined() && t.back().requires_grad());
  }
  const int64_t nd = t[0].dim() - 2;
  for (const auto& o : opts)
    TORCH_CHECK(static_cast<int64_t>(o.size()) == 3 * nd + 1, "lora_conv_apply: options must be stride, padding, "
                "dilation (", nd, " each) and groups, got ", o.size(), " values");
  if (!(at::GradMode::is_enabled() && any_grad)) {
    std::vector<bool> need(t.size(), false);
    return {lora_conv_forward(nullptr, t, need, cast, scalings, ps, opts), false};
  }
  std::vector<at::Tensor> defined;
  std::vector<int64_t> present(t.size(), 0);
  for (size_t i = 0; i < t.size(); ++i)
    if (t[i].defined()) {
      defined.push_back(t[i]);
      present[i] = 1;
    }
  auto out = LoraConvFunction::apply(at::TensorList(defined), present, cast, scalings, ps, opts);
  bool x_kept = false;  // x is saved when some A trains
  for (size_t i = kAt; i < t.size(); i += 3) x_kept = x_kept || t[i].requires_grad();
  return {out[0], x_kept};
}

}  // namespace

static Register reg_lora_conv([](pybind11::module_& m) {
  m.def("lora_conv_apply", &lora_conv, "slimgrad LoRA conv (peft's lora.Conv1d/2d/3d, bits dropout): one C++ Function");
});

}  // namespace slimgrad
