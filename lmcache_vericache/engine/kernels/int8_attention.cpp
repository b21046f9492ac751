// Decode attention over int8 KV codes, read as codes (see engine/int8_attention.py).
//
// For every job j (one request's layer): queries q[j] [H, m, D] float32 (m query rows per KV head,
// GQA groups x block tokens); keys kq[j] [H, nb, D/4, 16, 4] and values vq[j] [H, 4 nb, D, 4] int8
// in blocks of 16 tokens (nb = ceil(T/16), zero-padded), with one float32 scale per (head, token)
// in ks[j] / vs[j] [H, T]. A key block holds, per group of 4 dimensions, its 16 tokens' 4 codes;
// a value group of 4 tokens holds, per dimension, their 4 codes: the 4-byte runs VNNI's u8 x s8
// dot products (vpdpbusd) take, and one 64-byte run per vector in either path. Returns, per job,
// out [H, m, D] = softmax(scale * q k^T) v and lse [H, m] (natural log-sum-exp of the scaled
// scores). The codes are read once per (head, token) for all m rows: 1 byte per element instead of
// 2 or 4.
//
// A job may also bring its draft cache's exact suffix, sk[j] / sv[j] [H, >= S, D] (float32 or bf16,
// rows contiguous) of which the first S = slen[j] entries count (slen empty: all; S may be 0; a
// draft cache's layer is passed whole), with its causal block size causal[j] = n: row i (block token
// i % n) sees the suffix's first S - n + 1 + i % n entries (n = 0: all S). That part is attended
// exactly in float and merged into out / lse here, so a draft step's attention over "prefix codes +
// exact window" is one call per layer for the whole batch, not a kernel call and a log-sum-exp merge
// in PyTorch per request and layer (a large share of a batched draft step). An empty prefix (T = 0)
// gives out = 0, lse = -inf before that merge.
//
// With AVX512-VNNI (attend_vnni) the scores are integer dot products of the codes with q rounded
// to int8 (one scale per row), and p v integer dot products of the value codes with the weights
// p * vs rounded to uint8 (one scale per row and 32 tokens, kWeightBlocks): a drafter's numerics
// (tests/engine/test_int8_attention.py bounds them), at a fifth of the instructions. With AVX2
// alone (attend_madd) the same dot products are two multiply-adds each, q and the weights rounded
// to 7 bits. Elsewhere, or with integer=false, attend_float converts the codes to float and uses
// FMAs (exact up to float rounding).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && !defined(VERICACHE_VEC_WIDTH)
#include <immintrin.h>
#define VERICACHE_VNNI 1
#else
#define VERICACHE_VNNI 0
#endif
#if !VERICACHE_VNNI && defined(__AVX2__) && !defined(VERICACHE_VEC_WIDTH)
#include <immintrin.h>
#define VERICACHE_MADD 1
#else
#define VERICACHE_MADD 0
#endif

namespace {

using vericache::exp_nonpositive;
using vericache::kVecRegs;
using vericache::kW;
using vericache::load_floats;
using vericache::store_floats;
using vericache::to_float;
using vericache::vfloat;
using vericache::vint;

constexpr int64_t kBlock = 16;  // tokens per key block: one AVX-512 vector of scores
constexpr int kMaxRows = 8;     // query rows per pass (more rows: several passes over the codes)
// Blocks a source's prefetch_keys / prefetch_values asks for ahead of the one being read (the
// codebook tiles: 2 KB of 4-bit keys at head size 64; from DRAM 0.90 -> 0.78 ms for a batch-8 layer
// at 8k, docs/benchmarks.md).
constexpr int64_t kAhead = 4;
// Blocks whose p v weights share one uint8 scale in the VNNI path: the scale (a horizontal max, a
// division) and the integer sums' conversion are paid per 32 tokens, not 16.
constexpr int kWeightBlocks = 2;

// Row softmax of s [m, Tp] over its first T entries: numerators exp(s - max) in place (padding
// entries set to 0), with each row's max and sum; kW entries at a time, a scalar tail.
void softmax_numerators(float* __restrict__ s, int64_t m, int64_t T, int64_t Tp, float* __restrict__ mx,
                        float* __restrict__ sum) {
  const int64_t whole = T / kW * kW;
  for (int64_t i = 0; i < m; ++i) {
    float* __restrict__ si = s + i * Tp;
    vfloat topv = vfloat{} - INFINITY;
    for (int64_t t = 0; t < whole; t += kW) {
      const vfloat x = load_floats(si + t);
      topv = x > topv ? x : topv;
    }
    float top = -INFINITY;
    for (int l = 0; l < kW; ++l) top = topv[l] > top ? topv[l] : top;
    for (int64_t t = whole; t < T; ++t) top = si[t] > top ? si[t] : top;
    vfloat totalv = {};
    for (int64_t t = 0; t < whole; t += kW) {
      const vfloat e = exp_nonpositive(load_floats(si + t) - top);
      store_floats(si + t, e);
      totalv += e;
    }
    float total = 0.f;
    for (int l = 0; l < kW; ++l) total += totalv[l];
    for (int64_t t = whole; t < T; ++t) {
      si[t] = exp_nonpositive(si[t] - top);
      total += si[t];
    }
    for (int64_t t = T; t < Tp; ++t) si[t] = 0.f;
    mx[i] = top, sum[i] = total;
  }
}

inline vint load_words(const int8_t* p) { vint r; std::memcpy(&r, p, sizeof r); return r; }

// Byte j of each of kW words, sign-extended, as floats: one dimension of kW tokens (keys) or one
// token of kW dimensions (values).
inline vfloat codes(vint words, int j) { return __builtin_convertvector((words << (24 - 8 * j)) >> 24, vfloat); }

// Vectors of dimensions per p v pass for M rows: the M x chunk accumulators, the chunk's code words,
// a converted vector and a broadcast weight fit in the registers.
constexpr int chunk_vecs(int M, int vecs) {
  int c = vecs;
  while (c > 1 && (M + 1) * c + 2 > kVecRegs) c /= 2;
  return c;
}

// Portable path (M rows, templated like the VNNI one): codes to float, FMAs, kW lanes per vector
// (a block of 16 tokens is 16 / kW vectors of scores).
template <int M, int D, typename Src>
void attend_float(const float* __restrict__ q, const Src& src, const float* __restrict__ ks,
                  const float* __restrict__ vs, int64_t T, float scale,
                  float* __restrict__ out, float* __restrict__ lse, float* __restrict__ s) {
  alignas(64) int8_t buf[64];
  const int64_t nb = (T + kBlock - 1) / kBlock, Tp = nb * kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t t0 = b * kBlock;
    float tail[kBlock] = {};  // the last block's scales, zero-padded (no read past ks)
    if (t0 + kBlock > T) std::memcpy(tail, ks + t0, (T - t0) * sizeof(float));
    const float* kscales = t0 + kBlock <= T ? ks + t0 : tail;
    for (int part = 0; part < kBlock / kW; ++part) {
      vfloat acc[M] = {};
      for (int g = 0; g < D / 4; ++g) {
        const vint w = load_words(src.key(b, g, buf) + part * kW * 4);  // kW tokens x dims 4g..4g+3
        for (int j = 0; j < 4; ++j) {
          const vfloat kf = codes(w, j);
          for (int i = 0; i < M; ++i) acc[i] += q[i * D + 4 * g + j] * kf;
        }
      }
      const vfloat kscaled = load_floats(kscales + part * kW) * scale;
      for (int i = 0; i < M; ++i) store_floats(s + i * Tp + t0 + part * kW, acc[i] * kscaled);
    }
  }
  float mx[M], sum[M];
  softmax_numerators(s, M, T, Tp, mx, sum);
  for (int i = 0; i < M; ++i)
    for (int64_t t = 0; t < T; ++t) s[i * Tp + t] *= vs[t];  // value scale folded into the weight
  constexpr int kVecs = D / kW, kChunk = chunk_vecs(M, kVecs);
  for (int c0 = 0; c0 < kVecs; c0 += kChunk) {
    vfloat o[M][kChunk] = {};
    for (int64_t g = 0; g < Tp / 4; ++g) {
      vint w[kChunk];  // dimensions (c0 + c) kW.. x tokens 4g..4g+3
      for (int c = 0; c < kChunk; ++c) {
        const int dim = (c0 + c) * kW;
        alignas(64) int8_t vbuf[64];
        w[c] = load_words(src.value(g, dim / 16, vbuf) + (dim % 16) * 4);
      }
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < kChunk; ++c) {
          const vfloat vf = codes(w[c], j);
          for (int i = 0; i < M; ++i) o[i][c] += s[i * Tp + 4 * g + j] * vf;
        }
    }
    for (int i = 0; i < M; ++i)
      for (int c = 0; c < kChunk; ++c) store_floats(out + i * D + (c0 + c) * kW, o[i][c] * (1.f / sum[i]));
  }
  for (int i = 0; i < M; ++i) lse[i] = mx[i] + std::log(sum[i]);
}

// q of M rows rounded to int8 (-127..127) against each row's largest |q|, with the row's scale.
template <int M, int D>
inline void round_rows(const float* __restrict__ q, int8_t (&qi)[M][D], float (&qscale)[M]) {
  for (int i = 0; i < M; ++i) {
    float top = 0.f;
    for (int d = 0; d < D; ++d) top = std::max(top, std::fabs(q[i * D + d]));
    const float inv = top > 0.f ? 127.f / top : 0.f;
    qscale[i] = top > 0.f ? top / 127.f : 0.f;
    for (int d = 0; d < D; ++d) qi[i][d] = static_cast<int8_t>(std::lrintf(q[i * D + d] * inv));
  }
}

#if VERICACHE_VNNI
// VNNI path, M rows (templated: the accumulators stay in registers).
template <int M, int D, typename Src>
void attend_vnni(const float* __restrict__ q, const Src& src, const float* __restrict__ ks,
                 const float* __restrict__ vs, int64_t T, float scale,
                 float* __restrict__ out, float* __restrict__ lse, float* __restrict__ s) {
  const int64_t nb = (T + kBlock - 1) / kBlock, Tp = nb * kBlock;
  // q rounded to int8 per row; (k + 128) . q = k . q + 128 sum(q): the offset is undone per row.
  alignas(64) int8_t qi[M][D];
  float qscale[M];
  int32_t qoff[M];
  round_rows<M, D>(q, qi, qscale);
  for (int i = 0; i < M; ++i) {
    int32_t total = 0;
    for (int d = 0; d < D; ++d) total += qi[i][d];
    qoff[i] = 128 * total;
  }
  for (int64_t b = 0; b < nb; ++b) {
    if (b + kAhead < nb) src.prefetch_keys(b + kAhead);
    __m512i acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 32  // unrolled, a codebook source's vector index g % 4 is a constant: shifts by immediates
    for (int g = 0; g < D / 4; ++g) {
      const __m512i ku = src.key_u8(b, g);  // codes + 128: vpdpbusd's unsigned operand
      for (int i = 0; i < M; ++i) {
        int32_t qw;
        std::memcpy(&qw, &qi[i][4 * g], sizeof qw);
        acc[i] = _mm512_dpbusd_epi32(acc[i], ku, _mm512_set1_epi32(qw));
      }
    }
    const int64_t t0 = b * kBlock;
    const __m512 kscale = t0 + kBlock <= T ? _mm512_loadu_ps(ks + t0)
                                           : _mm512_maskz_loadu_ps((1u << (T - t0)) - 1, ks + t0);
    for (int i = 0; i < M; ++i) {
      const __m512 raw = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], _mm512_set1_epi32(qoff[i])));
      _mm512_storeu_ps(s + i * Tp + t0, _mm512_mul_ps(raw, _mm512_mul_ps(kscale, _mm512_set1_ps(qscale[i] * scale))));
    }
  }
  float mx[M], sum[M];
  softmax_numerators(s, M, T, Tp, mx, sum);
  // p v: per span of kWeightBlocks blocks, the weights p * vs of each row rounded to uint8 against
  // the span's largest, 4 tokens per dword; integer sums over the span, then scaled to float.
  constexpr int kV = D / 16, kSpan = kWeightBlocks;
  __m512 o[M][kV];
  for (int i = 0; i < M; ++i)
    for (int c = 0; c < kV; ++c) o[i][c] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += kSpan) {
    const int blocks = static_cast<int>(std::min<int64_t>(kSpan, nb - b0));
    __m512 w[M][kSpan], top[M];
    for (int i = 0; i < M; ++i) top[i] = _mm512_setzero_ps();
    for (int k = 0; k < blocks; ++k) {
      const int64_t t0 = (b0 + k) * kBlock;
      const __m512 vscale = t0 + kBlock <= T ? _mm512_loadu_ps(vs + t0)
                                             : _mm512_maskz_loadu_ps((1u << (T - t0)) - 1, vs + t0);
      for (int i = 0; i < M; ++i) {
        w[i][k] = _mm512_mul_ps(_mm512_loadu_ps(s + i * Tp + t0), vscale);
        top[i] = _mm512_max_ps(top[i], w[i][k]);
      }
    }
    alignas(64) uint8_t wq[M][kSpan * kBlock];
    float wscale[M];
    for (int i = 0; i < M; ++i) {
      const float largest = _mm512_reduce_max_ps(top[i]);
      wscale[i] = largest > 0.f ? largest / 255.f : 0.f;
      const __m512 inv = _mm512_set1_ps(largest > 0.f ? 255.f / largest : 0.f);
      for (int k = 0; k < blocks; ++k)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(wq[i] + k * kBlock),
                         _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(w[i][k], inv))));
    }
    __m512i acc[M][kV];
    for (int i = 0; i < M; ++i)
      for (int c = 0; c < kV; ++c) acc[i][c] = _mm512_setzero_si512();
    for (int k = 0; k < blocks; ++k) {
      const int64_t b = b0 + k;
      if (b + kAhead < nb) src.prefetch_values(b + kAhead);
#pragma GCC unroll 4  // the quad's index in its tile, quad & 3, a constant (as the keys' g % 4)
      for (int g = 0; g < kBlock / 4; ++g) {
        __m512i vv[kV];
        for (int c = 0; c < kV; ++c) vv[c] = src.value512(4 * b + g, c);
        for (int i = 0; i < M; ++i) {
          int32_t ww;
          std::memcpy(&ww, &wq[i][k * kBlock + 4 * g], sizeof ww);
          const __m512i wb = _mm512_set1_epi32(ww);
          for (int c = 0; c < kV; ++c) acc[i][c] = _mm512_dpbusd_epi32(acc[i][c], wb, vv[c]);
        }
      }
    }
    for (int i = 0; i < M; ++i) {
      const __m512 ws = _mm512_set1_ps(wscale[i]);
      for (int c = 0; c < kV; ++c) o[i][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][c]), ws, o[i][c]);
    }
  }
  for (int i = 0; i < M; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / sum[i]);
    for (int c = 0; c < kV; ++c) _mm512_storeu_ps(out + i * D + 16 * c, _mm512_mul_ps(o[i][c], inv));
    lse[i] = mx[i] + std::log(sum[i]);
  }
}

#endif

#if VERICACHE_MADD
// AVX2 integer path, M rows: AVX2 has no vpdpbusd, so a 4-byte dot product is vpmaddubsw (u8 x s8
// pairs to s16) then vpmaddwd by ones (pairs to s32). vpmaddubsw saturates at 32767, so both u8
// operands stay below 128: the scores take |k| against q carrying k's sign (vpsignb), q rounded
// to 7 bits per row; p v takes the weights p * vs rounded to 0..127 per row and 16-token block.
// Faster than the float path, with drafting numerics near the VNNI path's (tested).
template <int M, int D, typename Src>
void attend_madd(const float* __restrict__ q, const Src& src, const float* __restrict__ ks,
                 const float* __restrict__ vs, int64_t T, float scale,
                 float* __restrict__ out, float* __restrict__ lse, float* __restrict__ s) {
  alignas(64) int8_t buf[64];
  const int64_t nb = (T + kBlock - 1) / kBlock, Tp = nb * kBlock;
  alignas(32) int8_t qi[M][D];
  float qscale[M];
  round_rows<M, D>(q, qi, qscale);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t t0 = b * kBlock;
    float tail[kBlock] = {};  // the last block's scales, zero-padded (no read past ks)
    if (t0 + kBlock > T) std::memcpy(tail, ks + t0, (T - t0) * sizeof(float));
    const float* kscales = t0 + kBlock <= T ? ks + t0 : tail;
    for (int half = 0; half < 2; ++half) {  // tokens 8 half .. 8 half + 7
      __m256i acc[M];
      for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_si256();
      for (int g = 0; g < D / 4; ++g) {
        const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src.key(b, g, buf) + half * 32));
        const __m256i ka = _mm256_abs_epi8(k);
        for (int i = 0; i < M; ++i) {
          int32_t qw;
          std::memcpy(&qw, &qi[i][4 * g], sizeof qw);
          const __m256i pairs = _mm256_maddubs_epi16(ka, _mm256_sign_epi8(_mm256_set1_epi32(qw), k));
          acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs, ones));
        }
      }
      const __m256 kscale = _mm256_mul_ps(_mm256_loadu_ps(kscales + 8 * half), _mm256_set1_ps(scale));
      for (int i = 0; i < M; ++i)
        _mm256_storeu_ps(s + i * Tp + t0 + 8 * half,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_mul_ps(kscale, _mm256_set1_ps(qscale[i]))));
    }
  }
  float mx[M], sum[M];
  softmax_numerators(s, M, T, Tp, mx, sum);
  // p v: per block, each row's weights p * vs rounded to 0..127 against the block's largest, in
  // vectors (a scalar loop with lrintf costs more than the products it feeds). Weights are
  // >= 0; the numerators past T are 0 (softmax_numerators), their scales too (tail).
  alignas(32) float o[M][D] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t t0 = b * kBlock;
    alignas(16) uint8_t wq[M][kBlock];
    float wscale[M];
    float vtail[kBlock] = {};
    if (t0 + kBlock > T) std::memcpy(vtail, vs + t0, (T - t0) * sizeof(float));
    const float* vscales = t0 + kBlock <= T ? vs + t0 : vtail;
    const __m256 vs0 = _mm256_loadu_ps(vscales), vs1 = _mm256_loadu_ps(vscales + 8);
    for (int i = 0; i < M; ++i) {
      const __m256 w0 = _mm256_mul_ps(_mm256_loadu_ps(s + i * Tp + t0), vs0);
      const __m256 w1 = _mm256_mul_ps(_mm256_loadu_ps(s + i * Tp + t0 + 8), vs1);
      __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(_mm256_max_ps(w0, w1)), _mm256_extractf128_ps(_mm256_max_ps(w0, w1), 1));
      top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
      const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_shuffle_ps(top4, top4, 1)));
      wscale[i] = top > 0.f ? top / 127.f : 0.f;
      const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
      // round to nearest even (as lrintf), then 16 int32 -> 16 uint8 in token order
      const __m256i q16 = _mm256_permute4x64_epi64(
          _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(w0, inv)), _mm256_cvtps_epi32(_mm256_mul_ps(w1, inv))), 0xD8);
      _mm_store_si128(reinterpret_cast<__m128i*>(wq[i]),
                      _mm_packus_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)));
    }
    for (int c = 0; c < D / 8; ++c) {  // dimensions 8c .. 8c + 7
      __m256i acc[M];
      for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_si256();
      for (int g = 0; g < kBlock / 4; ++g) {
        const __m256i vv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src.value(4 * b + g, c / 2, buf) + (c % 2) * 32));
        for (int i = 0; i < M; ++i) {
          int32_t ww;
          std::memcpy(&ww, &wq[i][4 * g], sizeof ww);
          acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(ww), vv), ones));
        }
      }
      for (int i = 0; i < M; ++i) {
        float* oc = o[i] + 8 * c;
        _mm256_store_ps(oc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_set1_ps(wscale[i]), _mm256_load_ps(oc)));
      }
    }
  }
  for (int i = 0; i < M; ++i) {
    const float inv = 1.f / sum[i];
    for (int d = 0; d < D; ++d) out[i * D + d] = o[i][d] * inv;
    lse[i] = mx[i] + std::log(sum[i]);
  }
}
#endif

// M rows of one (job, head) by the chosen path.
template <int M, int D, typename Src>
void attend_rows(const float* q, const Src& src, const float* ks, const float* vs, int64_t T,
                 float scale, bool vnni, float* out, float* lse, float* s) {
#if VERICACHE_VNNI
  if (vnni) return attend_vnni<M, D>(q, src, ks, vs, T, scale, out, lse, s);
#endif
#if VERICACHE_MADD
  if (vnni) return attend_madd<M, D>(q, src, ks, vs, T, scale, out, lse, s);
#endif
  attend_float<M, D>(q, src, ks, vs, T, scale, out, lse, s);
}

// One (job, head): its m rows in passes of at most kMaxRows (the accumulators of a pass stay in
// registers; a verify-sized block re-reads the codes from cache per pass).
template <int D, typename Src>
void attend_head(const float* q, int64_t m, const Src& src, const float* ks, const float* vs,
                 int64_t T, float scale, bool vnni, float* out, float* lse, float* s) {
  for (int64_t i0 = 0; i0 < m; i0 += kMaxRows) {
    const float* qi = q + i0 * D;
    float *oi = out + i0 * D, *li = lse + i0;
    switch (std::min<int64_t>(kMaxRows, m - i0)) {
#define VERICACHE_ROWS(M) case M: attend_rows<M, D>(qi, src, ks, vs, T, scale, vnni, oi, li, s); break;
      VERICACHE_ROWS(1) VERICACHE_ROWS(2) VERICACHE_ROWS(3) VERICACHE_ROWS(4)
      VERICACHE_ROWS(5) VERICACHE_ROWS(6) VERICACHE_ROWS(7) VERICACHE_ROWS(8)
#undef VERICACHE_ROWS
    }
  }
}

// Merge the exact suffix k / v [S, D] (one head; rows ld elements apart) into m rows' out / lse.
// Row i sees the first S - n + 1 + i % n entries (n = 0: all S; the caller checks S >= max(n, 1), so
// every row sees at least one). w: scratch of S floats.
template <typename E, int D>
void merge_suffix(const float* __restrict__ q, int64_t m, const E* __restrict__ k, const E* __restrict__ v,
                  int64_t ld, int64_t S, int64_t n, float scale, float* __restrict__ out, float* __restrict__ lse,
                  float* __restrict__ w) {
  for (int64_t i = 0; i < m; ++i) {
    const float* __restrict__ qi = q + i * D;
    const int64_t seen = n > 0 ? S - n + 1 + i % n : S;
    float top = lse[i];
    for (int64_t t = 0; t < seen; ++t) {
      const E* __restrict__ kt = k + t * ld;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot += qi[d] * to_float(kt[d]);
      w[t] = dot * scale;
      top = w[t] > top ? w[t] : top;
    }
    const float wp = std::isinf(lse[i]) ? 0.f : exp_nonpositive(lse[i] - top);  // -inf: empty prefix
    float acc[D];
    float* __restrict__ oi = out + i * D;
    for (int d = 0; d < D; ++d) acc[d] = oi[d] * wp;
    float total = wp;
    for (int64_t t = 0; t < seen; ++t) {
      const float e = exp_nonpositive(w[t] - top);
      const E* __restrict__ vt = v + t * ld;
      for (int d = 0; d < D; ++d) acc[d] += e * to_float(vt[d]);
      total += e;
    }
    for (int d = 0; d < D; ++d) oi[d] = acc[d] / total;
    lse[i] = top + std::log(total);
  }
}

// A job's exact suffix of one head (its first S entries), by element type (float32 or bf16).
template <int D>
void merge_suffix_head(const float* q, int64_t m, const torch::Tensor& sk, const torch::Tensor& sv, int64_t S,
                       int64_t h, int64_t n, float scale, float* out, float* lse, std::vector<float>& w) {
  const int64_t ld = sk.stride(1);
  if (S == 0) return;
  w.resize(static_cast<size_t>(S));
  if (sk.scalar_type() == torch::kBFloat16) {
    const auto* k = sk.data_ptr<at::BFloat16>() + h * sk.stride(0);
    const auto* v = sv.data_ptr<at::BFloat16>() + h * sv.stride(0);
    merge_suffix<at::BFloat16, D>(q, m, k, v, ld, S, n, scale, out, lse, w.data());
  } else {
    merge_suffix<float, D>(q, m, sk.data_ptr<float>() + h * sk.stride(0), sv.data_ptr<float>() + h * sv.stride(0),
                           ld, S, n, scale, out, lse, w.data());
  }
}

// Where the attention paths read the codes: 64-byte vectors of int8 codes, key vector (b, g) =
// block b's 16 tokens x dimensions 4g..4g+3 ([token][dim]), value vector (quad, c) = tokens
// 4 quad..4 quad+3 x dimensions 16c..16c+15 ([dim][token]). key / value return a pointer to the
// 64 bytes (buf: where a source may decode them); the VNNI path takes them in registers instead
// (key_u8: the codes + 128, vpdpbusd's unsigned operand; value512).

// Stored int8 codes, blocked (Int8Prefix): the vectors are read in place.
template <int D>
struct Int8Codes {
  const int8_t* kb;
  const int8_t* vb;
  const int8_t* key(int64_t b, int g, int8_t*) const { return kb + (b * (D / 4) + g) * 64; }
  const int8_t* value(int64_t quad, int c, int8_t*) const { return vb + (quad * D + 16 * c) * 4; }
#if VERICACHE_VNNI
  __m512i key_u8(int64_t b, int g) const {
    return _mm512_xor_si512(_mm512_loadu_si512(key(b, g, nullptr)), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  __m512i value512(int64_t quad, int c) const { return _mm512_loadu_si512(value(quad, c, nullptr)); }
  // The hardware prefetchers keep up with int8's longer runs: software prefetch measured slower
  // (docs/benchmarks.md).
  void prefetch_keys(int64_t) const {}
  void prefetch_values(int64_t) const {}
#endif
};

// 2-4-bit codebook codes in tiles (CodebookPrefix), decoded to the codebook's int8 entries here.
// A tile holds the 4 vectors j of 16 tokens x 16 dimensions (keys: vectors g = 4 tile + j, values:
// quads 4 b + j of dimension group `tile`) in 32 x bits bytes (a tile is as large as its codes):
// 4-bit codes as two 64-byte nibble planes (byte k of plane j / 2: element k of vector j in its
// low (j even) or high nibble); 2- and 3-bit codes as a 64-byte plane of 2-bit fields (byte k:
// bits 0-1 of element k of vector j at bits 2j..2j+1), 3-bit codes then four 64-bit masks (bit k
// of mask j: bit 2 of element k of vector j). Decoding 64 codes is a shift and a mask (a masked
// add for bit 2) and one 16-entry byte-table lookup (vpshufb).
inline int tile_code(const uint8_t* tile, int bits, int j, int k) {
  if (bits == 4) return (tile[64 * (j / 2) + k] >> (4 * (j % 2))) & 15;
  int code = (tile[k] >> (2 * j)) & 3;
  if (bits == 3) code |= ((tile[64 + 8 * j + k / 8] >> (k % 8)) & 1) << 2;
  return code;
}

#if VERICACHE_VNNI
__attribute__((always_inline)) inline __m512i tile_codes(const uint8_t* tile, int bits, int j) {
  if (bits == 4)
    return _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(tile + 64 * (j / 2)), _mm_cvtsi32_si128(4 * (j % 2))),
                            _mm512_set1_epi8(15));
  const __m512i idx = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(tile), _mm_cvtsi32_si128(2 * j)),
                                       _mm512_set1_epi8(3));
  if (bits == 2) return idx;
  uint64_t mask;
  std::memcpy(&mask, tile + 64 + 8 * j, sizeof mask);
  return _mm512_mask_add_epi8(idx, mask, idx, _mm512_set1_epi8(4));
}
#endif

template <int D>
struct CodebookCodes {
  const uint8_t* kt;
  const uint8_t* vt;
  int kbits, vbits;
  const int8_t* klut;  // 16 entries each
  const int8_t* vlut;
  const uint8_t* key_tile(int64_t b, int g) const { return kt + (b * (D / 16) + g / 4) * 32 * kbits; }
  const uint8_t* value_tile(int64_t quad, int c) const { return vt + (quad / 4 * (D / 16) + c) * 32 * vbits; }
  const int8_t* key(int64_t b, int g, int8_t* buf) const {
    for (int k = 0; k < 64; ++k) buf[k] = klut[tile_code(key_tile(b, g), kbits, g % 4, k)];
    return buf;
  }
  const int8_t* value(int64_t quad, int c, int8_t* buf) const {
    for (int k = 0; k < 64; ++k) buf[k] = vlut[tile_code(value_tile(quad, c), vbits, quad % 4, k)];
    return buf;
  }
#if VERICACHE_VNNI
  __m512i ktable_u8, vtable;  // the codebooks in each 16-byte lane (keys + 128)
  CodebookCodes(const uint8_t* kt, const uint8_t* vt, int kbits, int vbits, const int8_t* klut, const int8_t* vlut)
      : kt(kt), vt(vt), kbits(kbits), vbits(vbits), klut(klut), vlut(vlut) {
    ktable_u8 = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(klut))),
                                 _mm512_set1_epi8(static_cast<char>(0x80)));
    vtable = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vlut)));
  }
  __m512i key_u8(int64_t b, int g) const { return _mm512_shuffle_epi8(ktable_u8, tile_codes(key_tile(b, g), kbits, g % 4)); }
  __m512i value512(int64_t quad, int c) const {
    return _mm512_shuffle_epi8(vtable, tile_codes(value_tile(quad, c), vbits, static_cast<int>(quad & 3)));
  }
  // Block b's tiles (all dimension groups), into L1.
  void prefetch_keys(int64_t b) const {
    vericache::prefetch_bytes(reinterpret_cast<uintptr_t>(key_tile(b, 0)), D / 16 * 32 * kbits);
  }
  void prefetch_values(int64_t b) const {
    vericache::prefetch_bytes(reinterpret_cast<uintptr_t>(value_tile(4 * b, 0)), D / 16 * 32 * vbits);
  }
#else
  CodebookCodes(const uint8_t* kt, const uint8_t* vt, int kbits, int vbits, const int8_t* klut, const int8_t* vlut)
      : kt(kt), vt(vt), kbits(kbits), vbits(vbits), klut(klut), vlut(vlut) {}
#endif
};

// y = x r for m rows x [m, D] and r [D, D] (row-major): each row's D sums in registers, one FMA per
// element of r (a codebook call rotates 3 rows per head and job: with a runtime D, a scalar loop
// was most of a short call).
template <int D>
void rotate_rows(const float* __restrict__ x, int64_t m, const float* __restrict__ r, float* __restrict__ y) {
  constexpr int kVecs = D / kW;
  static_assert(D % kW == 0, "head size must be a multiple of the vector width");
  for (int64_t i = 0; i < m; ++i) {
    vfloat acc[kVecs] = {};
    for (int d = 0; d < D; ++d) {
      const float xd = x[i * D + d];
      for (int c = 0; c < kVecs; ++c) acc[c] += xd * load_floats(r + d * D + c * kW);
    }
    for (int c = 0; c < kVecs; ++c) store_floats(y + i * D + c * kW, acc[c]);
  }
}

// f(std::integral_constant<int, D>) for the compiled head sizes.
template <typename F>
void with_head_dim(int64_t D, F&& f) {
  switch (D) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
  }
  TORCH_CHECK(false, "head size must be 16, 32, 64 or 128, got ", D);
}

// The job lists' lengths and q's shape, checked before anything reads a job's sizes.
void check_jobs(const std::vector<torch::Tensor>& q, std::initializer_list<size_t> sizes) {
  for (size_t n : sizes) TORCH_CHECK(n == q.size(), "job count mismatch");
  for (const auto& x : q)
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 3, "q must be contiguous float32 [H, m, D]");
}

// What every prefix kind shares (after check_jobs): the checks of the scales and the suffixes, one
// task per (job, head) over the threads, and the suffix merge. prefix(j, h, q, out, lse, s) attends the
// job's head over its prefix (T > 0), with s scratch of min(m, kMaxRows) x Tp floats. slen: the
// entries of each suffix attended, its first ones (empty: all; a draft cache's layer is passed whole,
// not sliced per layer and job in Python).
template <typename Prefix>
std::vector<std::vector<torch::Tensor>> run_jobs(const std::vector<torch::Tensor>& q, const std::vector<torch::Tensor>& ks,
                                                 const std::vector<torch::Tensor>& vs, double scale,
                                                 const std::vector<torch::Tensor>& sk, const std::vector<torch::Tensor>& sv,
                                                 const std::vector<int64_t>& causal, const std::vector<int64_t>& slen,
                                                 Prefix&& prefix) {
  const size_t jobs = q.size();  // the lists' lengths and q's shape: check_jobs, by the caller
  const bool suffix = !sk.empty();
  TORCH_CHECK(!suffix || (sk.size() == jobs && sv.size() == jobs && causal.size() == jobs),
              "sk, sv and causal must be given for every job or for none");
  TORCH_CHECK(slen.empty() || (suffix && slen.size() == jobs), "slen must be given for every suffix or for none");
  std::vector<int64_t> S(jobs, 0);
  std::vector<torch::Tensor> outs(jobs), lses(jobs);
  std::vector<std::pair<size_t, int64_t>> work;  // (job, head)
  for (size_t j = 0; j < jobs; ++j) {
    TORCH_CHECK(ks[j].dtype() == torch::kFloat32 && ks[j].is_contiguous() && vs[j].dtype() == torch::kFloat32 && vs[j].is_contiguous(),
                "scales must be contiguous float32 [H, T]");
    const int64_t H = q[j].size(0), m = q[j].size(1), D = q[j].size(2), T = ks[j].size(1);
    TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, "head size must be 16, 32, 64 or 128, got ", D);
    if (suffix) {
      TORCH_CHECK(sk[j].dim() == 3 && sk[j].size(0) == H && sk[j].size(2) == D && sv[j].sizes() == sk[j].sizes() &&
                  sk[j].stride(2) == 1 && sv[j].stride(2) == 1 && sv[j].strides() == sk[j].strides(),
                  "suffix keys / values must be [H, S, D] with contiguous rows and the same strides");
      TORCH_CHECK((sk[j].scalar_type() == torch::kFloat32 || sk[j].scalar_type() == torch::kBFloat16) &&
                  sv[j].scalar_type() == sk[j].scalar_type(), "suffix keys / values must be float32 or bfloat16");
      S[j] = slen.empty() ? sk[j].size(1) : slen[j];
      TORCH_CHECK(S[j] >= 0 && S[j] <= sk[j].size(1), "suffix length ", S[j], " outside [0, ", sk[j].size(1), "]");
      TORCH_CHECK(causal[j] >= 0 && causal[j] <= S[j] && (causal[j] == 0 || m % causal[j] == 0),
                  "causal block n must be in [0, S] and divide the rows");
    }
    TORCH_CHECK(T > 0 || suffix, "no keys");
    TORCH_CHECK(ks[j].size(0) == H && vs[j].sizes() == ks[j].sizes(), "scales must be [H, T]");
    outs[j] = torch::empty({H, m, D}, q[j].options());
    lses[j] = torch::empty({H, m}, q[j].options());
    for (int64_t h = 0; h < H; ++h) work.emplace_back(j, h);
  }
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, seen_w;
    for (int64_t w = begin; w < end; ++w) {
      const size_t j = work[w].first;
      const int64_t h = work[w].second;
      const int64_t m = q[j].size(1), D = q[j].size(2), T = ks[j].size(1);
      const int64_t Tp = (T + kBlock - 1) / kBlock * kBlock;
      s.resize(static_cast<size_t>(std::min<int64_t>(m, kMaxRows) * Tp));
      const float* qh = q[j].data_ptr<float>() + h * m * D;
      float* oh = outs[j].data_ptr<float>() + h * m * D;
      float* lh = lses[j].data_ptr<float>() + h * m;
      if (T == 0) {  // nothing packed yet: the suffix alone
        std::fill(oh, oh + m * D, 0.f);
        std::fill(lh, lh + m, -INFINITY);
      } else {
        prefix(j, h, qh, oh, lh, s.data());
      }
      if (suffix)
        with_head_dim(D, [&](auto dim) {
          merge_suffix_head<decltype(dim)::value>(qh, m, sk[j], sv[j], S[j], h, causal[j], static_cast<float>(scale), oh, lh,
                                                  seen_w);
        });
    }
  });
  return {outs, lses};
}

}  // namespace

std::vector<std::vector<torch::Tensor>> int8_attention(std::vector<torch::Tensor> q, std::vector<torch::Tensor> kq,
                                                       std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vq,
                                                       std::vector<torch::Tensor> vs, double scale, bool integer,
                                                       std::vector<torch::Tensor> sk, std::vector<torch::Tensor> sv,
                                                       std::vector<int64_t> causal, std::vector<int64_t> slen) {
  check_jobs(q, {kq.size(), ks.size(), vq.size(), vs.size()});
  for (size_t j = 0; j < q.size(); ++j) {
    TORCH_CHECK(ks[j].dim() == 2, "scales must be [H, T]");
    TORCH_CHECK(kq[j].dtype() == torch::kInt8 && kq[j].is_contiguous() && vq[j].dtype() == torch::kInt8 && vq[j].is_contiguous(),
                "codes must be contiguous int8");
    const int64_t H = q[j].size(0), D = q[j].size(2), nb = (ks[j].size(1) + kBlock - 1) / kBlock;
    TORCH_CHECK(kq[j].dim() == 5 && kq[j].size(0) == H && kq[j].size(1) == nb && kq[j].size(2) == D / 4 &&
                kq[j].size(3) == kBlock && kq[j].size(4) == 4, "keys must be blocked [H, ceil(T/16), D/4, 16, 4]");
    TORCH_CHECK(vq[j].dim() == 4 && vq[j].size(0) == H && vq[j].size(1) == 4 * nb && vq[j].size(2) == D &&
                vq[j].size(3) == 4, "values must be blocked [H, 4 ceil(T/16), D, 4]");
  }
  const bool vnni = integer && (VERICACHE_VNNI || VERICACHE_MADD);
  return run_jobs(q, ks, vs, scale, sk, sv, causal, slen, [&](size_t j, int64_t h, const float* qh, float* oh, float* lh, float* s) {
    const int64_t m = q[j].size(1), D = q[j].size(2), T = ks[j].size(1), Tp = (T + kBlock - 1) / kBlock * kBlock;
    with_head_dim(D, [&](auto dim) {
      constexpr int DIM = decltype(dim)::value;
      const Int8Codes<DIM> src{kq[j].data_ptr<int8_t>() + h * Tp * DIM, vq[j].data_ptr<int8_t>() + h * Tp * DIM};
      attend_head<DIM>(qh, m, src, ks[j].data_ptr<float>() + h * T, vs[j].data_ptr<float>() + h * T, T,
                       static_cast<float>(scale), vnni, oh, lh, s);
    });
  });
}

// Attention over codebook codes (TurboQuant: x = norm * (codebook[code] @ R)). The kernel works in
// the rotated domain: q is rotated once per row (q R^T), the prefix's output is rotated back
// (o R_v) before the exact suffix is merged. kt / vt [H, ceil(T/16), D/16, 32 bits] tiles
// (codebook_tiles), klut / vlut int8 [16] the codebooks scaled to int8 (entries past 2^bits
// unused), ks / vs [H, T] float32 the per-token scales (norm / the codebook's int8 scale), krot /
// vrot float32 [D, D] the rotations. Numerics of the int8 paths (q and the weights rounded).
std::vector<std::vector<torch::Tensor>> codebook_attention(std::vector<torch::Tensor> q, std::vector<torch::Tensor> kt,
                                                           std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vt,
                                                           std::vector<torch::Tensor> vs, int64_t kbits, int64_t vbits,
                                                           torch::Tensor klut, torch::Tensor vlut, torch::Tensor krot,
                                                           torch::Tensor vrot, double scale, bool integer,
                                                           std::vector<torch::Tensor> sk, std::vector<torch::Tensor> sv,
                                                           std::vector<int64_t> causal, std::vector<int64_t> slen) {
  check_jobs(q, {kt.size(), ks.size(), vt.size(), vs.size()});
  TORCH_CHECK(kbits >= 2 && kbits <= 4 && vbits >= 2 && vbits <= 4, "codes must have 2, 3 or 4 bits");
  TORCH_CHECK(klut.dtype() == torch::kInt8 && klut.numel() == 16 && klut.is_contiguous() && vlut.dtype() == torch::kInt8 &&
              vlut.numel() == 16 && vlut.is_contiguous(), "codebooks must be 16 contiguous int8 entries");
  for (size_t j = 0; j < q.size(); ++j) {
    TORCH_CHECK(ks[j].dim() == 2, "scales must be [H, T]");
    const int64_t H = q[j].size(0), D = q[j].size(2), nb = (ks[j].size(1) + kBlock - 1) / kBlock;
    for (const auto& [t, bits] : {std::pair{kt[j], kbits}, std::pair{vt[j], vbits}})
      TORCH_CHECK(t.dtype() == torch::kUInt8 && t.is_contiguous() && t.dim() == 4 && t.size(0) == H && t.size(1) == nb &&
                  t.size(2) == D / 16 && t.size(3) == 32 * bits, "codes must be tiles [H, ceil(T/16), D/16, 32 bits] uint8");
    TORCH_CHECK(krot.dtype() == torch::kFloat32 && vrot.dtype() == torch::kFloat32 && krot.is_contiguous() &&
                vrot.is_contiguous() && krot.dim() == 2 && krot.size(0) == D && krot.size(1) == D &&
                vrot.sizes() == krot.sizes(), "rotations must be contiguous float32 [D, D]");
  }
  const bool vnni = integer && (VERICACHE_VNNI || VERICACHE_MADD);
  const torch::Tensor krot_t = krot.t().contiguous();
  const float* krt = krot_t.data_ptr<float>();
  const float* vr = vrot.data_ptr<float>();
  return run_jobs(q, ks, vs, scale, sk, sv, causal, slen, [&](size_t j, int64_t h, const float* qh, float* oh, float* lh, float* s) {
    const int64_t m = q[j].size(1), D = q[j].size(2), T = ks[j].size(1), nb = (T + kBlock - 1) / kBlock;
    std::vector<float> qr(static_cast<size_t>(m * D)), orot(static_cast<size_t>(m * D));
    with_head_dim(D, [&](auto dim) {
      constexpr int DIM = decltype(dim)::value;
      rotate_rows<DIM>(qh, m, krt, qr.data());  // q R^T: the rotated query rows
      const int64_t tile = nb * (DIM / 16);
      const CodebookCodes<DIM> src{kt[j].data_ptr<uint8_t>() + h * tile * 32 * kbits,
                                   vt[j].data_ptr<uint8_t>() + h * tile * 32 * vbits, static_cast<int>(kbits),
                                   static_cast<int>(vbits), klut.data_ptr<int8_t>(), vlut.data_ptr<int8_t>()};
      attend_head<DIM>(qr.data(), m, src, ks[j].data_ptr<float>() + h * T, vs[j].data_ptr<float>() + h * T, T,
                       static_cast<float>(scale), vnni, orot.data(), lh, s);
      rotate_rows<DIM>(orot.data(), m, vr, oh);  // o R_v: back from the rotated domain
    });
  });
}

// Lay out codes as the tiles codebook_attention reads (see CodebookCodes). pieces[p] is one layer's
// codes of a stored chunk of counts[p] tokens ([H, n, D] read flat, `bits` bits each, little-endian,
// the compressor's packing); its tokens from starts[p] to its end are taken, all pieces' in order.
// values: value tiles (else key tiles). Returns [H, ceil(T/16), D/16, 32 bits] uint8, padding 0.
torch::Tensor codebook_tiles(std::vector<torch::Tensor> pieces, std::vector<int64_t> counts, std::vector<int64_t> starts,
                             int64_t H, int64_t D, int64_t bits, bool values) {
  TORCH_CHECK(bits >= 2 && bits <= 4, "codes must have 2, 3 or 4 bits");
  TORCH_CHECK(D % 16 == 0 && D > 0, "head size must be a multiple of 16");
  const size_t P = pieces.size();
  TORCH_CHECK(counts.size() == P && starts.size() == P, "one count and start per piece");
  std::vector<const uint8_t*> rows;  // where each token's codes of head 0 start, in order
  std::vector<int64_t> head_stride;  // bytes from one head's codes to the next, per token
  TORCH_CHECK(H > 0, "H must be positive");
  for (size_t p = 0; p < P; ++p) {
    // counts[p] is bounded by the piece's bytes first (a division: the product below cannot wrap).
    TORCH_CHECK(pieces[p].dtype() == torch::kUInt8 && pieces[p].is_contiguous() && pieces[p].dim() == 1 &&
                counts[p] >= 0 && counts[p] <= pieces[p].numel() * 8 / (H * D * bits) &&
                pieces[p].numel() == (H * counts[p] * D * bits + 7) / 8, "piece ", p, " is not ", H, " x ", counts[p],
                " x ", D, " packed ", bits, "-bit codes");
    TORCH_CHECK(0 <= starts[p] && starts[p] <= counts[p], "piece ", p, ": bad start token");
    const uint8_t* base = pieces[p].data_ptr<uint8_t>();
    for (int64_t t = starts[p]; t < counts[p]; ++t) {
      rows.push_back(base + t * D * bits / 8);
      head_stride.push_back(counts[p] * D * bits / 8);
    }
  }
  const int64_t T = static_cast<int64_t>(rows.size()), nb = (T + kBlock - 1) / kBlock, G = D / 16, tb = 32 * bits;
  auto out = torch::empty({H, nb, G, tb}, torch::kUInt8);
  uint8_t* o = out.data_ptr<uint8_t>();
  const uint64_t mask = (1u << bits) - 1;
  at::parallel_for(0, H * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t hb = begin; hb < end; ++hb) {
      const int64_t h = hb / nb, b = hb % nb;
      for (int64_t g = 0; g < G; ++g) {
        uint64_t x[kBlock] = {};  // each token's codes of dimensions 16g..16g+15 (2 bits bytes); padding 0
        for (int tt = 0; tt < kBlock && b * kBlock + tt < T; ++tt)
          std::memcpy(&x[tt], rows[b * kBlock + tt] + h * head_stride[b * kBlock + tt] + g * 2 * bits, 2 * bits);
        // element (j, k) of the tile: keys token k / 4, dimension 4j + k % 4; values token 4j + k % 4,
        // dimension k / 4.
        auto code = [&](int j, int k) -> unsigned {
          return values ? (x[4 * j + k % 4] >> (bits * (k / 4))) & mask : (x[k / 4] >> (bits * (4 * j + k % 4))) & mask;
        };
        uint8_t* tile = o + (hb * G + g) * tb;
        for (int k = 0; k < 64; ++k) {
          if (bits == 4) {
            tile[k] = code(0, k) | code(1, k) << 4;
            tile[64 + k] = code(2, k) | code(3, k) << 4;
          } else {
            tile[k] = (code(0, k) & 3) | (code(1, k) & 3) << 2 | (code(2, k) & 3) << 4 | (code(3, k) & 3) << 6;
          }
        }
        if (bits == 3)
          for (int j = 0; j < 4; ++j) {
            uint64_t m = 0;
            for (int k = 0; k < 64; ++k) m |= static_cast<uint64_t>(code(j, k) >> 2) << k;
            std::memcpy(tile + 64 + 8 * j, &m, sizeof m);
          }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_attention", &int8_attention, "attention over int8 KV codes with per-(head, token) scales",
        py::arg("q"), py::arg("kq"), py::arg("ks"), py::arg("vq"), py::arg("vs"), py::arg("scale"), py::arg("integer") = true,
        py::arg("sk") = std::vector<torch::Tensor>{}, py::arg("sv") = std::vector<torch::Tensor>{},
        py::arg("causal") = std::vector<int64_t>{}, py::arg("slen") = std::vector<int64_t>{});
  m.def("codebook_attention", &codebook_attention, "attention over 2-4-bit codebook KV codes in tiles",
        py::arg("q"), py::arg("kt"), py::arg("ks"), py::arg("vt"), py::arg("vs"), py::arg("kbits"), py::arg("vbits"),
        py::arg("klut"), py::arg("vlut"), py::arg("krot"), py::arg("vrot"), py::arg("scale"), py::arg("integer") = true,
        py::arg("sk") = std::vector<torch::Tensor>{}, py::arg("sv") = std::vector<torch::Tensor>{},
        py::arg("causal") = std::vector<int64_t>{}, py::arg("slen") = std::vector<int64_t>{});
  m.def("codebook_tiles", &codebook_tiles, "lay out packed codebook codes as codebook_attention's tiles",
        py::arg("pieces"), py::arg("counts"), py::arg("starts"), py::arg("H"), py::arg("D"),
        py::arg("bits"), py::arg("values"));
  m.attr("vnni") = static_cast<bool>(VERICACHE_VNNI);
  m.attr("madd") = static_cast<bool>(VERICACHE_MADD);  // the AVX2 integer path (attend_madd)
  m.attr("vec_width") = kW;  // floats per vector of the float path
}
