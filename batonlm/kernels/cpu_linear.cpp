// One row through a float projection on the CPU: y[N] = W[N, K] x[K], each weight read once
// (batonlm/kernels/cpu_linear.py: the build, the op, the reference).
//
// A decode step at one row is matrix-vector products that read every weight once and do two
// flops per weight: at memory bandwidth or not at all. Each output is one weight row's dot
// product with x, vectorised over K (the compiler's SIMD reduction), the rows split statically
// between torch's OpenMP threads (the process has loaded its libgomp.so.1: this library links
// the same soname); a small matrix runs on the calling thread (a parallel region costs more).
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
