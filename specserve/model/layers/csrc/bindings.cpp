// Python bindings of specserve's CPU kernels; each kernel's file says why it exists.
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "x [M, K] f32 @ Q4_1 blocks [N, K/32*20]^T -> [M, N]");
  m.def("q8_0_linear", &q8_0_linear, "x [M, K] f32 @ Q8_0 blocks [N, K/32*34]^T -> [M, N]");
  m.def("rms_norm", &rms_norm, "x [T, H] f32 -> weight * x / rms(x), per row");
  m.def("add_rms_norm", &add_rms_norm, "(x + residual) -> (rms_norm(x + residual), x + residual)");
}
