// Attention of a block of query rows over a dense bf16 / fp32 KV cache (see engine/dense_attention.py).
//
// q [H, m, D] float32 (m rows per KV head: GQA group x verify-block tokens), k / v [H, S, D] in the
// cache's dtype (any head stride; tokens contiguous by D). Returns out [H, m, D] float32 =
// softmax(scale q k^T) v and lse [H, m] (natural log-sum-exp of the scaled scores), unmasked: the
// caller handles the block's causal part. Each K/V row is read once for all m rows (a verify reads
// the bytes of one decode step), the work is split over (head, tile of tokens) and the tiles are
// merged by log-sum-exp. PyTorch's CPU flash kernel runs these shapes at ~36 GFLOPS here.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using vericache::exp_nonpositive;

constexpr int64_t kTile = 512;  // tokens per work item
constexpr int kRows = 16;       // query rows per score vector (one AVX-512 register of floats)
constexpr int kTok = 4;         // tokens scored together (share each q load)
constexpr int kOutRows = 4;     // query rows per output register block (4 x D/16 accumulators)

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 floats as one vector (GCC/Clang vector extension: one AVX-512 register, two AVX2 ones); a
// scalar operand is broadcast. Explicit vectors keep the accumulators in registers.
typedef float v16 __attribute__((vector_size(64)));
inline v16 load16(const float* p) { v16 r; std::memcpy(&r, p, sizeof r); return r; }
inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

// One (head, tile): scores s [nt, mp] (token-major, rows padded to mp), then per-row max / sum
// and the unnormalized output o [m, D].
template <typename T, int D>
void tile(const float* __restrict__ qt, int64_t m, int64_t mp, const T* __restrict__ k, const T* __restrict__ v,
          int64_t nt, float* __restrict__ s, float* __restrict__ mx, float* __restrict__ sum, float* __restrict__ o) {
  // scores: qt is [D, mp] (scaled, zero-padded rows); kTok tokens share each q vector load
  float kf[kTok][D];
  for (int64_t t = 0; t < nt; t += kTok) {
    const int64_t nu = std::min<int64_t>(kTok, nt - t);
    for (int u = 0; u < kTok; ++u)
      for (int d = 0; d < D; ++d) kf[u][d] = u < nu ? to_float(k[(t + u) * D + d]) : 0.f;
    for (int64_t ib = 0; ib < mp; ib += kRows) {
      v16 acc[kTok] = {};
      for (int d = 0; d < D; ++d) {
        const v16 qv = load16(qt + d * mp + ib);
        for (int u = 0; u < kTok; ++u) acc[u] += qv * kf[u][d];
      }
      for (int u = 0; u < nu; ++u) store16(s + (t + u) * mp + ib, acc[u]);
    }
  }
  // softmax numerators, vectorized across rows
  for (int64_t i = 0; i < mp; ++i) mx[i] = -INFINITY, sum[i] = 0.f;
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t i = 0; i < mp; ++i) mx[i] = std::max(mx[i], s[t * mp + i]);
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t i = 0; i < mp; ++i) {
      const float e = exp_nonpositive(s[t * mp + i] - mx[i]);
      s[t * mp + i] = e;
      sum[i] += e;
    }
  // o = p v, kOutRows rows at a time with their D / 16 accumulators each in registers
  constexpr int kV = D / 16;
  for (int64_t ib = 0; ib < m; ib += kOutRows) {
    v16 acc[kOutRows][kV] = {};
    for (int64_t t = 0; t < nt; ++t) {
      float vf[D];
      for (int d = 0; d < D; ++d) vf[d] = to_float(v[t * D + d]);
      v16 vv[kV];
      for (int j = 0; j < kV; ++j) vv[j] = load16(vf + 16 * j);
      const float* __restrict__ p = s + t * mp + ib;
      for (int r = 0; r < kOutRows; ++r)
        for (int j = 0; j < kV; ++j) acc[r][j] += vv[j] * p[r];  // rows past m: padded, discarded
    }
    for (int64_t r = 0; r < std::min<int64_t>(kOutRows, m - ib); ++r)
      for (int j = 0; j < kV; ++j) store16(o + (ib + r) * D + 16 * j, acc[r][j]);
  }
}

template <typename T, int D>
std::vector<torch::Tensor> run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, float scale) {
  const int64_t H = q.size(0), m = q.size(1), S = k.size(1);
  const int64_t mp = (m + kRows - 1) / kRows * kRows;  // rows padded (a multiple of kOutRows too)
  const int64_t tiles = (S + kTile - 1) / kTile;
  // q transposed to [H, D, mp], scaled, zero-padded
  std::vector<float> qt(static_cast<size_t>(H * D * mp), 0.f);
  const float* qp = q.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < m; ++i)
      for (int d = 0; d < D; ++d) qt[(h * D + d) * mp + i] = qp[(h * m + i) * D + d] * scale;
  std::vector<float> part_mx(static_cast<size_t>(H * tiles * mp)), part_sum(part_mx.size());
  std::vector<float> part_o(static_cast<size_t>(H * tiles * m * D));
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, H * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(static_cast<size_t>(kTile * mp));
    for (int64_t w = begin; w < end; ++w) {
      const int64_t h = w / tiles, t0 = (w % tiles) * kTile, nt = std::min(kTile, S - t0);
      tile<T, D>(qt.data() + h * D * mp, m, mp, kp + h * ks + t0 * D, vp + h * vs + t0 * D, nt, s.data(),
                 part_mx.data() + w * mp, part_sum.data() + w * mp, part_o.data() + w * m * D);
    }
  });
  auto out = torch::empty({H, m, D}, q.options());
  auto lse = torch::empty({H, m}, q.options());
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < m; ++i) {
      float top = -INFINITY;
      for (int64_t j = 0; j < tiles; ++j) top = std::max(top, part_mx[(h * tiles + j) * mp + i]);
      float total = 0.f;
      float* oi = op + (h * m + i) * D;
      std::fill(oi, oi + D, 0.f);
      for (int64_t j = 0; j < tiles; ++j) {
        const int64_t w = h * tiles + j;
        const float c = std::exp(part_mx[w * mp + i] - top);
        total += c * part_sum[w * mp + i];
        const float* po = part_o.data() + (w * m + i) * D;
        for (int d = 0; d < D; ++d) oi[d] += c * po[d];
      }
      for (int d = 0; d < D; ++d) oi[d] /= total;
      lp[h * m + i] = top + std::log(total);
    }
  return {out, lse};
}

}  // namespace

std::vector<torch::Tensor> dense_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3, "q must be contiguous float32 [H, m, D]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.dtype() == v.dtype(), "k, v must be [H, S, D] alike");
  const int64_t H = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == H && k.size(2) == D && k.size(1) > 0 && q.size(1) > 0, "shape mismatch");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "k, v must have contiguous tokens of D elements");
  const float sc = static_cast<float>(scale);
  if (k.dtype() == torch::kBFloat16) {
    if (D == 64) return run<at::BFloat16, 64>(q, k, v, sc);
    if (D == 128) return run<at::BFloat16, 128>(q, k, v, sc);
  } else if (k.dtype() == torch::kFloat32) {
    if (D == 64) return run<float, 64>(q, k, v, sc);
    if (D == 128) return run<float, 128>(q, k, v, sc);
  }
  TORCH_CHECK(false, "dense_attention: bf16 / fp32 with head size 64 or 128 only");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dense_attention", &dense_attention, "attention of a block of query rows over a dense KV cache");
}
