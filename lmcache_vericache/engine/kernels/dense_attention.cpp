// Attention of query rows over a dense bf16 / fp32 KV cache (engine/runtime.py: a decode token's GQA
// group over the whole cache, a verify block's rows over the entries before it and its own).
//
// q [H, m, D] float32 (m rows per KV head: GQA group x block tokens), k / v [H, S, D] in the
// cache's dtype (any head stride; tokens contiguous by D). Returns out [H, m, D] float32 =
// softmax(scale q k^T) v and lse [H, m] (natural log-sum-exp of the scaled scores). With causal = n
// the last n entries are a block whose token i % n (row i) sees only the entries up to its own;
// causal = 0 is unmasked. Each K/V row is read once for all m rows (a verify reads
// the bytes of one decode step), the work is split over (head, tile of tokens) and the tiles are
// merged by log-sum-exp (benchmarks/attention.py measures it against PyTorch's CPU flash kernel).
//
// On CPUs with AVX512-BF16 a bf16 cache takes tile_dp: q k^T and p v as bf16 pair dot products
// (vdpbf16ps, fp32 accumulation) straight from the cache's bytes, with q and the probabilities
// rounded to bf16 as a bf16 flash kernel does (q of a bf16 model is bf16 already: the scale is
// applied to the fp32 scores). Elsewhere, and for fp32 caches, tile converts to fp32 and uses FMAs.
// On CPUs with AMX, amx = true takes tile_amx (amx.h) instead: tile_dp's numerics, its matrix
// products on the tiles (faster there for decode steps' few rows too, though 16-row tiles hold them).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(VERICACHE_VEC_WIDTH)
#include <immintrin.h>
#define VERICACHE_DPBF16 1
#else
#define VERICACHE_DPBF16 0
#endif

namespace {

using vericache::exp_nonpositive;
using vericache::kVecRegs;
using vericache::kW;
using vericache::load_as_float;
using vericache::load_floats;
using vericache::store_floats;
using vericache::to_float;
using vericache::vfloat;

constexpr int64_t kTile = 512;  // tokens per work item
constexpr int kRows = kW;       // query rows per score vector (one register of floats)
constexpr int kTok = 4;         // tokens scored together (share each q load)
// Row vectors scored together (share each k broadcast): on AVX2 three, 12 accumulators to cover the
// FMA latency.
constexpr int kScoreVecs = kW == 16 ? 1 : 3;

// K rows this many tokens ahead of the ones being scored are prefetched: from DRAM (8k entries x 3
// heads, bf16, AVX-512 host, calls in a loop) a decode step's call took 0.41-0.45 ms without, 0.35-0.37
// with; a 5-token verify's 0.52-0.62 -> 0.46-0.47, a 17-token one's 1.48 -> 1.41-1.43. Inside a batch-8
// forward, between the linear layers, less: its 240 decode calls 103 -> 97 ms in one A/B, and a decode
// run's step costs did not move beyond the noise. The distance hardly matters (32-256 tokens within 2%).
// V is left to the hardware: prefetched while its tile was scored, the few-row calls ran slower than
// with K alone. Arithmetic unchanged: outputs are bit for bit those without.
constexpr int64_t kPrefetchTokens = 64;

// Prefetch rows t..t+n of a [*, D] table of T, past its end too (vericache::prefetch_bytes).
template <typename T, int D>
inline void prefetch_rows(const T* rows, int64_t t, int64_t n) {
  vericache::prefetch_bytes(reinterpret_cast<uintptr_t>(rows) + static_cast<uintptr_t>(t * D) * sizeof(T),
                            n * D * static_cast<int64_t>(sizeof(T)));
}

// A verify block's causal part: row i is the block's token i % n (n > 0), which sees the entries up
// to its own; `first` is the tile's index of the block's first entry. Later entries get -inf.
inline void mask_block(float* __restrict__ s, int64_t nt, int64_t mp, int64_t first, int64_t n) {
  if (n == 0) return;
  for (int64_t t = std::max<int64_t>(0, first + 1); t < nt; ++t)
    for (int64_t i = 0; i < mp; ++i)
      if (t - first > i % n) s[t * mp + i] = -INFINITY;
}

// Scores s [nt, mp] (token-major) -> softmax numerators exp(s - max) in place, with each row's max
// and sum; vectorized across rows. Masked (-inf) scores give exactly 0, a row masked throughout
// the tile max -inf and sum 0 (no weight in the merge of tiles).
inline void softmax_numerators(float* __restrict__ s, int64_t nt, int64_t mp, float* __restrict__ mx,
                               float* __restrict__ sum) {
  const vfloat neg_inf = vfloat{} - INFINITY;
  for (int64_t ib = 0; ib < mp; ib += kW) {
    vfloat top = neg_inf, total = {};
    for (int64_t t = 0; t < nt; ++t) {
      const vfloat x = load_floats(s + t * mp + ib);
      top = x > top ? x : top;
    }
    for (int64_t t = 0; t < nt; ++t) {
      const vfloat x = load_floats(s + t * mp + ib);
      const vfloat e = x == neg_inf ? vfloat{} : exp_nonpositive(x - top);
      store_floats(s + t * mp + ib, e);
      total += e;
    }
    store_floats(mx + ib, top);
    store_floats(sum + ib, total);
  }
}

// fp32 -> bf16 bits, rounded to nearest even (finite inputs: q, probabilities).
inline uint32_t bf16_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

// Scores of R row vectors from ib on for kTok tokens kf (nu of them real) into s [kTok, mp].
template <int R, int D>
inline void score_block(const float* __restrict__ qt, int64_t mp, int64_t ib, const float (&kf)[kTok][D], int64_t nu,
                        float* __restrict__ s) {
  vfloat acc[R][kTok] = {};
  for (int d = 0; d < D; ++d) {
    vfloat qv[R];
    for (int r = 0; r < R; ++r) qv[r] = load_floats(qt + d * mp + ib + r * kRows);
    for (int u = 0; u < kTok; ++u)
      for (int r = 0; r < R; ++r) acc[r][u] += qv[r] * kf[u][d];
  }
  for (int u = 0; u < nu; ++u)
    for (int r = 0; r < R; ++r) store_floats(s + u * mp + ib + r * kRows, acc[r][u]);
}

// Vectors of dimensions per accumulator block of R rows: as many as leave registers for them
// and one broadcast probability (AVX2, D = 64: 6 rows x 2 vectors or 2 x 4; AVX-512 6 x 4).
constexpr int pv_chunk(int R, int vecs) {
  int c = vecs < 4 ? vecs : 4;
  while (c > 1 && R * c + c + 1 > kVecRegs) c /= 2;
  return c;
}
// Rows a verify block's p v takes together: 12 (AVX2) or 24 (AVX-512) accumulators hide the FMA
// latency, which blocks of 2 x 4 rows (8 accumulators on AVX2) do not.
constexpr int kPvRows = 6;

// o [rows ib..ib+R, D] += p v over tokens t0..t1 of the tile (vf: their V rows as floats, from
// t0); rows past m are computed from whatever s holds there (padding, the next token's rows, the
// slack after the last) and discarded.
template <int R, int D>
inline void pv_rows(const float* __restrict__ s, int64_t mp, int64_t ib, int64_t m, const float* __restrict__ vf,
                    int64_t t0, int64_t t1, float* __restrict__ o) {
  constexpr int kVecs = D / kW, kChunk = pv_chunk(R, kVecs);
  const int64_t rows = std::min<int64_t>(R, m - ib);
  for (int c0 = 0; c0 < kVecs; c0 += kChunk) {
    vfloat acc[R][kChunk] = {};
    if (t0 > 0)
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < kChunk; ++j) acc[r][j] = load_floats(o + (ib + r) * D + (c0 + j) * kW);
    for (int64_t t = t0; t < t1; ++t) {
      vfloat vv[kChunk];
      for (int j = 0; j < kChunk; ++j) vv[j] = load_floats(vf + (t - t0) * D + (c0 + j) * kW);
      const float* __restrict__ p = s + t * mp + ib;
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < kChunk; ++j) acc[r][j] += vv[j] * p[r];
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < kChunk; ++j) store_floats(o + (ib + r) * D + (c0 + j) * kW, acc[r][j]);
  }
}

// Scores s [nt, mp] of mp rows (whole row vectors): kTok tokens share each q vector load and
// kScoreVecs row vectors each k broadcast.
template <typename T, int D>
inline void score_tile(const float* __restrict__ qt, int64_t mp, const T* __restrict__ k, int64_t nt,
                       float* __restrict__ s) {
  float kf[kTok][D];
  for (int64_t t = 0; t < nt; t += kTok) {
    const int64_t nu = std::min<int64_t>(kTok, nt - t);
    prefetch_rows<T, D>(k, t + kPrefetchTokens, kTok);
    for (int u = 0; u < kTok; ++u)  // whole vectors: bf16 widened kW at a time, not element by element
      for (int c = 0; c < D / kW; ++c)
        store_floats(kf[u] + c * kW, u < nu ? load_as_float(k + (t + u) * D + c * kW) : vfloat{});
    int64_t ib = 0;
    for (; ib + kScoreVecs * kRows <= mp; ib += kScoreVecs * kRows) score_block<kScoreVecs, D>(qt, mp, ib, kf, nu, s + t * mp);
    for (; ib < mp; ib += kRows) score_block<1, D>(qt, mp, ib, kf, nu, s + t * mp);
  }
}

// Scores of a decode step's few rows (M <= 4, padded to one vector: mp == kW) as dot products: each
// K row is widened once and meets the M rows' q in registers, then one horizontal sum per row. The
// row-vector form above spends a whole vector per dimension on M live lanes (3 of 8 on AVX2, 3 of 16
// on AVX-512).
template <typename T, int D, int M>
inline void score_rows(const float* __restrict__ qt, int64_t mp, const T* __restrict__ k, int64_t nt,
                       float* __restrict__ s) {
  constexpr int kV = D / kW;
  float qr[M][D];  // the rows contiguous (qt is [D, mp])
  for (int i = 0; i < M; ++i)
    for (int d = 0; d < D; ++d) qr[i][d] = qt[d * mp + i];
  for (int64_t t = 0; t < nt; ++t) {
    prefetch_rows<T, D>(k, t + kPrefetchTokens, 1);
    vfloat acc[M][2] = {};  // two chains per row: half the FMA latency per token
    for (int c = 0; c < kV; ++c) {
      const vfloat kv = load_as_float(k + t * D + c * kW);
      for (int i = 0; i < M; ++i) acc[i][c & 1] += load_floats(qr[i] + c * kW) * kv;
    }
    vfloat row = {};  // lanes past M: 0, as the zero-padded q rows give in the row-vector form
    for (int i = 0; i < M; ++i) {
      const vfloat a = acc[i][0] + acc[i][1];
      float x = 0.f;
      for (int l = 0; l < kW; ++l) x += a[l];
      row[i] = x;
    }
    store_floats(s + t * mp, row);
  }
}

// One (head, tile): scores s [nt, mp] (token-major, rows padded to mp), then per-row max / sum
// and the unnormalized output o [m, D].
template <typename T, int D>
void tile(const float* __restrict__ qt, int64_t m, int64_t mp, const T* __restrict__ k, const T* __restrict__ v,
          int64_t nt, int64_t first, int64_t n, float* __restrict__ s, float* __restrict__ mx, float* __restrict__ sum,
          float* __restrict__ o) {
  // scores: qt is [D, mp] (scaled, zero-padded rows). A decode step's few rows: dot products;
  // otherwise kTok tokens share each q vector load and kScoreVecs row vectors each k broadcast
  switch (mp == kW ? m : 0) {
    case 1: score_rows<T, D, 1>(qt, mp, k, nt, s); break;
    case 2: score_rows<T, D, 2>(qt, mp, k, nt, s); break;
    case 3: score_rows<T, D, 3>(qt, mp, k, nt, s); break;
    case 4: score_rows<T, D, 4>(qt, mp, k, nt, s); break;
    default: score_tile<T, D>(qt, mp, k, nt, s);
  }
  mask_block(s, nt, mp, first, n);
  softmax_numerators(s, nt, mp, mx, sum);
  // o = p v over kSub tokens at a time: their V rows stay in L1 for every block of rows (a whole
  // tile's V, 64-128 KB, would stream from L2 once per block of rows)
  constexpr int64_t kSub = 32;
  float vslice[kSub * D];  // a bf16 slice widened once, not once per row block
  for (int64_t t0 = 0; t0 < nt; t0 += kSub) {
    const int64_t t1 = std::min(nt, t0 + kSub);
    const float* vf = reinterpret_cast<const float*>(v) + t0 * D;  // fp32: read in place
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t t = t0; t < t1; ++t)
        for (int c = 0; c < D / kW; ++c) store_floats(vslice + (t - t0) * D + c * kW, load_as_float(v + t * D + c * kW));
      vf = vslice;
    }
    // blocks of kPvRows rows (a verify block's 3 x 17 rows); a decode step's few rows in one block
    // of 3 (a GQA group of 3: no padded row) or blocks of 2
    for (int64_t ib = 0; ib < m;) {
      if (m - ib > 4) {
        pv_rows<kPvRows, D>(s, mp, ib, m, vf, t0, t1, o);
        ib += kPvRows;
      } else if (m - ib == 3) {
        pv_rows<3, D>(s, mp, ib, m, vf, t0, t1, o);
        ib += 3;
      } else {
        pv_rows<2, D>(s, mp, ib, m, vf, t0, t1, o);
        ib += 2;
      }
    }
  }
}

#if VERICACHE_DPBF16
// 16 floats (one AVX-512 register) and their bf16_bits.
typedef float v16 __attribute__((vector_size(64)));
inline v16 load16(const float* p) { v16 r; std::memcpy(&r, p, sizeof r); return r; }
typedef uint32_t u16x __attribute__((vector_size(64)));
inline u16x bf16_bits(v16 x) {
  u16x b;
  std::memcpy(&b, &x, sizeof b);
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

// Scores s [nt, mp] of RV row vectors from ib on, U tokens at a time: RV x U accumulators (16 cover
// vdpbf16ps's latency, which the U = 4 chains of a single row vector did not), each q pair vector
// loaded once per U tokens, each k word broadcast once per RV row vectors. Every row's sum runs over
// e in order whatever RV and U: a decode row scores as the same row of a verify block does.
template <int D, int RV, int U>
inline void score_dp(const uint32_t* __restrict__ qp, int64_t mp, int64_t ib, const uint16_t* __restrict__ kb,
                     int64_t nt, __m512 vscale, float* __restrict__ s) {
  for (int64_t t = 0; t < nt; t += U) {
    const int64_t nu = std::min<int64_t>(U, nt - t);
    if (ib == 0) prefetch_rows<uint16_t, D>(kb, t + kPrefetchTokens, U);  // later row blocks find the tile in L2
    __m512 acc[RV][U];
    for (int r = 0; r < RV; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    for (int e = 0; e < D / 2; ++e) {
      __m512bh qv[RV];
      for (int r = 0; r < RV; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(qp + e * mp + ib + r * kRows);
      for (int u = 0; u < U; ++u) {
        const int64_t tu = t + std::min<int64_t>(u, nu - 1);  // past nt: a repeat, never stored
        uint32_t word;
        std::memcpy(&word, kb + tu * D + 2 * e, sizeof word);
        const __m512bh kw = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
        for (int r = 0; r < RV; ++r) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], qv[r], kw);
      }
    }
    for (int u = 0; u < nu; ++u)
      for (int r = 0; r < RV; ++r) _mm512_storeu_ps(s + (t + u) * mp + ib + r * kRows, _mm512_mul_ps(acc[r][u], vscale));
  }
}

// tile for a bf16 cache with vdpbf16ps. qp is [D/2, mp] words of bf16 pairs (q[i][2e], q[i][2e+1]),
// unscaled; p is a [ceil(nt/2), mp] scratch of bf16 probability pairs (p[t][i], p[t+1][i]); acc a
// [m, D] float scratch.
template <int D>
void tile_dp(const uint32_t* __restrict__ qp, int64_t m, int64_t mp, const at::BFloat16* __restrict__ k,
             const at::BFloat16* __restrict__ v, int64_t nt, int64_t first, int64_t n, float scale, float* __restrict__ s,
             uint32_t* __restrict__ p, float* __restrict__ acc_rows, float* __restrict__ mx, float* __restrict__ sum,
             float* __restrict__ o) {
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k);
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v);
  const __m512 vscale = _mm512_set1_ps(scale);
  // scores: blocks of 4 row vectors (a verify block's 3 x 17 rows: 64), the rest one at a time
  // with 8 tokens (a decode step's GQA group: one row vector)
  int64_t ib = 0;
  for (; ib + 4 * kRows <= mp; ib += 4 * kRows) score_dp<D, 4, 4>(qp, mp, ib, kb, nt, vscale, s);
  for (; ib + 2 * kRows <= mp; ib += 2 * kRows) score_dp<D, 2, 8>(qp, mp, ib, kb, nt, vscale, s);
  for (; ib < mp; ib += kRows) score_dp<D, 1, 8>(qp, mp, ib, kb, nt, vscale, s);
  // softmax numerators (fp32) and their sums, then the probabilities as bf16 token pairs
  mask_block(s, nt, mp, first, n);
  softmax_numerators(s, nt, mp, mx, sum);
  for (int64_t t = 0; t < nt; t += 2)
    for (int64_t ib = 0; ib < mp; ib += kRows) {
      const u16x lo = bf16_bits(load16(s + t * mp + ib));
      const u16x hi = t + 1 < nt ? bf16_bits(load16(s + (t + 1) * mp + ib)) : u16x{};
      const u16x w = lo | (hi << 16);
      std::memcpy(p + (t / 2) * mp + ib, &w, sizeof w);
    }
  // o = p v: rows r of a block, V rows t and t+1 interleaved into bf16 pairs, once per slice of
  // kPairs pairs (kept in L1 for every block of rows; interleaving them per block of rows cost a
  // shuffle per 4 products). unpacklo/hi work per 128-bit lane, so accumulator j of a 32-wide piece
  // holds dim 8 (j / 4) + j % 4 (lo) or that + 4 (hi); the order is undone once per row at the end.
  // A row's sums run over the pairs in order, through acc_rows between slices, whatever its block.
  constexpr int kPieces = D / 32, kR = D == 64 ? 4 : 2;  // 2 * kPieces * kR = 16 accumulators
  constexpr int64_t kPairs = 16;
  const __m512i zero = _mm512_setzero_si512();
  __m512bh vv[kPairs][2 * kPieces];
  for (int64_t t0 = 0; t0 < nt; t0 += 2 * kPairs) {
    const int64_t pairs = std::min<int64_t>(kPairs, (nt - t0 + 1) / 2);
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t t = t0 + 2 * q;
      for (int c = 0; c < kPieces; ++c) {
        const __m512i a = _mm512_loadu_si512(vb + t * D + 32 * c);
        const __m512i b = t + 1 < nt ? _mm512_loadu_si512(vb + (t + 1) * D + 32 * c) : zero;
        vv[q][2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        vv[q][2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
    }
    for (int64_t ib = 0; ib < m; ib += kR) {
      const int64_t rows = std::min<int64_t>(kR, m - ib);
      __m512 acc[kR][2 * kPieces];
      for (int r = 0; r < kR; ++r)
        for (int j = 0; j < 2 * kPieces; ++j)
          acc[r][j] = t0 == 0 || r >= rows ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_rows + (ib + r) * D + 16 * j);
      for (int64_t q = 0; q < pairs; ++q) {
        const uint32_t* __restrict__ pt = p + (t0 / 2 + q) * mp + ib;  // rows past m: padded, discarded
        for (int r = 0; r < kR; ++r) {
          const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pt[r]));
          for (int j = 0; j < 2 * kPieces; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], vv[q][j], pr);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < 2 * kPieces; ++j) _mm512_storeu_ps(acc_rows + (ib + r) * D + 16 * j, acc[r][j]);
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    const float* __restrict__ a = acc_rows + r * D;
    float* __restrict__ orow = o + r * D;
    for (int c = 0; c < kPieces; ++c)
      for (int j = 0; j < 16; ++j) {
        orow[32 * c + 8 * (j / 4) + j % 4] = a[32 * c + j];
        orow[32 * c + 8 * (j / 4) + 4 + j % 4] = a[32 * c + 16 + j];
      }
  }
}
#endif

template <typename T, int D>
std::vector<torch::Tensor> run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, float scale,
                               bool use_dp, bool use_amx, int64_t causal) {
  const int64_t H = q.size(0), m = q.size(1), S = k.size(1);
  const int64_t mp = (m + kRows - 1) / kRows * kRows;  // rows padded to whole score vectors
  const int64_t tiles = (S + kTile - 1) / kTile;
  const bool amx = VERICACHE_AMX && std::is_same_v<T, at::BFloat16> && use_amx;
  const bool dp = !amx && VERICACHE_DPBF16 && std::is_same_v<T, at::BFloat16> && use_dp;
  const float* qp = q.data_ptr<float>();
  // q, zero-padded to mp rows: (amx) bf16 rows [H, mp, D], unscaled; else transposed to [H, D, mp],
  // fp32 and scaled, or (dp) bf16 pairs [H, D/2, mp], unscaled
  std::vector<uint16_t> qrows(amx ? static_cast<size_t>(H * mp * D) : 0, 0);
  std::vector<float> qt(dp || amx ? 0 : static_cast<size_t>(H * D * mp), 0.f);
  std::vector<uint32_t> qpairs(dp ? static_cast<size_t>(H * D / 2 * mp) : 0, 0u);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < m; ++i)
      for (int d = 0; d < D; ++d) {
        const float x = qp[(h * m + i) * D + d];
        if (amx) {
          qrows[(h * mp + i) * D + d] = bf16_bits(x);
        } else if (dp) {
          qpairs[(h * D / 2 + d / 2) * mp + i] |= bf16_bits(x) << (16 * (d % 2));
        } else {
          qt[(h * D + d) * mp + i] = x * scale;
        }
      }
  std::vector<float> part_mx(static_cast<size_t>(H * tiles * mp)), part_sum(part_mx.size());
  std::vector<float> part_o(static_cast<size_t>(H * tiles * m * D));
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, H * tiles, 1, [&](int64_t begin, int64_t end) {
#if VERICACHE_AMX
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (amx) {
        vericache::AmxScratch scratch(kTile, mp, D);  // before the tiles: a failed allocation leaves them as they were
        const vericache::AmxTiles tiles_in_use;
        const auto* kb = reinterpret_cast<const uint16_t*>(kp);
        const auto* vb = reinterpret_cast<const uint16_t*>(vp);
        for (int64_t w = begin; w < end; ++w) {
          const int64_t h = w / tiles, t0 = (w % tiles) * kTile, nt = std::min(kTile, S - t0);
          vericache::tile_amx<D>(qrows.data() + h * mp * D, m, mp, kb + h * ks + t0 * D, vb + h * vs + t0 * D, nt,
                                 S - causal - t0, causal, scale, scratch, part_mx.data() + w * mp,
                                 part_sum.data() + w * mp, part_o.data() + w * m * D);
        }
        return;
      }
    }
#endif
    std::vector<float> s(static_cast<size_t>(kTile * mp + kPvRows));  // + the slack pv_rows may read
    std::vector<uint32_t> p(dp ? static_cast<size_t>(kTile / 2 * mp) : 0);
    std::vector<float> acc_rows(dp ? static_cast<size_t>(m * D) : 0);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t h = w / tiles, t0 = (w % tiles) * kTile, nt = std::min(kTile, S - t0);
      float* mxw = part_mx.data() + w * mp;
      float* sumw = part_sum.data() + w * mp;
      float* ow = part_o.data() + w * m * D;
#if VERICACHE_DPBF16
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (dp) {
          tile_dp<D>(qpairs.data() + h * D / 2 * mp, m, mp, kp + h * ks + t0 * D, vp + h * vs + t0 * D, nt,
                     S - causal - t0, causal, scale,
                     s.data(), p.data(), acc_rows.data(), mxw, sumw, ow);
          continue;
        }
      }
#endif
      tile<T, D>(qt.data() + h * D * mp, m, mp, kp + h * ks + t0 * D, vp + h * vs + t0 * D, nt, S - causal - t0, causal,
                 s.data(), mxw, sumw, ow);
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

bool amx_ready() {
#if VERICACHE_AMX
  return vericache::amx_permitted();
#else
  return false;
#endif
}

}  // namespace

std::vector<torch::Tensor> dense_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, bool dpbf16,
                                           int64_t causal, bool amx) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3, "q must be contiguous float32 [H, m, D]");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && k.dtype() == v.dtype(), "k, v must be [H, S, D] alike");
  const int64_t H = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == H && k.size(2) == D && k.size(1) > 0 && q.size(1) > 0, "shape mismatch");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "k, v must have contiguous tokens of D elements");
  TORCH_CHECK(causal >= 0 && causal <= k.size(1) && (causal == 0 || q.size(1) % causal == 0),
              "causal must be a block length dividing the rows (GQA group x block tokens), got ", causal);
  TORCH_CHECK(!amx || (amx_ready() && k.dtype() == torch::kBFloat16 && q.size(1) <= 128),
              "amx: a bf16 cache, at most 128 rows per KV head, on a CPU (and build) with AMX tiles");
  const float sc = static_cast<float>(scale);
  if (k.dtype() == torch::kBFloat16) {
    if (D == 64) return run<at::BFloat16, 64>(q, k, v, sc, dpbf16, amx, causal);
    if (D == 128) return run<at::BFloat16, 128>(q, k, v, sc, dpbf16, amx, causal);
  } else if (k.dtype() == torch::kFloat32) {
    if (D == 64) return run<float, 64>(q, k, v, sc, false, false, causal);
    if (D == 128) return run<float, 128>(q, k, v, sc, false, false, causal);
  }
  TORCH_CHECK(false, "dense_attention: bf16 / fp32 with head size 64 or 128 only");
}

// A forward's new K/V rows into the caches of one layer, every segment in one call (written one by
// one from Python they cost more than a 1-token step's attention over a short cache): rows off[s] ..
// off[s] + n[s] of k / v [N, H, D] go to entries at[s] .. at[s] + n[s] of layer `layer` of segment
// s's caches ck[s] / cv[s] [layers, H, capacity, D] (contiguous, the rows' dtype).
void write_rows(const std::vector<torch::Tensor>& ck, const std::vector<torch::Tensor>& cv, int64_t layer,
                const torch::Tensor& k, const torch::Tensor& v, const std::vector<int64_t>& at,
                const std::vector<int64_t>& off, const std::vector<int64_t>& n) {
  const size_t segs = ck.size();
  TORCH_CHECK(cv.size() == segs && at.size() == segs && off.size() == segs && n.size() == segs,
              "one cache pair, position, offset and count per segment");
  TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && v.is_contiguous() && v.sizes() == k.sizes() && v.dtype() == k.dtype(),
              "k, v must be contiguous [N, H, D] alike");
  const int64_t N = k.size(0), H = k.size(1), D = k.size(2), es = k.element_size();
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (size_t s = 0; s < segs; ++s) {
    for (const auto* c : {&ck[s], &cv[s]})
      TORCH_CHECK(c->dim() == 4 && c->is_contiguous() && c->dtype() == k.dtype() && c->size(1) == H && c->size(3) == D &&
                  0 <= layer && layer < c->size(0), "caches must be contiguous [layers, H, capacity, D] in the rows' dtype");
    const int64_t cap = ck[s].size(2);
    TORCH_CHECK(cv[s].size(2) == cap && 0 <= at[s] && n[s] >= 0 && at[s] + n[s] <= cap && 0 <= off[s] &&
                off[s] + n[s] <= N, "segment ", s, ": rows or entries out of range");
    auto* kc = static_cast<char*>(ck[s].data_ptr()) + layer * H * cap * D * es;
    auto* vc = static_cast<char*>(cv[s].data_ptr()) + layer * H * cap * D * es;
    for (int64_t t = 0; t < n[s]; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t src = ((off[s] + t) * H + h) * D * es, dst = (h * cap + at[s] + t) * D * es;
        std::memcpy(kc + dst, kp + src, D * es);
        std::memcpy(vc + dst, vp + src, D * es);
      }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // amx: built with the tile instructions and the OS grants this process the tile state
  m.def("dense_attention", &dense_attention, "attention of a block of query rows over a dense KV cache",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("dpbf16") = true, py::arg("causal") = 0, py::arg("amx") = false);
  m.def("write_rows", &write_rows, "a forward's new K/V rows into each segment's cache, one layer",
        py::arg("ck"), py::arg("cv"), py::arg("layer"), py::arg("k"), py::arg("v"), py::arg("at"), py::arg("off"),
        py::arg("n"));
  m.attr("amx") = amx_ready();
  m.attr("dpbf16") = static_cast<bool>(VERICACHE_DPBF16);
  m.attr("vec_width") = kW;  // floats per vector this build uses  // bf16 caches can use vdpbf16ps (tile_dp)
}
