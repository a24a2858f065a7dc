// Decode attention over the paged KV cache, reading K/V blocks in place (no gather).
//
//   q:           [B, H, D]              float32, one query token per sequence
//   k_cache:     [NB, BS, Hkv, D]       float32, or uint8: an FP8 cache's float8 e4m3 bytes (v_cache the same)
//   block_table: [B, MAXB]              int64, block ids of each sequence in order
//   ctx_lens:    [B]                    int64, tokens each query attends to
//   window:      > 0: only the last `window` of them (a sliding-window layer); 0: all
//   softcap:     > 0: scores become softcap * tanh(score / softcap) before the softmax; 0: not
//   k_lut, v_lut: [256] float32, for a uint8 cache: each byte's value times the layer's scale (empty otherwise)
//   returns      [B, H, D]
//
// Work item = one sequence: a token's K (or V) row holds every kv head contiguously,
// so each row is read once, sequentially, for all H query heads (head h uses kv head h / G). Two passes over the context (scores,
// then the weighted sum of V), each reading the rows in place from their blocks.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// A token's K or V row (Hkv * D values) as float32: in place for a float32 cache, else decoded into `buf`.
static inline const float* row_of(const float* fp, const uint8_t* bp, const float* lut, int64_t at, int64_t n,
                                  float* buf) {
  if (lut == nullptr) return fp + at;
  const uint8_t* src = bp + at;
  for (int64_t i = 0; i < n; ++i) buf[i] = lut[src[i]];
  return buf;
}

static inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor ctx_lens, double scale,
                                     int64_t window, double softcap, torch::Tensor k_lut, torch::Tensor v_lut) {
  const bool fp8 = k_cache.dtype() == torch::kUInt8;
  TORCH_CHECK(q.dtype() == torch::kFloat32 && (fp8 || k_cache.dtype() == torch::kFloat32), "float32 (or fp8) only");
  TORCH_CHECK(v_cache.dtype() == k_cache.dtype(), "K and V caches of one dtype");
  TORCH_CHECK(!fp8 || (k_lut.numel() == 256 && v_lut.numel() == 256 && k_lut.dtype() == torch::kFloat32 &&
                       v_lut.dtype() == torch::kFloat32 && k_lut.is_contiguous() && v_lut.is_contiguous()),
              "an fp8 cache needs its two 256-entry float32 tables");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_table.dtype() == torch::kInt64 && ctx_lens.dtype() == torch::kInt64, "int64 tables");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = H / Hkv, MAXB = block_table.size(1);
  auto bt_c = block_table.contiguous();
  auto cl_c = ctx_lens.contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = fp8 ? nullptr : k_cache.data_ptr<float>();
  const float* vp = fp8 ? nullptr : v_cache.data_ptr<float>();
  const uint8_t* kb = fp8 ? k_cache.data_ptr<uint8_t>() : nullptr;
  const uint8_t* vb = fp8 ? v_cache.data_ptr<uint8_t>() : nullptr;
  const float* kl = fp8 ? k_lut.data_ptr<float>() : nullptr;
  const float* vl = fp8 ? v_lut.data_ptr<float>() : nullptr;
  const int64_t* bt = bt_c.data_ptr<int64_t>();
  const int64_t* cl = cl_c.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap);
  const int64_t row = Hkv * D;  // floats between consecutive tokens of one block

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(H * D);
    std::vector<float> buf(fp8 ? row : 0);  // an fp8 row, decoded
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = cl[b];
      TORCH_CHECK(ctx >= 1 && ctx <= MAXB * BS, "context length out of range");
      const int64_t first = window > 0 && ctx > window ? ctx - window : 0;  // the first key the query sees
      const int64_t L = ctx - first;
      const float* qb = qp + b * H * D;
      const int64_t* blocks = bt + b * MAXB;
      scores.resize(H * L);
      // Pass 1: scores. A token's row holds all Hkv heads contiguously; read it once.
      for (int64_t i = 0; i < L; ++i) {
        const int64_t t = first + i;
        const float* kr = row_of(kp, kb, kl, (blocks[t / BS] * BS + t % BS) * row, row, buf.data());
        for (int64_t h = 0; h < H; ++h) scores[h * L + i] = dot(qb + h * D, kr + (h / G) * D, D) * sc;
      }
      if (cap > 0.f)
        for (auto& s : scores) s = cap * std::tanh(s / cap);
      for (int64_t h = 0; h < H; ++h) {
        float* s = scores.data() + h * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < L; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      // Pass 2: the probability-weighted sum of V rows.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t t = first + i;
        const float* vr = row_of(vp, vb, vl, (blocks[t / BS] * BS + t % BS) * row, row, buf.data());
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * L + i];
          const float* v = vr + (h / G) * D;
          float* a = acc.data() + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + b * H * D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (float32 or fp8, CPU)");
}
