// The core's CUDA kernels (the *.cu files beside this header), compiled in only where the core is built with nvcc
// for a CUDA torch (slimgrad.csrc._cuda_kernels_wanted; the family files then see SLIMGRAD_CUDA_KERNELS defined).
// Why they exist: a host-bound CUDA step pays ~40 µs of host time per aten launch on the GPU machines measured
// (docs/gpu.md), and the aten route's ReLU ran four launches where stock runs one; one kernel launched from C++
// writes the output and the 1-bit mask in one pass, as the CPU kernels and the Triton kernel do.
// Without nvcc (or where their build fails) the aten route runs: the same bits, more launches.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace slimgrad::cuda_kernels {

// x contiguous on CUDA (fp32, fp64, bf16, fp16), out contiguous of x's shape (x itself in place), packed of
// ceil(n / 8) bytes: out = stock's relu (slope absent) or leaky_relu(x, slope) to the bit; bit j of byte b is
// element 8b + j: out != 0 (relu: NaN keeps its gradient), x > 0 (leaky); padding bits 0.
void relu_mask_forward(const at::Tensor& x, at::Tensor& out, at::Tensor& packed, std::optional<double> slope);

// grad contiguous on CUDA: stock's threshold_backward(grad, out, 0) / leaky_relu_backward(grad, x, slope) read from
// each element's bit, to the bit.
at::Tensor relu_mask_backward(const at::Tensor& grad, const at::Tensor& packed, std::optional<double> slope);

// The "seed" dropout policy (dropout_seed_cuda.cu): out = x * (keep ? scale : 0), keep = philox::keep(seed, i, p);
// x, out contiguous CUDA tensors of one size and dtype (out may be x), seed one int64 value on x's device, scale
// stock's rounded 1 / (1 - p).
void dropout_seed_apply(const at::Tensor& x, at::Tensor& out, double p, const at::Tensor& seed, double scale);

}  // namespace slimgrad::cuda_kernels
