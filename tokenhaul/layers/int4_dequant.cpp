// Int4 weights on the CPU packed layout → dense bf16 W^T [K, N] in one pass (tokenhaul/layers/int4_dequant.py).
//
// The layout (torch's _convert_weight_to_int4pack_for_cpu, checked in tests/layers/test_packed.py): rows in
// blocks of B (64 where torch runs its AVX-512 kernels, 32 with AVX2); for each input k a block stores B / 2
// bytes, byte j = q[n0 + j] | q[n0 + B / 2 + j] << 4. 32-row blocks with the scales in unit order are in the GEMV's
// own order (int4_gemv.cpp): per quad of inputs k .. k + 3, byte 32 h + 4 r + i = rows 8 h + r | 16 + 8 h + r at k + i.
// scales_zeros [K / group, N, 2] or in unit order [N / 64, K / group, 64, 2] (int4_gemv.cpp), bf16:
// value = (q - 8) * scale + zero. Each task takes one group of inputs
// (its scales converted once), writes `group` rows of the output; plain loops the compiler vectorizes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

static inline float bf16_to_float(uint16_t h) { return c10::BFloat16(h, c10::BFloat16::from_bits()); }  // torch's own

static inline uint16_t float_to_bf16(float f) {  // round to nearest even (values are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

at::Tensor dequant_t(const at::Tensor& weight, const at::Tensor& scales_zeros, int64_t group, int64_t block) {
  TORCH_CHECK(weight.dtype() == at::kByte && weight.is_contiguous(), "weight: contiguous uint8 [N, K / 2]");
  const bool units = scales_zeros.dim() == 4;
  TORCH_CHECK(scales_zeros.dtype() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  (scales_zeros.dim() == 3 || (units && scales_zeros.size(2) == 64)),
              "scales_zeros: contiguous bf16 [K / group, N, 2] or [N / 64, K / group, 64, 2]");
  const int64_t groups = scales_zeros.size(units ? 1 : 0);
  const int64_t n = units ? scales_zeros.size(0) * 64 : scales_zeros.size(1);
  const int64_t k = groups * group;
  TORCH_CHECK(block == 32 || block == 64, "block: 32 or 64 rows");
  TORCH_CHECK(n % block == 0 && weight.size(0) == n && weight.size(1) * 2 == k, "shapes do not match");
  const int64_t half = block / 2;
  const bool quads = units && block == 32;
  auto out = at::empty({k, n}, weight.options().dtype(at::kBFloat16));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> scale(n), base(n);  // base = zero - 8 * scale
    uint8_t byte[16];  // a 32-row block's bytes of one input in torch's order, gathered from quads
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* s = units ? sz + ((j / 64) * groups + g) * 128 + (j % 64) * 2 : sz + (g * n + j) * 2;
        scale[j] = bf16_to_float(s[0]);
        base[j] = bf16_to_float(s[1]) - 8.0f * scale[j];
      }
      for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
        uint16_t* row = o + kk * n;
        for (int64_t b = 0; b < n / block; ++b) {
          const uint8_t* src = w + (b * k + kk) * half;
          if (quads) {  // byte j of torch's order: byte 32 (j / 8) + 4 (j % 8) + kk % 4 of the quad
            const uint8_t* q = w + (b * k + kk / 4 * 4) * 16 + kk % 4;
            for (int64_t j = 0; j < half; ++j) byte[j] = q[j / 8 * 32 + j % 8 * 4];
            src = byte;
          }
          const float* sc = scale.data() + b * block;
          const float* bs = base.data() + b * block;
          uint16_t* dst = row + b * block;
          for (int64_t j = 0; j < half; ++j) {
            dst[j] = float_to_bf16(bs[j] + static_cast<float>(src[j] & 15) * sc[j]);
            dst[j + half] = float_to_bf16(bs[j + half] + static_cast<float>(src[j] >> 4) * sc[j + half]);
          }
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY(tokenhaul_int4, m) {
  m.def("dequant_t(Tensor weight, Tensor scales_zeros, int group, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenhaul_int4, CPU, m) { m.impl("dequant_t", &dequant_t); }
