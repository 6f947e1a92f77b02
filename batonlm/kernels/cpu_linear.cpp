// One row through a float projection on the CPU: y[N] = W[N, K] x[K], each weight read once
// (batonlm/kernels/cpu_linear.py: the build, the op, the reference).
//
// A decode step at one row is matrix-vector products that read every weight once and do two
// flops per weight: at memory bandwidth or not at all. Each output is one weight row's dot
// product with x, vectorised over K (the compiler's SIMD reduction), the rows split statically
// between torch's OpenMP threads (torch's own runtime: this library links libtorch_cpu); a small
// matrix runs on the calling thread (a parallel region costs more).
//
// Registered with torch's dispatcher as batonlm::row_linear (a CPU kernel and a Meta one for
// tracing), so a compiled graph's C++ wrapper calls it in C++: ~2 us a call, where an op defined
// in Python cost ~22 us (57 calls a step on the 25M shape).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

extern "C" void batonlm_row_linear(const float* x, const float* w, float* y, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t n = 0; n < N; ++n) {
    const float* wr = w + n * K;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += wr[k] * x[k];
    y[n] = s;
  }
}

namespace {

std::vector<int64_t> out_sizes(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1),
              "batonlm::row_linear: x [..., K] and weight [N, K], got ", x.sizes(), " and ", w.sizes());
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return sizes;
}

at::Tensor row_linear_cpu(const at::Tensor& x, const at::Tensor& w) {
  std::vector<int64_t> sizes = out_sizes(x, w);
  TORCH_CHECK(x.numel() == x.size(-1), "batonlm::row_linear: one row, got x of shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "batonlm::row_linear: float32 x and a contiguous float32 weight");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(sizes, x.options());
  batonlm_row_linear(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), w.size(0), w.size(1));
  return y;
}

// While a graph is traced: the output's shape, symbolic sizes kept symbolic.
at::Tensor row_linear_meta(const at::Tensor& x, const at::Tensor& w) {
  std::vector<c10::SymInt> sizes = x.sym_sizes().vec();
  sizes.back() = w.sym_size(0);
  return at::empty_symint(sizes, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batonlm, m) { m.def("row_linear(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(batonlm, CPU, m) { m.impl("row_linear", &row_linear_cpu); }
TORCH_LIBRARY_IMPL(batonlm, Meta, m) { m.impl("row_linear", &row_linear_meta); }
