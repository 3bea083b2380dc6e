// Gathered GEMV for activation sparsity (tokenhaul/layers/linear_sparse.py): y[m] = Σ_{|x[m,i]| ≥ t} x[m,i]·W[i,:]
// over a weight stored by input channel, in one call: the kept inputs are found here and only their rows
// are read. Threads split each input row's kept rows and sum their partial outputs at the end, so every
// weight row is read whole by one thread (a long run), with the next rows prefetched.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PREFETCH = 16;  // kept rows fetched ahead into L2 (measured: 2 rows 1.02x dense bf16, 16 1.33x)

// kept input channels of each row of x [M, K] and their values; returns the total count
int64_t kept_inputs(const float* x, int64_t M, int64_t K, float t, std::vector<std::vector<int64_t>>& idx,
                    std::vector<std::vector<float>>& val) {
  int64_t n = 0;
  idx.assign(M, {});
  val.assign(M, {});
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < K; ++i) {
      const float v = x[m * K + i];
      if (std::fabs(v) >= t) {
        idx[m].push_back(i);
        val[m].push_back(v);
      }
    }
    n += static_cast<int64_t>(idx[m].size());
  }
  return n;
}

// acc[0, c1 - c0) += w · row[c0, c1); `Int8` rows are uint8 codes (scale and offset applied by the caller)
template <bool Int8>
inline void strip_axpy(const uint8_t* row, int64_t c0, int64_t c1, float w, float* acc) {
  if constexpr (Int8) {
    for (int64_t c = c0; c < c1; ++c) acc[c - c0] += w * static_cast<float>(row[c]);
  } else {
    const uint16_t* r = reinterpret_cast<const uint16_t*>(row);
    for (int64_t c = c0; c < c1; ++c) {
      uint32_t bits = static_cast<uint32_t>(r[c]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      acc[c - c0] += w * f;
    }
  }
}

#ifdef __AVX2__
template <bool Int8>
inline __m256 load8(const uint8_t* row, int64_t c) {
  if constexpr (Int8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c))));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
#endif

// acc [N] = Σ_j w_j · row_j over kept rows [j0, j1) of one input row: each weight row read whole, in order,
// the rows ahead prefetched (they are scattered: a hardware prefetcher sees only short runs)
template <bool Int8>
float rows_into(const uint8_t* W, int64_t row_bytes, const int64_t* ii, const float* vv, int64_t j0, int64_t j1,
                int64_t N, float* acc) {
  float offset_sum = 0.f;  // int8: Σ x_i · offset_i, added to every column by the caller
  const int64_t span = Int8 ? N : 2 * N;
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* row = W + ii[j] * row_bytes;
#ifdef __AVX2__
    if (j + PREFETCH < j1) {
      const char* ahead = reinterpret_cast<const char*>(W + ii[j + PREFETCH] * row_bytes);
      for (int64_t b = 0; b < span; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
    }
#endif
    float w = vv[j];
    if constexpr (Int8) {
      float so[2];
      std::memcpy(so, row + N, 8);
      offset_sum += w * so[1];
      w *= so[0];
    }
    int64_t c = 0;
#ifdef __AVX2__
    const __m256 wv = _mm256_set1_ps(w);
    for (; c + 8 <= N; c += 8)
      _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(wv, load8<Int8>(row, c), _mm256_loadu_ps(acc + c)));
#endif
    strip_axpy<Int8>(row, c, N, w, acc + c);
  }
  return offset_sum;
}

}  // namespace

// x [M, K] fp32; rows: [K, N + 8] uint8 (fbgemm rowwise int8: codes, then fp32 scale and offset) or [K, N]
// bf16. Returns (y [M, N] fp32, kept inputs per row [M] int64).
std::tuple<at::Tensor, at::Tensor> sparse_gemv(const at::Tensor& x, double threshold, const at::Tensor& rows,
                                               int64_t out_features) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous fp32 [M, K]");
  TORCH_CHECK(rows.is_contiguous() && rows.size(0) == x.size(1), "rows: contiguous [K, ...]");
  const bool int8 = rows.dtype() == at::kByte;
  TORCH_CHECK(int8 || rows.dtype() == at::kBFloat16, "rows: uint8 rowwise int8 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(rows.size(1) == (int8 ? N + 8 : N), "rows: width does not match out_features");
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<float>> val;
  kept_inputs(x.data_ptr<float>(), M, K, static_cast<float>(threshold), idx, val);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor kept = at::empty({M}, x.options().dtype(at::kLong));
  for (int64_t m = 0; m < M; ++m) kept.data_ptr<int64_t>()[m] = static_cast<int64_t>(idx[m].size());
  const uint8_t* W = static_cast<const uint8_t*>(rows.data_ptr());
  const int64_t row_bytes = rows.size(1) * rows.element_size();
  float* Y = y.data_ptr<float>();
  // each input row's kept rows split into one slice per thread, summed into per-slice partial outputs
  const int64_t T = std::max<int64_t>(1, at::get_num_threads());
  std::vector<float> part(M * T * N, 0.f), offs(M * T, 0.f);
  at::parallel_for(0, M * T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / T, t = task % T, n = static_cast<int64_t>(idx[m].size());
      const int64_t j0 = n * t / T, j1 = n * (t + 1) / T;
      float* acc = part.data() + task * N;
      offs[task] = int8 ? rows_into<true>(W, row_bytes, idx[m].data(), val[m].data(), j0, j1, N, acc)
                        : rows_into<false>(W, row_bytes, idx[m].data(), val[m].data(), j0, j1, N, acc);
    }
  });
  for (int64_t m = 0; m < M; ++m) {
    float off = 0.f;
    for (int64_t t = 0; t < T; ++t) off += offs[m * T + t];
    float* out = Y + m * N;
    const float* p0 = part.data() + m * T * N;
    for (int64_t c = 0; c < N; ++c) {
      float v = off;
      for (int64_t t = 0; t < T; ++t) v += p0[t * N + c];
      out[c] = v;
    }
  }
  return {y, kept};
}

TORCH_LIBRARY(tokenhaul_sparse, m) {
  m.def("gemv(Tensor x, float threshold, Tensor rows, int out_features) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenhaul_sparse, CPU, m) { m.impl("gemv", &sparse_gemv); }
