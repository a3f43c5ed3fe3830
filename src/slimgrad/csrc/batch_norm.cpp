// Batch norm of slimgrad's compiled eager core: the C++ twin of slimgrad.functional.batch_norm.BatchNormFunction,
// with its decisions (what is kept, what stands in for x, where dX is computed directly), so its numbers and saved
// bytes are the Python path's and stock's. aten's own kernels: native_batch_norm, native_batch_norm_backward, and on
// CUDA, where stock's selector picks cuDNN (the caller asks it), cudnn_batch_norm and its backward, as stock runs
// them (the Python Function's cuDNN branch, with no Python in the call: host-bound CUDA steps).
//
// Kept: x only where a requested gradient reads it (dW; dX in training), the running statistics in evaluation
// (buffers), the weight (a parameter), in training with x not kept the bias (a C-sized tensor of the statistics'
// dtype for the kernel's unread statistics). Double backward is refused, as the Python Function refuses it.
#include "common.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>

namespace slimgrad {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct BatchNormState : torch::CustomClassHolder {
  bool need_x = false, need_w = false, need_b = false, training = false;
  double eps = 0;
  std::vector<int64_t> x_shape, x_stride;
  bool x_dense = false;
  std::optional<at::MemoryFormat> x_format;  // channels-last layout of x, else none
  at::ScalarType stat_dtype = at::kFloat;
  // cuDNN in training: dB from cudnn_batch_norm_backward, handed dY in the layout cuDNN got x in
  bool cudnn_training = false;
  at::MemoryFormat cudnn_format = at::MemoryFormat::Contiguous;
};

// slimgrad.functional.batch_norm._dense: the elements fill [offset, offset + numel) exactly.
bool dense(const at::Tensor& t) {
  if (t.is_contiguous()) return true;
  std::vector<std::pair<int64_t, int64_t>> st;  // (stride, size) of the dims of size != 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) != 1) st.emplace_back(t.stride(d), t.size(d));
  std::sort(st.begin(), st.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : st) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

std::optional<at::MemoryFormat> channels_last_format(const at::Tensor& t) {
  if (t.is_contiguous()) return std::nullopt;
  if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) return at::MemoryFormat::ChannelsLast;
  if (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d)) return at::MemoryFormat::ChannelsLast3d;
  return std::nullopt;
}

const at::Tensor& value_or_undefined(const std::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

class BatchNormFunction : public torch::autograd::Function<BatchNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& weight_,
                            const std::optional<at::Tensor>& bias_, const std::optional<at::Tensor>& running_mean,
                            const std::optional<at::Tensor>& running_var, bool training, double momentum, double eps,
                            bool cudnn, bool grad_mode) {
    const at::Tensor& weight = value_or_undefined(weight_);
    const at::Tensor& bias = value_or_undefined(bias_);
    // cuDNN (stock's pick on CUDA): the operands _batch_norm_impl_index hands it, the same copies if any
    const at::MemoryFormat cudnn_format = !cudnn || input.is_contiguous() ? at::MemoryFormat::Contiguous
                                                                           : input.suggest_memory_format();
    at::Tensor out, save_mean, save_invstd, reserve;
    if (cudnn) {
      auto contiguous = [](const std::optional<at::Tensor>& t) {
        return t.has_value() && t->defined() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
      };
      std::tie(out, save_mean, save_invstd, reserve) =
          at::cudnn_batch_norm(input.contiguous(cudnn_format), weight.contiguous(), contiguous(bias_),
                               contiguous(running_mean), contiguous(running_var), training, momentum, eps);
    } else {
      std::tie(out, save_mean, save_invstd) =
          at::native_batch_norm(input, weight_, bias_, running_mean, running_var, training, momentum, eps);
    }
    auto st = c10::make_intrusive<BatchNormState>();
    st->need_x = grad_mode && input.requires_grad();
    st->need_w = grad_mode && weight.defined() && weight.requires_grad();
    st->need_b = grad_mode && bias.defined() && bias.requires_grad();
    if (!(st->need_x || st->need_w || st->need_b)) return out;
    st->training = training;
    st->eps = eps;
    st->x_shape = input.sizes().vec();
    st->x_stride = input.strides().vec();
    st->x_dense = dense(input);
    st->x_format = channels_last_format(input);
    // (cuDNN: the dtype slimgrad.functional.batch_norm._stat_dtype gives CUDA, for evaluation's unread statistics)
    st->stat_dtype = !cudnn ? save_mean.scalar_type()
                     : input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16 ? at::kFloat
                                                                                                : input.scalar_type();
    // dW always reads x; in training dX reads it as well (through x̂ and the batch statistics). The Python caller
    // notes a kept x for its producer (slimgrad.functional._common.note_input_kept).
    const bool keep_x = st->need_w || (training && st->need_x);
    if (cudnn && training) {
      // The caller runs stock itself wherever x is read, so only dB is requested here; cuDNN's backward reads its
      // own statistics and reserve (C-sized, and a reserve cuDNN sizes for itself: stock keeps both, and x).
      TORCH_CHECK(!keep_x, "slimgrad: batch_norm_forward with cuDNN in training serves a gradient of the bias only");
      st->cudnn_training = true;
      st->cudnn_format = cudnn_format;
      ctx->save_for_backward({at::Tensor(), weight, at::Tensor(), value_or_undefined(running_mean),
                              value_or_undefined(running_var), save_mean, save_invstd, reserve});
      ctx->saved_data["s"] = c10::IValue::make_capsule(st);
      return out;
    }
    const bool bias_as_stats = training && !keep_x;
    ctx->save_for_backward({
        keep_x ? input : at::Tensor(),
        weight,
        bias_as_stats ? bias : at::Tensor(),
        !training ? value_or_undefined(running_mean) : at::Tensor(),
        !training ? value_or_undefined(running_var) : at::Tensor(),
        training && keep_x ? save_mean : at::Tensor(),
        training && keep_x ? save_invstd : at::Tensor(),
    });
    ctx->saved_data["s"] = c10::IValue::make_capsule(st);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    auto it = ctx->saved_data.find("s");
    if (it == ctx->saved_data.end()) return variable_list(11);  // no gradient was requested of x, w or b
    auto st = c10::static_intrusive_pointer_cast<BatchNormState>(it->second.toCapsule());
    auto saved = ctx->get_saved_variables();
    at::Tensor dx, dw, db;
    if (st->cudnn_training) {
      at::NoGradGuard no_grad;
      // dB = sum(dY) from stock's kernel, which computes dX and dW as well (as it does for stock); its x operand is
      // dY itself, laid out as stock lays x out for it: dB does not read x, and dX/dW, which do, are dropped.
      const at::Tensor grad_out = grads[0].contiguous(st->cudnn_format);
      db = std::get<2>(at::cudnn_batch_norm_backward(grad_out, grad_out, saved[1], saved[3], saved[4], saved[5],
                                                     saved[6], st->eps, saved[7]));
      variable_list out{at::Tensor(), at::Tensor(), db};
      out = once_differentiable(std::move(out), grads, "BatchNormFunction");
      out.resize(11);
      return out;
    }
    {
      at::NoGradGuard no_grad;
      const at::Tensor& grad_out = grads[0];
      at::Tensor x = saved[0];
      const at::Tensor& weight = saved[1];
      const at::Tensor& bias = saved[2];
      const at::Tensor& running_mean = saved[3];
      const at::Tensor& running_var = saved[4];
      at::Tensor save_mean = saved[5], save_invstd = saved[6];
      const bool standin = !x.defined();
      // Evaluation, channels-last x, non-dense dY: stock's strided kernel lays dX out like x, but fed a zero-stride
      // stand-in it would lay it out contiguously. Compute dX directly there (same rounding when the parameters
      // have dY's dtype).
      const bool direct_dx = st->need_x && standin && !st->training && st->x_format.has_value() &&
                             !(st->x_dense && dense(grad_out)) && running_var.scalar_type() == grad_out.scalar_type();
      if (direct_dx) {
        std::vector<int64_t> bcast(st->x_shape.size(), 1);
        bcast[1] = st->x_shape[1];
        auto invstd = running_var.to(at::kDouble).add(st->eps).sqrt().reciprocal().to(running_var.scalar_type());
        dx = at::empty_strided(st->x_shape, st->x_stride, grad_out.options());
        at::mul_out(dx, grad_out, invstd.view(bcast));
        if (weight.defined()) dx.mul_(weight.view(bcast));
      }
      if (st->need_w || st->need_b || (st->need_x && !direct_dx)) {
        if (standin) {
          if (st->x_dense && dense(grad_out))
            x = grad_out.as_strided(st->x_shape, st->x_stride);
          else
            x = at::empty({}, grad_out.options()).expand(st->x_shape);
        }
        if (st->training && !save_mean.defined()) {
          // Only dB = sum(dY) is requested; any C-sized tensor of the statistics' dtype serves the kernel.
          if (bias.scalar_type() == st->stat_dtype && bias.is_contiguous())
            save_mean = save_invstd = bias.detach();
          else
            save_mean = save_invstd = at::zeros({st->x_shape[1]}, grad_out.options().dtype(st->stat_dtype));
        }
        if (!st->training && !save_mean.defined())
          save_mean = save_invstd = at::empty({0}, grad_out.options().dtype(st->stat_dtype));
        at::Tensor kdx;
        std::tie(kdx, dw, db) = at::native_batch_norm_backward(
            grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, st->training, st->eps,
            {st->need_x && !direct_dx, st->need_w, st->need_b});
        if (st->need_x && !direct_dx) {
          dx = kdx;
          if (standin && st->x_format.has_value() && dx.strides() != at::IntArrayRef(st->x_stride))
            dx = dx.contiguous(*st->x_format);
        }
      }
    }
    variable_list out{st->need_x ? dx : at::Tensor(), st->need_w ? dw : at::Tensor(),
                      st->need_b ? db : at::Tensor()};
    out = once_differentiable(std::move(out), grads, "BatchNormFunction");
    out.resize(11);
    return out;
  }
};

}  // namespace

static Register reg_batch_norm([](pybind11::module_& m) {
  m.def(
      "batch_norm_forward",
      [](const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
         const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var, bool training,
         double momentum, double eps, bool cudnn) {
        return BatchNormFunction::apply(input, weight, bias, running_mean, running_var, training, momentum, eps,
                                        cudnn, at::GradMode::is_enabled());
      },
      "slimgrad's batch norm (see batch_norm.cpp): keeps x only where a requested gradient reads it");
});

}  // namespace slimgrad
