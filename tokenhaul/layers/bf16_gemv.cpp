// Few-row bf16 linear for the CPU (tokenhaul/layers/bf16_gemv.py): y [M, N] fp32 = x [M, K] @ W^T, W bf16 [N, K]
// row-major, x bf16 or fp32 (widened to fp32 once), M small (decode: passes of up to 8 rows over the weights).
// Each weight row is read once per pass, widened to fp32 (a shift) and multiplied into every activation row of the
// pass with fp32 sums. Threads take contiguous ranges of rows; with one activation row a thread walks its range as
// STREAMS runs at once (more cache lines in flight per core), as the int8 GEMV does.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <algorithm>
#include <cstdint>
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

inline __m256 widen8(__m128i h) {  // 8 bf16 → fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

constexpr int64_t PREFETCH = 2048;  // bytes ahead in each weight row (the int8 GEMV's distance)

// R rows of W (their indices n[r]) against the M rows of X (fp32 [M, K]): Y [M, N] at those rows. Each (row,
// activation row) is summed the same way whatever R and M, so a row's result does not depend on its batch.
template <int M, int R>
void dot_rows(const uint16_t* W, const int64_t* n, const float* X, int64_t K, int64_t N, float* Y) {
  const uint16_t* w[R];
  float sum[R][M];
  for (int r = 0; r < R; ++r) w[r] = W + n[r] * K;
  int64_t k = 0;
#ifdef __AVX2__
  __m256 a[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) a[r][m] = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + k) + PREFETCH, _MM_HINT_T0);
      const __m256 w0 = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + k)));
      const __m256 w1 = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + k + 8)));
      for (int m = 0; m < M; ++m)
        a[r][m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(X + m * K + k + 8),
                                  _mm256_fmadd_ps(w0, _mm256_loadu_ps(X + m * K + k), a[r][m]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) sum[r][m] = hsum(a[r][m]);
#else
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) sum[r][m] = 0.f;
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) sum[r][m] += bf16_to_float(w[r][k]) * X[m * K + k];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) Y[m * N + n[r]] = sum[r][m];
}

#ifndef STREAMS  // runs per thread at one row, set per CPU vendor by tokenhaul/native.py (as for the int8 GEMVs)
#define STREAMS 4
#endif

// Rows [n0, n1): with one activation row cut into STREAMS runs walked in lockstep, else row by row
template <int M>
void rows_dot(const uint16_t* W, const float* X, int64_t K, int64_t N, int64_t n0, int64_t n1, float* Y) {
  constexpr int R = M == 1 ? STREAMS : 1;
  const int64_t len = (n1 - n0) / R;
  for (int64_t i = 0; i < len; ++i) {
    int64_t n[R];
    for (int r = 0; r < R; ++r) n[r] = n0 + r * len + i;
    dot_rows<M, R>(W, n, X, K, N, Y);
  }
  for (int64_t n = n0 + R * len; n < n1; ++n) dot_rows<M, 1>(W, &n, X, K, N, Y);
}

// Rows [n0, n1) against one pass's m activation rows (1 <= m <= 8)
void pass_rows(int64_t m, const uint16_t* W, const float* X, int64_t K, int64_t N, int64_t n0, int64_t n1, float* Y) {
  switch (m) {
    case 1: rows_dot<1>(W, X, K, N, n0, n1, Y); break;
    case 2: rows_dot<2>(W, X, K, N, n0, n1, Y); break;
    case 3: rows_dot<3>(W, X, K, N, n0, n1, Y); break;
    case 4: rows_dot<4>(W, X, K, N, n0, n1, Y); break;
    case 5: rows_dot<5>(W, X, K, N, n0, n1, Y); break;
    case 6: rows_dot<6>(W, X, K, N, n0, n1, Y); break;
    case 7: rows_dot<7>(W, X, K, N, n0, n1, Y); break;
    default: rows_dot<8>(W, X, K, N, n0, n1, Y); break;
  }
}

}  // namespace

constexpr int64_t MAX_ROWS = 8;  // rows per pass over the weights (one template per row count)

// static: a variant built beside the engine's op (bench/gemv_variants.py) keeps its own, not the first one loaded
static at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x: [M, K] with M >= 1");
  TORCH_CHECK(weight.dtype() == at::kBFloat16 && weight.is_contiguous() && weight.dim() == 2,
              "weight: contiguous bf16 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "shapes do not match");
  // x in fp32, in the calling thread's buffer, kept between calls (no heap traffic)
  thread_local std::vector<float> xf_area;
  const at::Tensor xc = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ? x.contiguous()
                                                                                          : x.to(at::kFloat).contiguous();
  const float* X = nullptr;
  if (xc.scalar_type() == at::kFloat) {
    X = xc.data_ptr<float>();
  } else {
    xf_area.resize(std::max<size_t>(xf_area.size(), M * K));
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < M * K; ++i) xf_area[i] = bf16_to_float(xb[i]);
    X = xf_area.data();
  }
  at::Tensor y = at::detail::empty_cpu({M, N}, at::kFloat, false, std::nullopt);  // not through the dispatcher
  const uint16_t* W = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  float* Y = y.data_ptr<float>();
  // grain: at least ~64 KB of weights per task, so a small matrix is not split finer than it pays
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS)
      pass_rows(std::min(M - m0, MAX_ROWS), W, X + m0 * K, K, N, n0, n1, Y + m0 * N);
  });
  return y;
}

// The op as a C function, for a compiled graph to call without the dispatcher (tokenhaul/native.py c_shims)
extern "C" AOTITorchError aoti_torch_cpu_bf16_gemv(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* out) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = torch::aot_inductor::new_tensor_handle(bf16_gemv(*tensor_handle_to_tensor_pointer(x),
                                                            *tensor_handle_to_tensor_pointer(weight)));
  });
}

TORCH_LIBRARY(tokenhaul_bf16, m) { m.def("bf16_gemv(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenhaul_bf16, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
