// Int4 packed weights × a few activation rows (tokenhaul/layers/int4_gemv.py): y = x W^T.
//
// Reads the CPU int4pack layout (see int4_dequant.cpp): rows in blocks of B (64 where torch runs its AVX-512
// kernels, 32 with AVX2), for each input k a block stores B / 2 bytes, byte j = q[n0 + j] | q[n0 + B / 2 + j] << 4.
// 32-row blocks come in the GEMV's own order (linear_int4.gemv_layout, with the scales in unit order): the same
// bytes of each quad of inputs k .. k + 3 (64 bytes) transposed, byte 32 h + 4 r + i = q[n0 + 8 h + r, k + i] |
// q[n0 + 16 + 8 h + r, k + i] << 4, so that a 32-byte half is VPMADDUBSW's operand as it lies: 8 rows × 4 inputs
// from the low nibbles, the 8 rows 16 further from the high ones (torch's order needs a lane permute and a byte
// shuffle per two inputs; bench/RESULTS.md "int4 on AVX2: codes in quads"). Work is done in units of 64 rows (one
// or two blocks) whatever B; value = (q - 8) * scale + zero with the
// (scale, zero) bf16 pairs either as torch stores them, [K / group, N, 2], or in unit order, [N / 64, K / group,
// 64, 2]: one sequential stream beside the codes' instead of 256 bytes every N * 4 (1.13-1.17x on Qwen2.5-0.5B's
// linears from DRAM at one row, bench/RESULTS.md "Scales in unit order"). Per group the codes are summed against
// the activations unscaled and the group's scale and zero applied after:
//   y[n] = Σ_g s[g,n] · (Σ_k q[n,k] x[k] - 8 Σ_k x[k]) + z[g,n] · Σ_k x[k].
// Three ways to sum: fp32 FMAs on the codes widened to fp32 (fp32 activations; bf16 ones of 3 or more rows on
// AVX-512 hosts without BF16 or VNNI), bf16 dot products (3 or more rows with AVX-512 BF16 but not VNNI), bytes
// times 8-bit activations (bf16 activations of 1 or 2 rows: VPDPBUSD with AVX-512 VNNI, else VPMADDUBSW, the same
// quantized sums; of 3 or more rows with AVX-512 VNNI in tiles of rows, with AVX2 against panels of codes laid out
// once per block). Within a way each row goes through the same
// operations whatever the row count, so a row's result depends on its batch only through which way its row count
// takes (with AVX-512 VNNI there is one way for every row count the engine sends here). With 32-row blocks (AVX2
// hosts) bf16 rows of 3 or more take the 8-bit path against panels of codes laid out in L1 (panel_blocks_i8),
// each thread taking whole blocks. Otherwise work is split evenly over
// threads in (block, group) units; a large weight's share of a thread is cut in parts walked together (more
// streams in flight), each part in memory order with the scales of a unit a few ahead prefetched; a block two parts
// share is summed after the parallel region.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#ifndef SCALES_AHEAD
#define SCALES_AHEAD 4  // units (block, group) ahead whose scales are prefetched (measured: none 1.0x, 2-8 1.3x)
#endif

#ifndef RANGES  // parts per thread walked together, a unit of each in turn: more streams in flight per core
#define RANGES 2   // Zen 5, from DRAM: 9728 x 896 +8-18 %, 896 x 4864 +2-15 %, 896 x 896 -2..-10 % (RANGES_FROM)
#endif
#ifndef RANGES_FROM
#define RANGES_FROM (1 << 20)  // bytes of codes from which a thread's share is cut in RANGES
#endif

#ifndef PREFETCH_HINT  // into L2, not L1: Zen 4, from DRAM, Qwen2.5-0.5B's linears +18 % (vCPUs on one CCD) / +23 %
#define PREFETCH_HINT _MM_HINT_T1  // (two), SmolLM2's +9 % / +8 % (the int8 GEMV read less with T1: it keeps T0)
#endif
#ifndef PREFETCH
#define PREFETCH 2048  // bytes of a thread's weight stream touched ahead (measured: 0 0.95x, 1024 0.98x)
#endif

namespace {

inline float bf16_to_float(uint16_t h) { return c10::BFloat16(h, c10::BFloat16::from_bits()); }  // torch's own

struct Problem {
  const uint8_t* w;    // [N / B][K][B / 2]
  const uint16_t* sz;  // (scale, zero) bf16 pairs, in the order `units` says
  const float* x;      // [M][K] (not filled for the 8-bit paths, which never read it)
  const float* xs;     // [M][G] group sums of x
  int64_t m, k, n, groups, group, block;
  const uint32_t* xpairs;  // bf16 x as (x[k], x[k + 1]) pairs, [M][K / 2]; null when x is fp32
  const int8_t* xq;        // 8-bit x (bf16 activations on the 8-bit paths), [M][K]; null otherwise
  const float* xd;         // its scale per QBLOCK inputs, [M][K / QBLOCK]; xs then holds the quantized x's sums
  bool units;              // sz in unit order [N / 64][G][64][2], else [G][N][2]
  bool tiles;              // the 8-bit x of 3 or more rows in tiles (AVX-512 VNNI: unit_tiles_i8)
};

// The (scale, zero) pairs of unit (block b, group g): its 64 rows'.
inline const uint16_t* unit_scales(const Problem& p, int64_t g, int64_t b) {
  return p.units ? p.sz + (b * p.groups + g) * 128 : p.sz + (g * p.n + b * 64) * 2;
}

constexpr int64_t QBLOCK = 16;  // inputs per activation scale of the 8-bit path

// QBLOCK bf16 inputs (raw bits) → fp32: the bits moved to the high half, as torch's conversion
inline void widen_block(const uint16_t* x, float* out) {
#ifdef __AVX2__
  static_assert(QBLOCK == 16, "two 8-float registers");
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  _mm256_storeu_ps(out, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16)));
  _mm256_storeu_ps(out + 8,
                   _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16)));
#else
  for (int64_t j = 0; j < QBLOCK; ++j) out[j] = bf16_to_float(x[j]);
#endif
}

// max |x| over n inputs (n a multiple of QBLOCK); a NaN is passed over, as std::max does
inline float abs_max(const float* x, int64_t n) {
#ifdef __AVX2__
  static_assert(QBLOCK == 16, "two 8-float registers");
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
  float amax = 0.0f;
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  return amax;
#endif
}

// n inputs (a multiple of QBLOCK) to int8: q = round-to-even(x · 127 / amax); returns the codes' sum.
inline int32_t quantize(const float* x, int64_t n, float amax, int8_t* q) {
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
#ifdef __AVX2__
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += QBLOCK) {
    const __m256i qa = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), iv));
    const __m256i qb = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), iv));
    const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qa, qb), 0xD8);  // 16 codes in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i),
                     _mm_packs_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(qa, qb)),
                              _mm256_extracti128_si256(_mm256_add_epi32(qa, qb), 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    sum += _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
  }
#else
  for (int64_t j = 0; j < n; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(x[j] * inv));
    sum += q[j];
  }
#endif
  return sum;
}

#ifdef __AVX2__
// A quad half's byte i of each row (8 rows) as 32-bit lanes: each 128-bit lane holds 4 rows' quads
inline __m256i quad_input(const uint8_t* half, int i) {
  static const __m256i pick[4] = {
      _mm256_setr_epi8(0, -1, -1, -1, 4, -1, -1, -1, 8, -1, -1, -1, 12, -1, -1, -1,
                       0, -1, -1, -1, 4, -1, -1, -1, 8, -1, -1, -1, 12, -1, -1, -1),
      _mm256_setr_epi8(1, -1, -1, -1, 5, -1, -1, -1, 9, -1, -1, -1, 13, -1, -1, -1,
                       1, -1, -1, -1, 5, -1, -1, -1, 9, -1, -1, -1, 13, -1, -1, -1),
      _mm256_setr_epi8(2, -1, -1, -1, 6, -1, -1, -1, 10, -1, -1, -1, 14, -1, -1, -1,
                       2, -1, -1, -1, 6, -1, -1, -1, 10, -1, -1, -1, 14, -1, -1, -1),
      _mm256_setr_epi8(3, -1, -1, -1, 7, -1, -1, -1, 11, -1, -1, -1, 15, -1, -1, -1,
                       3, -1, -1, -1, 7, -1, -1, -1, 11, -1, -1, -1, 15, -1, -1, -1)};
  return _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half)), pick[i]);
}

// out[TM][64] += rows m0.. of x against group g of unit b (64 rows). TM rows at once, SL of the unit's four
// slices at once (each slice: 8 rows from the low nibbles, the 8 rows B / 2 further from the high ones; with
// 32-row blocks a slice is a quad half).
template <int TM, int SL>
void block_rows(const Problem& p, int64_t b, int64_t g, int64_t m0, float* out) {
  constexpr int A = TM * SL * 2;  // accumulators: [m][slice][low / high nibbles]
  const int64_t k = p.k, n = p.n, group = p.group, groups = p.groups, stride = p.block / 2;
  const float* x = p.x + m0 * k;
  const float* xs = p.xs + m0 * groups;
  const __m256i high16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const uint16_t* szb = unit_scales(p, g, b);
  for (int s0 = 0; s0 < 4; s0 += SL) {
    __m256 acc[A];
#pragma GCC unroll 16
    for (int a = 0; a < A; ++a) acc[a] = _mm256_setzero_ps();
    const uint8_t* src[SL];  // slice s0 + s: block (s0 + s) / per of the unit, 8 ((s0 + s) % per) rows on (bytes
    int low[SL];             // 8 or, in quads, 32 times that); low: the first of the 8 rows its low nibbles hold
    const int per = static_cast<int>(p.block / 16);  // slices per block
    const bool quads = p.block == 32;
    for (int s = 0; s < SL; ++s) {
      const int64_t blk = b * (64 / p.block) + (s0 + s) / per, within = (s0 + s) % per;
      src[s] = p.w + blk * k * stride + g * group * stride + within * (quads ? 32 : 8);
      low[s] = static_cast<int>(((s0 + s) / per) * p.block + within * 8);
    }
    for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
#pragma GCC unroll 4
      for (int s = 0; s < SL; ++s) {  // one slice's 16 weights converted, then used by every row of x
#if PREFETCH
        if ((s0 + s) % per == 0 && (!quads || kk % 4 == 0))
          _mm_prefetch(reinterpret_cast<const char*>(src[s]) + PREFETCH, PREFETCH_HINT);
#endif
        const __m256i v = quads ? quad_input(src[s], static_cast<int>(kk % 4))
                                : _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src[s])));
        if (!quads) src[s] += stride;
        else if (kk % 4 == 3) src[s] += 64;
        const __m256 both = _mm256_cvtepi32_ps(v);  // lo + 16 hi: the low nibbles' sum is taken out after
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
#pragma GCC unroll 6
        for (int m = 0; m < TM; ++m) {
          const __m256 xv = _mm256_broadcast_ss(x + m * k + kk);
          acc[(m * SL + s) * 2] = _mm256_fmadd_ps(both, xv, acc[(m * SL + s) * 2]);
          acc[(m * SL + s) * 2 + 1] = _mm256_fmadd_ps(hi, xv, acc[(m * SL + s) * 2 + 1]);
        }
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < SL * 2; ++j) {
      const int r = low[j / 2] + (j & 1) * static_cast<int>(stride);  // the 8 rows this accumulator holds
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(szb + r * 2));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(v, high16));
#pragma GCC unroll 6
      for (int m = 0; m < TM; ++m) {
        const float sx = xs[m * groups + g];
        float* o = out + m * 64 + r;
        const __m256 sum = (j & 1) ? acc[m * SL * 2 + j]
                                   : _mm256_fnmadd_ps(_mm256_set1_ps(16.0f), acc[m * SL * 2 + j + 1], acc[m * SL * 2 + j]);
        const __m256 centred = _mm256_sub_ps(sum, _mm256_set1_ps(8.0f * sx));
        const __m256 y = _mm256_fmadd_ps(scale, centred, _mm256_loadu_ps(o));
        _mm256_storeu_ps(o, _mm256_fmadd_ps(zero, _mm256_set1_ps(sx), y));
      }
    }
  }
}

// Three or more bf16 rows with AVX2, 32-row blocks (in quads): the 8-bit x (as for one or two rows) against
// panels. Each block's codes are unpacked KC inputs at a time into VPMADDUBSW operands in L1, 8 rows × 4 inputs a
// register (a quad of inputs takes 4: rows 0-7 and 8-15 from the low nibbles, 16-23 and 24-31 from the high
// ones). Tiles of 2 rows × 32 outputs then sum by VPMADDUBSW into 16-bit sums over a QBLOCK (4 quads: at
// most 4 · 2 · 15 · 127 = 15240), VPMADDWD to 32 bits, and into fp32 outputs summed over the chunk:
// y += (s · d) · A per QBLOCK, + (z - 8 s) · X per group (X: the group's sum of the 8-bit x). The codes are laid
// out once for all the rows, and there is no per-group pass over memory: 1.1-1.6x the FMAs of block_rows at 3-512
// rows (bench/RESULTS.md "int4 on AVX2: 8-bit panels from 3 rows"). A row's sums run the same operations in the
// same order whatever the number of rows, and each thread takes whole blocks.
constexpr int64_t KC = 128;  // inputs per panel chunk: two panels of 2 KB
constexpr int64_t MC = 192;  // rows of x against each block in turn (a chunk of their 8-bit x stays in L2)

// A quad half (32 bytes) as two VPMADDUBSW operands: lo = its 8 rows' codes (low nibbles), hi = the 8 rows 16
// further (high nibbles)
inline void quad_half(const uint8_t* src, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(15);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  lo = _mm256_and_si256(v, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
}

// lo / hi [kc / 4][2] = the block's rows 0-15 / 16-31 as quads of inputs k0 .. k0 + kc: the low / high nibbles
// of its quads' two halves
inline void pack_chunk_i8(const Problem& p, int64_t blk, int64_t k0, int64_t kc, __m256i* lo, __m256i* hi) {
  const uint8_t* src = p.w + (blk * p.k + k0) * 16;
  for (int64_t q = 0; q < kc / 4; ++q, src += 64) {
#if PREFETCH
    _mm_prefetch(reinterpret_cast<const char*>(src) + PREFETCH, PREFETCH_HINT);
#endif
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) quad_half(src + 32 * i, lo[q * 2 + i], hi[q * 2 + i]);
  }
}

constexpr int PANEL_TILE = 2;  // rows a tile sums against both panels at once (Zen 3, 1 thread, 9728 x 896: 3 rows
                                // against one panel 55-59 GMAC/s, 2 against both 66-70, 3 against both 57-61)

// out[h][TR][16] (+)= TR rows of the 8-bit x (from row r) × the block's two panels of quads (h: rows 0-15, 16-31),
// each x quad broadcast once for all 32 rows; sz[h] [kc / GROUP][2][16]: s, z - 8 s
template <int TR, int GROUP>
inline void panel_rows_i8(const Problem& p, int64_t r, int64_t k0, int64_t kc, const __m256i* const (&panel)[2],
                          const float* const (&sz)[2], float* const (&out)[2], bool first) {
  const int64_t k = p.k, nb = k / QBLOCK;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq[TR];
  const float* xd[TR];
  const float* xs[TR];
  for (int m = 0; m < TR; ++m) {
    xq[m] = p.xq + (r + m) * k + k0;
    xd[m] = p.xd + (r + m) * nb + k0 / QBLOCK;
    xs[m] = p.xs + (r + m) * p.groups + k0 / GROUP;
  }
  __m256 y[TR][4];  // column c: outputs (c & 1) * 8 .. + 7 of panel c >> 1
#pragma GCC unroll 2
  for (int m = 0; m < TR; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      y[m][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out[c >> 1] + m * 16 + (c & 1) * 8);
  for (int64_t g0 = 0; g0 < kc; g0 += GROUP) {
    const int64_t g = g0 / GROUP;
    for (int64_t b0 = g0; b0 < g0 + GROUP; b0 += QBLOCK) {  // (unrolling these loops fully read 15 % slower)
      __m256i a[TR][4];
#pragma GCC unroll 4
      for (int64_t q = b0 / 4; q < (b0 + QBLOCK) / 4; ++q) {
        __m256i w[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) w[c] = _mm256_load_si256(panel[c >> 1] + q * 2 + (c & 1));
#pragma GCC unroll 2
        for (int m = 0; m < TR; ++m) {
          int32_t quad;
          std::memcpy(&quad, xq[m] + q * 4, 4);
          const __m256i xv = _mm256_set1_epi32(quad);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_maddubs_epi16(w[c], xv);
            a[m][c] = q == b0 / 4 ? v : _mm256_add_epi16(a[m][c], v);
          }
        }
      }
#pragma GCC unroll 2
      for (int m = 0; m < TR; ++m) {
        const __m256 d = _mm256_set1_ps(xd[m][b0 / QBLOCK]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c)
          y[m][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a[m][c], ones)),
                                    _mm256_mul_ps(_mm256_load_ps(sz[c >> 1] + g * 32 + (c & 1) * 8), d), y[m][c]);
      }
    }
#pragma GCC unroll 2
    for (int m = 0; m < TR; ++m) {
      const __m256 x = _mm256_set1_ps(xs[m][g]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c)
        y[m][c] = _mm256_fmadd_ps(_mm256_load_ps(sz[c >> 1] + g * 32 + 16 + (c & 1) * 8), x, y[m][c]);
    }
  }
#pragma GCC unroll 2
  for (int m = 0; m < TR; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out[c >> 1] + m * 16 + (c & 1) * 8, y[m][c]);
}

// rows m0 .. m1 - 1 against the block's panels, PANEL_TILE rows at a time
template <int GROUP>
void panel_tiles_i8(const Problem& p, int64_t m0, int64_t m1, int64_t k0, int64_t kc, const __m256i* const (&panel)[2],
                    const float* const (&sz)[2], float (&out)[2][MC * 16]) {
  for (int64_t r = m0; r < m1; r += PANEL_TILE) {
    float* const o[2] = {out[0] + (r - m0) * 16, out[1] + (r - m0) * 16};
    if (m1 - r >= PANEL_TILE)
      panel_rows_i8<PANEL_TILE, GROUP>(p, r, k0, kc, panel, sz, o, k0 == 0);
    else
      panel_rows_i8<1, GROUP>(p, r, k0, kc, panel, sz, o, k0 == 0);
  }
}

// 8 fp32 values to bf16, rounded to nearest even as c10::BFloat16 does (NaN: 0x7FC0)
inline void store8(const float* src, at::BFloat16* dst) {
  const __m256 v = _mm256_loadu_ps(src);
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// y [M][N] = the 8-bit x W^T over 32-row blocks blk0 .. blk1 - 1 (one thread's share), MC rows at a time
void panel_blocks_i8(const Problem& p, int64_t blk0, int64_t blk1, at::BFloat16* y) {
  alignas(32) __m256i lo[KC / 2], hi[KC / 2];
  alignas(32) float sz[2][KC / 32][32];  // per group: s, z - 8 s of 16 rows (lo / hi)
  alignas(32) float out[2][MC * 16];
  const __m256i high16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256 eight = _mm256_set1_ps(8.0f);
  const int64_t kc_max = KC / p.group * p.group;
  for (int64_t m0 = 0; m0 < p.m; m0 += MC) {
    const int64_t m1 = std::min(p.m, m0 + MC);
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      for (int64_t k0 = 0; k0 < p.k; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, p.k - k0);
        pack_chunk_i8(p, blk, k0, kc, lo, hi);
        for (int64_t gi = 0; gi < kc / p.group; ++gi) {
          const uint16_t* szb = unit_scales(p, k0 / p.group + gi, blk / 2) + (blk & 1) * 64;
          for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(szb + j * 16));
            const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 z = _mm256_fnmadd_ps(eight, s, _mm256_castsi256_ps(_mm256_and_si256(v, high16)));
            _mm256_store_ps(sz[j / 2][gi] + (j & 1) * 8, s);
            _mm256_store_ps(sz[j / 2][gi] + 16 + (j & 1) * 8, z);
          }
        }
        const __m256i* const panel[2] = {lo, hi};
        const float* const scales[2] = {sz[0][0], sz[1][0]};
        switch (p.group) {  // many_row_group: 32, 64 or 128
          case 32: panel_tiles_i8<32>(p, m0, m1, k0, kc, panel, scales, out); break;
          case 64: panel_tiles_i8<64>(p, m0, m1, k0, kc, panel, scales, out); break;
          default: panel_tiles_i8<128>(p, m0, m1, k0, kc, panel, scales, out); break;
        }
      }
      for (int64_t m = m0; m < m1; ++m)
        for (int j = 0; j < 4; ++j)
          store8(out[j >> 1] + (m - m0) * 16 + (j & 1) * 8, y + m * p.n + blk * 32 + j * 8);
    }
  }
}

// 8-bit activations (AVX2, bf16 activations), llama.cpp's way: x is quantized per QBLOCK inputs to int8 (scale
// d = max|x| / 127) and the codes are multiplied as bytes (vpmaddubsw: unsigned codes × signed x, adjacent pairs
// summed to int16) — 32 products per instruction instead of 8 FMAs on codes widened to fp32. 16-bit sums over a
// block of QBLOCK inputs (at most 8 · 2 · 15 · 127 = 30480) are widened and scaled by d into fp32 per group:
//   y[n] += s[g,n] · (A - 8 X) + z[g,n] · X,  A = Σ_blocks d · Σ_k q[n,k] xq[k],  X = Σ_blocks d · Σ_k xq[k].

// out[TM][64] += TM rows of the 8-bit x against group g of unit b, 32-row blocks in quads (AVX2 hosts' one- and
// two-row steps): a quad half is a VPMADDUBSW operand as it lies (8 rows × 4 inputs, x's quad broadcast), its
// 16-bit sums over a QBLOCK (4 quads: at most 4 · 2 · 15 · 127 = 15240) VPMADDWD to 32 bits and into fp32 sums
// kept in registers. A pass takes V of a block's two 32-byte halves (16 rows each); a row's sums run the same
// operations in the same order whatever TM.
template <int TM, int V>
inline void quad_rows_i8(const Problem& p, int64_t b, int64_t g, float* out) {
  const int64_t k = p.k, group = p.group, nb = k / QBLOCK;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i high16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const uint16_t* szb = unit_scales(p, g, b);
  for (int h = 0; h < 2; ++h)
    for (int v0 = 0; v0 < 2; v0 += V) {
      const uint8_t* src = p.w + (2 * b + h) * k * 16 + 32 * v0;
      __m256 acc[TM][2 * V];  // [m][v]: rows 8 (v0 + v) .. + 7 of the block; [m][V + v]: the 8 rows 16 further
      for (int m = 0; m < TM; ++m)
        for (int j = 0; j < 2 * V; ++j) acc[m][j] = _mm256_setzero_ps();
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += QBLOCK) {
        __m256i s16[TM][2 * V];
#pragma GCC unroll 4
        for (int64_t kk = k0; kk < k0 + QBLOCK; kk += 4) {
#if PREFETCH
          if (v0 == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kk * 16) + PREFETCH, PREFETCH_HINT);
#endif
          __m256i w[2 * V];
#pragma GCC unroll 2
          for (int v = 0; v < V; ++v) quad_half(src + kk * 16 + 32 * v, w[v], w[V + v]);
#pragma GCC unroll 2
          for (int m = 0; m < TM; ++m) {
            int32_t quad;
            std::memcpy(&quad, p.xq + m * k + kk, 4);
            const __m256i xv = _mm256_set1_epi32(quad);
#pragma GCC unroll 4
            for (int j = 0; j < 2 * V; ++j) {
              const __m256i v = _mm256_maddubs_epi16(w[j], xv);
              s16[m][j] = kk == k0 ? v : _mm256_add_epi16(s16[m][j], v);
            }
          }
        }
#pragma GCC unroll 2
        for (int m = 0; m < TM; ++m) {
          const __m256 dv = _mm256_set1_ps(p.xd[m * nb + k0 / QBLOCK]);
#pragma GCC unroll 4
          for (int j = 0; j < 2 * V; ++j)
            acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[m][j], ones)), dv, acc[m][j]);
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < 2 * V; ++j) {
        const int r = 32 * h + 8 * (v0 + j % V) + 16 * (j / V);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(szb + r * 2));
        const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(v, high16));
#pragma GCC unroll 2
        for (int m = 0; m < TM; ++m) {
          const float sx = p.xs[m * p.groups + g];
          float* o = out + m * 64 + r;
          const __m256 y = _mm256_fmadd_ps(scale, _mm256_sub_ps(acc[m][j], _mm256_set1_ps(8.0f * sx)),
                                           _mm256_loadu_ps(o));
          _mm256_storeu_ps(o, _mm256_fmadd_ps(zero, _mm256_set1_ps(sx), y));
        }
      }
    }
}

// 64-row blocks (AVX-512 hosts without VNNI): the codes of inputs k and k + 1 of a row paired into adjacent bytes
// by one byte interleave. The unit's (k, k + 1) pairs (32 bytes per input: byte i = rows i | i + 32) in four
// registers, 16 rows (two 128-bit lanes of 8) each: rows 32 (j >> 1) + 8 (j & 1) + 16 lane.
inline void unit_pairs(const uint8_t* src, __m256i (&w)[4]) {
  const __m256i m = _mm256_set1_epi8(15);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
  const __m256i l = _mm256_unpacklo_epi8(a, b), h = _mm256_unpackhi_epi8(a, b);
  w[0] = _mm256_and_si256(l, m);
  w[1] = _mm256_and_si256(h, m);
  w[2] = _mm256_and_si256(_mm256_srli_epi16(l, 4), m);
  w[3] = _mm256_and_si256(_mm256_srli_epi16(h, 4), m);
}

// out[TM][64] += the TM rows of the 8-bit x against group g of unit b (one 64-row block)
template <int TM>
void block_rows_i8(const Problem& p, int64_t b, int64_t g, float* out) {
  const int64_t k = p.k, group = p.group, groups = p.groups, nb = k / QBLOCK;
  const uint8_t* src = p.w + b * k * 32;
  alignas(32) float acc[TM][64] = {};
  for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += QBLOCK) {
    __m256i s16[TM][4];
    for (int m = 0; m < TM; ++m)
      for (int j = 0; j < 4; ++j) s16[m][j] = _mm256_setzero_si256();
    for (int64_t kk = k0; kk < k0 + QBLOCK; kk += 2) {
      __m256i w[4];
#if PREFETCH
      _mm_prefetch(reinterpret_cast<const char*>(src + kk * 32) + PREFETCH, PREFETCH_HINT);
#endif
      unit_pairs(src + kk * 32, w);
      for (int m = 0; m < TM; ++m) {
        int16_t pair;
        std::memcpy(&pair, p.xq + m * k + kk, 2);
        const __m256i xv = _mm256_set1_epi16(pair);
        for (int j = 0; j < 4; ++j) s16[m][j] = _mm256_add_epi16(s16[m][j], _mm256_maddubs_epi16(w[j], xv));
      }
    }
    for (int m = 0; m < TM; ++m) {  // acc[m] += d · the block's 16-bit sums
      const __m256 dv = _mm256_set1_ps(p.xd[m * nb + k0 / QBLOCK]);
      for (int j = 0; j < 4; ++j)
        for (int lane = 0; lane < 2; ++lane) {
          const __m128i part = lane ? _mm256_extracti128_si256(s16[m][j], 1) : _mm256_castsi256_si128(s16[m][j]);
          float* a = acc[m] + (j >> 1) * 32 + (j & 1) * 8 + 16 * lane;
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(part)), dv, _mm256_loadu_ps(a)));
        }
    }
  }
  const __m256i high16 = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const uint16_t* szb = unit_scales(p, g, b);
  for (int r = 0; r < 64; r += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(szb + r * 2));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(v, high16));
    for (int m = 0; m < TM; ++m) {
      const float sx = p.xs[m * groups + g];
      float* o = out + m * 64 + r;
      const __m256 centred = _mm256_sub_ps(_mm256_load_ps(acc[m] + r), _mm256_set1_ps(8.0f * sx));
      const __m256 y = _mm256_fmadd_ps(scale, centred, _mm256_loadu_ps(o));
      _mm256_storeu_ps(o, _mm256_fmadd_ps(zero, _mm256_set1_ps(sx), y));
    }
  }
}

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16")))

// The (scale, zero) pairs of rows 16 j .. 16 j + 15 of a unit as fp32 (a bf16 is an fp32's high half).
__attribute__((target("avx512f"), always_inline)) inline void scales16(const uint16_t* szb, int j, __m512& scale,
                                                                       __m512& zero) {
  const __m512i v = _mm512_loadu_si512(szb + j * 32);
  scale = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  zero = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// The byte permutation below: output byte 4r + {0, 1, 2, 3} = {code of row r at k, 0x3F, at k + 1, 0x3F}.
struct Pairs {
  alignas(64) uint8_t idx[2][64];
  Pairs() {
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 16; ++r) {
        idx[h][4 * r] = static_cast<uint8_t>(16 * h + r);
        idx[h][4 * r + 1] = 64;
        idx[h][4 * r + 2] = static_cast<uint8_t>(32 + 16 * h + r);
        idx[h][4 * r + 3] = 64;
      }
  }
};
const Pairs kPairs;

// AVX-512 BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids), bf16 activations: the codes become bf16
// 0.5 + q / 32 (bits 0x3F00 | q << 3, exact) by one byte permutation that pairs inputs k and k + 1 of a row,
// and VDPBF16PS multiplies them by (x[k], x[k + 1]) with fp32 sums (products of bf16 are exact in fp32).
// Per group: A = Σ (0.5 + q/32) x, so Σ q x = 32 A - 16 Σx and y += s (32 A - 24 Σx) + z Σx.
// A is summed as two halves of the group added at the end, whatever the row count (so a row's result does not
// depend on its batch): with one or two rows the halves run interleaved, twice the independent sums in flight
// (one chain per accumulator bounds one row to ~13 GB/s of codes from L1 on Sapphire Rapids, two to ~26).

// acc[m][j] += codes of inputs kk, kk + 1 (64 rows at src) · x's pair kk / 2 for TM rows.
template <int TM>
AVX512_BF16 inline __attribute__((always_inline)) void pair_step(const uint8_t* src, const uint32_t* xp, int64_t half,
                                                                int64_t pair, __m512 (&acc)[TM][4]) {
  const __m512i idx0 = _mm512_load_si512(kPairs.idx[0]), idx1 = _mm512_load_si512(kPairs.idx[1]);
  const __m512i exponent = _mm512_set1_epi8(0x3F), mask = _mm512_set1_epi8(0x78);
  const __mmask64 even = 0x5555555555555555ULL;  // code bytes; the odd ones keep 0x3F
#if PREFETCH
  _mm_prefetch(reinterpret_cast<const char*>(src) + PREFETCH, PREFETCH_HINT);
#endif
  const __m512i v = _mm512_loadu_si512(src);  // inputs k and k + 1, 64 rows each
  const __m512i lo = _mm512_and_si512(_mm512_slli_epi16(v, 3), mask);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 1), mask);
  const __m512i w[4] = {_mm512_mask_permutexvar_epi8(exponent, even, idx0, lo),
                        _mm512_mask_permutexvar_epi8(exponent, even, idx1, lo),
                        _mm512_mask_permutexvar_epi8(exponent, even, idx0, hi),
                        _mm512_mask_permutexvar_epi8(exponent, even, idx1, hi)};
  for (int m = 0; m < TM; ++m) {
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m * half + pair]));
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)w[j], xv);
  }
}

template <int TM>
AVX512_BF16 void block_rows_bf16(const Problem& p, int64_t b, int64_t g, int64_t m0, float* out) {
  const int64_t k = p.k, n = p.n, group = p.group, groups = p.groups, half = p.k / 2, quarter = group / 4;
  const uint8_t* wb = p.w + b * k * 32;
  const uint32_t* xp = p.xpairs + m0 * half;
  const float* xs = p.xs + m0 * groups;
  __m512 first[TM][4], second[TM][4];  // the group's first and second half of input pairs
  for (int m = 0; m < TM; ++m)
    for (int j = 0; j < 4; ++j) first[m][j] = second[m][j] = _mm512_setzero_ps();
  const uint8_t* src = wb + g * group * 32;
  const int64_t pair = g * group / 2;
  if (TM <= 2) {
    for (int64_t i = 0; i < quarter; ++i) {
      pair_step<TM>(src + i * 64, xp, half, pair + i, first);
      pair_step<TM>(src + (quarter + i) * 64, xp, half, pair + quarter + i, second);
    }
  } else {  // TM × 4 sums already in flight; the first half waits in L1, not in registers the second needs
    alignas(64) float kept[TM][4][16];
    for (int64_t i = 0; i < quarter; ++i) pair_step<TM>(src + i * 64, xp, half, pair + i, first);
    for (int m = 0; m < TM; ++m)
      for (int j = 0; j < 4; ++j) _mm512_store_ps(kept[m][j], first[m][j]);
    for (int64_t i = quarter; i < 2 * quarter; ++i) pair_step<TM>(src + i * 64, xp, half, pair + i, second);
    for (int m = 0; m < TM; ++m)
      for (int j = 0; j < 4; ++j) first[m][j] = _mm512_load_ps(kept[m][j]);
  }
  const uint16_t* szb = unit_scales(p, g, b);
  for (int j = 0; j < 4; ++j) {
    __m512 scale, zero;
    scales16(szb, j, scale, zero);
    for (int m = 0; m < TM; ++m) {
      const float sx = xs[m * groups + g];
      float* o = out + m * 64 + j * 16;
      const __m512 sum = _mm512_add_ps(first[m][j], second[m][j]);
      const __m512 c = _mm512_fmsub_ps(sum, _mm512_set1_ps(32.0f), _mm512_set1_ps(24.0f * sx));
      const __m512 y = _mm512_fmadd_ps(scale, c, _mm512_loadu_ps(o));
      _mm512_storeu_ps(o, _mm512_fmadd_ps(zero, _mm512_set1_ps(sx), y));
    }
  }
}

#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vnni")))

// The byte permutation of the VNNI path: from the codes of inputs k, k + 1 (bytes 0-63) and k + 2, k + 3 (64-127)
// of a 64-row block, dword r = the byte of row r (low nibble) / r + 32 (high nibble) at k, k + 1, k + 2, k + 3.
struct Quads {
  alignas(64) uint8_t idx[2][64];
  Quads() {
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 16; ++r)
        for (int i = 0; i < 4; ++i) idx[h][4 * r + i] = static_cast<uint8_t>(32 * i + 16 * h + r);
  }
};
const Quads kQuads;

// 8-bit activations with AVX-512 VNNI (64-row blocks): the 8-bit path above with VPDPBUSD, which sums 4 products
// of unsigned codes and signed x bytes into each int32 lane (64 an instruction). One two-source byte permutation
// lays out 4 inputs of 16 rows per register; the int32 sums of a QBLOCK are exact, then scaled by d into fp32 in
// the same order as the AVX2 path, so both give the same result.
template <int TM>
AVX512_VNNI void block_rows_vnni(const Problem& p, int64_t b, int64_t g, float* out) {
  const int64_t k = p.k, group = p.group, groups = p.groups, nb = k / QBLOCK;
  const uint8_t* src = p.w + b * k * 32;
  const __m512i idx0 = _mm512_load_si512(kQuads.idx[0]), idx1 = _mm512_load_si512(kQuads.idx[1]);
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[TM][4];
  for (int m = 0; m < TM; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += QBLOCK) {
    __m512i s32[TM][4];
    for (int m = 0; m < TM; ++m)
      for (int j = 0; j < 4; ++j) s32[m][j] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t kk = k0; kk < k0 + QBLOCK; kk += 4) {
#if PREFETCH
      _mm_prefetch(reinterpret_cast<const char*>(src + kk * 32) + PREFETCH, PREFETCH_HINT);
      _mm_prefetch(reinterpret_cast<const char*>(src + kk * 32) + PREFETCH + 64, PREFETCH_HINT);
#endif
      const __m512i v0 = _mm512_loadu_si512(src + kk * 32), v1 = _mm512_loadu_si512(src + kk * 32 + 64);
      const __m512i a = _mm512_permutex2var_epi8(v0, idx0, v1), c = _mm512_permutex2var_epi8(v0, idx1, v1);
      const __m512i w[4] = {_mm512_and_si512(a, low4), _mm512_and_si512(c, low4),
                            _mm512_and_si512(_mm512_srli_epi16(a, 4), low4),
                            _mm512_and_si512(_mm512_srli_epi16(c, 4), low4)};
      for (int m = 0; m < TM; ++m) {
        int32_t quad;
        std::memcpy(&quad, p.xq + m * k + kk, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int j = 0; j < 4; ++j) s32[m][j] = _mm512_dpbusd_epi32(s32[m][j], w[j], xv);
      }
    }
    for (int m = 0; m < TM; ++m) {
      const __m512 d = _mm512_set1_ps(p.xd[m * nb + k0 / QBLOCK]);
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[m][j]), d, acc[m][j]);
    }
  }
  const uint16_t* szb = unit_scales(p, g, b);
  for (int j = 0; j < 4; ++j) {
    __m512 scale, zero;
    scales16(szb, j, scale, zero);
    for (int m = 0; m < TM; ++m) {
      const float sx = p.xs[m * groups + g];
      float* o = out + m * 64 + j * 16;
      const __m512 centred = _mm512_sub_ps(acc[m][j], _mm512_set1_ps(8.0f * sx));
      const __m512 y = _mm512_fmadd_ps(scale, centred, _mm512_loadu_ps(o));
      _mm512_storeu_ps(o, _mm512_fmadd_ps(zero, _mm512_set1_ps(sx), y));
    }
  }
}

// Three or more rows with AVX-512 VNNI (64-row blocks): the 8-bit path above, each row through the very same
// operations (so a row's result does not depend on how many rows share the call), in tiles of up to 8 rows: the
// unit's codes are laid out once as VPDPBUSD operands (16 rows × 4 inputs a register) in an L1 buffer, then each
// register is taken against every row's broadcast x quad — 8 independent sums in flight, and the layout's byte
// permutations done once per unit instead of once per row.
constexpr int64_t GROUP_TILE = 8;  // rows summed together
constexpr int64_t MAX_QUAD_GROUP = 128;  // largest group of the many-row 8-bit path (its code buffer: 8 KB)

template <int TM, int QUADS>
AVX512_VNNI void tile_i8(const Problem& p, const __m512i* codes, int64_t g, int64_t m0, int j, __m512 scale,
                         __m512 zero, float* out) {
  static_assert(QBLOCK == 16, "4 quads a block");
  const int64_t k = p.k, nb = k / QBLOCK;
  const int8_t* xq = p.xq + m0 * k + g * p.group;
  const float* xd = p.xd + m0 * nb + g * p.group / QBLOCK;
  __m512 acc[TM];
#pragma GCC unroll 8
  for (int m = 0; m < TM; ++m) acc[m] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int blk = 0; blk < QUADS / 4; ++blk) {
    __m512i sum[TM];
#pragma GCC unroll 8
    for (int m = 0; m < TM; ++m) sum[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = blk * 4; i < blk * 4 + 4; ++i) {
      const __m512i w = _mm512_load_si512(codes + i);
#pragma GCC unroll 8
      for (int m = 0; m < TM; ++m) {
        int32_t quad;
        std::memcpy(&quad, xq + m * k + 4 * i, 4);
        sum[m] = _mm512_dpbusd_epi32(sum[m], w, _mm512_set1_epi32(quad));
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < TM; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_set1_ps(xd[m * nb + blk]), acc[m]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < TM; ++m) {
    const float sx = p.xs[(m0 + m) * p.groups + g];
    float* o = out + (m0 + m) * 64 + j * 16;
    const __m512 centred = _mm512_sub_ps(acc[m], _mm512_set1_ps(8.0f * sx));
    const __m512 y = _mm512_fmadd_ps(scale, centred, _mm512_loadu_ps(o));
    _mm512_storeu_ps(o, _mm512_fmadd_ps(zero, _mm512_set1_ps(sx), y));
  }
}

// Tiles of up to GROUP_TILE rows over all of x's rows, for one 16-row register j of the unit's codes.
template <int QUADS>
AVX512_VNNI void tiles_i8(const Problem& p, const __m512i* codes, int64_t g, int j, __m512 scale, __m512 zero,
                          float* out) {
  for (int64_t m0 = 0; m0 < p.m;) {
    const int64_t tm = std::min<int64_t>(p.m - m0, GROUP_TILE);
    switch (tm) {
      case 1: tile_i8<1, QUADS>(p, codes, g, m0, j, scale, zero, out); break;
      case 2: tile_i8<2, QUADS>(p, codes, g, m0, j, scale, zero, out); break;
      case 3: tile_i8<3, QUADS>(p, codes, g, m0, j, scale, zero, out); break;
      case 4: tile_i8<4, QUADS>(p, codes, g, m0, j, scale, zero, out); break;
      case 5: tile_i8<5, QUADS>(p, codes, g, m0, j, scale, zero, out); break;
      case 6: tile_i8<6, QUADS>(p, codes, g, m0, j, scale, zero, out); break;
      case 7: tile_i8<7, QUADS>(p, codes, g, m0, j, scale, zero, out); break;
      default: tile_i8<8, QUADS>(p, codes, g, m0, j, scale, zero, out); break;
    }
    m0 += tm;
  }
}

AVX512_VNNI void unit_tiles_i8(const Problem& p, int64_t b, int64_t g, float* out) {
  const int64_t k = p.k, quads = p.group / 4;
  alignas(64) __m512i codes[4][MAX_QUAD_GROUP / 4];  // [16-row register j][quad]
  const uint8_t* src = p.w + b * k * 32 + g * p.group * 32;
  const __m512i idx0 = _mm512_load_si512(kQuads.idx[0]), idx1 = _mm512_load_si512(kQuads.idx[1]);
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t i = 0; i < quads; ++i) {
    const __m512i v0 = _mm512_loadu_si512(src + i * 128), v1 = _mm512_loadu_si512(src + i * 128 + 64);
    const __m512i a = _mm512_permutex2var_epi8(v0, idx0, v1), c = _mm512_permutex2var_epi8(v0, idx1, v1);
    codes[0][i] = _mm512_and_si512(a, low4);
    codes[1][i] = _mm512_and_si512(c, low4);
    codes[2][i] = _mm512_and_si512(_mm512_srli_epi16(a, 4), low4);
    codes[3][i] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
  }
  const uint16_t* szb = unit_scales(p, g, b);
  for (int j = 0; j < 4; ++j) {
    __m512 scale, zero;
    scales16(szb, j, scale, zero);
    if (p.group == 32) tiles_i8<8>(p, codes[j], g, j, scale, zero, out);
    else if (p.group == 64) tiles_i8<16>(p, codes[j], g, j, scale, zero, out);
    else tiles_i8<32>(p, codes[j], g, j, scale, zero, out);
  }
}

bool has_avx512_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return yes;
}

bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return yes;
}

// bf16 activations of one or two rows take the 8-bit path (VNNI with 64-row blocks where the CPU has it); more
// rows the ways below
bool eight_bit_activations(int64_t m) { return m <= 2; }

// bf16 activations of 3 or more rows take the 8-bit path too where the CPU has AVX-512 VNNI (64-row blocks), in
// tiles of rows (unit_tiles_i8)
// The groups the many-row 8-bit paths take (their buffers hold up to 128 inputs of a group)
inline bool many_row_group(int64_t group) { return group == 32 || group == 64 || group == 128; }

bool eight_bit_tiles(int64_t m, int64_t group, int64_t block) {
  return m >= 3 && block == 64 && many_row_group(group) && has_avx512_vnni();
}

// bf16 activations of 3 or more rows take the 8-bit path against panels with 32-row blocks (AVX2: panel_blocks_i8)
bool eight_bit_panels(int64_t m, int64_t group, int64_t block) {
  return m >= 3 && block == 32 && many_row_group(group);
}

// One unit (block b, group g) for every row of x, added into out[M][64].
void unit(const Problem& p, int64_t b, int64_t g, float* out) {
  if (p.tiles) {
    unit_tiles_i8(p, b, g, out);
    return;
  }
  if (p.xq != nullptr && p.block == 64 && has_avx512_vnni()) {  // 1.3x the bf16 dot products in cache
    if (p.m == 1) block_rows_vnni<1>(p, b, g, out);
    else block_rows_vnni<2>(p, b, g, out);
    return;
  }
  if (p.xq != nullptr) {
    if (p.block == 32 && p.m == 1) quad_rows_i8<1, 2>(p, b, g, out);
    else if (p.block == 32) quad_rows_i8<2, 1>(p, b, g, out);
    else if (p.m == 1) block_rows_i8<1>(p, b, g, out);
    else block_rows_i8<2>(p, b, g, out);
    return;
  }
  if (p.xpairs != nullptr && p.block == 64 && has_avx512_bf16()) {
    for (int64_t m0 = 0; m0 < p.m;) {
      const int64_t tm = std::min<int64_t>(p.m - m0, 4);
      float* o = out + m0 * 64;
      switch (tm) {
        case 1: block_rows_bf16<1>(p, b, g, m0, o); break;
        case 2: block_rows_bf16<2>(p, b, g, m0, o); break;
        case 3: block_rows_bf16<3>(p, b, g, m0, o); break;
        default: block_rows_bf16<4>(p, b, g, m0, o); break;
      }
      m0 += tm;
    }
    return;
  }
  for (int64_t m0 = 0; m0 < p.m;) {
    const int64_t left = p.m - m0;
    float* o = out + m0 * 64;
    switch (std::min<int64_t>(left, 6)) {
      case 1: block_rows<1, 4>(p, b, g, m0, o); break;
      case 2: block_rows<2, 2>(p, b, g, m0, o); break;
      case 3: block_rows<3, 1>(p, b, g, m0, o); break;
      case 4: block_rows<4, 1>(p, b, g, m0, o); break;
      case 5: block_rows<5, 1>(p, b, g, m0, o); break;
      default: block_rows<6, 1>(p, b, g, m0, o); break;
    }
    m0 += std::min<int64_t>(left, 6);
  }
}
#else
bool eight_bit_activations(int64_t) { return false; }
bool eight_bit_tiles(int64_t, int64_t, int64_t) { return false; }
bool eight_bit_panels(int64_t, int64_t, int64_t) { return false; }

void unit(const Problem& p, int64_t b, int64_t g, float* out) {
  const int64_t half = p.block / 2;
  for (int64_t j = 0; j < 64; ++j) {
    const int64_t row = b * 64 + j, blk = row / p.block, within = row % p.block;
    const float scale = bf16_to_float(unit_scales(p, g, b)[j * 2]);
    const float zero = bf16_to_float(unit_scales(p, g, b)[j * 2 + 1]);
    for (int64_t m = 0; m < p.m; ++m) {
      float acc = 0.0f;
      for (int64_t kk = g * p.group; kk < (g + 1) * p.group; ++kk) {
        const uint8_t byte = p.block == 32  // in quads
                                 ? p.w[(blk * p.k + kk / 4 * 4) * 16 + (within % 16) / 8 * 32 + within % 8 * 4 + kk % 4]
                                 : p.w[(blk * p.k + kk) * half + within % half];
        acc += static_cast<float>(within < half ? byte & 15 : byte >> 4) * p.x[m * p.k + kk];
      }
      const float sx = p.xs[m * p.groups + g];
      out[m * 64 + j] += scale * (acc - 8.0f * sx) + zero * sx;
    }
  }
}
#endif

template <typename T>
void store_block(const float* acc, T* y, int64_t m, int64_t n, int64_t b) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < 64; ++j) y[r * n + b * 64 + j] = static_cast<T>(acc[r * 64 + j]);
}

// A tensor's TensorImpl and StorageImpl asked for at once: the weights streamed since the previous call evicted
// them, and read one after another at each call's serial entry they cost ~1,000 cycles
inline void prefetch_meta(const at::Tensor& t) {
  const char* impl = reinterpret_cast<const char*>(t.unsafeGetTensorImpl());
  for (size_t l = 0; l < sizeof(c10::TensorImpl); l += 64) __builtin_prefetch(impl + l);
}

inline void prefetch_storage(const at::Tensor& t) {
  const char* impl = reinterpret_cast<const char*>(t.unsafeGetTensorImpl()->storage().unsafeGetStorageImpl());
  for (size_t l = 0; l < sizeof(c10::StorageImpl); l += 64) __builtin_prefetch(impl + l);
}

}  // namespace

// static: a variant built beside the engine's op (bench/gemv_variants.py) keeps its own, not the first one loaded
static at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales_zeros, int64_t group,
                int64_t block) {
  prefetch_meta(weight);
  prefetch_meta(scales_zeros);
  prefetch_storage(weight);
  prefetch_storage(scales_zeros);
  TORCH_CHECK(x.dim() == 2 && (x.dtype() == at::kBFloat16 || x.dtype() == at::kFloat), "x: bf16 or fp32 [M, K]");
  TORCH_CHECK(weight.dtype() == at::kByte && weight.is_contiguous(), "weight: contiguous uint8 [N, K / 2]");
  const bool unit_order = scales_zeros.dim() == 4;
  TORCH_CHECK(scales_zeros.dtype() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  (scales_zeros.dim() == 3 || (unit_order && scales_zeros.size(2) == 64)),
              "scales_zeros: contiguous bf16 [K / group, N, 2] or [N / 64, K / group, 64, 2]");
  const int64_t groups = scales_zeros.size(unit_order ? 1 : 0);
  const int64_t n = unit_order ? scales_zeros.size(0) * 64 : scales_zeros.size(1);
  const int64_t k = groups * group, m = x.size(0);
  TORCH_CHECK(block == 32 || block == 64, "block: 32 or 64 rows");
  TORCH_CHECK(block == 64 || unit_order, "32-row blocks: the GEMV's layout, scales in unit order and codes in quads "
              "(linear_int4.gemv_layout)");
  TORCH_CHECK(n % 64 == 0 && weight.size(0) == n && weight.size(1) * 2 == k && x.size(1) == k,
              "shapes do not match");
  at::Tensor y = at::detail::empty_cpu({m, n}, x.scalar_type(), false, std::nullopt);  // not through the dispatcher
  if (m == 0) return y;
  const int64_t blocks = n / 64, units = blocks * groups;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  // parts: each thread's share cut in RANGES where the weight is large enough to gain from it (the shape and
  // the thread count choose, never the rows, so a row's sums do not depend on its batch)
  const int64_t ranges =
      n * k / 2 >= RANGES_FROM ? std::min<int64_t>(RANGES, std::max<int64_t>(1, blocks / threads)) : 1;
  const int64_t parts = threads * ranges;
  // one area, kept by the calling thread between calls (a decode step makes ~120: no heap traffic): x in fp32,
  // its group sums, the 8-bit x's scales and block sums, a block's sum, each part's block of outputs and the
  // partial sums of the (at most two) blocks it shares with a neighbour
  thread_local std::vector<float> area;
  thread_local std::vector<int8_t> xq_area;
  thread_local std::vector<int64_t> edge_area;
  const int64_t nq = m * k / QBLOCK;
  area.resize(std::max<size_t>(area.size(), m * k + m * groups + 2 * nq + m * 64 + parts * 3 * m * 64 + 16));
  float* xf = area.data();
  float* xs = xf + m * k;
  float* xd = xs + m * groups;
  float* block_sum = xd + nq;
  float* sum = block_sum + nq;
  // the parts' sums start on a cache line, so no line holds two threads' (written every unit: a line shared
  // across threads moved between cores once a unit, ~0.3 us when the two vCPUs sit on different CCDs)
  float* edges = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sum + m * 64) + 63) & ~uintptr_t{63});
  const at::Tensor xc = x.contiguous();
  const bool bf16 = x.dtype() == at::kBFloat16;
  const bool tiles = bf16 && eight_bit_tiles(m, group, block);
  const bool panels = bf16 && eight_bit_panels(m, group, block);
  const bool eight_bit = bf16 && (eight_bit_activations(m) || tiles || panels);
  int8_t* xq = nullptr;
  if (eight_bit) {  // quantized per QBLOCK inputs straight from bf16 (this path never reads x in fp32); xs: the
    TORCH_CHECK(group <= 128, "the 8-bit path takes groups of up to 128 inputs");  // quantized x's group sums
    xq_area.resize(std::max<size_t>(xq_area.size(), m * k));
    xq = xq_area.data();
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    const int64_t per_group = group / QBLOCK;
    at::parallel_for(0, m * groups, 2048 / per_group, [&](int64_t i0, int64_t i1) {  // a prefill's x: ~1 ms a call
      for (int64_t i = i0 * per_group; i < i1 * per_group; ++i) {
        float wide[QBLOCK];
        widen_block(xb + i * QBLOCK, wide);
        const float amax = abs_max(wide, QBLOCK);
        const int32_t codes = quantize(wide, QBLOCK, amax, xq + i * QBLOCK);
        xd[i] = amax / 127.0f;
        block_sum[i] = xd[i] * static_cast<float>(codes);
      }
      for (int64_t i = i0; i < i1; ++i) {
        float total = 0.0f;
        for (int64_t j = 0; j < per_group; ++j) total += block_sum[i * per_group + j];
        xs[i] = total;
      }
    });
  } else {
    if (bf16) {
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
      for (int64_t i = 0; i < m * k; ++i) xf[i] = bf16_to_float(xb[i]);
    } else {
      std::memcpy(xf, xc.data_ptr<float>(), m * k * sizeof(float));
    }
    for (int64_t i = 0; i < m * groups; ++i) {
      float total = 0.0f;
      for (int64_t j = 0; j < group; ++j) total += xf[i * group + j];
      xs[i] = total;
    }
  }
  const Problem p{weight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>()),
                  xf, xs, m, k, n, groups, group, block,
                  bf16 ? reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>()) : nullptr,
                  xq, eight_bit ? xd : nullptr, unit_order, tiles};
#ifdef __AVX2__
  if (panels) {  // whole blocks per thread: none of the parts' bookkeeping below
    const int64_t blocks32 = n / 32, per = (blocks32 + threads - 1) / threads;
    at::BFloat16* yb = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, blocks32, per, [&](int64_t b0, int64_t b1) { panel_blocks_i8(p, b0, b1, yb); });
    return y;
  }
#endif
  edge_area.assign(parts * 2, -1);
  int64_t* edge_block = edge_area.data();
  at::BFloat16* yb = bf16 ? y.data_ptr<at::BFloat16>() : nullptr;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  // A part's walk: its units u0 .. u1 - 1 in memory order; u, the next, as (block b, group g), and the unit whose
  // scales are prefetched (SCALES_AHEAD on) as (ab, ag): counted on, not divided out, each unit.
  struct Cursor {
    int64_t u0, u1, u, b, g, ab, ag;
  };
  auto start = [&](int64_t q) {
    const int64_t u0 = units * q / parts, ua = u0 + SCALES_AHEAD;
    return Cursor{u0, units * (q + 1) / parts, u0, u0 / groups, u0 % groups, ua / groups, ua % groups};
  };
  // the next unit of part q; its block stored (or its share kept) when done
  auto step = [&](int64_t q, Cursor& c) {
    float* acc = edges + (parts * 2 + q) * m * 64;
    const int64_t u = c.u, b = c.b, g = c.g;
    if (u == c.u0 || g == 0) std::fill(acc, acc + m * 64, 0.0f);
    if (u + SCALES_AHEAD < c.u1) {  // in torch's order a unit's scales lie n * 4 bytes from the previous group's
      const char* z = reinterpret_cast<const char*>(unit_scales(p, c.ag, c.ab));
      for (int l = 0; l < 256; l += 64) __builtin_prefetch(z + l, 0, 3);
    }
    if (++c.ag == groups) c.ag = 0, ++c.ab;
    if (++c.g == groups) c.g = 0, ++c.b;
    ++c.u;
    unit(p, b, g, acc);
    if (g < groups - 1 && u < c.u1 - 1) return;
    if (b * groups >= c.u0 && g == groups - 1) {  // the whole block is this part's
      if (bf16) store_block(acc, yb, m, n, b);
      else store_block(acc, yf, m, n, b);
    } else {  // shared with a neighbour: slot 0 where this part starts inside the block, 1 where it ends
      const int64_t e = q * 2 + (b * groups >= c.u0);
      edge_block[e] = b;
      std::copy(acc, acc + m * 64, edges + e * m * 64);
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {  // the thread's parts walked together, one unit of each in turn
      Cursor cursor[RANGES];
      for (int64_t r = 0; r < ranges; ++r) cursor[r] = start(t * ranges + r);
      for (bool more = true; more;) {
        more = false;
        for (int64_t r = 0; r < ranges; ++r)
          if (cursor[r].u < cursor[r].u1) step(t * ranges + r, cursor[r]), more = true;
      }
    }
  });
  for (int64_t e = 0; e < parts * 2; ++e) {  // each shared block: add every part, in order
    const int64_t b = edge_block[e];
    if (b < 0 || std::find(edge_block, edge_block + e, b) != edge_block + e) continue;
    std::fill(sum, sum + m * 64, 0.0f);
    for (int64_t f = e; f < parts * 2; ++f)
      if (edge_block[f] == b)
        for (int64_t i = 0; i < m * 64; ++i) sum[i] += edges[f * m * 64 + i];
    if (bf16) store_block(sum, yb, m, n, b);
    else store_block(sum, yf, m, n, b);
  }
  return y;
}

// The op as a C function the compiled decode step calls directly (inductor's `custom_ops_to_c_shims`; its name is
// inductor's for op `gemv` on CPU), not through the dispatcher's boxed call (engine/compiled_decode.py).
extern "C" AOTITorchError aoti_torch_cpu_gemv(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scales_zeros,
                                              int64_t group, int64_t block, AtenTensorHandle* out) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = torch::aot_inductor::new_tensor_handle(gemv(*tensor_handle_to_tensor_pointer(x),
                                                       *tensor_handle_to_tensor_pointer(weight),
                                                       *tensor_handle_to_tensor_pointer(scales_zeros), group, block));
  });
}

TORCH_LIBRARY_FRAGMENT(tokenhaul_int4, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor scales_zeros, int group, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenhaul_int4, CPU, m) { m.impl("gemv", &gemv); }
