// Average and adaptive average pooling in the compiled core: stock's kernels, nothing kept, one C++ call.
//
// Average pooling's backward needs only the input's shape and layout, so slimgrad's Python Function
// (functional.pooling.AvgPoolFunction) keeps nothing where stock keeps the input. Its saving costs a Python
// Function call and per-call argument handling (about 45 us a call, measured: 2x stock on small tensors); this
// Function does the same in C++: aten's forward kernel, and in backward aten's backward kernel fed a zero-stride
// stand-in of the input (its values are never read; a view of the incoming gradient, so it allocates nothing) or,
// where stock's gradient is channels_last, the channels_last buffer itself as that input (CUDA's kernels pick their
// loop from it), step for step as the Python Function. Adaptive pooling with a channels_last gradient is left to
// stock's op (avg_pool).
// Arguments aten rejects raise inside the call; the caller
// then runs the Python Function, whose error is stock's.
#include "common.h"

#include <optional>
#include <vector>

namespace slimgrad {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AvgPoolOptions {
  int64_t nd = 2;
  bool adaptive = false;
  std::vector<int64_t> kernel, stride, padding, output_size;  // output_size: -1 where None (the input's size)
  bool ceil_mode = false, count_include_pad = true;
  std::optional<int64_t> divisor_override;
};

AvgPoolOptions make_options(int64_t nd, bool adaptive, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                            std::vector<int64_t> padding, bool ceil_mode, bool count_include_pad,
                            std::optional<int64_t> divisor_override, std::vector<int64_t> output_size) {
  AvgPoolOptions o;
  o.nd = nd;
  o.adaptive = adaptive;
  o.kernel = std::move(kernel);
  o.stride = std::move(stride);
  o.padding = std::move(padding);
  o.ceil_mode = ceil_mode;
  o.count_include_pad = count_include_pad;
  o.divisor_override = divisor_override;
  o.output_size = std::move(output_size);
  return o;
}

// Whether stock's backward gives x's gradient channels_last: x's (1-d: unsqueezed) suggested format, 2-d kernels
// only (the 3-d ones return contiguous gradients).
bool channels_last_grad(const at::Tensor& x, int64_t nd) {
  if (nd == 3 || x.is_contiguous()) return false;
  const at::Tensor x4 = nd == 1 ? x.unsqueeze(-2) : x;
  return x4.dim() == 4 && x4.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
}

// A zero-stride tensor of `shape` that allocates nothing: a read-only view of g's first element (its values are
// never read), as functional._common.standin. A fresh element only where g has none.
at::Tensor stand_in(const at::Tensor& g, at::IntArrayRef shape) {
  if (g.numel() == 0) return at::empty({}, g.options()).expand(shape);
  return g.detach().as_strided(shape, std::vector<int64_t>(shape.size(), 0), g.storage_offset());
}

struct AvgPoolFunction : public torch::autograd::Function<AvgPoolFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const AvgPoolOptions* o,
                            const std::vector<int64_t>* out_size) {
    at::Tensor out;
    if (o->adaptive) {
      if (o->nd == 1)
        out = at::adaptive_avg_pool1d(x, *out_size);
      else if (o->nd == 2)
        out = at::adaptive_avg_pool2d(x, *out_size);
      else
        out = at::adaptive_avg_pool3d(x, *out_size);
    } else if (o->nd == 1) {
      out = at::avg_pool1d(x, o->kernel, o->stride, o->padding, o->ceil_mode, o->count_include_pad);
    } else if (o->nd == 2) {
      out = at::avg_pool2d(x, o->kernel, o->stride, o->padding, o->ceil_mode, o->count_include_pad,
                           o->divisor_override);
    } else {
      out = at::avg_pool3d(x, o->kernel, o->stride, o->padding, o->ceil_mode, o->count_include_pad,
                           o->divisor_override);
    }
    // What backward needs, in one int list: nd, adaptive, channels_last, ceil_mode, count_include_pad,
    // has divisor, divisor, rank, the (1-d: unsqueezed) input shape, then kernel, stride, padding (1-d: 2-d's).
    const bool one = o->nd == 1;
    std::vector<int64_t> shape = x.sizes().vec();
    if (one) shape.insert(shape.end() - 1, 1);
    const bool cl = channels_last_grad(x, o->nd);
    std::vector<int64_t> v = {o->nd, o->adaptive, cl, o->ceil_mode, o->count_include_pad,
                              o->divisor_override.has_value(), o->divisor_override.value_or(0),
                              static_cast<int64_t>(shape.size())};
    v.insert(v.end(), shape.begin(), shape.end());
    if (!o->adaptive) {
      for (const auto* opt : {&o->kernel, &o->stride, &o->padding}) {
        if (one) v.push_back(opt == &o->padding ? 0 : 1);
        v.insert(v.end(), opt->begin(), opt->end());
      }
    }
    ctx->saved_data["a"] = std::move(v);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    const auto v = ctx->saved_data["a"].toIntVector();
    const int64_t nd = v[0], rank = v[7];
    const bool adaptive = v[1], cl = v[2], ceil = v[3], cip = v[4];
    const std::optional<int64_t> div = v[5] ? std::optional<int64_t>(v[6]) : std::nullopt;
    const std::vector<int64_t> shape(v.begin() + 8, v.begin() + 8 + rank);
    at::Tensor g = nd == 1 ? grads[0].unsqueeze(-2) : grads[0];
    at::Tensor gi;
    if (adaptive) {
      // The result takes its layout from the input argument, whose values it never reads; channels_last inputs
      // never get here (avg_pool leaves them to stock), so a stand-in gives stock's layout.
      const at::Tensor self = stand_in(g, shape);
      gi = nd == 3 ? at::_adaptive_avg_pool3d_backward(g, self) : at::_adaptive_avg_pool2d_backward(g, self);
    } else {
      const int64_t m = nd == 1 ? 2 : nd, o0 = 8 + rank;
      const std::vector<int64_t> k(v.begin() + o0, v.begin() + o0 + m), s(v.begin() + o0 + m, v.begin() + o0 + 2 * m),
          p(v.begin() + o0 + 2 * m, v.begin() + o0 + 3 * m);
      if (nd == 3) {
        gi = at::avg_pool3d_backward(g, stand_in(g, shape), k, s, p, ceil, cip, div);
      } else if (cl) {
        gi = at::empty(shape, g.options().memory_format(at::MemoryFormat::ChannelsLast));
        // the buffer is the input argument too: the kernels (CUDA's in particular) choose their loop from the
        // input's suggested format, and a stand-in suggests contiguous (values never read)
        at::avg_pool2d_backward_out(gi, g, gi, k, s, p, ceil, cip, div);
      } else {
        gi = at::avg_pool2d_backward(g, stand_in(g, shape), k, s, p, ceil, cip, div);
      }
    }
    if (nd == 1) gi = gi.squeeze(-2);
    return once_differentiable({gi, at::Tensor(), at::Tensor()}, grads, "AvgPoolFunction");
  }
};

// The eager call; None where the Python path must run: an adaptive output of all ones (stock's mean), or an
// adaptive gradient stock lays out channels_last. That layout comes from the backward kernel's input argument
// alone (it has no out= variant of its own), and a tensor with channels_last strides spans the input's bytes:
// allocating one in backward put the peak an input above stock's, so stock's op runs (functional.pooling,
// _adaptive_grad_needs_input).
pybind11::object avg_pool(const at::Tensor& x, const AvgPoolOptions& o) {
  std::vector<int64_t> out_size;
  if (o.adaptive) {
    if (channels_last_grad(x, o.nd)) return pybind11::none();
    const int64_t n = o.output_size.size();
    if (x.dim() <= n && o.nd > 1) return pybind11::none();  // the Python path raises stock's error
    bool ones = true;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = o.output_size[i] >= 0 ? o.output_size[i] : x.size(x.dim() - n + i);
      out_size.push_back(v);
      ones = ones && v == 1;
    }
    if (ones) return pybind11::none();
  }
  return pybind11::cast(AvgPoolFunction::apply(x, &o, &out_size));
}

}  // namespace

static Register reg_avg_pool([](pybind11::module_& m) {
  pybind11::class_<AvgPoolOptions>(m, "AvgPoolOptions").def_readonly("nd", &AvgPoolOptions::nd);
  m.def("avg_pool_options", &make_options,
        "average pooling options: nd, adaptive, kernel, stride, padding, ceil_mode, count_include_pad, "
        "divisor_override, output_size (-1 for None)");
  m.def("avg_pool_apply", &avg_pool, "slimgrad average pooling: one C++ autograd Function call, or None");
});

}  // namespace slimgrad
