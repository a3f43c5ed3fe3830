// LoRA linear (peft's lora.Linear, plain LoRA) in the compiled core: slimgrad.functional.lora's
// LoraLinearFunction as one C++ autograd Function, for eager CPU calls (either dropout policy) and CUDA calls whose
// adapters do not drop.
//
// Forward and backward are the Python Function's, op for op: the same aten calls (at::linear, addmm/mm, the same
// casts and the same left-to-right sums), so the numbers are peft's; under the "bits" policy the adapters' dropout
// is stock's draw (dropout.cpp: the mask peft's nn.Dropout would draw) kept as bits, under "seed" one int64 seed per
// dropping adapter drawn as the Python Function draws them (`empty(k, int64).random_()`), the mask regenerated in
// backward by the Philox kernel (dropout_seed.cpp) that any dropout_seed backend shares; what is saved is what the
// Python Function saves, in the same order (x, or a compact copy, only when dW or some dA is requested; the seeds
// where dX or a dropping adapter's dA is requested; each adapter's A(drop(x)) only when its B trains; the packed
// masks only where dX or that dA is requested). Double backward is refused
// with the Python Function's message. An undefined weight is the Python Function's weight=None: the adapters alone
// (peft's bnb LoRA wrappers add them to their own quantized base), their sum cast to x's dtype.
#include "common.h"
#include "dropout.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <optional>
#include <utility>
#include <vector>

namespace slimgrad {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

at::Tensor base_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool fan_in_fan_out) {
  if (!fan_in_fan_out) return at::linear(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  // transformers' Conv1D.forward (GPT-2): weight is [in, out]
  at::Tensor x2 = x.view({-1, x.size(-1)});
  at::Tensor out = bias.defined() ? at::addmm(bias, x2, weight) : x2.mm(weight);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(weight.size(1));
  return out.view(shape);
}

// _common.compact: x, or a compact copy where x is a view whose storage holds more than x.
at::Tensor compact(const at::Tensor& x) {
  if (static_cast<int64_t>(x.storage().nbytes()) <= x.numel() * static_cast<int64_t>(x.element_size())) return x;
  return x.clone(at::MemoryFormat::Preserve);
}

std::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }

struct Result {
  at::Tensor out;
};

// tensors: x, weight, bias, then (A_i, B_i, bias_i) per adapter; undefined for None. need: requires-grad flags.
Result lora_forward(AutogradContext* ctx, const std::vector<at::Tensor>& t, const std::vector<bool>& need,
                    bool fan_in_fan_out, bool cast, const std::vector<double>& scalings, const std::vector<double>& ps,
                    bool seeded) {
  const at::Tensor &x = t[0], &weight = t[1], &bias = t[2];
  const size_t n = scalings.size();
  at::Tensor result = weight.defined() ? base_forward(x, weight, bias, fan_in_fan_out) : at::Tensor();
  const at::ScalarType base_dtype = weight.defined() ? result.scalar_type() : x.scalar_type();
  const bool need_x = need[0], need_w = need[1];
  bool any_a = false;
  for (size_t i = 0; i < n; ++i) any_a = any_a || need[3 + 3 * i];
  // x in the adapters' dtype, made when an adapter reads it (a dropping one reads x itself where the cast fuses
  // into the dropout's pass)
  const bool casts = n && cast && x.scalar_type() != t[3].scalar_type();
  const at::ScalarType a_dtype = n ? t[3].scalar_type() : x.scalar_type();
  const bool fuse = casts && dropout_core::fuses_cast(x, a_dtype);
  at::Tensor xa_cache = casts ? at::Tensor() : x;
  const auto xa = [&]() -> const at::Tensor& {
    if (!xa_cache.defined()) xa_cache = x.to(a_dtype);
    return xa_cache;
  };
  std::vector<at::Tensor> kept_t(n), masks(n);
  std::vector<int64_t> u_dtypes(n), dropping(n, 0);
  std::vector<std::vector<int64_t>> perms(n);
  std::vector<double> scales(n, 0.0);
  // the "seed" policy: one seed per dropping adapter, from the default generator (manual_seed and checkpointing
  // reproduce them), drawn before the adapters as the Python Function draws them
  at::Tensor seeds;
  std::vector<int64_t> seed_index(n, -1);
  int64_t n_seeds = 0;
  bool seeds_read = need_x;
  if (seeded) {
    for (size_t i = 0; i < n; ++i)
      if (ps[i] > 0 && ps[i] < 1) {
        seed_index[i] = n_seeds++;
        seeds_read = seeds_read || need[3 + 3 * i];
      }
    if (n_seeds) seeds = at::empty({n_seeds}, x.options().dtype(at::kLong)).random_();
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor &A = t[3 + 3 * i], &B = t[4 + 3 * i], &b_bias = t[5 + 3 * i];
    const double p = ps[i];
    at::Tensor dropped, mask;
    if (p == 1) {
      dropped = xa() * at::zeros({}, xa().options());
    } else if (seed_index[i] >= 0) {
      dropped = dropout_seed_core::apply(xa().contiguous(), p, seeds[seed_index[i]], false);
    } else if (p > 0 && !(need_x || need[3 + 3 * i])) {
      // no gradient reads this adapter's mask (x and its A frozen): stock's op itself (peft's nn.Dropout, after the
      // cast), nothing packed: a packed mask beside the draw put the step's peak a mask above peft's
      dropped = at::dropout(xa(), p, true);
    } else if (p > 0) {  // stock's draw (peft's nn.Dropout), kept as bits
      dropout_core::Forward f =
          fuse ? dropout_core::draw_and_apply_to(x, p, a_dtype) : dropout_core::draw_and_apply(xa(), p, false);
      dropped = std::move(f.out);
      mask = std::move(f.packed);
      perms[i] = std::move(f.perm);
      scales[i] = f.scale;
      dropping[i] = 1;
    } else {
      dropped = xa();
    }
    at::Tensor ti = at::linear(dropped, A);
    dropped.reset();
    at::Tensor u = at::linear(ti, B, opt(b_bias));
    if (need[4 + 3 * i]) kept_t[i] = ti;
    ti.reset();  // t goes once B has read it unless B trains (kept), as stock frees it: the peak stays at peft's
    u_dtypes[i] = static_cast<int64_t>(u.scalar_type());
    u = u * scalings[i];
    result = result.defined() ? result + u : u;
    u.reset();
    if (need_x || need[3 + 3 * i]) masks[i] = mask;
  }
  const at::ScalarType sum_dtype = result.defined() ? result.scalar_type() : base_dtype;
  if (n) result = result.to(base_dtype);
  Result r;
  r.out = result;
  if (ctx == nullptr) return r;
  const bool keep_x = need_w || any_a;
  at::Tensor kept_x = x;
  if (keep_x && !need_w) kept_x = compact(x);
  auto& d = ctx->saved_data;
  d["fan_in_fan_out"] = fan_in_fan_out;
  d["cast"] = cast;
  d["scalings"] = scalings;
  d["ps"] = ps;
  d["base_dtype"] = static_cast<int64_t>(base_dtype);
  d["sum_dtype"] = static_cast<int64_t>(sum_dtype);
  d["u_dtypes"] = u_dtypes;
  d["x_shape"] = x.sizes().vec();
  d["x_dtype"] = static_cast<int64_t>(x.scalar_type());
  d["dropping"] = dropping;
  d["scales"] = scales;
  c10::List<c10::List<int64_t>> perm_list;
  for (const auto& pm : perms) perm_list.push_back(c10::List<int64_t>(pm));
  d["perms"] = perm_list;
  d["seed_index"] = seed_index;
  variable_list saved{keep_x ? kept_x : at::Tensor(), need_x ? weight : at::Tensor(),
                      seeds_read ? seeds : at::Tensor()};
  for (auto& k : kept_t) saved.push_back(k);
  for (auto& m : masks) saved.push_back(m);
  for (size_t i = 3; i < 3 + 3 * n; ++i) saved.push_back(t[i]);  // (not x again, after the adapters)
  ctx->save_for_backward(saved);
  return r;
}

struct LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
  // tensors: the defined ones of (x, weight, bias, A_0, B_0, bias_0, ...); present: which of those slots are.
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors, std::vector<int64_t> present,
                               bool fan_in_fan_out, bool cast, std::vector<double> scalings, std::vector<double> ps,
                               bool seeded) {
    auto [t, need] = present_slots(tensors, present);
    ctx->saved_data["present"] = present;
    return {lora_forward(ctx, t, need, fan_in_fan_out, cast, scalings, ps, seeded).out};
  }

  // (grads_in by reference: present_backward says why)
  static variable_list backward(AutogradContext* ctx, variable_list& grads_in) {
    if (auto batched = slimgrad::per_batch_entry(ctx, grads_in, backward)) return *batched;
    // 6 non-tensor arguments: present, fan_in_fan_out, cast, scalings, ps, seeded
    return present_backward(ctx, grads_in, "LoraLinearFunction", 6,
                            [&](const std::vector<bool>& need, at::Tensor* dy) {
                              return compute(ctx, grads_in[0], need, dy);
                            });
  }

  // grad: a copy of dY's handle; dy: the engine's, both released after dY's last use (present_backward), or null
  static variable_list compute(AutogradContext* ctx, at::Tensor grad, const std::vector<bool>& need,
                               at::Tensor* dy) {
    auto& d = ctx->saved_data;
    const bool fan_in_fan_out = d["fan_in_fan_out"].toBool(), cast = d["cast"].toBool();
    const auto scalings = d["scalings"].toDoubleVector();
    const auto ps = d["ps"].toDoubleVector();
    const auto base_dtype = static_cast<at::ScalarType>(d["base_dtype"].toInt());
    const auto sum_dtype = static_cast<at::ScalarType>(d["sum_dtype"].toInt());
    const auto u_dtypes = d["u_dtypes"].toIntVector();
    const auto x_shape = d["x_shape"].toIntVector();
    const auto x_dtype = static_cast<at::ScalarType>(d["x_dtype"].toInt());
    const auto dropping = d["dropping"].toIntVector();
    const auto scales = d["scales"].toDoubleVector();
    const auto perm_list = d["perms"].toList();
    const auto seed_index = d["seed_index"].toIntVector();
    const size_t n = scalings.size();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &seeds = saved[2];
    const auto kept = [&](size_t i) -> const at::Tensor& { return saved[3 + i]; };
    const auto mask = [&](size_t i) -> const at::Tensor& { return saved[3 + n + i]; };
    const auto adapter = [&](size_t k) -> const at::Tensor& { return saved[3 + 2 * n + k]; };
    const bool need_x = need[0], need_w = need[1], need_bias = need[2];
    variable_list grads(need.size());
    // x again after the adapters: the base layer's part of dX goes there, the adapters' to x itself
    const bool split = need.size() > 3 + 3 * n;

    at::Tensor g = grad.to(sum_dtype);
    // the base's gradient (not made for adapters alone: weight is then undefined, and so are dW and the bias's)
    at::Tensor g_base;
    if ((need_x && weight.defined()) || need_w || need_bias) g_base = rows(g.to(base_dtype));
    int64_t last_g = -1;
    for (size_t i = 0; i < n && last_g < 0; ++i)
      if (need_x || need[3 + 3 * i] || need[4 + 3 * i] || need[5 + 3 * i]) last_g = static_cast<int64_t>(i);
    at::Tensor xa, dxa;
    std::vector<int64_t> x_rows_shape(x_shape.begin(), x_shape.end() - 1);
    for (int64_t i = static_cast<int64_t>(n) - 1; i >= 0; --i) {
      const at::Tensor &A = adapter(3 * i), &B = adapter(3 * i + 1);
      const bool need_a = need[3 + 3 * i], need_b = need[4 + 3 * i], need_bb = need[5 + 3 * i];
      if (!(need_x || need_a || need_b || need_bb)) continue;
      at::Tensor g_u = rows(g.to(static_cast<at::ScalarType>(u_dtypes[i])) * scalings[i]);
      if (i == last_g) {
        g.reset();
        grad.reset();
        if (dy) dy->reset();  // dY's last reader: freed here unless g_base views it or the caller holds it
      }
      if (need_bb) grads[5 + 3 * i] = g_u.sum(0);
      if (need_b) grads[4 + 3 * i] = g_u.t().mm(rows(kept(i)));
      if (!(need_x || need_a)) continue;
      const double p = ps[i];
      const bool bits = dropping[i] != 0;
      std::vector<int64_t> perm;
      if (bits) perm = perm_list.get(i).toIntVector();
      at::Tensor zero;
      if (p == 1) zero = at::zeros({}, A.options());
      at::Tensor dt = g_u.mm(B);
      g_u.reset();
      if (need_a) {
        const bool fused = bits && cast && x.scalar_type() != A.scalar_type() && perm.empty() &&
                           dropout_core::fuses_cast(x, A.scalar_type());
        if (!xa.defined() && !fused) {
          xa = x;
          if (cast && x.scalar_type() != A.scalar_type()) xa = x.to(A.scalar_type());
        }
        at::Tensor dropped;
        if (seed_index[i] >= 0) {
          dropped = dropout_seed_core::apply(xa.contiguous(), p, seeds[seed_index[i]], false);  // forward's mask
        } else if (fused) {
          dropped = dropout_core::apply_packed_to(x, mask(i), scales[i], A.scalar_type());  // cast + dropout
        } else if (bits) {
          dropped = dropout_core::apply_packed(xa, mask(i), perm, scales[i], false);
        } else if (zero.defined()) {
          dropped = xa * zero;
        } else {
          dropped = xa;
        }
        grads[3 + 3 * i] = dt.t().mm(rows(dropped));
      }
      if (need_x) {
        at::Tensor dd = dt.mm(A);
        if (seed_index[i] >= 0) {
          // dd: (rows, in), x's elements in order; a new tensor, as the Python Function's (and stock's grad * mask)
          dd = dropout_seed_core::apply(dd, p, seeds[seed_index[i]], false);
        } else if (bits) {
          std::vector<int64_t> shape = x_rows_shape;
          shape.push_back(dd.size(-1));
          dd = rows(dropout_core::apply_packed(dd.view(shape), mask(i), perm, scales[i], true));
        } else if (zero.defined()) {
          dd.mul_(zero);
        }
        dxa = dxa.defined() ? dxa.add_(dd) : dd;
      }
    }
    xa.reset();
    at::Tensor dx;
    if (need_x && weight.defined()) dx = g_base.mm(fan_in_fan_out ? weight.t() : weight);
    if (need_w) {
      at::Tensor x2d = rows(x);
      grads[1] = fan_in_fan_out ? x2d.t().mm(g_base) : g_base.t().mm(x2d);
    }
    if (need_bias) grads[2] = g_base.sum(0);
    g_base.reset();
    if (need_x) {
      if (dxa.defined()) dxa = dxa.to(x_dtype);
      // not views (matmul's own _unsafe_view): a view keeps its base, so autograd could not add another
      // consumer's gradient of x into this one in place (InputBuffer: the storage's only user) and allocated a
      // third x-sized tensor for the sum, as QLoRA's base + adapter on one x did (peft's dropout mul hands
      // autograd a fresh tensor there)
      const auto as_x = [&](const at::Tensor& d) { return d.defined() ? at::_unsafe_view(d, x_shape) : d; };
      if (split) {
        // Two gradients for x, as peft's graph hands it two (the adapters' path's, then the base layer's node,
        // which autograd runs after the adapters'): autograd adds them to x's other readers' one at a time, in
        // stock's order, where one pre-summed gradient was the same terms in another order (q, k and v reading
        // one x: ~1e-7 relative in fp32, 1 ulp in bf16). The Python Function does the same.
        grads[0] = as_x(dxa);
        grads[need.size() - 1] = as_x(dx);
      } else {
        if (dxa.defined()) dx = dx.defined() ? dx.add_(dxa) : dxa;
        grads[0] = as_x(dx);
      }
    }
    return grads;
  }
};

// One call of peft's plain-LoRA forward: (output, whether x itself was saved for backward).
// seeded: the adapters drop under the "seed" policy (else "bits", or none drops).
std::tuple<at::Tensor, bool> lora_linear(const std::vector<std::optional<at::Tensor>>& tensors, bool fan_in_fan_out,
                                         bool cast, const std::vector<double>& scalings,
                                         const std::vector<double>& ps, bool seeded) {
  std::vector<at::Tensor> t;
  t.reserve(tensors.size());
  bool any_grad = false;
  for (const auto& o : tensors) {
    t.push_back(o.has_value() ? *o : at::Tensor());
    any_grad = any_grad || (t.back().defined() && t.back().requires_grad());
  }
  if (!(at::GradMode::is_enabled() && any_grad)) {
    std::vector<bool> need(t.size(), false);
    return {lora_forward(nullptr, t, need, fan_in_fan_out, cast, scalings, ps, seeded).out, false};
  }
  const size_t n_slots = t.size();
  // x once more, after the adapters, for the base layer's part of dX (LoraLinearFunction::compute says why)
  if (t[1].defined() && t[0].requires_grad()) t.push_back(t[0]);
  std::vector<at::Tensor> defined;
  std::vector<int64_t> present(t.size(), 0);
  for (size_t i = 0; i < t.size(); ++i)
    if (t[i].defined()) {
      defined.push_back(t[i]);
      present[i] = 1;
    }
  auto out =
      LoraLinearFunction::apply(at::TensorList(defined), present, fan_in_fan_out, cast, scalings, ps, seeded);
  // x itself is saved when dW is requested, or some dA is and x is not a view into a larger storage (compact)
  const at::Tensor& x = t[0];
  bool need_a = false;
  for (size_t i = 3; i < n_slots; i += 3) need_a = need_a || (t[i].defined() && t[i].requires_grad());
  const bool need_w = t[1].defined() && t[1].requires_grad();
  const bool x_kept = need_w || (need_a && static_cast<int64_t>(x.storage().nbytes()) <=
                                               x.numel() * static_cast<int64_t>(x.element_size()));
  return {out[0], x_kept};
}

}  // namespace

static Register reg_lora([](pybind11::module_& m) {
  m.def("lora_linear_apply", &lora_linear, "slimgrad LoRA linear (plain LoRA): one C++ Function",
        pybind11::arg("tensors"), pybind11::arg("fan_in_fan_out"), pybind11::arg("cast"), pybind11::arg("scalings"),
        pybind11::arg("ps"), pybind11::arg("seeded") = false);
});

}  // namespace slimgrad
