// Decode attention straight from a paged KV cache, int8 or bf16 (tokenhaul/kv/decode_attention.py builds this).
//
// One query group per (sequence, KV head): the G query heads sharing a KV head read each key once, through the
// block table, in place. Each 16-key block is converted to fp32 in an L1 buffer on the way in, every KV head at
// once (a token's row of all heads is contiguous: one head's rows alone were two lines of every six); int8 blocks'
// per-token scales are applied to the score (K) or the softmax weight (V), so no full-precision copy of the cache
// is ever written. With AVX-512 VNNI, int8 K is not converted: the queries are rounded to int8 and the scores are
// integer dot products (scores_int8). A sequence's keys are split into chunks across threads (a softmax per chunk
// and head, merged at the end), so a single sequence still uses every thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#ifdef __AVX2__

// exp of 8 floats (Cephes polynomial, as avx_mathfun's exp256_ps): relative error ~2e-7.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// The sums of 8 vectors, one per lane.
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// int8 row → fp32
static inline void to_float(const int8_t* src, float* dst, int64_t D) {
  int64_t d = 0;
#ifdef __AVX2__
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(dst + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)))));
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

// bf16 row (raw bits) → fp32: the bits moved to the high half
static inline void to_float(const uint16_t* src, float* dst, int64_t D) {
  int64_t d = 0;
#ifdef __AVX2__
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                                  _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))),
                                  16)));
#endif
  for (; d < D; ++d) dst[d] = c10::BFloat16(src[d], c10::BFloat16::from_bits());
}

// s[t] = q · kf[t] for n keys (kf: n rows of D floats, ld apart)
static inline void dots(const float* q, const float* kf, int64_t n, int64_t D, int64_t ld, float* s) {
  int64_t t = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; t + 8 <= n; t += 8) {
      const float* k = kf + t * ld;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + ld + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * ld + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * ld + d), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * ld + d), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * ld + d), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * ld + d), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * ld + d), a7);
      }
      _mm256_storeu_ps(s + t, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
    }
  }
#endif
  for (; t < n; ++t) {
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kf[t * ld + d];
    s[t] = dot;
  }
}

// acc += Σ_t w[t] · vf[t] (vf: n rows of D floats, ld apart)
static inline void axpys(const float* w, const float* vf, int64_t n, int64_t D, int64_t ld, float* acc) {
  int64_t d0 = 0;
#ifdef __AVX2__
  for (; d0 + 64 <= D; d0 += 64) {  // 8 accumulators held in registers across the keys
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 wv = _mm256_set1_ps(w[t]);
      const float* v = vf + t * ld + d0;
      for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + 8 * i), a[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
  }
#endif
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = d0; d < D; ++d) acc[d] += w[t] * vf[t * ld + d];
}

// s[t] = s[t] · f[t] + add[t] (add: 0 for a visible key, -inf for a masked one); returns max_t s[t]
static inline float scale_mask_max(float* s, const float* f, const float* add, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#ifdef __AVX2__
  __m256 mv = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) {
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(s + t), _mm256_loadu_ps(f + t)),
                                   _mm256_loadu_ps(add + t));
    _mm256_storeu_ps(s + t, v);
    mv = _mm256_max_ps(mv, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float v : lanes) m = std::max(m, v);
#endif
  for (; t < n; ++t) {
    s[t] = s[t] * f[t] + add[t];
    m = std::max(m, s[t]);
  }
  return m;
}

// s[t] · keep[t] (1 visible, 0 masked: a masked key weighs exactly nothing, whatever exp8's clamp gave): returns
// their sum; then s[t] · vs[t] where vs is given (int8 V's per-token scales)
static inline float keep_sum_scale(float* s, const float* keep, const float* vs, int64_t n) {
  float total = 0.f;
  int64_t t = 0;
#ifdef __AVX2__
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + t), _mm256_loadu_ps(keep + t));
    acc = _mm256_add_ps(acc, v);
    if (vs) v = _mm256_mul_ps(v, _mm256_loadu_ps(vs + t));
    _mm256_storeu_ps(s + t, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) total += v;
#endif
  for (; t < n; ++t) {
    s[t] *= keep[t];
    total += s[t];
    if (vs) s[t] *= vs[t];
  }
  return total;
}

// dst[t] = src[t * H] · factor for n keys: one head's scales out of a block's [key, head] ones
static inline void by_head(const float* src, int64_t H, int64_t n, float factor, float* dst) {
  int64_t t = 0;
#ifdef __AVX2__
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(H));
  for (; t + 8 <= n; t += 8)
    _mm256_storeu_ps(dst + t, _mm256_mul_ps(_mm256_i32gather_ps(src + t * H, idx, 4), _mm256_set1_ps(factor)));
#endif
  for (; t < n; ++t) dst[t] = src[t * H] * factor;
}

static inline void exps(float* s, int64_t n, float m) {
  int64_t t = 0;
#ifdef __AVX2__
  for (; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m))));
#endif
  for (; t < n; ++t) s[t] = std::exp(s[t] - m);
}

// Chunks a sequence's keys are cut in: its visible blocks (from its own mask row, so never from the batch it is in)
// split into at most MAX_CHUNKS chunks of at least `min_blocks` blocks each. A lone short sequence then still
// gives every thread work of about equal size (SmolLM2's 3 KV heads were 3 tasks on 2 threads: one thread did
// two thirds of the work); its partial softmaxes merge in the same order whatever the batch.
constexpr int64_t MAX_CHUNKS = 16;

struct Chunks {
  int64_t first, size, count;  // first visible block, blocks per chunk, chunks
};

inline Chunks chunks_of(const bool* mrow, int64_t nb, int64_t bs, int64_t min_blocks) {
  int64_t first = 0, last = nb - 1;
  if (mrow) {
    auto visible = [&](int64_t j) {
      return std::any_of(mrow + j * bs, mrow + (j + 1) * bs, [](bool x) { return x; });
    };
    while (first < nb && !visible(first)) ++first;
    while (last >= first && !visible(last)) --last;
  }
  const int64_t blocks = last - first + 1;
  if (blocks <= 0) return {0, 1, 0};
  const int64_t size = std::max(min_blocks, (blocks + MAX_CHUNKS - 1) / MAX_CHUNKS);
  return {first, size, (blocks + size - 1) / size};
}

// int8 K with AVX-512 VNNI: the scores of 16 keys by integer dot products, llama.cpp's way for quantized KV. Each
// query row is rounded to int8 (per row: q ≈ qscale · q8, qscale = max|q| / 127) before the call; a block's 16 keys
// of one head are turned so that one 512-bit register holds the same 4 dimensions of all 16 keys, so
// `vpdpbusd` adds 4 products a key into 16 keys' sums at once (no sum across lanes). K is made unsigned (k + 128)
// and the query's 128 · Σ q8 taken off again.
#if defined(__x86_64__)
bool int8_queries(int64_t block_size, int64_t head_dim) {
  static const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vnni");
  return vnni && block_size == 16 && head_dim % 64 == 0;
}

#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

// S[g * ldS + t] = (Σ_d q8[g][d] · k[t][d]) · qscale[g] for the 16 keys t at k (`row` bytes apart, D of them each)
// and G query rows; kp: D * 16 bytes of scratch
AVX512_VNNI static void scores_int8(const int8_t* k, int64_t row, int64_t D, const int8_t* q8, const int32_t* qsum,
                                    const float* qscale, int64_t G, float* S, int64_t ldS, int32_t* kp) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t s = 0; s < D / 64; ++s) {  // 64 dimensions: 16 keys x 16 groups of 4 bytes, turned
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_xor_si512(_mm512_loadu_si512(k + i * row + s * 64), flip);
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    int32_t* out = kp + s * 256;  // group c of 4 bytes (dimensions 4c .. 4c + 3) of every key: 16 dwords at 16 c
    for (int j = 0; j < 4; ++j) {
      const __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
      const __m512i c = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
      const __m512i d = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
      _mm512_storeu_si512(out + 16 * j, _mm512_shuffle_i32x4(a, c, 0x88));
      _mm512_storeu_si512(out + 16 * (4 + j), _mm512_shuffle_i32x4(b, d, 0x88));
      _mm512_storeu_si512(out + 16 * (8 + j), _mm512_shuffle_i32x4(a, c, 0xDD));
      _mm512_storeu_si512(out + 16 * (12 + j), _mm512_shuffle_i32x4(b, d, 0xDD));
    }
  }
  for (int64_t g0 = 0; g0 < G; g0 += 8) {  // up to 8 query rows at once: independent sums, each group loaded once
    const int64_t n = std::min<int64_t>(8, G - g0);
    __m512i acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_si512();
    for (int64_t c = 0; c < D / 4; ++c) {
      const __m512i kv = _mm512_loadu_si512(kp + 16 * c);
      for (int j = 0; j < 8; ++j)
        if (j < n) {
          int32_t qv;
          std::memcpy(&qv, q8 + (g0 + j) * D + 4 * c, 4);
          acc[j] = _mm512_dpbusd_epi32(acc[j], kv, _mm512_set1_epi32(qv));
        }
    }
    for (int j = 0; j < n; ++j) {
      const __m512i dot = _mm512_sub_epi32(acc[j], _mm512_set1_epi32(128 * qsum[g0 + j]));
      _mm512_storeu_ps(S + (g0 + j) * ldS, _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(qscale[g0 + j])));
    }
  }
}
#else
bool int8_queries(int64_t, int64_t) { return false; }
static void scores_int8(const int8_t*, int64_t, int64_t, const int8_t*, const int32_t*, const float*, int64_t, float*,
                        int64_t, int32_t*) {}
#endif

// The i-th share of the lines of `bytes` bytes at p, `per` lines a share, asked for into L1. A whole block asked for
// at once stalled the core: prefetches wait for a free miss buffer as loads do (Qwen2.5-0.5B shapes, 4,096 keys:
// the whole next block at once was no faster than no prefetch at all; a share before each dot product, 1.32x).
static inline void fetch_share(const void* p, int64_t bytes, int64_t i, int64_t per) {
#ifdef __AVX2__
  const char* c = static_cast<const char*>(p);
  for (int64_t at = i * per * 64; at < std::min(bytes, (i + 1) * per * 64); at += 64) _mm_prefetch(c + at, _MM_HINT_T0);
#endif
}

// q [B, Hkv, G, D] fp32; K, V [N, bs, Hkv, D] of E (int8, or bf16 bits); KS, VS [N, bs, Hkv] fp32 scales (int8;
// null for bf16); table [B, nb] int64; mask [B, nb * bs] bool, or empty for all keys visible. Returns
// [B, Hkv, G, D] fp32.
//
// A task (a chunk of one sequence's blocks, every KV head) makes two passes: the scores of all its keys (each K
// block widened once, for every head), one softmax over them per query head, then the weighted sum of V (each V
// block widened once). Per query head that is one max, one exp pass and one sum a chunk, not one a block of 16.
template <typename E>
at::Tensor decode(const at::Tensor& q, const at::Tensor& kd, const E* K, const float* KS, const E* V,
                  const float* VS, const at::Tensor& table, const at::Tensor& mask, double scale,
                  int64_t min_chunk_blocks) {
  TORCH_CHECK(q.dtype() == at::kFloat && q.is_contiguous() && q.dim() == 4, "q: contiguous fp32 [B, Hkv, G, D]");
  TORCH_CHECK(table.dtype() == at::kLong && table.is_contiguous(), "table: contiguous int64 [B, nb]");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t bs = kd.size(1), nb = table.size(1), L = nb * bs;
  TORCH_CHECK(kd.size(2) == H && kd.size(3) == D && table.size(0) == B, "shapes of q, cache and table disagree");
  TORCH_CHECK(mask.numel() == 0 || (mask.dtype() == at::kBool && mask.is_contiguous() && mask.numel() == B * L),
              "mask: contiguous bool [B, nb * bs] or empty");
  const float* Q = q.data_ptr<float>();
  const int64_t* T = table.data_ptr<int64_t>();
  const bool* M = mask.numel() ? mask.data_ptr<bool>() : nullptr;
  const float ninf = -std::numeric_limits<float>::infinity();
  const float sc = static_cast<float>(scale);
  const int64_t stride = G * (D + 2);  // per (b, h, chunk): G maxima, G sums, G x D accumulators
  // the caller's scratch, kept between calls (a decode step makes one a layer; filled before it is read)
  thread_local std::vector<Chunks> cut;
  thread_local std::vector<int64_t> task0;  // sequence b's tasks (one per chunk, every KV head): task0[b] .. task0[b + 1]
  thread_local std::vector<float> part;  // partial softmaxes per (b, h, chunk): sequence b's at task0[b] * H, by head
  cut.resize(B);
  task0.resize(B + 1);
  task0[0] = 0;
  int64_t chunk_keys = 0;  // the most keys a task has
  for (int64_t b = 0; b < B; ++b) {
    cut[b] = chunks_of(M ? M + b * L : nullptr, nb, bs, min_chunk_blocks);
    task0[b + 1] = task0[b] + cut[b].count;
    chunk_keys = std::max(chunk_keys, cut[b].size * bs);
  }
  part.resize(std::max<size_t>(part.size(), task0[B] * H * stride));
  // int8 K with VNNI: every query row rounded to int8 (q8 · qscale; qsum: Σ q8, for the unsigned keys' offset)
  const bool q8_path = std::is_same_v<E, int8_t> && int8_queries(bs, D);
  thread_local std::vector<int8_t> q8_;
  thread_local std::vector<int32_t> qsum_;
  thread_local std::vector<float> qscale_;
  if (q8_path) {
    q8_.resize(std::max<size_t>(q8_.size(), B * H * G * D));
    qsum_.resize(std::max<size_t>(qsum_.size(), B * H * G));
    qscale_.resize(std::max<size_t>(qscale_.size(), B * H * G));
    for (int64_t r = 0; r < B * H * G; ++r) {
      const float* x = Q + r * D;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t d = 0; d < D; ++d) {
        const auto v = static_cast<int8_t>(std::nearbyint(x[d] * inv));  // to even, as the reference rounds
        q8_[r * D + d] = v;
        sum += v;
      }
      qsum_[r] = sum;
      qscale_[r] = amax / 127.f;
    }
  }
  const int8_t* const q8 = q8_.data();
  const int32_t* const qsum = qsum_.data();
  const float* const qscale = qscale_.data();
  // read through these from here on (inside the parallel region a thread_local names the running thread's own)
  const Chunks* const cuts = cut.data();
  const int64_t* const first_task = task0.data();
  float* const parts = part.data();
  const int64_t row = H * D;  // a token's K (or V) row: every KV head, contiguous
  const int64_t block_bytes = bs * row * static_cast<int64_t>(sizeof(E));
  const int64_t scale_bytes = bs * H * static_cast<int64_t>(sizeof(float));
  // the next block's lines are asked for in shares, one before each dot product: `per` lines a share
  const int64_t per = (block_bytes / 64 + H * G - 1) / (H * G);
  auto sequence_of = [&](int64_t task) {
    return std::upper_bound(first_task, first_task + B + 1, task) - first_task - 1;
  };
  at::parallel_for(0, first_task[B], 1, [&](int64_t begin, int64_t end) {
    // each thread's scratch, kept between calls: a block of K or V in fp32; per task the scores (then softmax
    // weights) of every (head, query head, key), each key's mask as an addend (0 / -inf) and a factor (1 / 0), and
    // per (head, key) the scores' factor (scale, times int8 K's scale) and int8 V's scale
    thread_local std::vector<float> scratch;
    thread_local std::vector<int32_t> kp;  // a head of a K block turned for scores_int8
    scratch.resize(std::max<size_t>(scratch.size(), bs * row + (H * G + 2 + 2 * H) * chunk_keys));
    if (q8_path) kp.resize(std::max<size_t>(kp.size(), D * 4));
    float* const xf = scratch.data();
    float* const S = xf + bs * row;
    float* const add = S + H * G * chunk_keys;
    float* const keep = add + chunk_keys;
    float* const f = keep + chunk_keys;
    float* const vsh = f + H * chunk_keys;
    thread_local std::vector<int64_t> blocks;  // the task's blocks with a visible key
    {  // the first task's first K block
      const int64_t b = sequence_of(begin);
      const int64_t j = cuts[b].first + (begin - first_task[b]) * cuts[b].size;
      fetch_share(K + T[b * nb + j] * bs * row, block_bytes, 0, block_bytes);
    }
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = sequence_of(task);
      const Chunks& ch = cuts[b];
      const int64_t c = task - first_task[b];
      const int64_t j0 = ch.first + c * ch.size, j1 = std::min(nb, j0 + ch.size);
      blocks.clear();
      for (int64_t j = j0; j < j1; ++j) {
        const bool* mrow = M ? M + b * L + j * bs : nullptr;
        if (!mrow || std::any_of(mrow, mrow + bs, [](bool x) { return x; })) blocks.push_back(j);
      }
      const int64_t nblk = static_cast<int64_t>(blocks.size()), n = nblk * bs;  // keys of the task
      // what comes after this task's last V block: the next task's first K block
      const E* after = nullptr;
      if (task + 1 < end) {
        const int64_t b2 = sequence_of(task + 1);
        after = K + T[b2 * nb + cuts[b2].first + (task + 1 - first_task[b2]) * cuts[b2].size] * bs * row;
      }
      // pass 1: scores, each K block widened once for every head
      for (int64_t i = 0; i < nblk; ++i) {
        const int64_t j = blocks[i], blk = T[b * nb + j];
        const bool* mrow = M ? M + b * L + j * bs : nullptr;
        const E* next = i + 1 < nblk ? K + T[b * nb + blocks[i + 1]] * bs * row : V + T[b * nb + blocks[0]] * bs * row;
        if (!q8_path) to_float(K + blk * bs * row, xf, bs * row);
        for (int64_t t = 0; t < bs; ++t) {
          const bool visible = !mrow || mrow[t];
          add[i * bs + t] = visible ? 0.f : ninf;
          keep[i * bs + t] = visible ? 1.f : 0.f;
        }
        if (KS)  // per-token scales, by head
          for (int64_t h = 0; h < H; ++h) {
            by_head(KS + blk * bs * H + h, H, bs, sc, f + h * chunk_keys + i * bs);
            by_head(VS + blk * bs * H + h, H, bs, 1.f, vsh + h * chunk_keys + i * bs);
          }
        for (int64_t h = 0; h < H; ++h) {
          if (q8_path) {  // only int8 E: K's bytes as they are
            fetch_share(next, block_bytes, h, per * G);
            const int64_t r = (b * H + h) * G;
            scores_int8(reinterpret_cast<const int8_t*>(K + blk * bs * row + h * D), row, D, q8 + r * D, qsum + r,
                        qscale + r, G, S + h * G * chunk_keys + i * bs, chunk_keys, kp.data());
            continue;
          }
          for (int64_t g = 0; g < G; ++g) {
            fetch_share(next, block_bytes, h * G + g, per);
            dots(Q + ((b * H + h) * G + g) * D, xf + h * D, bs, D, row, S + (h * G + g) * chunk_keys + i * bs);
          }
        }
        if (KS && i + 1 < nblk) {  // the next block's scales: a line or two each
          const int64_t nxt = T[b * nb + blocks[i + 1]];
          fetch_share(KS + nxt * bs * H, scale_bytes, 0, scale_bytes);
          fetch_share(VS + nxt * bs * H, scale_bytes, 0, scale_bytes);
        }
      }
      // one softmax per (head, query head) over the task's keys; the weights then carry int8 V's scales
      for (int64_t h = 0; h < H; ++h) {
        float* mx = parts + ((first_task[b] * H) + h * ch.count + c) * stride;
        float* sm = mx + G;
        std::fill(sm + G, mx + stride, 0.f);
        if (!KS) std::fill(f + h * chunk_keys, f + h * chunk_keys + n, sc);
        for (int64_t g = 0; g < G; ++g) {
          float* sg = S + (h * G + g) * chunk_keys;
          const float m = n ? scale_mask_max(sg, f + h * chunk_keys, add, n) : ninf;
          mx[g] = m;
          sm[g] = 0.f;
          if (m == ninf) continue;  // no visible key (its V pass below adds nothing)
          exps(sg, n, m);
          sm[g] = keep_sum_scale(sg, keep, KS ? vsh + h * chunk_keys : nullptr, n);
        }
      }
      // pass 2: the weighted sum of V, each V block widened once for every head
      for (int64_t i = 0; i < nblk; ++i) {
        const int64_t blk = T[b * nb + blocks[i]];
        const E* next = i + 1 < nblk ? V + T[b * nb + blocks[i + 1]] * bs * row : after;
        to_float(V + blk * bs * row, xf, bs * row);
        for (int64_t h = 0; h < H; ++h) {
          float* acc = parts + ((first_task[b] * H) + h * ch.count + c) * stride + 2 * G;
          for (int64_t g = 0; g < G; ++g) {
            if (next) fetch_share(next, block_bytes, h * G + g, per);
            axpys(S + (h * G + g) * chunk_keys + i * bs, xf + h * D, bs, D, row, acc + g * D);
          }
        }
      }
    }
  });
  at::Tensor out = at::detail::empty_cpu({B, H, G, D}, at::kFloat, false, std::nullopt);
  float* O = out.data_ptr<float>();
  for (int64_t bh = 0; bh < B * H; ++bh) {  // merge the chunks' partial softmaxes
    const int64_t b = bh / H, nchunks = cuts[b].count;
    const float* first = parts + (first_task[b] * H + bh % H * nchunks) * stride;
    for (int64_t g = 0; g < G; ++g) {
      float* o = O + (bh * G + g) * D;
      std::fill(o, o + D, 0.f);
      float m = ninf;
      for (int64_t c = 0; c < nchunks; ++c) m = std::max(m, first[c * stride + g]);
      if (m == ninf) continue;  // no visible key: zeros
      float total = 0.f;
      for (int64_t c = 0; c < nchunks; ++c) {
        const float* p = first + c * stride;
        if (p[g] == ninf) continue;
        const float f = std::exp(p[g] - m);
        total += p[G + g] * f;
        for (int64_t d = 0; d < D; ++d) o[d] += p[2 * G + g * D + d] * f;
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
    }
  }
  return out;
}

at::Tensor decode_int8(const at::Tensor& q, const at::Tensor& kd, const at::Tensor& ks, const at::Tensor& vd,
                       const at::Tensor& vs, const at::Tensor& table, const at::Tensor& mask, double scale,
                       int64_t min_chunk_blocks) {
  TORCH_CHECK(kd.dtype() == at::kChar && vd.dtype() == at::kChar && kd.is_contiguous() && vd.is_contiguous() &&
              vd.sizes() == kd.sizes(), "kd, vd: contiguous int8 [N, bs, Hkv, D]");
  TORCH_CHECK(ks.dtype() == at::kFloat && vs.dtype() == at::kFloat && ks.is_contiguous() && vs.is_contiguous() &&
              ks.numel() * kd.size(3) == kd.numel() && vs.sizes() == ks.sizes(),
              "ks, vs: contiguous fp32 [N, bs, Hkv]");
  return decode(q, kd, kd.data_ptr<int8_t>(), ks.data_ptr<float>(), vd.data_ptr<int8_t>(), vs.data_ptr<float>(),
                table, mask, scale, min_chunk_blocks);
}

at::Tensor decode_bf16(const at::Tensor& q, const at::Tensor& kd, const at::Tensor& vd, const at::Tensor& table,
                       const at::Tensor& mask, double scale, int64_t min_chunk_blocks) {
  TORCH_CHECK(kd.dtype() == at::kBFloat16 && vd.dtype() == at::kBFloat16 && kd.is_contiguous() &&
              vd.is_contiguous() && vd.sizes() == kd.sizes(), "kd, vd: contiguous bf16 [N, bs, Hkv, D]");
  const auto* K = reinterpret_cast<const uint16_t*>(kd.data_ptr<at::BFloat16>());
  const auto* V = reinterpret_cast<const uint16_t*>(vd.data_ptr<at::BFloat16>());
  return decode<uint16_t>(q, kd, K, nullptr, V, nullptr, table, mask, scale, min_chunk_blocks);
}

// The ops as C functions the compiled decode step calls directly (inductor's `custom_ops_to_c_shims`), not through
// the dispatcher's boxed call (engine/compiled_decode.py).
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

extern "C" AOTITorchError aoti_torch_cpu_decode_int8(AtenTensorHandle q, AtenTensorHandle kd, AtenTensorHandle ks,
                                                     AtenTensorHandle vd, AtenTensorHandle vs, AtenTensorHandle table,
                                                     AtenTensorHandle mask, double scale, int64_t min_chunk_blocks,
                                                     AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = torch::aot_inductor::new_tensor_handle(decode_int8(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(kd), *tensor_handle_to_tensor_pointer(ks),
        *tensor_handle_to_tensor_pointer(vd), *tensor_handle_to_tensor_pointer(vs),
        *tensor_handle_to_tensor_pointer(table), *tensor_handle_to_tensor_pointer(mask), scale, min_chunk_blocks));
  });
}

extern "C" AOTITorchError aoti_torch_cpu_decode_bf16(AtenTensorHandle q, AtenTensorHandle kd, AtenTensorHandle vd,
                                                     AtenTensorHandle table, AtenTensorHandle mask, double scale,
                                                     int64_t min_chunk_blocks, AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = torch::aot_inductor::new_tensor_handle(decode_bf16(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(kd), *tensor_handle_to_tensor_pointer(vd),
        *tensor_handle_to_tensor_pointer(table), *tensor_handle_to_tensor_pointer(mask), scale, min_chunk_blocks));
  });
}

TORCH_LIBRARY(tokenhaul_kv, m) {
  m.def("int8_queries(int block_size, int head_dim) -> bool", &int8_queries);
  m.def("decode_int8(Tensor q, Tensor kd, Tensor ks, Tensor vd, Tensor vs, Tensor table, Tensor mask, "
        "float scale, int min_chunk_blocks) -> Tensor");
  m.def("decode_bf16(Tensor q, Tensor kd, Tensor vd, Tensor table, Tensor mask, float scale, "
        "int min_chunk_blocks) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenhaul_kv, CPU, m) {
  m.impl("decode_int8", &decode_int8);
  m.impl("decode_bf16", &decode_bf16);
}
