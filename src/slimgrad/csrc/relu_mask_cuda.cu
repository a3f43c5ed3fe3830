// ReLU / LeakyReLU with a 1-bit mask on CUDA, one launch each way (cuda_kernels.h says why).
//
// Forward: one thread per element; a warp's 32 keep-bits come from one ballot, and every eighth lane writes its
// byte, so the mask is written in the same pass as the output (bit j of byte b is element 8b + j, the layout of
// slimgrad.kernels.bitmask). Threads past the end vote 0: the last byte's padding bits are zero, as the CPU kernels
// leave them. Values follow stock's CUDA kernels exactly: relu is clamp_min(x, 0) (NaN keeps its bits, -0.0 becomes
// +0.0), leaky_relu and its backward compute in the opmath type (fp32 for the 16-bit dtypes) with the slope rounded
// to it, threshold_backward writes +0 where the bit is clear.
#include "cuda_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>

namespace slimgrad::cuda_kernels {
namespace {

constexpr int kThreads = 256;  // a multiple of 32: every warp starts at an element index divisible by 32

template <typename T, bool kLeaky>
__global__ void relu_mask_forward_kernel(const T* __restrict__ x, T* out, uint8_t* __restrict__ packed,
                                         int64_t n, int64_t nb, at::opmath_type<T> slope) {
  using opmath_t = at::opmath_type<T>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  bool keep = false;
  if (i < n) {
    const T v = x[i];
    const opmath_t a = static_cast<opmath_t>(v);
    if (kLeaky) {
      keep = a > opmath_t(0);
      out[i] = keep ? v : static_cast<T>(a * slope);
    } else {
      keep = !(a <= opmath_t(0));  // > 0, or NaN (which clamp_min returns as it is)
      out[i] = keep ? v : static_cast<T>(opmath_t(0));
    }
  }
  const unsigned votes = __ballot_sync(0xffffffffu, keep);
  const int lane = threadIdx.x & 31;
  if ((lane & 7) == 0 && (i >> 3) < nb) packed[i >> 3] = static_cast<uint8_t>((votes >> lane) & 0xFFu);
}

template <typename T, bool kLeaky>
__global__ void relu_mask_backward_kernel(const T* __restrict__ grad, const uint8_t* __restrict__ packed,
                                          T* __restrict__ out, int64_t n, at::opmath_type<T> slope) {
  using opmath_t = at::opmath_type<T>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const bool keep = (packed[i >> 3] >> (i & 7)) & 1;
  const T g = grad[i];
  if (kLeaky) {
    out[i] = keep ? g : static_cast<T>(static_cast<opmath_t>(g) * slope);
  } else {
    out[i] = keep ? g : static_cast<T>(opmath_t(0));
  }
}

int64_t blocks_for(int64_t threads) { return (threads + kThreads - 1) / kThreads; }

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "slimgrad's CUDA relu mask kernel: ", name,
              " must be a contiguous CUDA tensor (a slimgrad bug: the core routes only those here)");
  TORCH_CHECK(t.numel() < (int64_t{1} << 31) - kThreads, "slimgrad's CUDA relu mask kernel: ", name,
              " has too many elements");
}

}  // namespace

void relu_mask_forward(const at::Tensor& x, at::Tensor& out, at::Tensor& packed, std::optional<double> slope) {
  check(x, "x");
  const int64_t n = x.numel(), nb = packed.numel();
  if (nb == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = blocks_for(nb * 8);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "slimgrad_relu_mask_forward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    uint8_t* mp = packed.mutable_data_ptr<uint8_t>();
    if (slope) {
      relu_mask_forward_kernel<scalar_t, true><<<blocks, kThreads, 0, stream>>>(
          xp, op, mp, n, nb, static_cast<opmath_t>(*slope));
    } else {
      relu_mask_forward_kernel<scalar_t, false><<<blocks, kThreads, 0, stream>>>(xp, op, mp, n, nb, opmath_t(0));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor relu_mask_backward(const at::Tensor& grad, const at::Tensor& packed, std::optional<double> slope) {
  check(grad, "grad");
  at::Tensor out = at::empty(grad.sizes(), grad.options());
  const int64_t n = grad.numel();
  if (n == 0) return out;
  const c10::cuda::CUDAGuard guard(grad.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "slimgrad_relu_mask_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    const uint8_t* mp = packed.const_data_ptr<uint8_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if (slope) {
      relu_mask_backward_kernel<scalar_t, true><<<blocks_for(n), kThreads, 0, stream>>>(
          gp, mp, op, n, static_cast<opmath_t>(*slope));
    } else {
      relu_mask_backward_kernel<scalar_t, false><<<blocks_for(n), kThreads, 0, stream>>>(gp, mp, op, n, opmath_t(0));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace slimgrad::cuda_kernels
