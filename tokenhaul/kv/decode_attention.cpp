// Decode attention straight from a paged KV cache, int8 or bf16 (tokenhaul/kv/decode_attention.py builds this).
//
// One query group per (sequence, KV head): the G query heads sharing a KV head read each key once, through the
// block table, in place. Each 16-key block is converted to fp32 in an L1 buffer on the way in, every KV head at
// once (a token's row of all heads is contiguous: one head's rows alone were two lines of every six); int8 blocks'
// per-token scales are applied to the score (K) or the softmax weight (V), so no full-precision copy of the cache
// is ever written. A sequence's keys are split into chunks across threads (online softmax per chunk and head,
// merged at the end), so a single sequence still uses every thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>

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

// q [B, Hkv, G, D] fp32; K, V [N, bs, Hkv, D] of E (int8, or bf16 bits); KS, VS [N, bs, Hkv] fp32 scales (int8;
// null for bf16); table [B, nb] int64; mask [B, nb * bs] bool, or empty for all keys visible. Returns
// [B, Hkv, G, D] fp32.
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
  for (int64_t b = 0; b < B; ++b) {
    cut[b] = chunks_of(M ? M + b * L : nullptr, nb, bs, min_chunk_blocks);
    task0[b + 1] = task0[b] + cut[b].count;
  }
  part.resize(std::max<size_t>(part.size(), task0[B] * H * stride));
  // read through these from here on (inside the parallel region a thread_local names the running thread's own)
  const Chunks* const cuts = cut.data();
  const int64_t* const first_task = task0.data();
  float* const parts = part.data();
  const int64_t row = H * D;  // a token's K (or V) row: every KV head, contiguous
  const int64_t block_bytes = bs * row * static_cast<int64_t>(sizeof(E));
  auto fetch = [&](int64_t blk, int hint) {  // every line of a block's K and V
#ifdef __AVX2__
    const char* k = reinterpret_cast<const char*>(K + blk * bs * row);
    const char* v = reinterpret_cast<const char*>(V + blk * bs * row);
    for (int64_t line = 0; line < block_bytes; line += 64) {
      if (hint == 1) _mm_prefetch(k + line, _MM_HINT_T1), _mm_prefetch(v + line, _MM_HINT_T1);
      else _mm_prefetch(k + line, _MM_HINT_T0), _mm_prefetch(v + line, _MM_HINT_T0);
    }
#endif
  };
  at::parallel_for(0, first_task[B], 1, [&](int64_t begin, int64_t end) {
    // each thread's scratch, kept between calls: scores, a block of K and of V in fp32; per block each key's mask
    // as an addend (0 / -inf) and a factor (1 / 0); per head the scores' factor (scale, times int8 K's per-token
    // scale) and int8 V's per-token scale
    thread_local std::vector<float> scratch;
    scratch.resize(std::max<size_t>(scratch.size(), G * bs + 2 * bs * row + 4 * bs));
    float* const s_ = scratch.data();
    float* const kf = s_ + G * bs;
    float* const vf = kf + bs * row;
    float* const add = vf + bs * row;
    float* const keep = add + bs;
    float* const f = keep + bs;
    float* const vsh = f + bs;
    std::fill(f, f + bs, sc);
    // The first block of each of this thread's tasks, asked for at once: the loop below fetches a task's next
    // block while it computes one, so a task's first block was read at the full latency of the pool's memory.
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = std::upper_bound(first_task, first_task + B + 1, task) - first_task - 1;
      fetch(T[b * nb + cuts[b].first + (task - first_task[b]) * cuts[b].size], 1);
    }
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = std::upper_bound(first_task, first_task + B + 1, task) - first_task - 1;
      const Chunks& ch = cuts[b];
      const int64_t c = task - first_task[b];
      for (int64_t h = 0; h < H; ++h) {
        float* mx = parts + ((first_task[b] * H) + h * ch.count + c) * stride;
        std::fill(mx, mx + G, ninf);
        std::fill(mx + G, mx + stride, 0.f);
      }
      const int64_t j0 = ch.first + c * ch.size;
      for (int64_t j = j0; j < std::min(nb, j0 + ch.size); ++j) {
        const int64_t blk = T[b * nb + j];
        const bool* mrow = M ? M + b * L + j * bs : nullptr;
        if (mrow && std::none_of(mrow, mrow + bs, [](bool x) { return x; })) continue;
        if (j + 1 < nb) fetch(T[b * nb + j + 1], 0);  // the next block is anywhere in the pool
        to_float(K + blk * bs * row, kf, bs * row);  // the whole block, every head: contiguous reads
        to_float(V + blk * bs * row, vf, bs * row);
        for (int64_t t = 0; t < bs; ++t) {
          const bool visible = !mrow || mrow[t];
          add[t] = visible ? 0.f : ninf;
          keep[t] = visible ? 1.f : 0.f;
        }
        for (int64_t h = 0; h < H; ++h) {
          float* mx = parts + ((first_task[b] * H) + h * ch.count + c) * stride;
          float* sm = mx + G;
          float* acc = sm + G;
          const float* qb = Q + (b * H + h) * G * D;
          const int64_t base = blk * bs * H + h;  // slot (blk, t, h) = base + t * H: the scales' index
          if (KS)  // int8 (K and V scales together); bf16 keeps f = scale
            for (int64_t t = 0; t < bs; ++t) f[t] = KS[base + t * H] * sc, vsh[t] = VS[base + t * H];
          for (int64_t g = 0; g < G; ++g) {
            float* sg = s_ + g * bs;
            dots(qb + g * D, kf + h * D, bs, D, row, sg);
            const float bmax = scale_mask_max(sg, f, add, bs);
            const float mnew = std::max(mx[g], bmax);
            // exp(-inf) = 0 on the first visible block; the max mostly stays, and exp(0) is 1 exactly
            const float corr = mnew == mx[g] ? 1.f : std::exp(mx[g] - mnew);
            exps(sg, bs, mnew);
            const float bsum = keep_sum_scale(sg, keep, VS ? vsh : nullptr, bs);
            float* ag = acc + g * D;
            if (corr != 1.f)
              for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
            sm[g] = sm[g] * corr + bsum;
            mx[g] = mnew;
            axpys(sg, vf + h * D, bs, D, row, ag);
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
  m.def("decode_int8(Tensor q, Tensor kd, Tensor ks, Tensor vd, Tensor vs, Tensor table, Tensor mask, "
        "float scale, int min_chunk_blocks) -> Tensor");
  m.def("decode_bf16(Tensor q, Tensor kd, Tensor vd, Tensor table, Tensor mask, float scale, "
        "int min_chunk_blocks) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenhaul_kv, CPU, m) {
  m.impl("decode_int8", &decode_int8);
  m.impl("decode_bf16", &decode_bf16);
}
