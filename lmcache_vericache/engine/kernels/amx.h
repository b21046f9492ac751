// One (head, tile) of dense_attention.cpp on AMX tiles (bf16 cache, CPUs with amx_bf16): a verify
// block's q k^T and p v as tile matrix products (TDPBF16PS, fp32 accumulation), the softmax between
// them in AVX-512. Numerics as tile_dp's: q and the probabilities rounded to bf16, scores, sums and
// outputs in fp32, the scale applied to the fp32 scores.
//
// (The scale is applied as one fused multiply-subtract, so a probability can round to the
// neighbouring bf16 of tile_dp's.)
//
// Layouts (all tiles are 16 rows of 64 bytes; a B operand holds bf16 pairs along the reduced axis):
//   scores S [mp, ntp] row-major = Q [mp, D] (A) x K^T (B: 16 d-pairs x 16 tokens, the K tile's
//   32-bit words transposed), then softmax numerators P [mp, ntp] bf16 in place of the A operand,
//   o [mp, D] = P (A: 16 rows x 32 tokens) x V (B: 16 token pairs x 16 dims, rows t and t+1
//   interleaved). ntp = nt rounded up to 32 tokens; the padding tokens have zero K/V and are masked.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(VERICACHE_VEC_WIDTH)
#define VERICACHE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <memory>

#include "common.h"

namespace vericache {

// Linux hands AMX's tile data state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction is SIGILL. oneDNN asks too: a second
// request is a no-op.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Palette 1, all eight tiles 16 rows x 64 bytes, for the life of the object (one work loop on one
// thread). The configuration is per thread and other libraries may keep theirs loaded between
// calls (PyTorch's brgemm skips reloading a configuration it believes current), so the thread's
// previous one is put back at the end, or the tiles released where there was none.
class AmxTiles {
 public:
  AmxTiles() {
    _tile_storeconfig(previous_);
    alignas(64) uint8_t cfg[64] = {};
    cfg[0] = 1;
    for (int t = 0; t < 8; ++t) {
      const uint16_t colsb = 64;
      std::memcpy(cfg + 16 + 2 * t, &colsb, 2);
      cfg[48 + t] = 16;
    }
    _tile_loadconfig(cfg);
  }
  ~AmxTiles() {
    if (previous_[0] != 0) {
      _tile_loadconfig(previous_);
    } else {
      _tile_release();
    }
  }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

 private:
  alignas(64) uint8_t previous_[64] = {};
};

// rows[16] of 16 dwords -> their transpose, written as 16 rows of 16 dwords at out.
inline void transpose16x16(__m512i (&a)[16], uint32_t* __restrict__ out) {
  __m512i b[16], c[16];
  for (int i = 0; i < 8; ++i) {
    b[2 * i] = _mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // c[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3
    c[4 * i] = _mm512_unpacklo_epi64(b[4 * i], b[4 * i + 2]);
    c[4 * i + 1] = _mm512_unpackhi_epi64(b[4 * i], b[4 * i + 2]);
    c[4 * i + 2] = _mm512_unpacklo_epi64(b[4 * i + 1], b[4 * i + 3]);
    c[4 * i + 3] = _mm512_unpackhi_epi64(b[4 * i + 1], b[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i e0 = _mm512_shuffle_i32x4(c[k], c[4 + k], 0x44), e1 = _mm512_shuffle_i32x4(c[k], c[4 + k], 0xEE);
    const __m512i f0 = _mm512_shuffle_i32x4(c[8 + k], c[12 + k], 0x44), f1 = _mm512_shuffle_i32x4(c[8 + k], c[12 + k], 0xEE);
    _mm512_storeu_si512(out + (k) * 16, _mm512_shuffle_i32x4(e0, f0, 0x88));
    _mm512_storeu_si512(out + (4 + k) * 16, _mm512_shuffle_i32x4(e0, f0, 0xDD));
    _mm512_storeu_si512(out + (8 + k) * 16, _mm512_shuffle_i32x4(e1, f1, 0x88));
    _mm512_storeu_si512(out + (12 + k) * 16, _mm512_shuffle_i32x4(e1, f1, 0xDD));
  }
}

// Scratch of one thread for tiles of up to tile_tokens tokens and mp rows. Not zeroed: tile_amx
// writes every part it reads (padding included) first.
struct AmxScratch {
  std::unique_ptr<uint32_t[]> kt, vv;  // K^T blocks [ntp/16][D/32][16][16] words; V pairs [ntp/2][D] words
  std::unique_ptr<float[]> s, o;       // scores [mp, ntp]; one block of rows' output [16, D]
  std::unique_ptr<uint16_t[]> p;       // probabilities [mp, ntp] bf16
  AmxScratch(int64_t tile_tokens, int64_t mp, int D)
      : kt(new uint32_t[tile_tokens * D / 2]), vv(new uint32_t[tile_tokens * D / 2]), s(new float[mp * tile_tokens]),
        o(new float[16 * D]), p(new uint16_t[mp * tile_tokens]) {}
};

// One (head, tile) as tile() / tile_dp() compute it: qb [mp, D] bf16 (rows past m zero), k / v the
// tile's nt entries, `first` / n the causal block (n = 0: none). Writes mx / sum [mp] (scaled max,
// sum of numerators; -inf / 0 for a row the tile hides entirely) and the unnormalized o [m, D].
template <int D>
void tile_amx(const uint16_t* __restrict__ qb, int64_t m, int64_t mp, const uint16_t* __restrict__ k,
              const uint16_t* __restrict__ v, int64_t nt, int64_t first, int64_t n, float scale, AmxScratch& w,
              float* __restrict__ mx, float* __restrict__ sum, float* __restrict__ o) {
  static_assert(D % 32 == 0, "head size: whole 32-element halves");
  constexpr int kHalves = D / 32;
  const int64_t ntp = (nt + 31) / 32 * 32;
  uint32_t* kt = w.kt.get();
  float* s = w.s.get();
  uint16_t* p = w.p.get();
  // K^T: per 16 tokens and 32 dims, the 16 x 16 words (dim pairs) transposed; padding tokens zero
  for (int64_t tb = 0; tb < ntp / 16; ++tb)
    for (int hf = 0; hf < kHalves; ++hf) {
      __m512i rows[16];
      for (int t = 0; t < 16; ++t) {
        const int64_t tok = tb * 16 + t;
        rows[t] = tok < nt ? _mm512_loadu_si512(k + tok * D + 32 * hf) : _mm512_setzero_si512();
      }
      transpose16x16(rows, kt + (tb * kHalves + hf) * 256);
    }
  // S = Q K^T, one 16 x 16 block at a time: tile 0 accumulates, 4 holds Q's rows, 5 K^T's block
  for (int64_t tb = 0; tb < ntp / 16; ++tb)
    for (int64_t rb = 0; rb < mp; rb += 16) {
      _tile_zero(0);
      for (int hf = 0; hf < kHalves; ++hf) {
        _tile_loadd(4, qb + rb * D + 32 * hf, D * 2);
        _tile_loadd(5, kt + (tb * kHalves + hf) * 256, 64);
        _tile_dpbf16ps(0, 4, 5);
      }
      _tile_stored(0, s + rb * ntp + tb * 16, ntp * 4);
    }
  // softmax numerators per row over the tokens it sees, rounded to bf16 for p v; rows past m zero
  // (padding rows of the A operand: no exponentials for them)
  std::memset(p + m * ntp, 0, sizeof(uint16_t) * (mp - m) * ntp);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < m; ++i) {
    const float* row = s + i * ntp;
    uint16_t* prow = p + i * ntp;
    const int64_t lim = std::min(nt, n ? std::max<int64_t>(0, first + 1 + i % n) : nt);
    __m512 top = neg_inf;
    for (int64_t t = 0; t < lim; t += 16) {
      const __mmask16 live = t + 16 <= lim ? 0xFFFF : static_cast<__mmask16>((1u << (lim - t)) - 1);
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(neg_inf, live, row + t));
    }
    const float best = _mm512_reduce_max_ps(top);
    const __m512 shift = _mm512_set1_ps(best * scale), vscale = _mm512_set1_ps(scale);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < ntp; t += 32) {
      __m512 e[2];
      for (int u = 0; u < 2; ++u) {
        const int64_t t0 = t + 16 * u;
        const __mmask16 live = t0 + 16 <= lim ? 0xFFFF : t0 >= lim ? 0 : static_cast<__mmask16>((1u << (lim - t0)) - 1);
        const vfloat x = (vfloat)_mm512_fmsub_ps(_mm512_loadu_ps(row + t0), vscale, shift);
        e[u] = _mm512_maskz_mov_ps(live, (__m512)exp_nonpositive(x));
        total = _mm512_add_ps(total, e[u]);
      }
      _mm512_storeu_si512(prow + t, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    mx[i] = lim > 0 ? best * scale : -INFINITY;
    sum[i] = _mm512_reduce_add_ps(total);
  }
  // V as token pairs: word (v[t][d], v[t+1][d]) at [t/2][d]; padding tokens zero
  uint32_t* vv = w.vv.get();
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                          39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t t = 0; t < ntp; t += 2)
    for (int hf = 0; hf < kHalves; ++hf) {
      const __m512i a = t < nt ? _mm512_loadu_si512(v + t * D + 32 * hf) : _mm512_setzero_si512();
      const __m512i b = t + 1 < nt ? _mm512_loadu_si512(v + (t + 1) * D + 32 * hf) : _mm512_setzero_si512();
      _mm512_storeu_si512(vv + (t / 2) * D + 32 * hf, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(vv + (t / 2) * D + 32 * hf + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  // o = P V per block of 16 rows, 4 blocks of 16 dims at a time (tiles 0-3), P in 4, V pairs in 5
  float* ob = w.o.get();
  for (int64_t rb = 0; rb < m; rb += 16) {
    for (int g = 0; g < D / 64; ++g) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t t = 0; t < ntp; t += 32) {
        const uint32_t* vt = vv + (t / 2) * D + 64 * g;
        _tile_loadd(4, p + rb * ntp + t, ntp * 2);
        _tile_loadd(5, vt, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, vt + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, vt + 32, D * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, vt + 48, D * 4);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, ob + 64 * g, D * 4);
      _tile_stored(1, ob + 64 * g + 16, D * 4);
      _tile_stored(2, ob + 64 * g + 32, D * 4);
      _tile_stored(3, ob + 64 * g + 48, D * 4);
    }
    std::memcpy(o + rb * D, ob, sizeof(float) * D * std::min<int64_t>(16, m - rb));
  }
}

}  // namespace vericache
#else
#define VERICACHE_AMX 0
#endif
