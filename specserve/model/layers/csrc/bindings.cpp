// Python bindings of specserve's CPU kernels; each kernel's file says why it exists.
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "x [M, K] f32 @ Q4_1 blocks [N, K/32*20]^T -> [M, N]");
  m.def("q8_0_linear", &q8_0_linear, "x [M, K] f32 @ Q8_0 blocks [N, K/32*34]^T -> [M, N]");
  m.def("q4_1_a8_linear", &q4_1_a8_linear,
        "x [M, K] f32, rounded to 8 bits per block, @ packed Q4_1 [N/16, K/32, 320] -> [M, N]");
  m.def("q8_0_a8_linear", &q8_0_a8_linear,
        "x [M, K] f32, rounded to 8 bits per block, @ packed Q8_0 [N/16, K/32, 576] -> [M, N]");
  m.def("amx_ready", &amx_ready, "whether the AMX kernels can run in this process");
  m.def("q4_1_amx_linear", &q4_1_amx_linear,
        "x [M, K] f32 (as `parts` bfloat16 parts; 3: exact) @ Q4_1 packed for AMX "
        "[N/16, K/32, 320] -> [M, N] (float32 results)",
        py::arg("x"), py::arg("w"), py::arg("n"), py::arg("parts") = 3);
  m.def("q8_0_amx_linear", &q8_0_amx_linear,
        "x [M, K] f32 (as `parts` bfloat16 parts; 3: exact) @ Q8_0 packed for AMX "
        "[N/16, K/32, 544] -> [M, N] (float32 results)",
        py::arg("x"), py::arg("w"), py::arg("n"), py::arg("parts") = 3);
  m.def("rms_norm", &rms_norm, "x [T, H] f32 -> weight * x / rms(x), per row");
  m.def("add_rms_norm", &add_rms_norm, "(x + residual) -> (rms_norm(x + residual), x + residual)");
  m.def("rope_write_kv", &rope_write_kv,
        "rotate packed q/k, write k/v to cache slots (and mirror rows); returns q [T, H, D]",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("k_mirror") = py::none(), py::arg("v_mirror") = py::none(),
        py::arg("mirror_rows") = py::none());
  m.def("silu_mul", &silu_mul, "gate_up [T, 2I] f32 -> silu(gate) * up [T, I]");
  m.def("argmax_rows", &argmax_rows, "x [R, V] f32 -> [R] int64, as torch.argmax(x, -1)");
  m.def("screen_groups", &screen_groups,
        "scores [R, V] f32 (screened logits), x [R, K] f32, the bound's constants -> (candidate "
        "groups of 16 columns, sorted; whether the bound held)");
  m.def("a8_vnni", &a8_vnni, "whether the 8-bit-activation GGUF products use AVX-512 VNNI here");
  m.def("a8_screen_candidates", &a8_screen_candidates,
        "scores [R, V] f32 (q8_0_a8_linear's logits), x [R, K] f32, col_norms [V] f32 (rounded "
        "up), max_norm >= each, w [V, bytes] u8 (the exact head's blocks), the bound's "
        "constants -> (candidate columns, whole groups of 16 ascending; their rows of w; "
        "whether the bound held)");
  m.def("run_attention", &run_attention,
        "q [T, H, D] of short runs against k, v [S, KvH, K, D]; causal within each run");
}
