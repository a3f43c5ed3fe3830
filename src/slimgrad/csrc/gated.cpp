// The gated activations act(gate) * up (SwiGLU, GeGLU and the Hugging Face formula GELUs) in the compiled core: one
// C++ torch::autograd::Function called once from gated_activation's eager CPU path (issue 22: the Python Function's
// per-call cost was most of a tiny call's time, and the Llama-like LoRA step runs one per layer).
//
// It is slimgrad/functional/gated.py's GatedFunction step for step, so the bits are the Python path's (and stock's):
// - the same aten ops in the same order, dtypes and operand order (a Python scalar operand `0.5 * x` is aten's
//   mul with a wrapped-number tensor, which at::mul(x, Scalar) also builds; `d.pow(2)` keeps its integer exponent);
// - the same tensors kept (gate when either input needs a gradient, up only when gate does) and the same producer
//   notes (note_input_kept on what is kept);
// - only the requested gradients, double backward refused with the Python path's message.
// No loops of its own: every element-wise step is aten's kernel, which is what fixes the bits. The entry point
// returns None (gated.py then runs GatedFunction, which raises the errors or handles the case) for anything not
// plain: an unknown kind, tensor subclasses, non-CPU or non-strided tensors, dtypes other than fp32/fp64/bf16/fp16,
// mismatched shapes or dtypes, autocast on.
#include "common.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <utility>

namespace slimgrad {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
namespace py = pybind11;

// functional/gated.py's ACTIVATIONS, in order (gated.py's _KIND_CODE).
enum Kind : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kGeluNew = 3, kGeluPython = 4, kQuickGelu = 5 };

// The literal Python floats of gated.py (transformers' constants as Python computes them).
constexpr double kTanhC = 0.7978845608028654;  // math.sqrt(2.0 / math.pi)
constexpr double kCubic = 0.044715;
constexpr double kSqrt2 = 1.4142135623730951;  // math.sqrt(2.0)
constexpr double kErfC = 1.1283791670955126;   // 2.0 / sqrt(M_PI), derivatives.yaml's erf factor
constexpr double kQuick = 1.702;

// activation_forward
Tensor act_forward(int64_t kind, const Tensor& x) {
  switch (kind) {
    case kSilu:
      return at::silu(x);
    case kGelu:
      return at::gelu(x);
    case kGeluTanh:
      return at::gelu(x, "tanh");
    case kGeluNew: {
      // 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))
      auto a = x * 0.5;
      auto inner = (x + at::pow(x, 3.0) * kCubic) * kTanhC;
      return a * (at::tanh(inner) + 1.0);
    }
    case kGeluPython: {
      // x * 0.5 * (1.0 + torch.erf(x / 1.4142135623730951))
      auto a = x * 0.5;
      return a * (at::erf(x / kSqrt2) + 1.0);
    }
    default:  // kQuickGelu: x * torch.sigmoid(1.702 * x)
      return x * at::sigmoid(x * kQuick);
  }
}

// activation_backward: (dX, act(x) when need_out)
std::pair<Tensor, Tensor> act_backward(int64_t kind, const Tensor& grad, const Tensor& x, bool need_out) {
  switch (kind) {
    case kSilu:
      return {at::silu_backward(grad, x), need_out ? act_forward(kind, x) : Tensor()};
    case kGelu:
      return {at::gelu_backward(grad, x, "none"), need_out ? act_forward(kind, x) : Tensor()};
    case kGeluTanh:
      return {at::gelu_backward(grad, x, "tanh"), need_out ? act_forward(kind, x) : Tensor()};
    // gated.py's activation_backward, temporary for temporary: each made where first needed, freed after its last
    // use, fresh ones updated in place (the same element-wise ops, so the same bits)
    case kGeluNew: {
      Tensor t = at::pow(x, 3.0);
      t.mul_(py_float(kCubic)).add_(x).mul_(py_float(kTanhC)).tanh_();
      Tensor a = x * 0.5;
      Tensor ga = grad * a;
      if (!need_out) a.reset();
      Tensor gs = at::tanh_backward(ga, t);
      gs.mul_(py_float(kTanhC));
      ga.reset();
      Tensor v = t.add_(py_float(1.0));
      t.reset();
      Tensor hv = grad * v;
      hv.mul_(py_float(0.5));
      Tensor out = need_out ? a * v : Tensor();
      v.reset();
      a.reset();
      {
        Tensor g_pow = gs * kCubic;
        Tensor sq = x.pow(2.0);
        sq.mul_(py_float(3.0));
        g_pow.mul_(sq);
        sq.reset();
        gs.add_(g_pow);
      }
      return {gs.add_(hv), out};
    }
    case kGeluPython: {
      Tensor d = x / kSqrt2;
      Tensor v = at::erf(d);
      v.add_(py_float(1.0));
      Tensor g_d = d.pow(c10::Scalar(static_cast<int64_t>(2)));
      g_d.neg_().exp_().mul_(py_float(kErfC));
      d.reset();
      Tensor a = x * 0.5;
      {
        Tensor ga = grad * a;
        g_d.mul_(ga);
      }
      if (!need_out) a.reset();
      Tensor hv = grad * v;
      hv.mul_(py_float(0.5));
      Tensor out = need_out ? a * v : Tensor();
      v.reset();
      a.reset();
      return {g_d.div_(py_float(kSqrt2)).add_(hv), out};
    }
    default: {  // kQuickGelu
      Tensor s = x * kQuick;
      s.sigmoid_();
      Tensor d_s = grad * x;
      at::sigmoid_backward_out(d_s, d_s, s);  // (element-wise: into grad * x)
      d_s.mul_(py_float(kQuick));
      Tensor out = need_out ? x * s : Tensor();
      s.mul_(grad).add_(d_s);  // grad * s + d_s
      return {s, out};
    }
  }
}

// What GatedFunction keeps of an input (gated.py's _kept): the input, or its values in the narrower dtype its
// producer noted they all belong to (`narrow`, the ScalarType's code; -1: none), cast back in backward.
Tensor kept(const Tensor& x, int64_t narrow) {
  return narrow < 0 ? x : x.to(static_cast<at::ScalarType>(narrow));
}

Tensor widened(const Tensor& x, at::ScalarType wide) {
  return x.defined() && x.scalar_type() != wide ? x.to(wide) : x;
}

struct GatedFn : public torch::autograd::Function<GatedFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up, int64_t kind, bool need_gate,
                        bool need_up, int64_t narrow_gate, int64_t narrow_up) {
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["need_gate"] = need_gate;
    ctx->saved_data["need_up"] = need_up;
    ctx->saved_data["wide"] = static_cast<int64_t>(gate.scalar_type());
    // the output first, then any narrower copies (as GatedFunction's setup_context, after its forward): act(gate)
    // is freed by then, so the copies do not add to the forward's peak (nor to a checkpoint's recomputation)
    Tensor out = act_forward(kind, gate) * up;
    ctx->save_for_backward(
        {(need_gate || need_up) ? kept(gate, narrow_gate) : Tensor(), need_gate ? kept(up, narrow_up) : Tensor()});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads, backward)) return *batched;
    bool need_gate = ctx->saved_data["need_gate"].toBool(), need_up = ctx->saved_data["need_up"].toBool();
    variable_list result(7);
    {
      at::NoGradGuard no_grad;
      auto saved = ctx->get_saved_variables();
      auto wide = static_cast<at::ScalarType>(ctx->saved_data["wide"].toInt());
      // (an input kept narrower is widened where it is read, so that no two wide copies are alive at once)
      // (the local copies are the only references where checkpointing recomputed them: reset as gated.py's `del`)
      Tensor gate = widened(saved[0], wide);
      saved[0].reset();
      const Tensor& dy = grads[0];
      int64_t kind = ctx->saved_data["kind"].toInt();
      if (need_gate) {
        // stock: d(act) = dY * up (mul's backward), then the activation's backward on it. For aten's activations
        // act(gate) is made after d(act) is freed, and a widened gate freed before dUp: one gate-sized tensor
        // fewer at backward's peak (the formula GELUs reuse their intermediates instead)
        bool fused = kind <= kGeluTanh;
        Tensor d_act = dy * widened(saved[1], wide);
        saved[1].reset();
        auto [d_gate, act] = act_backward(kind, d_act, gate, need_up && !fused);
        d_act.reset();
        result[0] = std::move(d_gate);
        if (need_up) {
          if (fused) act = act_forward(kind, gate);
          gate.reset();
          result[1] = dy * act;
        }
      } else if (need_up) {
        result[1] = dy * act_forward(kind, gate);
      }
    }
    return once_differentiable(std::move(result), grads, "GatedFunction");
  }
};

// exactly torch.Tensor or nn.Parameter (a subclass may override __torch_function__: the Python path honours it),
// a defined strided CPU tensor of one of the four float dtypes
std::optional<Tensor> plain_cpu(py::handle obj) {
  auto type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  if (type != THPVariableClass && type != ParameterClass) return std::nullopt;
  const auto& t = THPVariable_Unpack(obj.ptr());
  if (!t.defined() || t.device().type() != at::kCPU || t.layout() != at::kStrided) return std::nullopt;
  auto d = t.scalar_type();
  if (d != at::kFloat && d != at::kDouble && d != at::kBFloat16 && d != at::kHalf) return std::nullopt;
  return t;
}

// A torch.dtype's ScalarType code, or -1 for None.
int64_t dtype_code(py::handle obj) {
  if (obj.is_none() || !THPDtype_Check(obj.ptr())) return -1;
  return static_cast<int64_t>(reinterpret_cast<THPDtype*>(obj.ptr())->scalar_type);
}

// gated_activation(gate, up, kind) or None. `note`: called with each input the Function keeps (the
// producer/consumer rule, as GatedFunction.setup_context), or None. `narrow_gate`, `narrow_up`: the dtype whose
// values the input holds exactly (functional._common.exactly_narrower), kept in it, or None.
py::object gated(py::handle gate_obj, py::handle up_obj, int64_t kind, py::handle note, py::handle narrow_gate,
                 py::handle narrow_up) {
  if (kind < kSilu || kind > kQuickGelu || at::autocast::is_autocast_enabled(at::kCPU)) return py::none();
  auto gate = plain_cpu(gate_obj);
  auto up = plain_cpu(up_obj);
  if (!gate || !up || gate->scalar_type() != up->scalar_type() || gate->sizes() != up->sizes()) return py::none();
  bool grad = at::GradMode::is_enabled();
  bool need_gate = grad && gate->requires_grad(), need_up = grad && up->requires_grad();
  Tensor out;
  if (!(need_gate || need_up)) {
    at::AutoGradMode off(false);  // as the Function's forward runs (an inference tensor stays one either way)
    out = act_forward(kind, *gate) * *up;
  } else {
    int64_t n_gate = dtype_code(narrow_gate), n_up = dtype_code(narrow_up);
    out = GatedFn::apply(*gate, *up, kind, need_gate, need_up, n_gate, n_up);
    if (!note.is_none()) {  // an input kept in a narrower dtype is not the producer's tensor
      if (n_gate < 0) note(gate_obj);
      if (need_gate && n_up < 0) note(up_obj);
    }
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
}

}  // namespace

static Register reg_gated([](py::module_& m) {
  m.def("gated", &gated, "act(gate) * up keeping gate (and up where gate needs a gradient), or None", py::arg("gate"),
        py::arg("up"), py::arg("kind"), py::arg("note"), py::arg("narrow_gate") = py::none(),
        py::arg("narrow_up") = py::none());
});

}  // namespace slimgrad
