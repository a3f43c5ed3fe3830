// Stride rules shared by the element-wise families (defined in relu_mask.cpp): ports of
// slimgrad.functional._layout, so that the core's gradients are laid out exactly as stock's and the Python path's.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace slimgrad {
namespace masks {
using Strides = std::vector<int64_t>;
// The strides TensorIterator gives a binary element-wise op's new output (inputs of `shape`, in this order).
Strides binary_strides(at::IntArrayRef shape, at::IntArrayRef first, at::IntArrayRef second);
Strides like_strides(const at::Tensor& t);
at::Tensor conform(const at::Tensor& t, const Strides& strides);
Strides memory_order(const at::Tensor& t, bool& dense);
Strides inverse(const Strides& perm);
}  // namespace masks
}  // namespace slimgrad
