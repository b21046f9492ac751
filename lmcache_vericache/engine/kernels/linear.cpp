// A linear layer for the few rows of a decode step or a verify block (engine/linear.py):
// y [M, N] = x [M, K] . w [N, K]^T in x's dtype, x and w float32 or bf16 (w an nn.Linear weight as
// it is, rows contiguous), float32 sums, K a multiple of the vector width.
//
// Why: with M = 1-200 rows the weights dominate the bytes, and the BLAS PyTorch calls on a CPU runs
// far from that bound for so few rows (MKL on an AVX2-only CPU; worst with bf16 weights, which it
// has no arithmetic for; docs/benchmarks.md). Here each block of C weight rows is read from
// memory once, widened to float once per vector (bf16), and multiplied into R x C register
// accumulators for every block of R input rows (up to 4, or 8 where the CPU has 32 vector registers
// and the call as many rows) while it sits in L1.
//
// Each output element is one dot product, its K products summed lane-wise (lane l takes k = l mod
// kW) and the lanes then in a fixed order (built without -fassociative-math, kernels/__init__.py,
// so the compiler cannot regroup the sums per block size): row m's result depends on x[m] and w
// only, not on M or on which block the row fell in. A decode step and a verify block therefore
// compute the same linear layers bit for bit, which lossless decoding does not need (it compares
// against itself) but which keeps greedy ties out of a batch's shape.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && !defined(VERICACHE_VEC_WIDTH)
#include <immintrin.h>
// bf16 rows times bf16 weights on CPUs with AVX512-BF16: vdpbf16ps multiplies 32 pairs per
// instruction with no widening (block_dot); the widening path stays for everything else.
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif
constexpr int64_t kDotW = 32;  // bf16 elements per vdpbf16ps

namespace {

using vericache::kVecRegs;
using vericache::kW;
using vericache::load_as_float;
using vericache::load_floats;
using vericache::vfloat;

// Accumulators R x C plus C weight vectors and one input vector fit the register file, in one of two
// shapes: wide, up to 4 rows x kColsWide (AVX2 / SSE, 16 registers: 4 x 3 + 3 + 1; AVX-512, 32:
// 4 x 6 + 6 + 1), and with 32 registers tall, 8 rows x 3 (8 x 3 + 3 + 1), for calls of 8 rows or
// more: a decode step's 8 rows then take one pass over each weight block, not two (SmolLM2's 30
// layers and LM head, 8 bf16 rows, weights from DRAM, 2-core EPYC: 13.6 against 15.7 ms; 40 rows
// equal; fp32 weights 8-40 rows 6-22% faster), while fewer rows keep the wide shape's 6 independent
// sums per row (tall, 1-3 fp32 rows ran 10-15% slower).
constexpr int kRowsWide = 4;
constexpr int kColsWide = (kVecRegs - 1) / (kRowsWide + 1);
constexpr int kRowsTall = kVecRegs == 32 ? 8 : kRowsWide;
constexpr int kColsTall = (kVecRegs - 1) / (kRowsTall + 1);

// Elements of a weight row fetched ahead of the products (the widening path).
constexpr int64_t kAhead = 512;
// The dot path fetches whole blocks ahead: a block's C weight rows are contiguous and the next
// blocks follow them, so while a block is multiplied the one kPfBlocks ahead is fetched, a step's
// share of its lines at each step (a prefetch past the weights does not fault). A few rows'
// products per weight hide too little of the memory's latency: 8 rows of SmolLM2's layers in bf16
// on a 2-core EPYC took 14.2 -> 11.4 ms against fetching 1 KB ahead in each row (1 block ahead
// 1.21x, 3 blocks 1.20x). The widening path (AVX2, fp32) keeps its row-wise fetch: fp32 rows on
// that EPYC measured no gain (unmeasured on AVX2).
constexpr int64_t kPfBlocks = 2;

inline float lane_sum(vfloat a) {
  float s = 0.f;
  for (int l = 0; l < kW; ++l) s += a[l];  // a fixed order: the batch invariance above
  return s;
}

// y[r, j] for R rows of x (row stride K) and the weight rows w0 + j*K, j < cols (the rest repeat
// the last one and are not stored), stored as TY (bf16: rounded to nearest even, as .to() does).
template <int R, int C, typename T, typename TY>
inline void block(const float* __restrict__ x, const T* __restrict__ w0, int64_t K, int cols,
                  TY* __restrict__ y, int64_t ldy) {
  vfloat acc[R][C] = {};
  const T* wr[C];
  for (int j = 0; j < C; ++j) wr[j] = w0 + std::min(j, cols - 1) * K;
  for (int64_t k = 0; k < K; k += kW) {
    vfloat wv[C];
    for (int j = 0; j < C; ++j) {
      __builtin_prefetch(wr[j] + k + kAhead);
      wv[j] = load_as_float(wr[j] + k);
    }
    for (int r = 0; r < R; ++r) {
      const vfloat xv = load_floats(x + r * K + k);
      for (int j = 0; j < C; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < cols; ++j) y[r * ldy + j] = static_cast<TY>(lane_sum(acc[r][j]));
}

// Threads split the weight rows into blocks of C (each reads its share of w once, for all M rows);
// within a block the rows go RMax at a time, the rest with as many accumulators as rows (no wasted
// products). tile(R, C, m, n0, cols): rows m..m+R of output columns n0..n0+cols, R and C
// std::integral_constants (the block functions take them as template arguments).
template <int RMax, int C, typename Tile>
void tiles_of(int64_t M, int64_t N, const Tile& tile) {
  using Cols = std::integral_constant<int, C>;
  const int64_t col_blocks = (N + C - 1) / C;
  at::parallel_for(0, col_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * C;
      const int cols = static_cast<int>(std::min<int64_t>(C, N - n0));
      int64_t m = 0;
      for (; m + RMax <= M; m += RMax) tile(std::integral_constant<int, RMax>{}, Cols{}, m, n0, cols);
      switch (M - m) {  // the cases at or past RMax cannot occur, and are not instantiated
        case 7: if constexpr (RMax > 7) tile(std::integral_constant<int, 7>{}, Cols{}, m, n0, cols); break;
        case 6: if constexpr (RMax > 6) tile(std::integral_constant<int, 6>{}, Cols{}, m, n0, cols); break;
        case 5: if constexpr (RMax > 5) tile(std::integral_constant<int, 5>{}, Cols{}, m, n0, cols); break;
        case 4: if constexpr (RMax > 4) tile(std::integral_constant<int, 4>{}, Cols{}, m, n0, cols); break;
        case 3: tile(std::integral_constant<int, 3>{}, Cols{}, m, n0, cols); break;
        case 2: tile(std::integral_constant<int, 2>{}, Cols{}, m, n0, cols); break;
        case 1: tile(std::integral_constant<int, 1>{}, Cols{}, m, n0, cols); break;
        default: break;
      }
    }
  });
}

// The register block's shape by the call's rows (the comment above kRowsWide says why).
template <typename Tile>
void for_tiles(int64_t M, int64_t N, const Tile& tile) {
  if (M >= kRowsTall && kRowsTall > kRowsWide) tiles_of<kRowsTall, kColsTall>(M, N, tile);
  else tiles_of<kRowsWide, kColsWide>(M, N, tile);
}

#if defined(__AVX512BF16__) && !defined(VERICACHE_VEC_WIDTH)
// block() for bf16 x and w, K a multiple of kDotW: lane l of an accumulator sums the products of
// k = kDotW i + 2 l and + 2 l + 1 in order of i (vdpbf16ps adds each pair to its lane), the lanes
// then in a fixed tree (_mm512_reduce_add_ps: 4 shuffle-adds; 16 scalar adds per output took 11-13%
// longer at K = 576), so a row's result still depends on x[m] and w only.
template <int R, int C, typename TY>
inline void block_dot(const c10::BFloat16* __restrict__ x, const c10::BFloat16* __restrict__ w0, int64_t K,
                      int cols, TY* __restrict__ y, int64_t ldy) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r][j] = _mm512_setzero_ps();
  const c10::BFloat16* wr[C];
  for (int j = 0; j < C; ++j) wr[j] = w0 + std::min(j, cols - 1) * K;
  // a step reads C lines of the block: it fetches C lines of the block kPfBlocks ahead
  const char* ahead = reinterpret_cast<const char*>(w0 + kPfBlocks * C * K);
  for (int64_t k = 0; k < K; k += kDotW) {
    __m512bh wv[C];
    for (int j = 0; j < C; ++j) {
      __builtin_prefetch(ahead + (k / kDotW * C + j) * 64);
      wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int j = 0; j < C; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < cols; ++j) y[r * ldy + j] = static_cast<TY>(_mm512_reduce_add_ps(acc[r][j]));
}

// y as TY: bf16 (x's dtype), or float32 sums (a bias is then added before the one rounding)
template <typename TY>
torch::Tensor run_dot(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(c10::CppTypeToScalarType<TY>::value));
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.template data_ptr<TY>();
  for_tiles(M, N, [&](auto R, auto C, int64_t m, int64_t n0, int cols) {
    block_dot<decltype(R)::value, decltype(C)::value>(xp + m * K, wp + n0 * K, K, cols, yp + m * N + n0, N);
  });
  return y;
}
#endif

template <typename T, typename TY>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  // bf16 rows widened once here (a few KB), not once per block of weight rows
  std::vector<float> widened;
  const float* xp;
  if constexpr (std::is_same_v<TY, float>) {
    xp = x.data_ptr<float>();
  } else {
    widened.resize(static_cast<size_t>(M * K));
    const TY* xb = x.data_ptr<TY>();
    for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(xb[i]);
    xp = widened.data();
  }
  const T* wp = w.data_ptr<T>();
  TY* yp = y.data_ptr<TY>();
  for_tiles(M, N, [&](auto R, auto C, int64_t m, int64_t n0, int cols) {
    block<decltype(R)::value, decltype(C)::value>(xp + m * K, wp + n0 * K, K, cols, yp + m * N + n0, N);
  });
  return y;
}

template <typename TY>
torch::Tensor run_weights(const torch::Tensor& x, const torch::Tensor& w) {
  if (w.dtype() == torch::kFloat32) return run<float, TY>(x, w);
  if (w.dtype() == torch::kBFloat16) return run<c10::BFloat16, TY>(x, w);
  TORCH_CHECK(false, "linear: float32 or bfloat16 weights only");
}

}  // namespace

torch::Tensor linear(torch::Tensor x, torch::Tensor w, bool float_out) {
  TORCH_CHECK((x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16) && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous float32 or bfloat16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1), "w must be contiguous [N, K] with x's K");
  TORCH_CHECK(x.size(1) % kW == 0, "K must be a multiple of ", kW, ", got ", x.size(1));
#if defined(__AVX512BF16__) && !defined(VERICACHE_VEC_WIDTH)
  if (x.dtype() == torch::kBFloat16 && w.dtype() == torch::kBFloat16 && x.size(1) % kDotW == 0)
    return float_out ? run_dot<float>(x, w) : run_dot<c10::BFloat16>(x, w);
#endif
  if (float_out && x.dtype() == torch::kBFloat16) return run_weights<float>(x.to(torch::kFloat32), w);  // widened exactly
  return x.dtype() == torch::kFloat32 ? run_weights<float>(x, w) : run_weights<c10::BFloat16>(x, w);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x . w^T for a few rows of x, in x's dtype (float32 sums; float_out: the sums unrounded)",
        py::arg("x"), py::arg("w"), py::arg("float_out") = false);
  m.attr("vec_width") = kW;
  m.attr("bf16_dot") = kBf16Dot;  // bf16 x bf16 with K % 32 == 0 runs block_dot
}
