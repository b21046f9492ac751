// The small per-token ops around the linear layers and attention (engine/hf_model.py,
// engine/runtime.py, engine/verify.py), one call each instead of PyTorch's several.
//
// Why: each is a few microseconds of arithmetic, but PyTorch runs it as 3-8 ops over fresh tensors
// (an RMSNorm ~26 us for 8 rows of SmolLM2, rotary embedding ~32 us, a sampled token's
// probabilities and draw ~280 us over 49,152 entries), and a decode step runs 61 norms and 30
// rotary embeddings: ~2.7 ms of a 55 ms batch-8 draft step at 8k on a 2-core EPYC.
//
// rms_norm and rope compute what the PyTorch expressions they replace compute, rounding to the
// tensor's dtype where those round (bf16: after each op): rms_norm is Llama's RMSNorm,
// w * (x * rsqrt(mean(x^2) + eps)).to(dtype) with the mean in float32 (summed in another order,
// hence equal to ~1 float32 ulp); rope is q * cos + rotate_half(q) * sin, bit for bit (built with
// -ffp-contract=off, kernels/__init__.py, so no product is fused into a sum). Each row's result
// depends on that row only.
#include <torch/extension.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include <type_traits>

namespace {

using vericache::exp_nonpositive;
using vericache::kW;
using vericache::to_float;
using vericache::vfloat;
using vericache::vint;

// float -> T as .to(T) rounds (bf16: nearest even).
template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <typename T>
void rms_norm_rows(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int64_t rows,
                   int64_t h, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * h;
    float ss = 0.f;
    for (int64_t i = 0; i < h; ++i) {
      const float v = to_float(xr[i]);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    T* yr = y + r * h;
    for (int64_t i = 0; i < h; ++i)  // normalized, rounded to T, then times the weight, rounded again
      yr[i] = round_to<T>(to_float(w[i]) * to_float(round_to<T>(to_float(xr[i]) * inv)));
  }
}

// y = RMSNorm(x) over the last dimension (x [..., H] contiguous, w [H], same dtype).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type(),
              "rms_norm: contiguous x and w of one dtype");
  const int64_t h = w.numel();
  TORCH_CHECK(x.size(-1) == h, "rms_norm: x's last dimension must be w's size");
  auto y = torch::empty_like(x);
  const int64_t rows = x.numel() / h;
  if (x.scalar_type() == torch::kBFloat16) {
    using T = c10::BFloat16;
    rms_norm_rows(x.data_ptr<T>(), w.data_ptr<T>(), y.data_ptr<T>(), rows, h, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "rms_norm: float32 or bfloat16");
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, h, static_cast<float>(eps));
  }
  return y;
}

template <typename T>
void rope_rows(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin, T* __restrict__ y,
               int64_t n, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < n; ++t) {
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    for (int64_t hd = 0; hd < heads; ++hd) {
      const T* xr = x + (t * heads + hd) * d;
      T* yr = y + (t * heads + hd) * d;
      for (int64_t i = 0; i < d; ++i) {
        // rotate_half: [-x2, x1]; negation is exact in any dtype
        const float rot = i < half ? -to_float(xr[i + half]) : to_float(xr[i - half]);
        const T a = round_to<T>(to_float(xr[i]) * to_float(c[i]));
        const T b = round_to<T>(rot * to_float(s[i]));
        yr[i] = round_to<T>(to_float(a) + to_float(b));
      }
    }
  }
}

// q * cos + rotate_half(q) * sin for x [N, H, D] contiguous, cos / sin [N, D] (one rotation per token).
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "rope: contiguous x [N, H, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "rope: one dtype");
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && cos.numel() == n * d && sin.numel() == n * d, "rope: cos / sin must be [N, D], D even");
  auto y = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16) {
    using T = c10::BFloat16;
    rope_rows(x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), y.data_ptr<T>(), n, heads, d);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "rope: float32 or bfloat16");
    rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>(), n, heads, d);
  }
  return y;
}

// softmax(x / temperature) of each row of x [R, V] float32 (contiguous), float32 out; an empty
// tensor where a row holds a NaN or its maximum is not finite (the caller takes PyTorch's path, which
// says what it says). A -inf logit gets probability exactly 0 (a masked token is never drawn).
torch::Tensor softmax(torch::Tensor x, double temperature) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "softmax: float32 [R, V]");
  const int64_t rows = x.size(0), v = x.size(1);
  auto y = torch::empty_like(x);
  const float t = static_cast<float>(temperature);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data_ptr<float>() + r * v;
    float* yr = y.data_ptr<float>() + r * v;
    int64_t i = 0;
    const vfloat neg_inf = vfloat{} - std::numeric_limits<float>::infinity();
    vfloat mv = neg_inf;
    vint nan = {};
    for (; i + kW <= v; i += kW) {
      const vfloat q = vericache::load_floats(xr + i) / t;  // divided as x / temperature divides
      vericache::store_floats(yr + i, q);
      mv = q > mv ? q : mv;
      nan |= q != q;
    }
    float m = -std::numeric_limits<float>::infinity();
    bool has_nan = false;
    for (int l = 0; l < kW; ++l) {
      m = std::max(m, mv[l]);
      has_nan |= nan[l] != 0;
    }
    for (; i < v; ++i) {
      yr[i] = xr[i] / t;
      m = std::max(m, yr[i]);
      has_nan |= yr[i] != yr[i];
    }
    if (has_nan || !std::isfinite(m)) return torch::empty({0});
    i = 0;
    vfloat acc = {};
    for (; i + kW <= v; i += kW) {
      const vfloat y = vericache::load_floats(yr + i);
      const vfloat e = y == neg_inf ? vfloat{} : exp_nonpositive(y - m);  // exp_nonpositive floors at e^-87
      vericache::store_floats(yr + i, e);
      acc += e;
    }
    float s = 0.f;
    for (int l = 0; l < kW; ++l) s += acc[l];
    for (; i < v; ++i) {
      yr[i] = yr[i] == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(yr[i] - m);
      s += yr[i];
    }
    const float inv = 1.f / s;
    for (int64_t j = 0; j < v; ++j) yr[j] *= inv;
  }
  return y;
}

constexpr int64_t kDrawBlock = 256;

// The first index whose running sum (float64) of w [V] (float32, contiguous) exceeds u * total, u
// in [0, 1): an inverse-CDF draw. Sums blocks first, then scans the one block holding the target;
// where that scan (another summation order than the block's sum) ends short of it by rounding, the
// block's last entry of positive weight. -1 where a weight is negative or not finite, all are 0, or
// there are none.
int64_t draw(torch::Tensor w, double u) {
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == torch::kFloat32, "draw: float32 [V]");
  const float* p = w.data_ptr<float>();
  const int64_t v = w.numel(), blocks = (v + kDrawBlock - 1) / kDrawBlock;
  std::vector<double> sums(blocks);
  if (v == 0) return -1;  // nothing to draw from
  // float32 lanes widened to float64 lanes, 8 at a time; NaN and negative weights marked lane-wise
  // (a NaN compares false, so `!(w >= 0)` marks it too)
  typedef float vf8 __attribute__((vector_size(32)));
  typedef double vd8 __attribute__((vector_size(64)));
  typedef int32_t vi8 __attribute__((vector_size(32)));
  vi8 bad = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kDrawBlock, end = std::min(v, begin + kDrawBlock);
    int64_t i = begin;
    vd8 acc = {};
    for (; i + 8 <= end; i += 8) {
      vf8 x;
      std::memcpy(&x, p + i, sizeof x);
      bad |= !(x >= 0.f);
      acc += __builtin_convertvector(x, vd8);
    }
    double s = 0.0;
    for (int l = 0; l < 8; ++l) s += acc[l];
    for (; i < end; ++i) {
      bad[0] |= !(p[i] >= 0.f);
      s += static_cast<double>(p[i]);
    }
    sums[b] = s;
  }
  bool ok = true;
  for (int l = 0; l < 8; ++l) ok &= bad[l] == 0;
  // running sums of the blocks, one after another: the total and the search see the same numbers
  // (a plain loop summing the total could be vectorized into another order)
  for (int64_t b = 1; b < blocks; ++b) sums[b] += sums[b - 1];
  const double total = sums[blocks - 1];
  if (!ok || !(total > 0.0) || !std::isfinite(total)) return -1;
  const double target = u * total;
  int64_t b = 0;
  while (b < blocks - 1 && sums[b] <= target) ++b;
  double run = b ? sums[b - 1] : 0.0;
  const int64_t end = std::min(v, (b + 1) * kDrawBlock);
  int64_t last = -1;
  for (int64_t i = b * kDrawBlock; i < end; ++i) {
    if (p[i] > 0.f) last = i;
    run += static_cast<double>(p[i]);
    if (run > target && p[i] > 0.f) return i;
  }
  return last;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "Llama's RMSNorm over the last dimension", py::arg("x"), py::arg("w"), py::arg("eps"));
  m.def("rope", &rope, "q * cos + rotate_half(q) * sin for q [N, H, D], cos / sin [N, D]",
        py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("softmax", &softmax, "softmax(x / temperature) per row of float32 x [R, V] (empty: a NaN or a non-finite maximum)",
        py::arg("x"), py::arg("temperature"));
  m.def("draw", &draw, "inverse-CDF draw from float32 weights at uniform u (-1: invalid weights)",
        py::arg("w"), py::arg("u"));
  m.attr("vec_width") = kW;  // floats per vector this build uses
}
