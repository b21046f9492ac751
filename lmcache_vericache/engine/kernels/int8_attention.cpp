// Decode attention over int8 KV codes, dequantized on the fly (see engine/int8_attention.py).
//
// For every job j (one request's layer): queries q[j] [H, m, D] float32 (m query rows per KV head,
// GQA groups x block tokens), keys kq[j] [H, D, T] (transposed) / values vq[j] [H, T, D] int8 with one
// float32 scale per (head, token) in ks[j] / vs[j] [H, T]. Returns, per job, out [H, m, D] = softmax(scale * q k^T) v
// and lse [H, m] (natural log-sum-exp of the scaled scores) so the caller can merge this part with
// attention over other entries. The codes are read once per (head, token) for all m rows: 1 byte
// per element instead of 2 or 4, which is what a memory-bound decode step pays for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// exp(x) for x <= 0 from 2^x = 2^n * 2^f, with a degree-6 polynomial for 2^f on [0, 1) (relative
// error ~2e-7): plain arithmetic the compiler vectorizes, unlike a libm call per element.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504089f;
  const float n = std::floor(t);
  const float f = t - n;
  float p = 1.53533e-4f;
  p = p * f + 1.33989e-3f;
  p = p * f + 9.61844e-3f;
  p = p * f + 5.55033e-2f;
  p = p * f + 2.40227e-1f;
  p = p * f + 6.93147e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

constexpr int64_t kTile = 256;  // tokens per tile: a tile's scores stay in L1

// kt: keys transposed [D, T] (row d holds dimension d of every token: contiguous loads along t);
// vq: values [T, D]. s: scratch [m, T].
void attend_head(const float* __restrict__ q, const int8_t* __restrict__ kt, const float* __restrict__ ks,
                 const int8_t* __restrict__ vq, const float* __restrict__ vs, int64_t m, int64_t T, int64_t D,
                 float scale, float* __restrict__ out, float* __restrict__ lse, float* __restrict__ s) {
  alignas(64) float kf[kTile];
  for (int64_t t0 = 0; t0 < T; t0 += kTile) {
    const int64_t nt = std::min(kTile, T - t0);
    for (int64_t i = 0; i < m; ++i) {
      float* __restrict__ si = s + i * T + t0;
      for (int64_t t = 0; t < nt; ++t) si[t] = 0.f;
    }
    for (int64_t d = 0; d < D; ++d) {
      const int8_t* __restrict__ kd = kt + d * T + t0;
      for (int64_t t = 0; t < nt; ++t) kf[t] = static_cast<float>(kd[t]);  // converted once for all rows
      for (int64_t i = 0; i < m; ++i) {
        const float qd = q[i * D + d];
        float* __restrict__ si = s + i * T + t0;
        for (int64_t t = 0; t < nt; ++t) si[t] += qd * kf[t];
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      float* __restrict__ si = s + i * T + t0;
      for (int64_t t = 0; t < nt; ++t) si[t] *= scale * ks[t0 + t];
    }
  }
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
    TORCH_CHECK(kq[j].size(0) == H && kq[j].size(1) == D && kq[j].size(2) == T, "keys must be transposed [H, D, T]");
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
      attend_head(q[j].data_ptr<float>() + h * m * D, kq[j].data_ptr<int8_t>() + h * T * D, ks[j].data_ptr<float>() + h * T,
                  vq[j].data_ptr<int8_t>() + h * T * D, vs[j].data_ptr<float>() + h * T, m, T, D, static_cast<float>(scale),
                  outs[j].data_ptr<float>() + h * m * D, lses[j].data_ptr<float>() + h * m, s.data());
    }
  });
  return {outs, lses};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_attention", &int8_attention, "attention over int8 KV codes with per-(head, token) scales");
}
