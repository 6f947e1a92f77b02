// Decode attention over the token-level KV pool on the CPU, each key and value read in place
// through the rows' KV slots (batonlm/kernels/cpu_attention.py: the build, the op, the reference).
//
// q    [B, KVH, G, D]  a row's G query heads sharing each KV head, float32, contiguous
// k, v [KVH, S, D]     one layer's pool (head-major), float32, contiguous
// idx  [B, L]          each row's KV slots, int64; mask [B, L] which of them it attends to
// out  [B, KVH, G, D]  softmax_j(scale * q . k[idx_j]) . v[idx_j] over the unmasked j; zeros
//                      for a row with none (the padding rows of a compiled batch)
//
// One (row, KV head) per OpenMP iteration, in torch's OpenMP runtime (the process has loaded its
// libgomp.so.1: this library links the same soname). Each key is read once for the group's query
// heads; the scores are kept whole (L floats a head), then exponentiated, then V is summed.
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
