// Shared by every family file of slimgrad's compiled eager core (see __init__.py for why it exists).
//
// Each family file defines its torch::autograd::Function(s) and one-pass kernels, and registers its Python
// bindings with a file-level `static slimgrad::Register` object: no shared list of families to edit.
#pragma once

#include <ATen/ATen.h>
#include <ATen/LegacyBatchedTensorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace slimgrad {

using Registrar = void (*)(pybind11::module_&);

// Every family's registration function, called once when the extension module is imported.
std::vector<Registrar>& registrars();

struct Register {
  explicit Register(Registrar r) { registrars().push_back(r); }
};

// The double-backward error text for a Function (keyed by the Python Function's class name, e.g.
// "BatchNormFunction"), set from Python at load time so the core's message is the Python path's, word for word.
const std::string& double_backward_message(const std::string& key);

// slimgrad's once_differentiable for C++ Functions: call at the end of backward with the gradients it
// returns and the gradients it received. Outside create_graph it returns `grads_out` as they are; under it
// the outputs are routed through torch's DelayedError node, so that differentiating them again raises
// `double_backward_message(key)` (and only then, as torch's once_differentiable does).
torch::autograd::variable_list once_differentiable(torch::autograd::variable_list grads_out,
                                                   const torch::autograd::variable_list& grads_in,
                                                   const std::string& key);

// The LoRA Functions' tensor inputs by slot: `tensors` holds only the defined ones, `present` flags which slots
// they fill; returns every slot (undefined where absent) and whether each requires grad.
// A Python float as Python passes it to an in-place op (`t.mul_(v)`: a wrapped number, which the kernel reads in the
// tensor's opmath type). C++'s `t.mul_(double)` runs aten's mul_.Scalar, which first rounds v to t's dtype: in bf16
// and fp16 that is another product (x * 1.702 in bf16 is not x * bf16(1.702)). Out-of-place `t * v` is unaffected.
inline at::Tensor py_float(double v) { return at::native::wrapped_scalar_tensor(v); }

// t, or where t is a view (a kernel's result permuted back to the input's layout: channels-last, transposed), a tensor
// on t's storage with t's sizes and strides that autograd does not take for a view. A custom Function's output that is
// a view cannot be modified in place afterwards (`out += residual`, a following in-place ReLU: "Output 0 of ... is a
// view and is being modified inplace"), where stock's output can.
inline at::Tensor not_a_view(const at::Tensor& t) {
  if (!t.is_view()) return t;
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

inline std::pair<std::vector<at::Tensor>, std::vector<bool>> present_slots(at::TensorList tensors,
                                                                           const std::vector<int64_t>& present) {
  std::vector<at::Tensor> t(present.size());
  std::vector<bool> need(present.size(), false);
  size_t k = 0;
  for (size_t i = 0; i < present.size(); ++i)
    if (present[i]) {
      t[i] = tensors[k++];
      need[i] = t[i].requires_grad();
    }
  return {std::move(t), std::move(need)};
}

// Backward of the LoRA Functions, whose optional tensor inputs are passed only where present (the
// `saved_data["present"]` flags, one per slot): `compute(need)` gives one gradient per slot (need: a present
// slot's needs_input_grad), only where dY is defined; the present slots' gradients go out in order through
// once_differentiable (key), then `extra` undefined entries for the Function's non-tensor arguments.
// compute(need, dy): dy, the engine's own handle on dY (the Function's backward takes grads_in by reference, so
// this is the CppNode's list, not a copy), which compute resets after its last use, as stock's engine frees dY
// after the node that reads it (peft's scaling product) rather than at the end of the layer's backward; null where
// autograd builds a graph of the backward (create_graph: the error node below must see dY).
template <class Compute>
torch::autograd::variable_list present_backward(torch::autograd::AutogradContext* ctx,
                                                torch::autograd::variable_list& grads_in,
                                                const std::string& key, size_t extra, Compute&& compute) {
  const bool may_release = !at::GradMode::is_enabled();
  const auto present = ctx->saved_data["present"].toIntVector();
  std::vector<bool> need(present.size(), false);
  size_t k = 0;
  for (size_t i = 0; i < present.size(); ++i)
    if (present[i]) need[i] = ctx->needs_input_grad(k++);
  torch::autograd::variable_list full(present.size());
  if (grads_in[0].defined()) {
    at::NoGradGuard no_grad;
    full = compute(need, may_release ? &grads_in[0] : nullptr);
  }
  torch::autograd::variable_list grads;
  for (size_t i = 0; i < present.size(); ++i)
    if (present[i]) grads.push_back(full[i]);
  auto out = once_differentiable(std::move(grads), grads_in, key);
  out.resize(out.size() + extra);
  return out;
}

// Autograd's batched backward (torch.autograd.grad(..., is_grads_batched=True), hence jacobian(vectorize=True))
// hands a Function legacy-vmap BatchedTensors, whose data the kernels cannot read. Called first in a backward with
// that backward itself: where a gradient is batched, it runs `backward` once per entry of the innermost level's
// batch on plain tensors (gradients batched at outer levels too are unbatched by the nested calls) and batches
// the results again, as legacy vmap's fallback does for an op without a batching rule, and the Python Functions'
// wrapper (_common.serves_batched_grads) does; elsewhere it returns nothing and costs one check per gradient.
template <class Backward>
std::optional<torch::autograd::variable_list> per_batch_entry(torch::autograd::AutogradContext* ctx,
                                                              const torch::autograd::variable_list& grads,
                                                              Backward&& backward) {
  int64_t level = -1;
  for (const auto& g : grads)
    if (g.defined())
      if (auto* impl = at::maybeGetBatchedImpl(g))
        for (const auto& bd : impl->bdims()) level = std::max(level, bd.level());
  if (level < 0) return std::nullopt;
  std::vector<at::Tensor> physical(grads.size());
  int64_t size = 1;
  for (size_t i = 0; i < grads.size(); ++i) {
    auto* impl = grads[i].defined() ? at::maybeGetBatchedImpl(grads[i]) : nullptr;
    if (impl == nullptr) continue;
    const auto bdims = impl->bdims();
    if (std::none_of(bdims.begin(), bdims.end(), [&](const auto& bd) { return bd.level() == level; })) continue;
    physical[i] = at::_remove_batch_dim(grads[i], level, 1, 0);
    size = physical[i].size(0);
  }
  std::vector<torch::autograd::variable_list> entries;
  for (int64_t b = 0; b < size; ++b) {
    torch::autograd::variable_list entry(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) entry[i] = physical[i].defined() ? physical[i][b].clone() : grads[i];
    entries.push_back(backward(ctx, entry));
  }
  torch::autograd::variable_list out(entries[0].size());
  for (size_t k = 0; k < out.size(); ++k) {
    if (!entries[0][k].defined()) continue;
    std::vector<at::Tensor> column;
    for (auto& e : entries) column.push_back(e[k]);
    out[k] = at::_add_batch_dim(at::stack(column), 0, level);
  }
  return out;
}

}  // namespace slimgrad
