// Decode attention over the token-level KV pool on the CPU, each key and value read in place
// through the rows' KV slots (batonlm/kernels/cpu_attention.py: the build, the op, the reference).
//
// q    [B, KVH, G, D]  a row's G query heads sharing each KV head, float32, contiguous
// k, v [KVH, S, D]     one layer's pool (head-major), float32, contiguous
// idx  [B, L]          each row's KV slots, int64; mask [B, L] which of them it attends to
// out  [B, KVH, G, D]  softmax_j(scale * q . k[idx_j]) . v[idx_j] over the unmasked j; zeros
//                      for a row with none (the padding rows of a compiled batch)
//
// One (row, KV head) per OpenMP iteration, in torch's OpenMP runtime (this library links
// libtorch_cpu). Each key is read once for the group's query heads; the scores are kept whole
// (L floats a head), then exponentiated, then V is summed.
//
// Registered with torch's dispatcher as batonlm::paged_decode_attention (a CPU kernel and a Meta
// one for tracing): a compiled graph's C++ wrapper calls it without going through Python.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

extern "C" void batonlm_paged_decode_attention(
    const float* q, const float* k, const float* v, const int64_t* idx, const bool* mask, float* out,
    int64_t B, int64_t KVH, int64_t G, int64_t D, int64_t L, int64_t S, float scale) {
#pragma omp parallel
  {
    std::vector<float> p(G * L);
    std::vector<float> acc(G * D);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < KVH; ++h) {
        const float* qb = q + (b * KVH + h) * G * D;
        const int64_t* row_idx = idx + b * L;
        const bool* row_mask = mask + b * L;
        const float* kh = k + h * S * D;
        const float* vh = v + h * S * D;
        for (int64_t j = 0; j < L; ++j) {
          if (!row_mask[j]) continue;
          const float* kr = kh + row_idx[j] * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qb + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * kr[d];
            p[g * L + j] = s * scale;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* pg = p.data() + g * L;
          float top = -INFINITY;
          for (int64_t j = 0; j < L; ++j)
            if (row_mask[j] && pg[j] > top) top = pg[j];
          float sum = 0.f;
          for (int64_t j = 0; j < L; ++j) {
            float e = row_mask[j] ? std::exp(pg[j] - top) : 0.f;
            pg[j] = e;
            sum += e;
          }
          const float inv = sum > 0.f ? 1.f / sum : 0.f;
          for (int64_t j = 0; j < L; ++j) pg[j] *= inv;
        }
        for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
        for (int64_t j = 0; j < L; ++j) {
          if (!row_mask[j]) continue;
          const float* vr = vh + row_idx[j] * D;
          for (int64_t g = 0; g < G; ++g) {
            const float w = p[g * L + j];
            float* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
          }
        }
        float* ob = out + (b * KVH + h) * G * D;
        for (int64_t i = 0; i < G * D; ++i) ob[i] = acc[i];
      }
    }
  }
}

namespace {

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& idx,
                  const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(1) &&
                  k.size(2) == q.size(3) && idx.dim() == 2 && idx.size(0) == q.size(0) && mask.sizes() == idx.sizes(),
              "batonlm::paged_decode_attention: q [B, KVH, G, D], pools [KVH, S, D], kv_index and mask [B, L]; got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ", idx.sizes(), ", ", mask.sizes());
}

at::Tensor paged_decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& idx, const at::Tensor& mask, double scale) {
  check_shapes(q, k, v, idx, mask);
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  idx.scalar_type() == at::kLong && mask.scalar_type() == at::kBool,
              "batonlm::paged_decode_attention: float32 q and pools, int64 kv_index, bool mask");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "batonlm::paged_decode_attention: contiguous pools");
  const at::Tensor qc = q.contiguous(), ic = idx.contiguous(), mc = mask.contiguous();
  at::Tensor out = at::empty_like(qc);
  batonlm_paged_decode_attention(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                 ic.data_ptr<int64_t>(), mc.data_ptr<bool>(), out.data_ptr<float>(), q.size(0),
                                 q.size(1), q.size(2), q.size(3), idx.size(1), k.size(1), static_cast<float>(scale));
  return out;
}

// While a graph is traced: the output's shape only (the context length is symbolic: not read).
at::Tensor paged_decode_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, double) {
  return at::empty_like(q, at::MemoryFormat::Contiguous);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batonlm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor kv_index, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(batonlm, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention_cpu); }
TORCH_LIBRARY_IMPL(batonlm, Meta, m) { m.impl("paged_decode_attention", &paged_decode_attention_meta); }
