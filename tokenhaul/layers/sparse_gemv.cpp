// Gathered GEMV for activation sparsity (tokenhaul/layers/linear_sparse.py): y[m] = Σ_{|x[m,i]| ≥ t} x[m,i]·W[i,:]
// over a weight stored by input channel, in one call: the kept inputs are found here and only their rows are
// read. The weight is stored in column parts, [P, K, w columns]: a part's slices of every input row lie
// together, so the kept rows of a part are read nearly in memory order (with one [K, N] matrix a part's
// slices lay a whole row apart: short scattered reads). Threads take parts (no partial sums to add up); the
// fp32 accumulator of a part (<= TILE columns) stays in L1, four kept rows per pass over it, the slices a few
// rows ahead prefetched.
// Storage: "int8" [P, K, w] uint8 codes + [K, 2] fp32 (scale, offset) per input channel; "bf16" [P, K, w];
// "int4" [P, K, w / 2] codes (per 16 columns 8 bytes: byte b = q[b] | q[b + 8] << 4) + [K / G, 2, N] bf16
// (scale, zero) per (group of G input channels, column), Int4Linear's own: a skipped channel's codes are never
// read (a group's scales are, when any of its channels is kept). kept[0] += kept channels, kept[1] += groups read.
// int8 with bf16 inputs on AVX-512 VNNI hosts: x · scale as 15-bit integers (one scale per input row, as the dense
// int8 GEMV quantizes its inputs), four kept rows' codes interleaved per 32-bit lane, int32 sums (vpdpbusd): the
// float pass was bound by its conversions (~13 GB/s a core from L2); fp32 inputs keep the exact float sums.
// int4 with bf16 inputs on AVX2 hosts without AVX-512: x as int8 per group of inputs (as the dense int4 GEMV's 8-bit
// path), four kept rows' codes interleaved per 32-bit lane, int16 sums (vpmaddubsw): the float pass spent 7 ops per
// 16 products on widening nibbles (with the branch-free search for kept inputs, SmolLM2's and Qwen2.5-0.5B's linears
// from DRAM 1.29x / 1.26x: bench/RESULTS.md "Sparse int4 on AVX2").
// int4 with bf16 inputs on AVX-512 VNNI hosts: the same 8-bit x, int32 sums (vpdpbusd) 128 columns a step (the float
// pass was bound by widening nibbles; SmolLM2's linears 1.11x from DRAM, 1.21x from L3: bench/RESULTS.md "Sparse int4
// on AVX-512 VNNI").
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

enum Kind { BF16 = 0, INT8 = 1, INT4 = 2 };
constexpr int64_t TILE = 1024;  // most output columns per part (fp32 accumulator: 4 KB)
// kept rows whose slices are prefetched ahead, into L2 (all 121 SmolLM2 projections, 2 threads, int8 / bf16
// dense ÷ gathered time: into L1 8 ahead 1.24 / 1.46, into L2 8 ahead 1.49 / 1.90, 16 ahead 1.56 / 1.93)
constexpr int64_t AHEAD = 16;
// int8 quads walked side by side per thread, set per CPU vendor by tokenhaul/native.py (SmolLM2 / Qwen layers, 0.4,
// from DRAM, Intel: 1 run 13.2 / 15.1 GB/s, 2 runs 13.7 / 15.8, 4 runs 14.1 / 16.2; Zen 4: 4 runs 12.9 / 15.6,
// 2 runs 12.8 / 16.6; the dense int8 GEMV reads 21-28)
#ifndef STREAMS
#define STREAMS 4
#endif
#ifndef INT4_VNNI  // int4 with bf16 x on AVX-512 hosts (bench/gemv_variants.py -D): 1 tile_int4_vnni (with VNNI),
#define INT4_VNNI 1  // 0 the float pass, 2 tile_int4_bytes (to compare the two integer paths, which agree to the bit)
#endif
#ifndef SCALES_AHEAD_GROUPS
#define SCALES_AHEAD_GROUPS 1  // int4: the scales of the read group this many groups on are prefetched
#endif

inline float bf16_to_float(uint16_t h) { return c10::BFloat16(h, c10::BFloat16::from_bits()); }  // torch's own

// one input row's kept channels: index, weight (x, times the channel's scale for int8), and for int8
// Σ x·offset; for int4 the kept channels' boundaries per group and Σ x per group
struct Kept {
  std::vector<int32_t> idx;
  std::vector<float> w;
  std::vector<int32_t> group_end;  // int4: kept entries [group_end[g-1], group_end[g]) are in group g
  std::vector<float> group_sum;
  float offset_sum = 0.f;
  // int8 on hosts with AVX-512 VNNI: w as 15-bit integers (w ≈ (128 · hi + lo) · qscale), four kept entries'
  // bytes per quad (one 32-bit word), idx padded to a multiple of four (padding: the last kept row again, weight 0)
  std::vector<uint8_t> hi, lo;
  float qscale = 1.f;
  // int4 with bf16 inputs on AVX2 hosts without AVX-512: each group's kept x as int8, x ≈ xq · group_scale[g]
  // (round-to-even of x · 127 / max |x|, as the dense int4 GEMV's 8-bit path), group_codes[g] = Σ xq
  std::vector<int8_t> xq;
  std::vector<float> group_scale;
  std::vector<int32_t> group_codes;
  void clear() {  // empty, capacity kept
    idx.clear(); w.clear(); group_end.clear(); group_sum.clear(); hi.clear(); lo.clear(); xq.clear();
    group_scale.clear(); group_codes.clear();
    offset_sum = 0.f;
    qscale = 1.f;
  }
};

// the kept channels' index and x (in idx, w), in order
template <typename T>
void kept_of(const T* x, int64_t K, float t, Kept& k) {
  k.idx.reserve(K);
  k.w.reserve(K);
  for (int64_t i = 0; i < K; ++i) {
    float v;
    if constexpr (std::is_same_v<T, float>) v = x[i]; else v = bf16_to_float(x[i]);
    if (!(std::fabs(v) >= t)) continue;
    k.idx.push_back(static_cast<int32_t>(i));
    k.w.push_back(v);
  }
}

#ifdef __AVX2__
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
const bool kWide = [] {  // set at load: read the CPU model first (libgcc's constructor may not have run yet)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}();

// the same for bf16 x, 16 channels a step (AVX-512: a compare and two compresses instead of a branch per channel)
AVX512 void kept_of_wide(const uint16_t* x, int64_t K, float t, Kept& k) {
  k.idx.resize(K + 16);
  k.w.resize(K + 16);
  int32_t* idx = k.idx.data();
  float* w = k.w.data();
  const __m512 tv = _mm512_set1_ps(t);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t j = 0;
  for (int64_t i = 0; i < K; i += 16) {
    const __mmask16 in = K - i >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (K - i)) - 1);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, x + i)), 16));
    const __mmask16 m = _mm512_mask_cmp_ps_mask(in, _mm512_abs_ps(v), tv, _CMP_GE_OQ);
    _mm512_storeu_si512(idx + j, _mm512_maskz_compress_epi32(m, at));
    _mm512_storeu_ps(w + j, _mm512_maskz_compress_ps(m, v));
    j += __builtin_popcount(m);
    at = _mm512_add_epi32(at, step);
  }
  k.idx.resize(j);
  k.w.resize(j);
}

// the same with AVX2, 8 channels a step: a compare, and the kept lanes moved to the front by a permutation looked up
// by the compare's mask (no branch per channel: at 40-60 % kept one in two mispredicted)
const auto kFront = [] {  // per 8-bit mask, the permutation that puts its set lanes first, in order
  std::array<std::array<int32_t, 8>, 256> lut{};
  for (int m = 0; m < 256; ++m) {
    int j = 0;
    for (int b = 0; b < 8; ++b)
      if (m >> b & 1) lut[m][j++] = b;
  }
  return lut;
}();

void kept_of_avx2(const uint16_t* x, int64_t K, float t, Kept& k) {
  k.idx.resize(K + 8);
  k.w.resize(K + 8);
  int32_t* idx = k.idx.data();
  float* w = k.w.data();
  const __m256 tv = _mm256_set1_ps(t), sign = _mm256_set1_ps(-0.f);
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t i = 0, j = 0;
  for (; i + 8 <= K; i += 8) {
    const __m256 v = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))), 16));
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v), tv, _CMP_GE_OQ));
    const __m256i order = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kFront[m].data()));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + j), _mm256_permutevar8x32_epi32(at, order));
    _mm256_storeu_ps(w + j, _mm256_permutevar8x32_ps(v, order));
    j += __builtin_popcount(m);
    at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
  }
  for (; i < K; ++i) {
    const float v = bf16_to_float(x[i]);
    if (!(std::fabs(v) >= t)) continue;
    idx[j] = static_cast<int32_t>(i);
    w[j++] = v;
  }
  k.idx.resize(j);
  k.w.resize(j);
}
#endif

// one input row's Kept: the kept channels, then int8: w = x · scale and Σ x · offset; int4: each group's end and Σ x
template <typename T>
void find_kept(const T* x, int64_t K, float t, Kind kind, const float* so, int64_t G, Kept& k) {
#ifdef __AVX2__
  if constexpr (!std::is_same_v<T, float>)
    if (kWide) kept_of_wide(x, K, t, k); else kept_of_avx2(x, K, t, k);
  else kept_of(x, K, t, k);
#else
  kept_of(x, K, t, k);
#endif
  const int64_t n = static_cast<int64_t>(k.idx.size());
  if (kind == INT8) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = k.idx[j];
      k.offset_sum += k.w[j] * so[2 * i + 1];
      k.w[j] *= so[2 * i];
    }
  } else if (kind == INT4) {  // group_end[g] = number of kept channels below (g + 1) * G
    k.group_end.resize(K / G);
    k.group_sum.resize(K / G);
    int64_t j = 0;
    for (int64_t g = 0; g < K / G; ++g) {
      float sum = 0.f;
      for (; j < n && k.idx[j] < (g + 1) * G; ++j) sum += k.w[j];
      k.group_sum[g] = sum;
      k.group_end[g] = static_cast<int32_t>(j);
    }
  }
}

inline void prefetch(const uint8_t* p, int64_t bytes) {
#ifdef __AVX2__
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + b), _MM_HINT_T1);
#endif
}

#ifdef __AVX2__
template <Kind K>
inline __m256 load8(const uint8_t* p) {  // 8 columns of one row, p at the first column's bytes
  if constexpr (K == INT8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// int4: 16 columns of one row from its 8 bytes
inline void load16_int4(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
#endif

inline float scalar_at(const uint8_t* row, int64_t c, Kind kind) {
  if (kind == INT8) return static_cast<float>(row[c]);
  if (kind == BF16) return bf16_to_float(reinterpret_cast<const uint16_t*>(row)[c]);
  const uint8_t b = row[(c / 16) * 8 + (c % 8)];
  return static_cast<float>((c % 16) < 8 ? (b & 15) : (b >> 4));
}

// acc[0, n) += Σ_r w[r] · rows[r][0, n) for R rows at once (one load and store of acc per R rows)
template <Kind K, int R>
inline void pass(const uint8_t* const* r, const float* w, int64_t n, float* acc) {
  int64_t c = 0;
#ifdef __AVX2__
  __m256 wv[R];
  for (int q = 0; q < R; ++q) wv[q] = _mm256_set1_ps(w[q]);
  if constexpr (K == INT4) {
    for (; c + 16 <= n; c += 16) {
      __m256 lo, hi, sl, sh;
      load16_int4(r[0] + c / 2, sl, sh);
      sl = _mm256_mul_ps(wv[0], sl);
      sh = _mm256_mul_ps(wv[0], sh);
      for (int q = 1; q < R; ++q) {
        load16_int4(r[q] + c / 2, lo, hi);
        sl = _mm256_fmadd_ps(wv[q], lo, sl);
        sh = _mm256_fmadd_ps(wv[q], hi, sh);
      }
      _mm256_storeu_ps(acc + c, _mm256_add_ps(_mm256_loadu_ps(acc + c), sl));
      _mm256_storeu_ps(acc + c + 8, _mm256_add_ps(_mm256_loadu_ps(acc + c + 8), sh));
    }
  } else {
    constexpr int64_t num = K == BF16 ? 2 : 1;
    for (; c + 8 <= n; c += 8) {
      __m256 s = _mm256_mul_ps(wv[0], load8<K>(r[0] + c * num));
      if constexpr (R >= 2) {
        __m256 t = _mm256_mul_ps(wv[1], load8<K>(r[1] + c * num));
        for (int q = 2; q < R; q += 2) {
          s = _mm256_fmadd_ps(wv[q], load8<K>(r[q] + c * num), s);
          if (q + 1 < R) t = _mm256_fmadd_ps(wv[q + 1], load8<K>(r[q + 1] + c * num), t);
        }
        s = _mm256_add_ps(s, t);
      }
      _mm256_storeu_ps(acc + c, _mm256_add_ps(_mm256_loadu_ps(acc + c), s));
    }
  }
#endif
  for (; c < n; ++c)
    for (int q = 0; q < R; ++q) acc[c] += w[q] * scalar_at(r[q], c, K);
}

#ifdef __AVX2__
// The same sums 16 lanes wide (hosts with AVX-512: Zen 4 and 5, Sapphire Rapids): int4's unpacking bound the AVX2
// pass (+18-35 % on Zen 5); int8 rows gain ~5 % (bound by how the rows are read: bench/RESULTS.md "Sparsity on an
// AMD EPYC Zen 5 host"). Each column's products are added in the same order as there: the same fp32 sums.
template <Kind K>
AVX512 inline __m512 load16(const uint8_t* p) {  // 16 columns of one int8 or bf16 row
  if constexpr (K == INT8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// int4: 32 columns from 16 bytes; lanes of lo = columns 0-7 and 16-23, of hi = 8-15 and 24-31
AVX512 inline void load32_int4(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

template <Kind K, int R>
AVX512 void pass512(const uint8_t* const* r, const float* w, int64_t n, float* acc) {
  __m512 wv[R];
  for (int q = 0; q < R; ++q) wv[q] = _mm512_set1_ps(w[q]);
  int64_t c = 0;
  if constexpr (K == INT4) {
    for (; c + 32 <= n; c += 32) {
      __m512 lo, hi, sl, sh;
      load32_int4(r[0] + c / 2, sl, sh);
      sl = _mm512_mul_ps(wv[0], sl);
      sh = _mm512_mul_ps(wv[0], sh);
      for (int q = 1; q < R; ++q) {
        load32_int4(r[q] + c / 2, lo, hi);
        sl = _mm512_fmadd_ps(wv[q], lo, sl);
        sh = _mm512_fmadd_ps(wv[q], hi, sh);
      }
      _mm512_storeu_ps(acc + c, _mm512_add_ps(_mm512_loadu_ps(acc + c), _mm512_shuffle_f32x4(sl, sh, 0x44)));
      _mm512_storeu_ps(acc + c + 16,
                       _mm512_add_ps(_mm512_loadu_ps(acc + c + 16), _mm512_shuffle_f32x4(sl, sh, 0xEE)));
    }
  } else {
    constexpr int64_t num = K == BF16 ? 2 : 1;
    for (; c + 16 <= n; c += 16) {
      __m512 s = _mm512_mul_ps(wv[0], load16<K>(r[0] + c * num));
      if constexpr (R >= 2) {
        __m512 t = _mm512_mul_ps(wv[1], load16<K>(r[1] + c * num));
        for (int q = 2; q < R; q += 2) {
          s = _mm512_fmadd_ps(wv[q], load16<K>(r[q] + c * num), s);
          if (q + 1 < R) t = _mm512_fmadd_ps(wv[q + 1], load16<K>(r[q + 1] + c * num), t);
        }
        s = _mm512_add_ps(s, t);
      }
      _mm512_storeu_ps(acc + c, _mm512_add_ps(_mm512_loadu_ps(acc + c), s));
    }
  }
  if (c < n) {  // the last columns (int4: 16 of them) as the AVX2 pass sums them
    constexpr int64_t num = K == BF16 ? 2 : 1, den = K == INT4 ? 2 : 1;
    const uint8_t* rest[R];
    for (int q = 0; q < R; ++q) rest[q] = r[q] + c * num / den;
    pass<K, R>(rest, w, n - c, acc + c);
  }
}
#endif

template <Kind K, int R>
inline void pass_best(const uint8_t* const* r, const float* w, int64_t n, float* acc) {
#ifdef __AVX2__
  if (kWide) return pass512<K, R>(r, w, n, acc);
#endif
  pass<K, R>(r, w, n, acc);
}

#ifdef __AVX2__
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
const bool kVnni = kWide && __builtin_cpu_supports("avx512vnni");  // kWide read the CPU model first

// quantize_kept's vector steps (AVX-512), 16 at a time up to the last whole 16 (each returns how many it did): the
// most |w| (into `most`); and w · inv rounded, split into (q >> 7, q & 127) bytes
VNNI int64_t max16(const float* w, int64_t n, float& most) {
  __m512 m = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(w + j)));
  most = _mm512_reduce_max_ps(m);
  return j;
}
VNNI int64_t split16(const float* w, float inv, int64_t n, uint8_t* hi, uint8_t* lo) {
  const __m512 iv = _mm512_set1_ps(inv);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w + j), iv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + j), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 7)));
    const __m512i low7 = _mm512_and_si512(q, _mm512_set1_epi32(127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + j), _mm512_cvtepi32_epi8(low7));
  }
  return j;
}

// Kept::hi / lo / qscale from w (see there); the int32 sums cannot overflow below 2^16 kept rows (a lane grows by
// < 4 · 255 · 128 per quad)
void quantize_kept(Kept& k) {
  if (k.idx.empty()) return;
  while (k.idx.size() % 4) {
    k.idx.push_back(k.idx.back());
    k.w.push_back(0.f);
  }
  const int64_t n = static_cast<int64_t>(k.w.size());
  const float* w = k.w.data();
  k.hi.resize(n);
  k.lo.resize(n);
  uint8_t* hi = k.hi.data();
  uint8_t* lo = k.lo.data();
  float most = 0.f;  // on VNNI hosts 16 at a time: the same max, the same rounding (the current mode, as nearbyint)
  int64_t j = kVnni ? max16(w, n, most) : 0;
  for (; j < n; ++j) most = std::max(most, std::fabs(w[j]));
  k.qscale = most > 0.f ? most / 16383.f : 1.f;
  const float inv = 1.f / k.qscale;
  j = kVnni ? split16(w, inv, n, hi, lo) : 0;
  for (; j < n; ++j) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(w[j] * inv));  // |q| <= 16383
    hi[j] = static_cast<uint8_t>(q >> 7);  // floor(q / 128), as a signed byte
    lo[j] = static_cast<uint8_t>(q & 127);
  }
}

inline uint32_t quad(const uint8_t* bytes, int64_t u) {  // the four bytes of quad u as one word
  uint32_t v;
  std::memcpy(&v, bytes + 4 * u, 4);
  return v;
}

// 64 bytes at `at` of four rows (p[0..3], masked by m) interleaved: word i of 128-bit lane L of Q[q] holds byte
// 16 L + 4 q + i of each row, (p[0], p[1], p[2], p[3])
VNNI inline void interleave4(const uint8_t* const* p, int64_t at, __mmask64 m, __m512i* Q) {
  const __m512i a0 = _mm512_maskz_loadu_epi8(m, p[0] + at), a1 = _mm512_maskz_loadu_epi8(m, p[1] + at);
  const __m512i a2 = _mm512_maskz_loadu_epi8(m, p[2] + at), a3 = _mm512_maskz_loadu_epi8(m, p[3] + at);
  const __m512i al = _mm512_unpacklo_epi8(a0, a1), ah = _mm512_unpackhi_epi8(a0, a1);
  const __m512i bl = _mm512_unpacklo_epi8(a2, a3), bh = _mm512_unpackhi_epi8(a2, a3);
  Q[0] = _mm512_unpacklo_epi16(al, bl);
  Q[1] = _mm512_unpackhi_epi16(al, bl);
  Q[2] = _mm512_unpacklo_epi16(ah, bh);
  Q[3] = _mm512_unpackhi_epi16(ah, bh);
}

// hi/lo [blocks of 64 columns: 4 × 16 lanes] += Σ over `quads` quads of 4 rows: codes · (hi or lo bytes). Per 64
// columns the 4 rows' bytes are interleaved into words (r0[c], r1[c], r2[c], r3[c]) with unpacks inside 128-bit
// lanes: word i of lane L of the q-th register is column 16 L + 4 q + i (stored so, put in order at the end)
VNNI void quads_int8(const uint8_t* const* r, const uint8_t* xh, const uint8_t* xl, int64_t quads, int64_t n,
                     int32_t* hi, int32_t* lo) {
  for (int64_t c = 0; c < n; c += 64) {
    const __mmask64 m = n - c >= 64 ? ~__mmask64(0) : (__mmask64(1) << (n - c)) - 1;
    __m512i H[4], L[4];
    for (int q = 0; q < 4; ++q) {
      H[q] = _mm512_load_si512(hi + c + 16 * q);
      L[q] = _mm512_load_si512(lo + c + 16 * q);
    }
    for (int64_t u = 0; u < quads; ++u) {
      __m512i Q[4];
      interleave4(r + 4 * u, c, m, Q);
      const __m512i vh = _mm512_set1_epi32(static_cast<int32_t>(quad(xh, u)));
      const __m512i vl = _mm512_set1_epi32(static_cast<int32_t>(quad(xl, u)));
      for (int q = 0; q < 4; ++q) {
        H[q] = _mm512_dpbusd_epi32(H[q], Q[q], vh);
        L[q] = _mm512_dpbusd_epi32(L[q], Q[q], vl);
      }
    }
    for (int q = 0; q < 4; ++q) {
      _mm512_store_si512(hi + c + 16 * q, H[q]);
      _mm512_store_si512(lo + c + 16 * q, L[q]);
    }
  }
}

// out[0, n) = qscale · (128 · hi + lo), columns put back in order (a 4 × 4 transpose of 128-bit lanes per block)
VNNI void finish_int8(const int32_t* hi, const int32_t* lo, float qscale, int64_t n, float* out) {
  const __m512 s128 = _mm512_set1_ps(128.f * qscale), s1 = _mm512_set1_ps(qscale);
  for (int64_t c = 0; c < n; c += 64) {
    __m512 v[4];
    for (int q = 0; q < 4; ++q)
      v[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(hi + c + 16 * q)), s128,
                             _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(lo + c + 16 * q)), s1));
    const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
    const __m512 t2 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
    alignas(64) float block[64];
    _mm512_store_ps(block, _mm512_shuffle_f32x4(t0, t1, 0x88));
    _mm512_store_ps(block + 16, _mm512_shuffle_f32x4(t0, t1, 0xDD));
    _mm512_store_ps(block + 32, _mm512_shuffle_f32x4(t2, t3, 0x88));
    _mm512_store_ps(block + 48, _mm512_shuffle_f32x4(t2, t3, 0xDD));
    std::memcpy(out + c, block, sizeof(float) * std::min<int64_t>(64, n - c));
  }
}

// tile<INT8> with integer sums: the quads cut into STREAMS runs, a pass takes the next quad of each (several
// streams of rows in flight per thread; integer sums, so the order does not change a bit)
void tile_int8_vnni(const uint8_t* W, int64_t row_bytes, const Kept& k, int64_t n, float* out) {
  const int64_t quads = static_cast<int64_t>(k.idx.size()) / 4, padded = (n + 63) / 64 * 64;
  auto row = [&](int64_t j) { return W + static_cast<int64_t>(k.idx[j]) * row_bytes; };
  alignas(64) int32_t hi[TILE], lo[TILE];
  std::fill(hi, hi + padded, 0);
  std::fill(lo, lo + padded, 0);
  const int64_t per = (quads + STREAMS - 1) / STREAMS;  // quads per run (the last may be shorter)
  for (int64_t s = 0; s < STREAMS; ++s)
    for (int64_t j = 4 * s * per; j < std::min(4 * quads, 4 * s * per + AHEAD); ++j) prefetch(row(j), n);
  const uint8_t* r[4 * STREAMS];
  alignas(4) uint8_t xh[4 * STREAMS], xl[4 * STREAMS];
  for (int64_t i = 0; i < per; ++i) {
    int64_t count = 0;
    for (int64_t s = 0; s < STREAMS; ++s) {
      const int64_t u = s * per + i;
      if (u >= std::min(quads, (s + 1) * per)) continue;
      for (int64_t a = 4 * u + AHEAD; a < std::min(4 * std::min(quads, (s + 1) * per), 4 * u + 4 + AHEAD); ++a)
        prefetch(row(a), n);
      for (int q = 0; q < 4; ++q) r[4 * count + q] = row(4 * u + q);
      std::memcpy(xh + 4 * count, k.hi.data() + 4 * u, 4);
      std::memcpy(xl + 4 * count, k.lo.data() + 4 * u, 4);
      ++count;
    }
    quads_int8(r, xh, xl, count, n, hi, lo);
  }
  finish_int8(hi, lo, k.qscale, n, out);
}
#endif

#ifdef __AVX2__
// Kept::xq / group_scale / group_codes from w and group_end (see there)
void quantize_kept_int4(Kept& k) {
  const size_t groups = k.group_end.size();
  k.xq.resize(k.idx.size());
  k.group_scale.assign(groups, 0.f);
  k.group_codes.assign(groups, 0);
  int32_t j0 = 0;
  for (size_t g = 0; g < groups; ++g) {
    const int32_t j1 = k.group_end[g];
    float most = 0.f;
    for (int32_t j = j0; j < j1; ++j) most = std::max(most, std::fabs(k.w[j]));
    const float inv = most > 0.f ? 127.f / most : 0.f;
    int32_t sum = 0;
    for (int32_t j = j0; j < j1; ++j) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(k.w[j] * inv));
      k.xq[j] = static_cast<int8_t>(q);
      sum += q;
    }
    k.group_scale[g] = most / 127.f;
    k.group_codes[g] = sum;
    j0 = j1;
  }
}

// 64 columns of one int4 row (32 bytes, per 16 columns 8 bytes) with its 4-byte units reordered 0 2 4 6 1 3 5 7:
// after the byte interleaving in quads_int4, lanes then come out in column order
template <bool TAIL>
inline __m256i codes64(const uint8_t* p, __m256i tail) {
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i v = TAIL ? _mm256_maskload_epi32(reinterpret_cast<const int*>(p), tail)
                         : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_permutevar8x32_epi32(v, order);
}

// s[0, 8) (int16 sums) += the codes of `quads` quads of rows (r[4 u .. 4 u + 3]) at byte b times their x bytes
// (xw[u]: the 4 rows' int8 x): the quad's bytes interleaved per column into words (r0, r1, r2, r3), nibbles split,
// VPMADDUBSW. s[2 i] holds columns 16 i .. 16 i + 7, s[2 i + 1] columns 16 i + 8 .. 16 i + 15, each lane
// (r0 · x0 + r1 · x1, r2 · x2 + r3 · x3): at most 8 quads (8 · 2 · 15 · 127 = 30480 fits int16)
template <bool TAIL>
inline void quads_int4(const uint8_t* const* r, const int32_t* xw, int64_t quads, int64_t b, __m256i tail,
                       __m256i* s) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int64_t u = 0; u < quads; ++u) {
    const uint8_t* const* p = r + 4 * u;
    const __m256i a = codes64<TAIL>(p[0] + b, tail), c = codes64<TAIL>(p[1] + b, tail);
    const __m256i d = codes64<TAIL>(p[2] + b, tail), e = codes64<TAIL>(p[3] + b, tail);
    const __m256i ac0 = _mm256_unpacklo_epi8(a, c), ac1 = _mm256_unpackhi_epi8(a, c);
    const __m256i de0 = _mm256_unpacklo_epi8(d, e), de1 = _mm256_unpackhi_epi8(d, e);
    const __m256i w[4] = {_mm256_unpacklo_epi16(ac0, de0), _mm256_unpackhi_epi16(ac0, de0),
                          _mm256_unpacklo_epi16(ac1, de1), _mm256_unpackhi_epi16(ac1, de1)};
    const __m256i xv = _mm256_set1_epi32(xw[u]);
    for (int i = 0; i < 4; ++i) {
      s[2 * i] = _mm256_add_epi16(s[2 * i], _mm256_maddubs_epi16(_mm256_and_si256(w[i], low), xv));
      s[2 * i + 1] = _mm256_add_epi16(
          s[2 * i + 1], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w[i], 4), low), xv));
    }
  }
}

// The 8-bit int4 paths' walk over a tile's read groups (those with a kept channel; groups of up to 128 inputs).
// next() moves to the next one: g, its kept rows padded to whole quads with its last row at x = 0 (r; xw: each
// quad's four int8 x), [n0, n1): the next read group's kept entries, whose rows (row(j)) the caller prefetches as it
// goes. The next read group's scales are prefetched here, and before the first group its rows.
struct ReadGroups {
  const uint8_t* W;
  int64_t row_bytes;
  const uint16_t* scales;
  int64_t N, n;
  const Kept& k;
  int64_t groups = static_cast<int64_t>(k.group_end.size()), g = -1, after = next_read(-1), quads = 0, n0 = 0, n1 = 0;
  const uint8_t* r[128];
  int32_t xw[32];

  const uint8_t* row(int64_t j) const { return W + static_cast<int64_t>(k.idx[j]) * row_bytes; }
  int64_t start(int64_t at) const { return at ? k.group_end[at - 1] : 0; }
  int64_t next_read(int64_t at) const {  // the first group after `at` with a kept channel (groups if none)
    for (++at; at < groups && k.group_end[at] == start(at); ++at) {}
    return at;
  }
  bool next() {
    if (g < 0 && after < groups)
      for (int64_t j = start(after); j < k.group_end[after]; ++j) prefetch(row(j), n / 2);
    g = after;
    if (g >= groups) return false;
    const int64_t j0 = start(g), j1 = k.group_end[g];
    quads = (j1 - j0 + 3) / 4;
    after = next_read(g);
    std::fill(xw, xw + quads, 0);
    for (int64_t e = 0; e < 4 * quads; ++e) {
      const int64_t j = std::min(j0 + e, j1 - 1);
      r[e] = row(j);
      if (j0 + e < j1) reinterpret_cast<int8_t*>(xw)[e] = k.xq[j];
    }
    n0 = n1 = 0;
    if (after < groups) {
      prefetch(reinterpret_cast<const uint8_t*>(scales + after * 2 * N), 2 * n);
      prefetch(reinterpret_cast<const uint8_t*>(scales + (after * 2 + 1) * N), 2 * n);
      n0 = start(after);
      n1 = k.group_end[after];
    }
    return true;
  }
};

// tile<INT4> with 8-bit x: per read group and 64 columns, the kept rows' codes summed as bytes against the group's
// int8 x (quads_int4; a last partial quad padded with its last row at x = 0), then out[c] += scale[g, c] · d ·
// (Σ q xq - 8 Σ xq) + zero[g, c] · d · Σ xq. While a group is summed the next read group's rows are prefetched, a
// line of each per 128 columns; integer sums, so the order of rows does not change a bit
void tile_int4_bytes(const uint8_t* W, int64_t row_bytes, const uint16_t* scales, int64_t N, const Kept& k,
                     int64_t n, float* out) {
  std::fill(out, out + n, 0.f);
  alignas(32) int32_t sums[64];
  const __m256i ones = _mm256_set1_epi16(1);
  for (ReadGroups w{W, row_bytes, scales, N, n, k}; w.next();) {
    const int64_t g = w.g, quads = w.quads, n0 = w.n0, n1 = w.n1;
    const uint16_t* s = scales + g * 2 * N;  // this group's scales, then its zeros
    const uint16_t* o = s + N;
    const float d = k.group_scale[g];
    const __m256 dv = _mm256_set1_ps(d), xs = _mm256_set1_ps(d * static_cast<float>(k.group_codes[g]));
    const __m256i x8 = _mm256_set1_epi32(8 * k.group_codes[g]);
    for (int64_t c = 0; c < n; c += 64) {
      // per 128 columns a line of each of the next read group's rows; at the first also the line of each slice's last
      // byte (slices are not line-aligned)
      if (c % 128 == 0)
        for (int64_t j = n0; j < n1; ++j) prefetch(w.row(j) + c / 2, 1);
      if (c == 0)
        for (int64_t j = n0; j < n1; ++j) prefetch(w.row(j) + n / 2 - 1, 1);
      const int64_t m = std::min<int64_t>(64, n - c);  // a multiple of 16
      const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(m / 2)),
                                              _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
      for (int64_t u0 = 0; u0 < quads; u0 += 8) {
        __m256i acc[8];
        for (auto& a : acc) a = _mm256_setzero_si256();
        const int64_t count = std::min<int64_t>(8, quads - u0);
        if (m == 64) quads_int4<false>(w.r + 4 * u0, w.xw + u0, count, c / 2, tail, acc);
        else quads_int4<true>(w.r + 4 * u0, w.xw + u0, count, c / 2, tail, acc);
        for (int i = 0; i < 8; ++i) {
          const __m256i v = _mm256_madd_epi16(acc[i], ones);
          __m256i* at = reinterpret_cast<__m256i*>(sums + 8 * i);
          _mm256_store_si256(at, u0 ? _mm256_add_epi32(_mm256_load_si256(at), v) : v);
        }
      }
      for (int64_t i = 0; i < m; i += 8) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_load_si256(
            reinterpret_cast<const __m256i*>(sums + i)), x8));
        const __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(load8<BF16>(reinterpret_cast<const uint8_t*>(s + c + i)), dv),
                                         q, _mm256_loadu_ps(out + c + i));
        _mm256_storeu_ps(out + c + i,
                         _mm256_fmadd_ps(load8<BF16>(reinterpret_cast<const uint8_t*>(o + c + i)), xs, t));
      }
    }
  }
}

// tile<INT4> with 8-bit x on AVX-512 VNNI hosts: as tile_int4_bytes, 128 columns a step and int32 sums (vpdpbusd),
// one pass over all of a group's quads. A row's 64 bytes unpacked with the quad's other rows inside 128-bit lanes:
// word i of lane L of Q[k] is byte 16 L + 4 k + i of each row, whose low nibbles are column 32 L + 16 (k / 2) +
// 4 (k % 2) + i and high nibbles that + 8; a 4 × 4 transpose of 128-bit lanes puts the sums in column order.
// Integer sums and the same float steps as tile_int4_bytes: the same outputs to the bit.
VNNI inline void lanes_in_order(const __m512i* v, __m512i* out) {  // out[L] = lane L of v[0], v[1], v[2], v[3]
  const __m512i t0 = _mm512_shuffle_i32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_i32x4(v[2], v[3], 0x44);
  const __m512i t2 = _mm512_shuffle_i32x4(v[0], v[1], 0xEE), t3 = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
  out[0] = _mm512_shuffle_i32x4(t0, t1, 0x88);
  out[1] = _mm512_shuffle_i32x4(t0, t1, 0xDD);
  out[2] = _mm512_shuffle_i32x4(t2, t3, 0x88);
  out[3] = _mm512_shuffle_i32x4(t2, t3, 0xDD);
}

VNNI void tile_int4_vnni(const uint8_t* W, int64_t row_bytes, const uint16_t* scales, int64_t N, const Kept& k,
                         int64_t n, float* out) {
  std::fill(out, out + n, 0.f);
  const __m512i low = _mm512_set1_epi8(15);
  for (ReadGroups w{W, row_bytes, scales, N, n, k}; w.next();) {
    const int64_t g = w.g, quads = w.quads, n0 = w.n0, n1 = w.n1;
    const uint16_t* s = scales + g * 2 * N;  // this group's scales, then its zeros
    const uint16_t* o = s + N;
    const __m512 dv = _mm512_set1_ps(k.group_scale[g]);
    const __m512 xs = _mm512_set1_ps(k.group_scale[g] * static_cast<float>(k.group_codes[g]));
    const __m512i x8 = _mm512_set1_epi32(8 * k.group_codes[g]);
    for (int64_t c = 0; c < n; c += 128) {
      for (int64_t j = n0; j < n1; ++j) prefetch(w.row(j) + c / 2, 1);  // a line of each of the next group's rows
      if (c == 0)  // and the line of each slice's last byte (slices are not line-aligned)
        for (int64_t j = n0; j < n1; ++j) prefetch(w.row(j) + n / 2 - 1, 1);
      const int64_t m = std::min<int64_t>(128, n - c);  // a multiple of 16
      const __mmask64 bytes = m == 128 ? ~__mmask64(0) : (__mmask64(1) << (m / 2)) - 1;
      __m512i acc[8];  // acc[2 k + h]: Q[k]'s low (h = 0) or high (h = 1) nibbles
      for (auto& a : acc) a = _mm512_setzero_si512();
      for (int64_t u = 0; u < quads; ++u) {
        __m512i Q[4];
        interleave4(w.r + 4 * u, c / 2, bytes, Q);
        const __m512i xv = _mm512_set1_epi32(w.xw[u]);
        for (int q = 0; q < 4; ++q) {
          acc[2 * q] = _mm512_dpbusd_epi32(acc[2 * q], _mm512_and_si512(Q[q], low), xv);
          acc[2 * q + 1] = _mm512_dpbusd_epi32(acc[2 * q + 1], _mm512_and_si512(_mm512_srli_epi16(Q[q], 4), low), xv);
        }
      }
      __m512i sums[8];  // sums[j]: columns c + 16 j .. c + 16 j + 15
      for (int e = 0; e < 2; ++e) {  // columns 32 L + 16 e + 4 m + i: quarter m from acc (2 (2 e + m % 2) + m / 2)
        const __m512i v[4] = {acc[4 * e], acc[4 * e + 2], acc[4 * e + 1], acc[4 * e + 3]};
        __m512i t[4];
        lanes_in_order(v, t);
        for (int L = 0; L < 4; ++L) sums[2 * L + e] = t[L];
      }
      for (int64_t j = 0; j < m / 16; ++j) {
        const int64_t at = c + 16 * j;
        const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[j], x8));
        const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + at))), 16));
        const __m512 ze = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + at))), 16));
        const __m512 t = _mm512_fmadd_ps(_mm512_mul_ps(sc, dv), q, _mm512_loadu_ps(out + at));
        _mm512_storeu_ps(out + at, _mm512_fmadd_ps(ze, xs, t));
      }
    }
  }
}
#endif

// acc[0, n) += Σ_j w[j] · row_j[0, n) over kept entries [j0, j1) of a part (its rows `row_bytes` apart), four
// rows per pass; the slices of the kept rows AHEAD entries on (up to the last kept row, across int4 groups) are
// prefetched
template <Kind K>
void rows_into(const uint8_t* base, int64_t row_bytes, const Kept& k, int64_t j0, int64_t j1, int64_t n,
               float* acc) {
  constexpr int64_t num = K == BF16 ? 2 : 1, den = K == INT4 ? 2 : 1;  // bytes per column = num / den
  const int64_t slice = n * num / den, last = static_cast<int64_t>(k.idx.size());
  auto row = [&](int64_t j) { return base + static_cast<int64_t>(k.idx[j]) * row_bytes; };
  if (j0 == 0 || K != INT4)
    for (int64_t j = 0; j < std::min(last, AHEAD); ++j) prefetch(row(j), slice);
  const uint8_t* r[8];
  int64_t j = j0;
  if constexpr (K == INT4) {  // twice the arithmetic per byte: eight rows per pass over the accumulator
    for (; j + 8 <= j1; j += 8) {
      for (int64_t a = j + AHEAD; a < std::min(last, j + AHEAD + 8); ++a) prefetch(row(a), slice);
      for (int q = 0; q < 8; ++q) r[q] = row(j + q);
      pass_best<K, 8>(r, k.w.data() + j, n, acc);
    }
  }
  for (; j + 4 <= j1; j += 4) {
    for (int64_t a = j + AHEAD; a < std::min(last, j + AHEAD + 4); ++a) prefetch(row(a), slice);
    for (int q = 0; q < 4; ++q) r[q] = row(j + q);
    pass_best<K, 4>(r, k.w.data() + j, n, acc);
  }
  for (int64_t a = j + AHEAD; a < std::min(last, j1 + AHEAD); ++a) prefetch(row(a), slice);
  for (int q = 0; q < j1 - j; ++q) r[q] = row(j + q);
  if (j1 - j == 3) pass_best<K, 3>(r, k.w.data() + j, n, acc);
  if (j1 - j == 2) pass_best<K, 2>(r, k.w.data() + j, n, acc);
  if (j1 - j == 1) pass_best<K, 1>(r, k.w.data() + j, n, acc);
}

// columns [c0, c0 + n) of one output row (n <= TILE), read from their part W (rows `row_bytes` apart)
template <Kind K>
void tile(const uint8_t* W, int64_t row_bytes, const void* sz, int64_t N, const Kept& k, int64_t c0, int64_t n,
          float* out) {
#ifdef __AVX2__
  if constexpr (K == INT8)
    if (kVnni && k.hi.size() == k.idx.size()) return tile_int8_vnni(W, row_bytes, k, n, out);  // quantized
  if constexpr (K == INT4)
    if (!k.group_scale.empty()) {  // 8-bit x
      const uint16_t* scales = static_cast<const uint16_t*>(sz) + c0;
      if (kWide && INT4_VNNI == 1) return tile_int4_vnni(W, row_bytes, scales, N, k, n, out);
      return tile_int4_bytes(W, row_bytes, scales, N, k, n, out);
    }
#endif
  std::fill(out, out + n, 0.f);
  if constexpr (K != INT4) {
    rows_into<K>(W, row_bytes, k, 0, static_cast<int64_t>(k.idx.size()), n, out);
  } else {
    // value = (q - 8) · scale + zero (Int4Linear's): y[c] = Σ_g scale[g, c] · (Σ_{i in g} x_i q_i[c] - 8 Σ_{i in g}
    // x_i) + zero[g, c] · Σ_{i in g} x_i
    alignas(64) float part[TILE];
    int32_t j0 = 0;
    const uint16_t* scales = static_cast<const uint16_t*>(sz) + c0;  // bf16 [K / G, 2, N] from column c0
    for (size_t g = 0; g < k.group_end.size(); ++g) {
      const int32_t j1 = k.group_end[g];
      if (j1 == j0) continue;
#if SCALES_AHEAD_GROUPS
      for (size_t a = g + SCALES_AHEAD_GROUPS; a < k.group_end.size(); ++a)  // the next read group's scales
        if (k.group_end[a] > k.group_end[a - 1]) {
          prefetch(reinterpret_cast<const uint8_t*>(scales + a * 2 * N), 2 * n);
          prefetch(reinterpret_cast<const uint8_t*>(scales + (a * 2 + 1) * N), 2 * n);
          break;
        }
#endif
      std::fill(part, part + n, 0.f);
      rows_into<K>(W, row_bytes, k, j0, j1, n, part);
      const uint16_t* s = scales + static_cast<int64_t>(g) * 2 * N;  // this group's scales, then its zeros
      const uint16_t* o = s + N;
      const float xs = k.group_sum[g];
      int64_t c = 0;
#ifdef __AVX2__
      const __m256 xv = _mm256_set1_ps(xs), x8 = _mm256_set1_ps(8 * xs);
      for (; c + 8 <= n; c += 8) {
        const __m256 q = _mm256_sub_ps(_mm256_loadu_ps(part + c), x8);
        const __m256 t = _mm256_fmadd_ps(load8<BF16>(reinterpret_cast<const uint8_t*>(s + c)), q,
                                         _mm256_loadu_ps(out + c));
        _mm256_storeu_ps(out + c,
                         _mm256_fmadd_ps(load8<BF16>(reinterpret_cast<const uint8_t*>(o + c)), xv, t));
      }
#endif
      for (; c < n; ++c) out[c] += bf16_to_float(s[c]) * (part[c] - 8 * xs) + bf16_to_float(o[c]) * xs;
      j0 = j1;
    }
  }
}

// out[0, n) = acc + add + bias (fp32, or rounded to bf16 as torch rounds)
template <typename T>
void store(const float* acc, float add, const float* bias, int64_t n, T* out) {
  int64_t c = 0;
#ifdef __AVX2__
  if constexpr (!std::is_same_v<T, float>) {  // torch's rounding (to nearest even, NaN quiet), 8 at a time
    const __m256 a = _mm256_set1_ps(add);
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF), nan = _mm256_set1_epi32(0x7FC00000);
    for (; c + 8 <= n; c += 8) {
      const __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(acc + c), a),
                                     bias ? _mm256_loadu_ps(bias + c) : _mm256_setzero_ps());
      const __m256i b = _mm256_castps_si256(v);
      __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b, 16), one)));
      r = _mm256_srli_epi32(_mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))), 16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c),
                       _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
  }
#endif
  for (; c < n; ++c) {
    const float v = acc[c] + add + (bias ? bias[c] : 0.f);
    if constexpr (std::is_same_v<T, float>) out[c] = v; else out[c] = c10::BFloat16(v);
  }
}

// parts [P][K][row_bytes] of `width` columns each (the last may be partly padding); Y [M, N] fp32 or bf16
template <Kind K, typename T>
void run(const std::vector<Kept>& kept, const uint8_t* W, int64_t parts, int64_t K_in, int64_t row_bytes,
         int64_t width, const void* sz, int64_t N, const float* bias, T* Y) {
  const int64_t M = static_cast<int64_t>(kept.size());
  at::parallel_for(0, M * parts, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[TILE];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / parts, p = task % parts, c0 = p * width, n = std::min(width, N - c0);
      if (n <= 0) continue;
      tile<K>(W + p * K_in * row_bytes, row_bytes, sz, N, kept[m], c0, n, acc);
      store(acc, kept[m].offset_sum, bias ? bias + c0 : nullptr, n, Y + m * N + c0);
    }
  });
}

}  // namespace

// x [M, K] fp32 or bf16 (contiguous); rows [P, K, ...] and scales as above (int8 [K, 2] fp32, int4 [K / G, 2, N]
// bf16, bf16 none: the scales name the storage); kept [2] int64 gets the kept channels (and int4 groups read) of
// all M rows added. Returns y [M, N] in x's dtype (bias added when given).
// static: a variant built beside the engine's op (bench/gemv_variants.py) keeps its own, not the first one loaded
static at::Tensor sparse_gemv(const at::Tensor& x, double threshold, const at::Tensor& rows,
                       const c10::optional<at::Tensor>& scales, int64_t out_features, int64_t group,
                       const c10::optional<at::Tensor>& bias, at::Tensor kept_count) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && (x.dtype() == at::kFloat || x.dtype() == at::kBFloat16),
              "x: contiguous fp32 or bf16 [M, K]");
  TORCH_CHECK(rows.is_contiguous() && rows.dim() == 3 && rows.size(1) == x.size(1), "rows: contiguous [P, K, ...]");
  TORCH_CHECK(kept_count.dtype() == at::kLong && kept_count.numel() == 2 && kept_count.is_contiguous(),
              "kept: int64 [2]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const Kind kind = !scales.has_value() ? BF16 : (scales->dtype() == at::kFloat ? INT8 : INT4);
  const int64_t parts = rows.size(0), width = kind == INT4 ? 2 * rows.size(2) : rows.size(2);
  TORCH_CHECK(rows.dtype() == (kind == BF16 ? at::kBFloat16 : at::kByte) && width % 16 == 0 &&
                  parts * width >= N && (parts - 1) * width < N,
              "rows: [P, K, w] bf16 or uint8, or [P, K, w / 2] uint8 (int4), w % 16 == 0, P parts covering N");
  TORCH_CHECK(kind != INT4 || (N % 16 == 0 && group > 0 && K % group == 0), "int4: N % 16 == 0, K % group == 0");
  const void* sz = nullptr;
  if (kind == INT8) {
    TORCH_CHECK(scales.has_value() && scales->dtype() == at::kFloat && scales->is_contiguous() &&
                    scales->numel() == 2 * K, "int8 scales: fp32 [K, 2]");
    sz = scales->data_ptr();
  } else if (kind == INT4) {
    TORCH_CHECK(scales.has_value() && scales->dtype() == at::kBFloat16 && scales->is_contiguous() &&
                    scales->numel() == 2 * (K / group) * N, "int4 scales: bf16 [K / group, 2, N]");
    sz = scales->data_ptr();
  }
  const float* so = kind == INT8 ? static_cast<const float*>(sz) : nullptr;
  thread_local std::vector<Kept> kept;  // the calling thread's (capacity kept between calls: no allocation per call)
  kept.resize(M);
  for (auto& k : kept) k.clear();
  int64_t total = 0, groups = 0;
  for (int64_t m = 0; m < M; ++m) {
    if (x.dtype() == at::kFloat)
      find_kept(x.data_ptr<float>() + m * K, K, static_cast<float>(threshold), kind, so, group, kept[m]);
    else
      find_kept(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * K, K,
                static_cast<float>(threshold), kind, so, group, kept[m]);
    total += static_cast<int64_t>(kept[m].idx.size());
    for (size_t g = 0; g < kept[m].group_end.size(); ++g)
      groups += kept[m].group_end[g] > (g ? kept[m].group_end[g - 1] : 0);
  }
#ifdef __AVX2__
  if (kind == INT8 && kVnni && K < 65536 && x.dtype() == at::kBFloat16)  // fp32 inputs: the exact float sums
    for (auto& k : kept) quantize_kept(k);
  // (groups of up to 128 inputs; on AVX-512 hosts only with VNNI: tile_int4_vnni; else the float pass)
  if (kind == INT4 && group <= 128 && (!kWide || (INT4_VNNI == 1 && kVnni) || INT4_VNNI == 2) &&
      x.dtype() == at::kBFloat16)  // fp32 inputs: the exact float sums
    for (auto& k : kept) quantize_kept_int4(k);
#endif
  int64_t* counts = kept_count.data_ptr<int64_t>();
  counts[0] += total;
  counts[1] += groups;
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "bias: [N]");
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const uint8_t* W = static_cast<const uint8_t*>(rows.data_ptr());
  const int64_t row_bytes = rows.size(2) * rows.element_size();
  auto all = [&](auto* Y) {
    if (kind == INT8) run<INT8>(kept, W, parts, K, row_bytes, width, sz, N, bp, Y);
    else if (kind == BF16) run<BF16>(kept, W, parts, K, row_bytes, width, sz, N, bp, Y);
    else run<INT4>(kept, W, parts, K, row_bytes, width, sz, N, bp, Y);
  };
  if (x.dtype() == at::kFloat) all(y.data_ptr<float>());
  else all(y.data_ptr<at::BFloat16>());
  return y;
}

// The op as a C function, for a compiled graph to call without the dispatcher (tokenhaul/native.py c_shims)
extern "C" AOTITorchError aoti_torch_cpu_sparse_gemv(AtenTensorHandle x, double threshold, AtenTensorHandle rows,
                                                     AtenTensorHandle* scales, int64_t out_features, int64_t group,
                                                     AtenTensorHandle* bias, AtenTensorHandle kept,
                                                     AtenTensorHandle* out) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  auto optional = [](AtenTensorHandle* h) {
    return h ? c10::optional<at::Tensor>(*tensor_handle_to_tensor_pointer(*h)) : c10::optional<at::Tensor>();
  };
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = torch::aot_inductor::new_tensor_handle(sparse_gemv(
        *tensor_handle_to_tensor_pointer(x), threshold, *tensor_handle_to_tensor_pointer(rows), optional(scales),
        out_features, group, optional(bias), *tensor_handle_to_tensor_pointer(kept)));
  });
}

TORCH_LIBRARY(tokenhaul_sparse, m) {
  m.def("sparse_gemv(Tensor x, float threshold, Tensor rows, Tensor? scales, int out_features, int group, "
        "Tensor? bias, Tensor(a!) kept) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenhaul_sparse, CPU, m) { m.impl("sparse_gemv", &sparse_gemv); }
