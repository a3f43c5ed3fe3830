#include "common.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <unordered_map>

namespace slimgrad {

std::vector<Registrar>& registrars() {
  static std::vector<Registrar> all;
  return all;
}

namespace {
std::unordered_map<std::string, std::string>& messages() {
  static std::unordered_map<std::string, std::string> all;
  return all;
}
}  // namespace

const std::string& double_backward_message(const std::string& key) {
  auto it = messages().find(key);
  if (it == messages().end()) {
    static std::string fallback;
    fallback = "slimgrad: " + key + " (compiled core, once_differentiable) does not support double backward";
    return fallback;
  }
  return it->second;
}

torch::autograd::variable_list once_differentiable(torch::autograd::variable_list grads_out,
                                                   const torch::autograd::variable_list& grads_in,
                                                   const std::string& key) {
  if (!at::GradMode::is_enabled()) return grads_out;
  torch::autograd::variable_list upstream;
  for (const auto& g : grads_in)
    if (g.defined() && g.requires_grad()) upstream.push_back(g);
  if (upstream.empty()) return grads_out;
  // As slimgrad.functional._common.once_differentiable: detached outputs that require grad, and the incoming
  // gradients that require grad, all go through the error node (so autograd.grad(penalty, x) reaches it).
  torch::autograd::variable_list inputs;
  for (const auto& o : grads_out) {
    if (o.defined()) {
      auto d = o.detach();
      d.set_requires_grad(true);
      inputs.push_back(d);
    } else {
      inputs.push_back(o);
    }
  }
  const size_t n_out = inputs.size();
  inputs.insert(inputs.end(), upstream.begin(), upstream.end());
  auto err = std::make_shared<torch::autograd::DelayedError>(double_backward_message(key),
                                                             static_cast<int64_t>(inputs.size()));
  auto results = (*err)(std::move(inputs));
  results.resize(n_out);
  return results;
}

}  // namespace slimgrad

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "slimgrad's compiled eager core (built by slimgrad.csrc on first use)";
  m.def("set_double_backward_message",
        [](const std::string& key, const std::string& text) { slimgrad::messages()[key] = text; });
  // autocast's own cast of an op's input (at::autocast::cached_cast): a trainable fp32 leaf is cast once per autocast
  // region and every call in the region shares that copy, so the calls' gradients meet in the lower precision at the
  // one cast, as stock's do (a per-call .to() summed them in fp32: siamese forwards in one region differed by an ulp)
  m.def("autocast_cached_cast", [](const at::Tensor& t, py::handle dtype) {
    return at::autocast::cached_cast(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type, t, t.device().type());
  });
  // whether the *.cu kernels are compiled in (slimgrad.csrc builds them with nvcc for a CUDA torch; cuda_kernels.h)
  m.def("cuda_kernels", [] {
#ifdef SLIMGRAD_CUDA_KERNELS
    return true;
#else
    return false;
#endif
  });
  for (auto r : slimgrad::registrars()) r(m);
}
