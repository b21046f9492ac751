// Decode attention over int8 KV codes, dequantized on the fly (see engine/int8_attention.py).
//
// For every job j (one request's layer): queries q[j] [H, m, D] float32 (m query rows per KV head,
// GQA groups x block tokens), keys kq[j] [H, ceil(T/16), D, 16] (blocked by 16 tokens) / values
// vq[j] [H, T, D] int8 with one float32 scale per (head, token) in ks[j] / vs[j] [H, T]. Returns, per job, out [H, m, D] = softmax(scale * q k^T) v
// and lse [H, m] (natural log-sum-exp of the scaled scores) so the caller can merge this part with
// attention over other entries. The codes are read once per (head, token) for all m rows: 1 byte
// per element instead of 2 or 4, which is what a memory-bound decode step pays for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using vericache::exp_nonpositive;

constexpr int64_t kBlock = 16;  // tokens per key block: one AVX-512 vector of float scores

// Keys are blocked: kb [ceil(T / 16), D, 16] (block b holds dimension d of its 16 tokens
// contiguously, so a block is one 16*D-byte run and its scores accumulate in registers; the last
// block is zero-padded). Values [T, D]. Scores s [m, T] are scratch.

// Softmax of each row of s in place, times the value scales; writes lse.
void softmax_rows(float* __restrict__ s, const float* __restrict__ vs, int64_t m, int64_t T, float* __restrict__ lse) {
  for (int64_t i = 0; i < m; ++i) {
    float* __restrict__ si = s + i * T;
    float mx = -INFINITY;
    for (int64_t t = 0; t < T; ++t) mx = si[t] > mx ? si[t] : mx;
    float sum = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      si[t] = exp_nonpositive(si[t] - mx);
      sum += si[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < T; ++t) si[t] *= inv * vs[t];  // value scale folded into the weight
    lse[i] = mx + std::log(sum);
  }
}

// M query rows and head size D known at compile time: accumulators live in registers.
template <int M, int D>
void attend_fixed(const float* __restrict__ q, const int8_t* __restrict__ kb, const float* __restrict__ ks,
                  const int8_t* __restrict__ vq, const float* __restrict__ vs, int64_t T, float scale,
                  float* __restrict__ out, float* __restrict__ lse, float* __restrict__ s) {
  for (int64_t t0 = 0; t0 < T; t0 += kBlock) {
    const int8_t* __restrict__ blk = kb + t0 * D;
    float acc[M][kBlock] = {};
    for (int d = 0; d < D; ++d) {
      float kf[kBlock];
      for (int t = 0; t < kBlock; ++t) kf[t] = static_cast<float>(blk[d * kBlock + t]);
      for (int i = 0; i < M; ++i) {
        const float qd = q[i * D + d];
        for (int t = 0; t < kBlock; ++t) acc[i][t] += qd * kf[t];
      }
    }
    const int64_t nt = std::min(kBlock, T - t0);
    for (int i = 0; i < M; ++i)
      for (int64_t t = 0; t < nt; ++t) s[i * T + t0 + t] = acc[i][t] * scale * ks[t0 + t];
  }
  softmax_rows(s, vs, M, T, lse);
  float o[M][D] = {};
  for (int64_t t = 0; t < T; ++t) {
    const int8_t* __restrict__ vr = vq + t * D;
    float vf[D];
    for (int d = 0; d < D; ++d) vf[d] = static_cast<float>(vr[d]);
    for (int i = 0; i < M; ++i) {
      const float w = s[i * T + t];
      for (int d = 0; d < D; ++d) o[i][d] += w * vf[d];
    }
  }
  for (int i = 0; i < M; ++i)
    for (int d = 0; d < D; ++d) out[i * D + d] = o[i][d];
}

// Any m and D (a cached prompt's tail, n-gram blocks, other head sizes): same layout, plain loops.
void attend_any(const float* __restrict__ q, const int8_t* __restrict__ kb, const float* __restrict__ ks,
                const int8_t* __restrict__ vq, const float* __restrict__ vs, int64_t m, int64_t T, int64_t D,
                float scale, float* __restrict__ out, float* __restrict__ lse, float* __restrict__ s) {
  for (int64_t t0 = 0; t0 < T; t0 += kBlock) {
    const int8_t* __restrict__ blk = kb + t0 * D;
    const int64_t nt = std::min(kBlock, T - t0);
    for (int64_t i = 0; i < m; ++i) {
      float acc[kBlock] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float qd = q[i * D + d];
        for (int t = 0; t < kBlock; ++t) acc[t] += qd * static_cast<float>(blk[d * kBlock + t]);
      }
      for (int64_t t = 0; t < nt; ++t) s[i * T + t0 + t] = acc[t] * scale * ks[t0 + t];
    }
  }
  softmax_rows(s, vs, m, T, lse);
  for (int64_t i = 0; i < m * D; ++i) out[i] = 0.f;
  for (int64_t t = 0; t < T; ++t) {
    const int8_t* __restrict__ vr = vq + t * D;
    for (int64_t i = 0; i < m; ++i) {
      const float w = s[i * T + t];
      float* __restrict__ oi = out + i * D;
      for (int64_t d = 0; d < D; ++d) oi[d] += w * static_cast<float>(vr[d]);
    }
  }
}

template <int D>
bool attend_d(const float* q, const int8_t* kb, const float* ks, const int8_t* vq, const float* vs, int64_t m,
              int64_t T, float scale, float* out, float* lse, float* s) {
  switch (m) {
    case 1: attend_fixed<1, D>(q, kb, ks, vq, vs, T, scale, out, lse, s); return true;
    case 2: attend_fixed<2, D>(q, kb, ks, vq, vs, T, scale, out, lse, s); return true;
    case 3: attend_fixed<3, D>(q, kb, ks, vq, vs, T, scale, out, lse, s); return true;
    case 4: attend_fixed<4, D>(q, kb, ks, vq, vs, T, scale, out, lse, s); return true;
    case 6: attend_fixed<6, D>(q, kb, ks, vq, vs, T, scale, out, lse, s); return true;
    case 8: attend_fixed<8, D>(q, kb, ks, vq, vs, T, scale, out, lse, s); return true;
    default: return false;
  }
}

void attend_head(const float* q, const int8_t* kb, const float* ks, const int8_t* vq, const float* vs, int64_t m,
                 int64_t T, int64_t D, float scale, float* out, float* lse, float* s) {
  // the common decode shapes (GQA group of 1-8 query heads, head size 64 or 128) get fixed loops
  if (D == 64 && attend_d<64>(q, kb, ks, vq, vs, m, T, scale, out, lse, s)) return;
  if (D == 128 && attend_d<128>(q, kb, ks, vq, vs, m, T, scale, out, lse, s)) return;
  attend_any(q, kb, ks, vq, vs, m, T, D, scale, out, lse, s);
}

}  // namespace

std::vector<std::vector<torch::Tensor>> int8_attention(std::vector<torch::Tensor> q, std::vector<torch::Tensor> kq,
                                                       std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vq,
                                                       std::vector<torch::Tensor> vs, double scale) {
  const size_t jobs = q.size();
  TORCH_CHECK(kq.size() == jobs && ks.size() == jobs && vq.size() == jobs && vs.size() == jobs, "job count mismatch");
  std::vector<torch::Tensor> outs(jobs), lses(jobs);
  std::vector<std::pair<size_t, int64_t>> work;  // (job, head)
  for (size_t j = 0; j < jobs; ++j) {
    TORCH_CHECK(q[j].dtype() == torch::kFloat32 && q[j].is_contiguous() && q[j].dim() == 3, "q must be contiguous float32 [H, m, D]");
    TORCH_CHECK(kq[j].dtype() == torch::kInt8 && kq[j].is_contiguous() && vq[j].dtype() == torch::kInt8 && vq[j].is_contiguous(),
                "codes must be contiguous int8");
    TORCH_CHECK(ks[j].dtype() == torch::kFloat32 && ks[j].is_contiguous() && vs[j].dtype() == torch::kFloat32 && vs[j].is_contiguous(),
                "scales must be contiguous float32 [H, T]");
    const int64_t H = q[j].size(0), m = q[j].size(1), D = q[j].size(2), T = vq[j].size(1);
    TORCH_CHECK(vq[j].size(0) == H && vq[j].size(2) == D, "values must be [H, T, D]");
    TORCH_CHECK(kq[j].dim() == 4 && kq[j].size(0) == H && kq[j].size(1) == (T + kBlock - 1) / kBlock &&
                kq[j].size(2) == D && kq[j].size(3) == kBlock, "keys must be blocked [H, ceil(T/16), D, 16]");
    TORCH_CHECK(ks[j].size(0) == H && ks[j].size(1) == T && vs[j].sizes() == ks[j].sizes(), "scales shape mismatch");
    TORCH_CHECK(T > 0, "no keys");
    outs[j] = torch::empty({H, m, D}, q[j].options());
    lses[j] = torch::empty({H, m}, q[j].options());
    for (int64_t h = 0; h < H; ++h) work.emplace_back(j, h);
  }
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;
    for (int64_t w = begin; w < end; ++w) {
      const size_t j = work[w].first;
      const int64_t h = work[w].second;
      const int64_t m = q[j].size(1), D = q[j].size(2), T = vq[j].size(1);
      s.resize(static_cast<size_t>(m * T));
      const int64_t nb = kq[j].size(1);
      attend_head(q[j].data_ptr<float>() + h * m * D, kq[j].data_ptr<int8_t>() + h * nb * kBlock * D, ks[j].data_ptr<float>() + h * T,
                  vq[j].data_ptr<int8_t>() + h * T * D, vs[j].data_ptr<float>() + h * T, m, T, D, static_cast<float>(scale),
                  outs[j].data_ptr<float>() + h * m * D, lses[j].data_ptr<float>() + h * m, s.data());
    }
  });
  return {outs, lses};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_attention", &int8_attention, "attention over int8 KV codes with per-(head, token) scales");
}
