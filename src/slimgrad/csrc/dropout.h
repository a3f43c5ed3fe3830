// What dropout.cpp shares with lora.cpp (LoRA's adapter dropout is the same draw, kernels and layouts).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace slimgrad {
namespace dropout_core {

// functional.dropout.bits_forward: stock's draw into empty_like(x, uint8), x's memory order, one pass.
struct Forward {
  at::Tensor out, packed;
  std::vector<int64_t> perm, noise_strides;  // perm empty: x's logical order
  bool noise_contiguous = true;
  double scale = 0;
};
Forward draw_and_apply(const at::Tensor& input, double p, bool inplace);

// functional.dropout.bits_backward: grad * noise from the packed mask, in the forward's memory order; `inplace`:
// written into grad when its layout allows (a fresh tensor of the caller's).
at::Tensor apply_packed(const at::Tensor& grad, const at::Tensor& packed, const std::vector<int64_t>& perm,
                        double scale, bool inplace);

// The strides stock's `grad * noise` has (TensorIterator's rule, grad first; noise: empty_like(x)'s strides): where
// a gradient made in the mask's memory order is handed on (masks::conform), as stock's layout (the next node's kernel
// may depend on it).
std::vector<int64_t> product_strides(const at::Tensor& grad, const std::vector<int64_t>& noise_strides,
                                     bool noise_contiguous);

// x.to(dtype) then dropout, in one pass (the cast is exact): for a contiguous bf16/fp16 x and dtype float32, as
// LoRA's adapters see x. fuses_cast says when these apply; the draw is stock's `empty_like(x.to(dtype))`.
bool fuses_cast(const at::Tensor& x, at::ScalarType dtype);

// Stock's noise value at kept elements, `ones((), dtype).div_(1 - p)`, once per (p, dtype): both policies' scale.
double noise_scale(double p, at::ScalarType dtype);
Forward draw_and_apply_to(const at::Tensor& x, double p, at::ScalarType dtype);
at::Tensor apply_packed_to(const at::Tensor& x, const at::Tensor& packed, double scale, at::ScalarType dtype);

}  // namespace dropout_core

namespace dropout_seed_core {

// The "seed" policy's kernel (dropout_seed.cpp): x * (keep ? scale : 0) for a contiguous x, the mask Philox's for
// (seed, element index, p) (philox.h), the scale stock's rounded 1 / (1 - p); in place into x when `inplace`.
// seed: one int64 value on the CPU.
at::Tensor apply(const at::Tensor& x, double p, const at::Tensor& seed, bool inplace);

}  // namespace dropout_seed_core
}  // namespace slimgrad
