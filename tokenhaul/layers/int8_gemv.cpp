// Few-row int8 linear for the CPU (tokenhaul/layers/int8_gemv.py): y [M, N] = (x [M, K] @ W^T) * scale, W int8
// [N, K] row-major with one scale per row, x bf16, y fp32, M small (decode: passes of up to 8 rows, all of them
// over a block of weight rows before the next). Each weight row is read once per pass, widened to int16 and
// multiplied (madd) into every activation row of the pass, itself as int16 codes with one scale per row (15 bits,
// finer than bf16). Threads take contiguous ranges of rows; with one activation row a thread walks its range as
// STREAMS runs at once (more cache lines in flight per core).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

inline float bf16_to_float(uint16_t h) { return c10::BFloat16(h, c10::BFloat16::from_bits()); }  // torch's own

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

constexpr int64_t CHUNK = 4096;  // inputs summed in int32 before a flush to fp32: each lane grows <= 4 * 127 * 32767 a step, 128 steps < 2^31

// bytes ahead in the row: on a Zen 4 host 512 read 1.1-1.2x the hardware prefetcher alone; on a Sapphire Rapids
// host (Qwen lm_head, 2 threads) 512 16.7 GB/s, 1024 14.7, 2048 18.8-20.2, 4096 18.0, 8192 19.2, none 12.9
constexpr int64_t PREFETCH = 2048;

// R rows of W (their indices n[r]) against the M rows of Xq (int16 [M, K], row m's value = Xq * xs[m]):
// Y [M, N] at those rows = Σ_k W[n, k] * Xq[m, k] * xs[m] * scale[n], int32 sums flushed to fp32 every CHUNK
// inputs. Each (row, activation row) is summed the same way whatever R and M, so a row's result does not depend
// on its batch; R > 1 walks R weight rows at once (more cache lines in flight per core).
template <int M, int R>
void dot_rows(const int8_t* W, const int64_t* n, const int16_t* Xq, const float* xs, const uint16_t* S, int64_t K,
              int64_t N, float* Y) {
  const int8_t* w[R];
  float sum[R][M];
  for (int r = 0; r < R; ++r) {
    w[r] = W + n[r] * K;
    for (int m = 0; m < M; ++m) sum[r][m] = 0.f;
  }
  int64_t k = 0;
#ifdef __AVX2__
  for (int64_t c0 = 0; c0 + 32 <= K; c0 += CHUNK) {
    const int64_t c1 = std::min(K, c0 + CHUNK) & ~int64_t{31};
    __m256i a[R][M];  // one sum per (row, x row): 16 for 8 x rows leave room for the operands (no spills)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) a[r][m] = _mm256_setzero_si256();
    for (k = c0; k < c1; k += 32) {  // 32 weights widened to int16, multiplied and pair-summed to int32
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + PREFETCH), _MM_HINT_T0);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + k)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + k + 16)));
        for (int m = 0; m < M; ++m) {
          const __m256i* x = reinterpret_cast<const __m256i*>(Xq + m * K + k);
          a[r][m] = _mm256_add_epi32(a[r][m], _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(x)),
                                                                _mm256_madd_epi16(w1, _mm256_loadu_si256(x + 1))));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        sum[r][m] += hsum(_mm256_cvtepi32_ps(a[r][m]));
  }
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) sum[r][m] += static_cast<float>(static_cast<int32_t>(w[r][k]) * Xq[m * K + k]);
  for (int r = 0; r < R; ++r) {
    const float s = bf16_to_float(S[n[r]]);
    for (int m = 0; m < M; ++m) Y[m * N + n[r]] = sum[r][m] * xs[m] * s;
  }
}

#ifndef STREAMS  // runs per thread at one row, set per CPU vendor by tokenhaul/native.py. 700 MB of Qwen layers, 2 threads
#define STREAMS 4  // (GB/s): Sapphire Rapids 1 19.7, 2 26.5, 4 30.3, 8 28.8; Zen 4 (one CCD) 1 27.4, 2 27.4, 4 25.5
#endif

// Rows [n0, n1): with one activation row cut into STREAMS runs walked in lockstep (one sequential run keeps too
// few cache lines in flight to reach a core's share of DRAM bandwidth, bench/RESULTS.md), else row by row.
template <int M>
void rows_dot(const int8_t* W, const int16_t* Xq, const float* xs, const uint16_t* S, int64_t K, int64_t N,
              int64_t n0, int64_t n1, float* Y) {
  constexpr int R = M == 1 ? STREAMS : 1;
  const int64_t len = (n1 - n0) / R;
  for (int64_t i = 0; i < len; ++i) {
    int64_t n[R];
    for (int r = 0; r < R; ++r) n[r] = n0 + r * len + i;
    dot_rows<M, R>(W, n, Xq, xs, S, K, N, Y);
  }
  for (int64_t n = n0 + R * len; n < n1; ++n) dot_rows<M, 1>(W, &n, Xq, xs, S, K, N, Y);
}

// Rows [n0, n1) against one pass's m activation rows (1 <= m <= 8)
void pass_rows(int64_t m, const int8_t* W, const int16_t* Xq, const float* xs, const uint16_t* S, int64_t K,
               int64_t N, int64_t n0, int64_t n1, float* Y) {
  switch (m) {
    case 1: rows_dot<1>(W, Xq, xs, S, K, N, n0, n1, Y); break;
    case 2: rows_dot<2>(W, Xq, xs, S, K, N, n0, n1, Y); break;
    case 3: rows_dot<3>(W, Xq, xs, S, K, N, n0, n1, Y); break;
    case 4: rows_dot<4>(W, Xq, xs, S, K, N, n0, n1, Y); break;
    case 5: rows_dot<5>(W, Xq, xs, S, K, N, n0, n1, Y); break;
    case 6: rows_dot<6>(W, Xq, xs, S, K, N, n0, n1, Y); break;
    case 7: rows_dot<7>(W, Xq, xs, S, K, N, n0, n1, Y); break;
    default: rows_dot<8>(W, Xq, xs, S, K, N, n0, n1, Y); break;
  }
}

float abs_max(const float* x, int64_t K) {
  float amax = 0.f;
  int64_t k = 0;
#ifdef __AVX2__
  __m256 m = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (; k + 8 <= K; k += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)), m);  // NaN: m kept
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

// q = round-to-even(x · inv) as int16 (|x · inv| <= 32767 here)
void quantize_row(const float* x, int64_t K, float inv, int16_t* q) {
  int64_t k = 0;
#ifdef __AVX2__
  const __m256 iv = _mm256_set1_ps(inv);
  for (; k + 16 <= K; k += 16) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), iv));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), iv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
  }
#endif
  for (; k < K; ++k) q[k] = static_cast<int16_t>(std::nearbyint(x[k] * inv));
}

}  // namespace

constexpr int64_t MAX_ROWS = 8;  // rows per pass over the weights (one template per row count)
#ifndef PASS_BYTES  // weight rows each task runs every pass over before it moves on (while they stay in L2)
#define PASS_BYTES 65536
#endif

// static: a variant built beside the engine's op (bench/gemv_variants.py) keeps its own, not the first one loaded
static at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x: [M, K] with M >= 1");
  TORCH_CHECK(weight.dtype() == at::kChar && weight.is_contiguous() && weight.dim() == 2, "weight: contiguous int8");
  TORCH_CHECK(scales.dtype() == at::kBFloat16 && scales.is_contiguous(), "scales: contiguous bf16 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && scales.numel() == N, "shapes do not match");
  // each activation row as int16 codes with one fp32 scale (15 bits of its largest value: finer than bf16's 8),
  // in the calling thread's buffers, kept between calls (no heap traffic; a bf16 x widened here, not by an op)
  thread_local std::vector<float> xf_area, xs;
  thread_local std::vector<int16_t> xq;
  xq.resize(std::max<size_t>(xq.size(), M * K));
  xs.resize(std::max<size_t>(xs.size(), M));
  const at::Tensor xc = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ? x.contiguous()
                                                                                          : x.to(at::kFloat).contiguous();
  const float* xp = nullptr;
  if (xc.scalar_type() == at::kFloat) {
    xp = xc.data_ptr<float>();
  } else {
    xf_area.resize(std::max<size_t>(xf_area.size(), M * K));
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < M * K; ++i) xf_area[i] = c10::BFloat16(xb[i], c10::BFloat16::from_bits());
    xp = xf_area.data();
  }
  for (int64_t m = 0; m < M; ++m) {
    const float amax = abs_max(xp + m * K, K);
    xs[m] = amax > 0.f ? amax / 32767.f : 1.f;
    quantize_row(xp + m * K, K, 1.f / xs[m], xq.data() + m * K);
  }
  at::Tensor y = at::detail::empty_cpu({M, N}, at::kFloat, false, std::nullopt);  // not through the dispatcher
  const int8_t* W = weight.data_ptr<int8_t>();
  const uint16_t* S = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const int16_t* X = xq.data();  // the calling thread's buffers (thread_local: not named inside the tasks)
  const float* XS = xs.data();
  float* Y = y.data_ptr<float>();
  // passes of up to 8 rows, each row summed the same way whatever the pass; with more than one pass a task runs
  // them all over PASS_BYTES of weight rows at a time, so the weight comes from DRAM once, not once per pass.
  // grain: at least ~64 KB of weights per task, so a small matrix is not split finer than it pays
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
  const int64_t block = M <= MAX_ROWS ? N : std::max<int64_t>(1, PASS_BYTES / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t b0 = n0; b0 < n1; b0 += block)
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS)
        pass_rows(std::min(M - m0, MAX_ROWS), W, X + m0 * K, XS + m0, S, K, N, b0, std::min(n1, b0 + block),
                  Y + m0 * N);
  });
  return y;
}

// The op as a C function, for a compiled graph to call without the dispatcher (tokenhaul/native.py c_shims)
extern "C" AOTITorchError aoti_torch_cpu_int8_gemv(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scales,
                                                   AtenTensorHandle* out) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = torch::aot_inductor::new_tensor_handle(int8_gemv(*tensor_handle_to_tensor_pointer(x),
                                                            *tensor_handle_to_tensor_pointer(weight),
                                                            *tensor_handle_to_tensor_pointer(scales)));
  });
}

TORCH_LIBRARY(tokenhaul_int8, m) { m.def("int8_gemv(Tensor x, Tensor weight, Tensor scales) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenhaul_int8, CPU, m) { m.impl("int8_gemv", &int8_gemv); }
