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
// A job may also bring its draft cache's exact suffix, sk[j] / sv[j] [H, S, D] (float32 or bf16,
// rows contiguous; S may be 0) with its causal block size causal[j] = n: row i (block token i % n)
// sees the suffix's first S - n + 1 + i % n entries (n = 0: all of them). That part is attended
// exactly in float and merged into out / lse here, so a draft step's attention over "prefix codes +
// exact window" is one call per layer for the whole batch, not a kernel call and a log-sum-exp merge
// in PyTorch per request and layer (a large share of a batched draft step). An empty prefix (T = 0)
// gives out = 0, lse = -inf before that merge.
//
// With AVX512-VNNI (attend_vnni) the scores are integer dot products of the codes with q rounded
// to int8 (one scale per row), and p v integer dot products of the value codes with the weights
// p * vs rounded to uint8 (one scale per row and block of 16 tokens): a drafter's numerics
// (tests/engine/test_int8_attention.py bounds them), at a fifth of the instructions. With AVX2
// alone (attend_madd) the same dot products are two multiply-adds each, q and the weights rounded
// to 7 bits. Elsewhere, or with integer=false, attend_float converts the codes to float and uses
// FMAs (exact up to float rounding).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
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
template <int M, int D>
void attend_float(const float* __restrict__ q, const int8_t* __restrict__ kb, const float* __restrict__ ks,
                  const int8_t* __restrict__ vb, const float* __restrict__ vs, int64_t T, float scale,
                  float* __restrict__ out, float* __restrict__ lse, float* __restrict__ s) {
  const int64_t nb = (T + kBlock - 1) / kBlock, Tp = nb * kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t t0 = b * kBlock;
    float tail[kBlock] = {};  // the last block's scales, zero-padded (no read past ks)
    if (t0 + kBlock > T) std::memcpy(tail, ks + t0, (T - t0) * sizeof(float));
    const float* kscales = t0 + kBlock <= T ? ks + t0 : tail;
    for (int part = 0; part < kBlock / kW; ++part) {
      vfloat acc[M] = {};
      for (int g = 0; g < D / 4; ++g) {
        const vint w = load_words(kb + (b * (D / 4) + g) * 64 + part * kW * 4);  // kW tokens x dims 4g..4g+3
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
      for (int c = 0; c < kChunk; ++c) w[c] = load_words(vb + (g * D + (c0 + c) * kW) * 4);
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
template <int M, int D>
void attend_vnni(const float* __restrict__ q, const int8_t* __restrict__ kb, const float* __restrict__ ks,
                 const int8_t* __restrict__ vb, const float* __restrict__ vs, int64_t T, float scale,
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
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_si512();
    const int8_t* __restrict__ blk = kb + b * (D / 4) * 64;
    for (int g = 0; g < D / 4; ++g) {
      const __m512i ku = _mm512_xor_si512(_mm512_loadu_si512(blk + g * 64), flip);  // s8 -> u8 (+128)
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
  // p v: per block of 16 tokens, the weights p * vs of each row rounded to uint8 against the
  // block's largest, 4 tokens per dword; integer sums over the block, then scaled to float.
  constexpr int kV = D / 16;
  __m512 o[M][kV];
  for (int i = 0; i < M; ++i)
    for (int c = 0; c < kV; ++c) o[i][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t t0 = b * kBlock;
    const __m512 vscale = t0 + kBlock <= T ? _mm512_loadu_ps(vs + t0)
                                           : _mm512_maskz_loadu_ps((1u << (T - t0)) - 1, vs + t0);
    alignas(64) uint8_t wq[M][kBlock];
    float wscale[M];
    for (int i = 0; i < M; ++i) {
      const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(s + i * Tp + t0), vscale);
      const float top = _mm512_reduce_max_ps(w);
      wscale[i] = top > 0.f ? top / 255.f : 0.f;
      const __m512 inv = _mm512_set1_ps(top > 0.f ? 255.f / top : 0.f);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(wq[i]), _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(w, inv))));
    }
    __m512i acc[M][kV];
    for (int i = 0; i < M; ++i)
      for (int c = 0; c < kV; ++c) acc[i][c] = _mm512_setzero_si512();
    const int8_t* __restrict__ blk = vb + t0 * D;
    for (int g = 0; g < kBlock / 4; ++g) {
      __m512i vv[kV];
      for (int c = 0; c < kV; ++c) vv[c] = _mm512_loadu_si512(blk + (g * D + 16 * c) * 4);
      for (int i = 0; i < M; ++i) {
        int32_t ww;
        std::memcpy(&ww, &wq[i][4 * g], sizeof ww);
        const __m512i wb = _mm512_set1_epi32(ww);
        for (int c = 0; c < kV; ++c) acc[i][c] = _mm512_dpbusd_epi32(acc[i][c], wb, vv[c]);
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
template <int M, int D>
void attend_madd(const float* __restrict__ q, const int8_t* __restrict__ kb, const float* __restrict__ ks,
                 const int8_t* __restrict__ vb, const float* __restrict__ vs, int64_t T, float scale,
                 float* __restrict__ out, float* __restrict__ lse, float* __restrict__ s) {
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
        const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + (b * (D / 4) + g) * 64 + half * 32));
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
    const int8_t* __restrict__ blk = vb + t0 * D;
    for (int c = 0; c < D / 8; ++c) {  // dimensions 8c .. 8c + 7
      __m256i acc[M];
      for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_si256();
      for (int g = 0; g < kBlock / 4; ++g) {
        const __m256i vv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (g * D + 8 * c) * 4));
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
template <int M, int D>
void attend_rows(const float* q, const int8_t* kb, const float* ks, const int8_t* vb, const float* vs, int64_t T,
                 float scale, bool vnni, float* out, float* lse, float* s) {
#if VERICACHE_VNNI
  if (vnni) return attend_vnni<M, D>(q, kb, ks, vb, vs, T, scale, out, lse, s);
#endif
#if VERICACHE_MADD
  if (vnni) return attend_madd<M, D>(q, kb, ks, vb, vs, T, scale, out, lse, s);
#endif
  attend_float<M, D>(q, kb, ks, vb, vs, T, scale, out, lse, s);
}

// One (job, head): its m rows in passes of at most kMaxRows (the accumulators of a pass stay in
// registers; a verify-sized block re-reads the codes from cache per pass).
template <int D>
void attend_head(const float* q, int64_t m, const int8_t* kb, const float* ks, const int8_t* vb, const float* vs,
                 int64_t T, float scale, bool vnni, float* out, float* lse, float* s) {
  for (int64_t i0 = 0; i0 < m; i0 += kMaxRows) {
    const float* qi = q + i0 * D;
    float *oi = out + i0 * D, *li = lse + i0;
    switch (std::min<int64_t>(kMaxRows, m - i0)) {
#define VERICACHE_ROWS(M) case M: attend_rows<M, D>(qi, kb, ks, vb, vs, T, scale, vnni, oi, li, s); break;
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

// A job's exact suffix of one head, by element type (float32 or bf16).
template <int D>
void merge_suffix_head(const float* q, int64_t m, const torch::Tensor& sk, const torch::Tensor& sv, int64_t h,
                       int64_t n, float scale, float* out, float* lse, std::vector<float>& w) {
  const int64_t S = sk.size(1), ld = sk.stride(1);
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

}  // namespace

std::vector<std::vector<torch::Tensor>> int8_attention(std::vector<torch::Tensor> q, std::vector<torch::Tensor> kq,
                                                       std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vq,
                                                       std::vector<torch::Tensor> vs, double scale, bool integer,
                                                       std::vector<torch::Tensor> sk, std::vector<torch::Tensor> sv,
                                                       std::vector<int64_t> causal) {
  const size_t jobs = q.size();
  TORCH_CHECK(kq.size() == jobs && ks.size() == jobs && vq.size() == jobs && vs.size() == jobs, "job count mismatch");
  const bool suffix = !sk.empty();
  TORCH_CHECK(!suffix || (sk.size() == jobs && sv.size() == jobs && causal.size() == jobs),
              "sk, sv and causal must be given for every job or for none");
  std::vector<torch::Tensor> outs(jobs), lses(jobs);
  std::vector<std::pair<size_t, int64_t>> work;  // (job, head)
  for (size_t j = 0; j < jobs; ++j) {
    TORCH_CHECK(q[j].dtype() == torch::kFloat32 && q[j].is_contiguous() && q[j].dim() == 3, "q must be contiguous float32 [H, m, D]");
    TORCH_CHECK(kq[j].dtype() == torch::kInt8 && kq[j].is_contiguous() && vq[j].dtype() == torch::kInt8 && vq[j].is_contiguous(),
                "codes must be contiguous int8");
    TORCH_CHECK(ks[j].dtype() == torch::kFloat32 && ks[j].is_contiguous() && vs[j].dtype() == torch::kFloat32 && vs[j].is_contiguous(),
                "scales must be contiguous float32 [H, T]");
    const int64_t H = q[j].size(0), m = q[j].size(1), D = q[j].size(2), T = ks[j].size(1);
    const int64_t nb = (T + kBlock - 1) / kBlock;
    TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, "head size must be 16, 32, 64 or 128, got ", D);
    if (suffix) {
      TORCH_CHECK(sk[j].dim() == 3 && sk[j].size(0) == H && sk[j].size(2) == D && sv[j].sizes() == sk[j].sizes() &&
                  sk[j].stride(2) == 1 && sv[j].stride(2) == 1 && sv[j].strides() == sk[j].strides(),
                  "suffix keys / values must be [H, S, D] with contiguous rows and the same strides");
      TORCH_CHECK((sk[j].scalar_type() == torch::kFloat32 || sk[j].scalar_type() == torch::kBFloat16) &&
                  sv[j].scalar_type() == sk[j].scalar_type(), "suffix keys / values must be float32 or bfloat16");
      TORCH_CHECK(causal[j] >= 0 && causal[j] <= sk[j].size(1) && (causal[j] == 0 || m % causal[j] == 0),
                  "causal block n must be in [0, S] and divide the rows");
    }
    TORCH_CHECK(T > 0 || suffix, "no keys");
    TORCH_CHECK(ks[j].size(0) == H && vs[j].sizes() == ks[j].sizes(), "scales must be [H, T]");
    TORCH_CHECK(kq[j].dim() == 5 && kq[j].size(0) == H && kq[j].size(1) == nb && kq[j].size(2) == D / 4 &&
                kq[j].size(3) == kBlock && kq[j].size(4) == 4, "keys must be blocked [H, ceil(T/16), D/4, 16, 4]");
    TORCH_CHECK(vq[j].dim() == 4 && vq[j].size(0) == H && vq[j].size(1) == 4 * nb && vq[j].size(2) == D &&
                vq[j].size(3) == 4, "values must be blocked [H, 4 ceil(T/16), D, 4]");
    outs[j] = torch::empty({H, m, D}, q[j].options());
    lses[j] = torch::empty({H, m}, q[j].options());
    for (int64_t h = 0; h < H; ++h) work.emplace_back(j, h);
  }
  const bool vnni = integer && (VERICACHE_VNNI || VERICACHE_MADD);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, seen_w;
    for (int64_t w = begin; w < end; ++w) {
      const size_t j = work[w].first;
      const int64_t h = work[w].second;
      const int64_t m = q[j].size(1), D = q[j].size(2), T = ks[j].size(1);
      const int64_t Tp = (T + kBlock - 1) / kBlock * kBlock;
      s.resize(static_cast<size_t>(std::min<int64_t>(m, kMaxRows) * Tp));
      const float* qh = q[j].data_ptr<float>() + h * m * D;
      const int8_t* kh = kq[j].data_ptr<int8_t>() + h * Tp * D;
      const int8_t* vh = vq[j].data_ptr<int8_t>() + h * Tp * D;
      const float *ksh = ks[j].data_ptr<float>() + h * T, *vsh = vs[j].data_ptr<float>() + h * T;
      float* oh = outs[j].data_ptr<float>() + h * m * D;
      float* lh = lses[j].data_ptr<float>() + h * m;
      const float sc = static_cast<float>(scale);
      if (T == 0) {  // nothing packed yet: the suffix alone
        std::fill(oh, oh + m * D, 0.f);
        std::fill(lh, lh + m, -INFINITY);
      }
      switch (D) {
#define VERICACHE_HEAD(DIM)                                                                        \
  case DIM:                                                                                        \
    if (T > 0) attend_head<DIM>(qh, m, kh, ksh, vh, vsh, T, sc, vnni, oh, lh, s.data());           \
    if (suffix) merge_suffix_head<DIM>(qh, m, sk[j], sv[j], h, causal[j], sc, oh, lh, seen_w);        \
    break;
        VERICACHE_HEAD(16) VERICACHE_HEAD(32) VERICACHE_HEAD(64) VERICACHE_HEAD(128)
#undef VERICACHE_HEAD
      }
    }
  });
  return {outs, lses};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_attention", &int8_attention, "attention over int8 KV codes with per-(head, token) scales",
        py::arg("q"), py::arg("kq"), py::arg("ks"), py::arg("vq"), py::arg("vs"), py::arg("scale"), py::arg("integer") = true,
        py::arg("sk") = std::vector<torch::Tensor>{}, py::arg("sv") = std::vector<torch::Tensor>{},
        py::arg("causal") = std::vector<int64_t>{});
  m.attr("vnni") = static_cast<bool>(VERICACHE_VNNI);
  m.attr("madd") = static_cast<bool>(VERICACHE_MADD);  // the AVX2 integer path (attend_madd)
  m.attr("vec_width") = kW;  // floats per vector of the float path
}
