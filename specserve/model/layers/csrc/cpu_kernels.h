// Shared declarations of specserve's CPU kernels (built by specserve/model/layers/cpu_kernels.py).
#pragma once

#include <torch/extension.h>

#include <tuple>

// gguf_linear.cpp: x [M, K] float32 @ raw GGUF blocks [N, K / 32 * block bytes]^T -> [M, N]
torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& w);

// rms_norm.cpp: float32 RMSNorm rows, and the residual add fused in front of it
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps);
