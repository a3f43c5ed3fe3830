// Convolutions (1-3d, plain and transposed, every padding mode) of slimgrad's compiled eager core: the C++ twin of
// slimgrad.functional.conv._ConvFunction, with the same decisions (what is kept, which kernel gives dX, which
// tensor stands in for X), so its numbers and saved bytes are the Python path's and stock's.
//
// Kept: X only when the weight needs grad, the weight only when X does; with an explicit pad (padding modes, an
// asymmetric padding='same') X unpadded, the pad redone in backward. dX: aten's convolution_backward fed a tensor
// of X's shape and layout whose values it never reads (channels-last X, and 1x1 kernels, where it is faster than
// the transposed convolution), else the transposed (plain, for a transposed conv) convolution of dY; then the
// pad's backward. dW/dB: convolution_backward (the weight kept where it is a leaf, else an uninitialised carrier of
// its shape and layout), dB alone a sum (fp16/bf16 on CPU: that call, for the bias only, on carriers). Under
// autocast Python casts the tensors as autocast does and calls this on the casts (zeros padding; a padding mode, and
// an X that views a larger storage with a trainable weight, where the Python Function keeps a compact copy, stay
// with the Python Function).
#include "common.h"

#include <ATen/Parallel.h>
#include <ATen/native/ConvUtils.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>
#include <mutex>

namespace slimgrad {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Options that do not change between calls of one module (made once, cached on the module by Python).
struct ConvCfg : torch::CustomClassHolder {
  std::vector<int64_t> stride, padding, dilation, output_padding;
  bool transposed = false;
  int64_t groups = 1;
  std::vector<int64_t> pad;  // an explicit F.pad of X first (F.pad order), empty for none
  std::string pad_mode;      // "constant", "reflect", "replicate", "circular"
  bool padded() const { return !pad.empty(); }
};

// Per-call state for backward (non-tensor; every tensor kept goes through save_for_backward).
struct ConvState : torch::CustomClassHolder {
  c10::intrusive_ptr<ConvCfg> cfg;
  std::vector<int64_t> x_shape, x_stride, w_shape, xp_shape;  // xp: X as the convolution saw it (padded)
  at::MemoryFormat x_format = at::MemoryFormat::Contiguous, xp_format = at::MemoryFormat::Contiguous;
  at::MemoryFormat w_format = at::MemoryFormat::Contiguous;  // the weight carrier's layout (weight_carrier)
  bool need_x = false, need_w = false, need_b = false;
  bool carrier_dx = false;  // dX through convolution_backward with a carrier of X's shape and layout
  bool db_in_dx_call = false;  // dB from that same call (fp16/bf16 on CPU: see conv_fwd)
  bool db_call = false;  // the bias alone trainable: dB from convolution_backward on carriers (see conv_fwd)
  // X itself while someone else holds it (nothing kept alive): the carrier of choice.
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> x_ref{
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  bool has_x_ref = false;
};

// slimgrad.functional.conv._format: the layout aten's convolution reads from `t`; a tensor contiguous in both
// layouts goes by its strides (as aten's choice does).
at::MemoryFormat conv_format(const at::Tensor& t) {
  if (t.is_contiguous()) {
    const auto d = t.dim();
    if (d == 4 ? !t.is_contiguous(at::MemoryFormat::ChannelsLast)
               : (d == 5 ? !t.is_contiguous(at::MemoryFormat::ChannelsLast3d) : true))
      return at::MemoryFormat::Contiguous;
  }
  return t.suggest_memory_format();
}

// Whether aten's kernels see `t` in a layout an uninitialised tensor of conv_format(t) reproduces: contiguous or
// channels-last. A computed weight that is another view (a parametrization returning a transpose: orthogonal on wide
// conv kernels) is not: its carrier made dW through other kernels than stock's (~1e-6 off), and its dX by the
// transposed convolution read it strided where stock's backward reads a contiguous copy (the wrappers sweep).
bool standard_layout(const at::Tensor& t) {
  if (t.is_contiguous()) return true;
  const auto d = t.dim();
  return (d == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
         (d == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d));
}

std::vector<int64_t> dense_strides(at::IntArrayRef shape, at::MemoryFormat fmt) {
  const int64_t n = static_cast<int64_t>(shape.size());
  std::vector<int64_t> order;
  if (fmt == at::MemoryFormat::ChannelsLast || fmt == at::MemoryFormat::ChannelsLast3d) {
    order.push_back(1);
    for (int64_t d = n - 1; d >= 2; --d) order.push_back(d);
    order.push_back(0);
  } else {
    for (int64_t d = n - 1; d >= 0; --d) order.push_back(d);
  }
  std::vector<int64_t> strides(n, 0);
  int64_t step = 1;
  for (auto d : order) {
    strides[d] = step;
    step *= std::max<int64_t>(shape[d], 1);
  }
  return strides;
}

int64_t extent(at::IntArrayRef shape, at::IntArrayRef strides) {
  int64_t e = 1;
  for (size_t i = 0; i < shape.size(); ++i) e += (shape[i] - 1) * strides[i];
  return e;
}

// slimgrad.functional.conv._shape_carrier: a tensor of `shape` and layout `fmt` whose values the kernel never reads:
// X while alive and unchanged in shape and layout; else a view over the incoming gradient's storage where it is
// large enough; else an uninitialised tensor (stock holds X here). Under a differentiable backward the latter.
at::Tensor shape_carrier(const ConvState& st, at::IntArrayRef shape, at::MemoryFormat fmt, const at::Tensor& big) {
  if (!at::GradMode::is_enabled()) {
    if (st.has_x_ref) {
      auto impl = st.x_ref.lock();
      if (impl) {
        at::Tensor x(std::move(impl));
        if (x.sizes() == shape && x.strides() == at::IntArrayRef(st.x_stride) &&
            x.scalar_type() == big.scalar_type() && x.device() == big.device() && x.has_storage() &&
            static_cast<int64_t>(x.storage().nbytes()) >=
                (x.storage_offset() + extent(x.sizes(), x.strides())) * static_cast<int64_t>(x.element_size()))
          return x;
      }
    }
    auto strides = dense_strides(shape, fmt);
    if (big.has_storage() && static_cast<int64_t>(big.storage().nbytes()) >=
                                 extent(shape, strides) * static_cast<int64_t>(big.element_size()))
      return big.as_strided(shape, strides, 0);
  }
  return at::empty(shape, big.options().memory_format(fmt));
}

// slimgrad.functional._common.suggest_memory_format
at::MemoryFormat plain_format(const at::Tensor& t) {
  if (t.is_contiguous()) return at::MemoryFormat::Contiguous;
  if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) return at::MemoryFormat::ChannelsLast;
  if (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d)) return at::MemoryFormat::ChannelsLast3d;
  return at::MemoryFormat::Contiguous;
}

at::Tensor pad_x(const ConvCfg& c, const at::Tensor& x) {
  return at::pad(x, c.pad, c.pad_mode, std::nullopt);
}

// slimgrad.functional.conv._circular_pad_backward: the reverse of stock's slice copies, one addition per element
// and step as in stock.
at::Tensor circular_pad_backward(at::Tensor g, const std::vector<int64_t>& pad) {
  const at::Tensor grad = g;
  const int64_t nd = static_cast<int64_t>(pad.size()) / 2;
  for (int64_t i = nd - 1; i >= 0; --i) {
    const int64_t dim = g.dim() - 1 - i, pad_l = pad[2 * i], pad_r = pad[2 * i + 1], size = g.size(dim);
    if (pad_r > 0) g.narrow(dim, pad_l, pad_r).add_(g.narrow(dim, size - pad_r, pad_r));
    if (pad_l > 0) g.narrow(dim, size - pad_l - pad_r, pad_l).add_(g.narrow(dim, 0, pad_l));
  }
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t dim = g.dim() - 1 - i, pad_l = pad[2 * i], pad_r = pad[2 * i + 1];
    g = g.narrow(dim, pad_l, g.size(dim) - pad_l - pad_r);
  }
  return g.contiguous(plain_format(grad));
}

// slimgrad.functional.conv._pad_backward: the pad's gradient from the padded one, without X.
at::Tensor pad_backward(const ConvState& st, const at::Tensor& dxp) {
  const auto& c = *st.cfg;
  if (c.pad_mode == "constant") {
    std::vector<int64_t> neg(c.pad.size());
    for (size_t i = 0; i < neg.size(); ++i) neg[i] = -c.pad[i];
    return at::constant_pad_nd(dxp, neg);
  }
  if (c.pad_mode == "circular") return circular_pad_backward(dxp, c.pad);
  const int64_t nd = static_cast<int64_t>(c.pad.size()) / 2;
  std::vector<int64_t> shape = dxp.sizes().vec();
  for (int64_t i = 0; i < nd; ++i) shape[shape.size() - 1 - i] -= c.pad[2 * i] + c.pad[2 * i + 1];
  at::Tensor like = st.x_format == at::MemoryFormat::Contiguous
                        ? at::empty({}, dxp.options()).expand(shape)
                        : shape_carrier(st, shape, st.x_format, dxp);
  const bool reflect = c.pad_mode == "reflect";
  switch (nd) {
    case 1:
      return reflect ? at::reflection_pad1d_backward(dxp, like, c.pad)
                     : at::replication_pad1d_backward(dxp, like, c.pad);
    case 2:
      return reflect ? at::reflection_pad2d_backward(dxp, like, c.pad)
                     : at::replication_pad2d_backward(dxp, like, c.pad);
    default:
      return reflect ? at::reflection_pad3d_backward(dxp, like, c.pad)
                     : at::replication_pad3d_backward(dxp, like, c.pad);
  }
}

at::Tensor unpad(const ConvState& st, const at::Tensor& dxp) {
  return st.cfg->padded() ? pad_backward(st, dxp) : dxp;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_backward(const ConvCfg& c, const at::Tensor& grad,
                                                               const at::Tensor& x, const at::Tensor& weight,
                                                               std::array<bool, 3> mask) {
  const int64_t channels = grad.size(1);
  at::OptionalIntArrayRef bias_sizes;
  if (mask[2]) bias_sizes = at::IntArrayRef(&channels, 1);
  return at::convolution_backward(grad, x, weight, bias_sizes, c.stride, c.padding, c.dilation, c.transposed,
                                  c.output_padding, c.groups, mask);
}

// slimgrad.functional.conv._dx_route_on_onednn: stock's convolution (on X) and the one computing dX without dW
// (transposed to it, on dY, shaped as the output) both on oneDNN, by aten's own backend selector.
bool select_dx_route_on_onednn(const ConvCfg& c, const at::Tensor& xp, const at::Tensor& weight,
                               const at::Tensor& out) {
  using at::native::ConvBackend;
  auto onednn = [](ConvBackend b) {
    return b == ConvBackend::Mkldnn || b == ConvBackend::MkldnnTranspose || b == ConvBackend::MkldnnEmpty;
  };
  const std::vector<int64_t> zeros(c.stride.size(), 0);
  auto sym = [](const std::vector<int64_t>& v) { return c10::fromIntArrayRefSlow(v); };
  if (!onednn(at::native::select_conv_backend(xp, weight, std::nullopt, sym(c.stride), sym(c.padding),
                                              sym(c.dilation), c.transposed, sym(c.output_padding),
                                              c10::SymInt(c.groups), std::nullopt)))
    return false;
  return onednn(at::native::select_conv_backend(out, weight, std::nullopt, sym(c.stride), sym(c.padding),
                                                sym(c.dilation), !c.transposed, sym(zeros), c10::SymInt(c.groups),
                                                std::nullopt));
}

// Asked once per key (sizes, strides, dtypes, the options, the thread count, oneDNN's switch: all the selector
// reads here), as the Python path asks it.
bool dx_route_on_onednn(const ConvCfg& c, const at::Tensor& xp, const at::Tensor& weight, const at::Tensor& out) {
  std::vector<int64_t> key;
  auto add = [&](at::IntArrayRef v) {
    key.push_back(static_cast<int64_t>(v.size()));
    key.insert(key.end(), v.begin(), v.end());
  };
  add(xp.sizes());
  add(xp.strides());
  add(weight.sizes());
  add(out.sizes());
  add(c.stride);
  add(c.padding);
  add(c.dilation);
  add(c.output_padding);
  key.insert(key.end(), {static_cast<int64_t>(xp.scalar_type()), static_cast<int64_t>(weight.scalar_type()),
                         c.transposed, c.groups, at::get_num_threads(),
                         at::globalContext().userEnabledMkldnn()});
  static std::mutex lock;
  static std::map<std::vector<int64_t>, bool> answers;
  {
    std::lock_guard<std::mutex> guard(lock);
    auto it = answers.find(key);
    if (it != answers.end()) return it->second;
  }
  const bool answer = select_dx_route_on_onednn(c, xp, weight, out);
  std::lock_guard<std::mutex> guard(lock);
  if (answers.size() >= 1024) answers.clear();
  answers.emplace(std::move(key), answer);
  return answer;
}

// slimgrad.functional.conv._weight_carrier: the weight for a convolution_backward without dX where it was not kept
// (a computed weight, which stock keeps): aten makes it contiguous in the backend's layout before reading its shape,
// so a zero-stride stand-in became a weight-sized copy plus its element; an uninitialised tensor in the weight's
// layout costs the bytes stock held all along.
at::Tensor weight_carrier(const ConvState& st, const at::Tensor& grad) {
  return at::empty(st.w_shape, grad.options().memory_format(st.w_format));
}

// The forward and backward shared by the two Functions below (with and without a bias: autograd cannot take an
// undefined tensor as an input).
at::Tensor conv_fwd(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                    const c10::intrusive_ptr<ConvCfg>& cfg, bool grad_mode) {
  const auto& c = *cfg;
  const at::Tensor xp = c.padded() ? pad_x(c, x) : x;
  auto out = at::convolution(xp, weight, bias, c.stride, c.padding, c.dilation, c.transposed, c.output_padding,
                             c.groups);
  // ctx->needs_input_grad, also where no input requires grad (the node then has no edges to ask)
  const bool need_x = grad_mode && x.requires_grad(), need_w = grad_mode && weight.requires_grad();
  const bool need_b = grad_mode && bias.defined() && bias.requires_grad();
  if (!(need_x || need_w || need_b)) return out;
  auto st = c10::make_intrusive<ConvState>();
  st->cfg = cfg;
  st->need_x = need_x;
  st->need_w = need_w;
  st->need_b = need_b;
  st->x_shape = x.sizes().vec();
  st->xp_shape = xp.sizes().vec();
  st->w_shape = weight.sizes().vec();
  st->xp_format = conv_format(xp);
  st->x_format = c.padded() && need_x ? conv_format(x) : st->xp_format;
  const bool cpu = x.device().is_cpu();
  // fp16/bf16 on CPU: a separate dB sum would make an fp32 copy of dY (aten's CPU sum of a reduced float type over
  // several dims); stock's own call gives dB there, its bits and bytes
  const bool reduced_on_cpu = cpu && (out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16);
  if (need_x && !need_w) {
    bool pointwise = !c.transposed;
    for (int64_t d = 2; d < weight.dim(); ++d) pointwise = pointwise && weight.size(d) == 1;
    // (and stock's CPU fallback kernels, fp64/fp16, and wherever stock's kernel or the transposed convolution on dY
    // would not run oneDNN: see functional/conv.py's setup_context)
    const bool fallback_kernel = cpu && x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16;
    // A trainable bias in fp16/bf16 on CPU: dB from stock's own call, with dX: the carrier route.
    st->db_in_dx_call = need_b && reduced_on_cpu;
    // A strided convolution on CPU: stock's backward-data kernel, as fast or faster, where oneDNN's transposed
    // convolution took a scratch 128 B larger (step peak above stock's).
    bool strided = false;
    for (auto s : c.stride) strided = strided || s != 1;
    strided = strided && !c.transposed && cpu;
    // (the backend selector last: asked only where nothing else decided)
    // (a weight in another layout: stock's own call reads it as stock's does, see standard_layout)
    st->carrier_dx = pointwise || st->db_in_dx_call || strided || fallback_kernel ||
                     st->xp_format != at::MemoryFormat::Contiguous || !standard_layout(weight) ||
                     (cpu && !dx_route_on_onednn(c, xp, weight, out));
    if (st->carrier_dx || st->x_format != at::MemoryFormat::Contiguous) {
      st->x_stride = x.strides().vec();
      st->x_ref = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(x.getIntrusivePtr());
      st->has_x_ref = true;
    }
  } else if (!need_x && !need_w && need_b && reduced_on_cpu) {
    // The bias alone trainable in fp16/bf16 on CPU: dB from stock's own call (output_mask for the bias only), where
    // a sum over (N, spatial) would make an fp32 copy of dY: up to 2x dY above stock's step peak. Fed the weight
    // (kept where it is a leaf, else a carrier) and a carrier of X's shape and layout: stock keeps both.
    st->db_call = true;
    st->x_stride = x.strides().vec();
    st->x_ref = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(x.getIntrusivePtr());
    st->has_x_ref = true;
  }
  // The weight for dX, and for dW (or dB alone, above) where it is a leaf the caller holds anyway: aten's backward
  // makes whatever stands in for it contiguous (see weight_carrier).
  // (A computed weight in another layout is kept, as stock keeps it: no carrier reproduces what aten reads.)
  const bool keep_w = need_x || ((need_w || st->db_call) && (weight.is_leaf() || !standard_layout(weight)));
  if ((need_w || st->db_call) && !keep_w) st->w_format = conv_format(weight);
  ctx->save_for_backward({need_w ? x : at::Tensor(), keep_w ? weight : at::Tensor()});
  ctx->saved_data["s"] = c10::IValue::make_capsule(st);
  return out;
}

// dX, dW, dB (undefined where not requested)
std::array<at::Tensor, 3> conv_bwd(AutogradContext* ctx, const at::Tensor& grad) {
  auto st = c10::static_intrusive_pointer_cast<ConvState>(ctx->saved_data["s"].toCapsule());
  const auto& c = *st->cfg;
  auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  // A parameter whose data was replaced since forward (diffusers' layerwise casting puts fp8 storage back after each
  // forward; stock reads the new data too, and aten's backward takes the mixed dtypes): in dY's dtype, the forward's
  if (saved[1].defined() && saved[1].scalar_type() != grad.scalar_type()) saved[1] = saved[1].to(grad.scalar_type());
  const at::Tensor& weight = saved[1];
  at::Tensor dx, dw, db;
  if (st->need_x && st->need_w) {
    std::tie(dx, dw, db) =
        conv_backward(c, grad, c.padded() ? pad_x(c, x) : x, weight, {true, true, st->need_b});
    return {unpad(*st, dx), dw, st->need_b ? db : at::Tensor()};
  }
  if (st->need_x && st->carrier_dx) {
    auto carrier = shape_carrier(*st, st->xp_shape, st->xp_format, grad);
    std::tie(dx, std::ignore, db) = conv_backward(c, grad, carrier, weight, {true, false, st->db_in_dx_call});
    carrier = at::Tensor();
    dx = unpad(*st, dx);
  } else if (st->need_x) {
    // Stock's backward runs in the contiguous layout whatever dY's: the copy is the one its kernel makes.
    auto g = grad.is_contiguous() ? grad : grad.contiguous();
    const int64_t nd = static_cast<int64_t>(st->x_shape.size()) - 2;
    if (c.transposed) {
      dx = at::convolution(g, weight, {}, c.stride, c.padding, c.dilation, false, std::vector<int64_t>(nd, 0),
                           c.groups);
      // With output_padding >= stride the plain conv yields extra trailing rows: drop them.
      for (int64_t i = 0; i < nd; ++i)
        if (dx.size(2 + i) != st->xp_shape[2 + i]) dx = dx.narrow(2 + i, 0, st->xp_shape[2 + i]);
    } else {
      std::vector<int64_t> extra(nd);
      for (int64_t i = 0; i < nd; ++i)
        extra[i] = st->xp_shape[2 + i] - ((grad.size(2 + i) - 1) * c.stride[i] - 2 * c.padding[i] +
                                          c.dilation[i] * (st->w_shape[2 + i] - 1) + 1);
      dx = at::convolution(g, weight, {}, c.stride, c.padding, c.dilation, true, extra, c.groups);
    }
    dx = unpad(*st, dx);
  }
  if (st->need_w) {
    auto w = weight.defined() ? weight : weight_carrier(*st, grad);
    auto r = conv_backward(c, grad, c.padded() ? pad_x(c, x) : x, w, {false, true, st->need_b});
    dw = std::get<1>(r);
    db = std::get<2>(r);
  } else if (st->need_b && !db.defined() && st->db_call) {
    auto carrier = shape_carrier(*st, st->xp_shape, st->xp_format, grad);
    db = std::get<2>(conv_backward(c, grad, carrier, weight.defined() ? weight : weight_carrier(*st, grad),
                                   {false, false, true}));
  } else if (st->need_b && !db.defined()) {
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < grad.dim(); ++d) dims.push_back(d);
    db = grad.sum(dims);
  }
  return {st->need_x ? dx : at::Tensor(), dw, st->need_b ? db : at::Tensor()};
}

class ConvFunction : public torch::autograd::Function<ConvFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const c10::intrusive_ptr<ConvCfg>& cfg, bool grad_mode) {
    return conv_fwd(ctx, x, weight, bias, cfg, grad_mode);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    auto g = conv_bwd(ctx, grads[0]);
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor()};
  }
};

class ConvNoBiasFunction : public torch::autograd::Function<ConvNoBiasFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::intrusive_ptr<ConvCfg>& cfg, bool grad_mode) {
    return conv_fwd(ctx, x, weight, at::Tensor(), cfg, grad_mode);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    auto g = conv_bwd(ctx, grads[0]);
    return {g[0], g[1], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

static Register reg_conv([](pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<ConvCfg, c10::intrusive_ptr<ConvCfg>>(m, "conv_Cfg")
      .def(py::init([](std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
                       bool transposed, std::vector<int64_t> output_padding, int64_t groups,
                       std::vector<int64_t> pad, std::string pad_mode) {
        auto c = c10::make_intrusive<ConvCfg>();
        c->pad = std::move(pad);
        c->pad_mode = std::move(pad_mode);
        c->stride = std::move(stride);
        c->padding = std::move(padding);
        c->dilation = std::move(dilation);
        c->transposed = transposed;
        c->output_padding = std::move(output_padding);
        c->groups = groups;
        return c;
      }))
      .def_property_readonly("padded", &ConvCfg::padded);
  m.def(
      "conv_forward",
      [](const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
         const c10::intrusive_ptr<ConvCfg>& cfg) {
        const bool grad_mode = at::GradMode::is_enabled();
        if (bias.has_value()) return ConvFunction::apply(x, weight, *bias, cfg, grad_mode);
        return ConvNoBiasFunction::apply(x, weight, cfg, grad_mode);
      },
      "slimgrad's convolution (see conv.cpp): keeps X only for dW, the weight only for dX");
});

}  // namespace slimgrad
