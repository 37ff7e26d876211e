// Native CPU kernels for MXFP4 matmul: out[M, N] = x[M, K] @ W[N, K]^T with W kept packed; one decode
// token's routed experts in one call (MXFP4 or plain fp32 weights); and, at the end, the two byte
// histograms the atlas scan counts MXFP4 and 16-bit tensors with.
//
// Layout (compressed-tensors `mxfp4-pack-quantized`):
//   packed [N, K/2] uint8: element 2j in the low nibble of byte j, element 2j+1 in the high nibble
//   scale  [N, K/32] uint8: E8M0, byte s means 2^(s-127), 255 is NaN
//
// Two paths, chosen by the caller through `gemv_max_m`:
//   * small M (decode): one pass over W per group of up to 8 rows of x (_native_rows.h `gemv_rows`, the
//     decode step's kernel: a row's bits do not depend on M). Each pair of blocks is decoded once, nibble
//     by nibble, into fp32 "code times two" values and multiplied into the x rows with FMAs. Parallel over
//     output rows n.
//   * large M (prefill): W is decoded to fp32 one [tile_n, tile_k] tile at a time into a per-thread
//     scratch buffer, and the tile is multiplied with at::addmm_ (MKL sgemm). Scratch memory is
//     tile_n * tile_k floats per thread, independent of the matrix size. Parallel over n-tiles.
//     A bfloat16 x takes the same path with bfloat16 tiles (every MXFP4 value is exact in bfloat16) that
//     span all of K, so that torch's bf16 GEMM (oneDNN: bf16 products, fp32 sums) rounds each output once.
//
// The SIMD code is AVX2 + FMA, compiled per function with __attribute__((target)) so that the module
// itself loads on any x86-64 CPU; `cpu_supported()` tells Python whether the kernels may be called. The
// small-M GEMV also has an AVX-512 variant (_native_rows512.h, bit for bit the AVX2 results), taken where
// the CPU has AVX-512 F/DQ; `gemv_variant()` names the one in use.

#include <torch/extension.h>

#include "_native_bf16.h"
#include "_native_common.h"
#include "_native_int8.h"
#include "_native_math.h"
#include "_native_rows.h"
#include "_native_rows512.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>


namespace {

using namespace mxfp4_rows;  // kBlock, decode_block, kMaxRows, gemv_dense


// dst[i, j] = W[n_begin + i, k_begin + j] in fp32, for a tile of `rows` x `cols` (cols a multiple of 32).
__attribute__((target("avx2,fma"))) void decode_tile(const uint8_t* packed, const uint8_t* scale, int64_t K,
                                                     int64_t n_begin, int64_t rows, int64_t k_begin,
                                                     int64_t cols, float* dst) {
  const int64_t blocks = K / kBlock;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t n = n_begin + i;
    const uint8_t* row_bytes = packed + n * (K / 2) + k_begin / 2;
    const uint8_t* row_scale = scale + n * blocks + k_begin / kBlock;
    float* row_out = dst + i * cols;
    for (int64_t b = 0; b < cols / kBlock; ++b) {
      __m256 w[4];
      decode_block(row_bytes + b * kBlockBytes, w);
      const __m256 s = _mm256_set1_ps(kHalfScale.value[row_scale[b]]);
      for (int q = 0; q < 4; ++q) _mm256_storeu_ps(row_out + b * kBlock + 8 * q, _mm256_mul_ps(w[q], s));
    }
  }
}

// The same tile in bfloat16: each fp32 value's upper 16 bits. Exact, not a rounding: an MXFP4 value is a
// code of at most two significant bits times a power of two, so the lower 16 bits of its fp32 form are zero
// (subnormal ones included: 2^-128 x 0.5 still sits in the upper mantissa bits); NaN (scale 255) stays NaN.
__attribute__((target("avx2,fma"))) void decode_tile(const uint8_t* packed, const uint8_t* scale, int64_t K,
                                                     int64_t n_begin, int64_t rows, int64_t k_begin,
                                                     int64_t cols, at::BFloat16* dst) {
  const int64_t blocks = K / kBlock;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t n = n_begin + i;
    const uint8_t* row_bytes = packed + n * (K / 2) + k_begin / 2;
    const uint8_t* row_scale = scale + n * blocks + k_begin / kBlock;
    auto* row_out = reinterpret_cast<uint16_t*>(dst + i * cols);
    for (int64_t b = 0; b < cols / kBlock; ++b) {
      __m256 w[4];
      decode_block(row_bytes + b * kBlockBytes, w);
      const __m256 s = _mm256_set1_ps(kHalfScale.value[row_scale[b]]);
      for (int q = 0; q < 4; q += 2) {
        const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(_mm256_mul_ps(w[q], s)), 16);
        const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(_mm256_mul_ps(w[q + 1], s)), 16);
        // packus interleaves 128-bit lanes (lo0-3 hi0-3 lo4-7 hi4-7); the permute puts them back in order
        const __m256i packed16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_out + b * kBlock + 8 * q), packed16);
      }
    }
  }
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scale.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK((x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous float32 or bfloat16 [M, K] tensor");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be a contiguous uint8 [N, K/2] tensor");
  TORCH_CHECK(scale.scalar_type() == torch::kUInt8 && scale.dim() == 2 && scale.is_contiguous(),
              "scale must be a contiguous uint8 [N, K/32] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0 && packed.size(1) * 2 == K && scale.size(1) * kBlock == K &&
                  packed.size(0) == scale.size(0),
              "inconsistent shapes: x ", x.sizes(), ", packed ", packed.sizes(), ", scale ", scale.sizes());
}


// Output rows per task of the small-M paths: about 64 KiB of packed weights, so small matrices are not split.
int64_t gemv_grain(int64_t K) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K / 2)); }

// Small-M path: parallel over output rows, groups of up to kMaxRows rows of x per pass over W. Each output
// is computed by one thread in a fixed order, so results do not depend on the number of threads; both M = 1
// variants give the same bits. `variant`: "auto" (gemv_variant()), "avx2" or "avx512".
torch::Tensor matmul_gemv(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                          const std::string& variant) {
  const bool wide = mxfp4_rows512::wide_variant(variant);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  torch::Tensor out = torch::empty({M, N}, x.options());
  std::vector<float> storage;
  const mxfp4_rows512::LaidOut xd = mxfp4_rows512::lay_out(x.data_ptr<float>(), K, M, wide, storage);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, gemv_grain(K), [&](int64_t n_begin, int64_t n_end) {
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, M - r0);
      mxfp4_rows512::kernel(wide, M, rows)(xd.data + r0 * xd.stride, xd.stride, pp, sp, K, op + r0 * N, N,
                                           n_begin, n_end);
    }
  });
  return out;
}

// Small-M path of a bfloat16 x: the bf16 dot-product GEMV of _native_bf16.h where the CPU has AVX-512 BF16,
// else x converted to fp32 for the fp32 GEMV and the result rounded to bfloat16.
torch::Tensor matmul_gemv_bf16(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                               const std::string& variant) {
  static const bool supported = mxfp4_bf16::cpu_supported();
  if (!supported) return matmul_gemv(x.to(torch::kFloat32), packed, scale, variant).to(torch::kBFloat16);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  torch::Tensor out = torch::empty({M, N}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  at::parallel_for(0, N, gemv_grain(K), [&](int64_t n_begin, int64_t n_end) {
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, M - r0);
      mxfp4_bf16::kGemvRows[rows](xp + r0 * K, pp, sp, K, N, op + r0 * N, n_begin, n_end);
    }
  });
  return out;
}

// Large-M path: per thread, decode [tile_n, tile_k] tiles of W into scratch (x's dtype) and multiply with
// torch's GEMM. A bfloat16 tile spans all of K (as many rows as tile_n * tile_k elements hold, at least one),
// so that the output is rounded to bfloat16 once rather than once per tile of K.
template <typename T>
torch::Tensor matmul_tiled(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                           int64_t tile_n, int64_t tile_k) {
  TORCH_CHECK(tile_n > 0 && tile_k > 0 && tile_k % kBlock == 0, "tile_n > 0 and tile_k a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  if constexpr (!std::is_same_v<T, float>) {
    tile_n = std::max<int64_t>(1, tile_n * tile_k / K);
    tile_k = K;
  }
  torch::Tensor out = torch::empty({M, N}, x.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  const int64_t n_tiles = (N + tile_n - 1) / tile_n;
  // The worker threads do not inherit inference mode: without it, addmm_ into `out` (an inference tensor
  // when the caller runs under torch.inference_mode) is refused there.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, n_tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    c10::InferenceMode guard(inference);
    torch::Tensor scratch = torch::empty({tile_n * tile_k}, x.options());  // per-thread tile buffer
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n0 = t * tile_n, rows = std::min(tile_n, N - n0);
      torch::Tensor out_tile = out.narrow(1, n0, rows);  // [M, rows], row stride N
      for (int64_t k0 = 0; k0 < K; k0 += tile_k) {
        const int64_t cols = std::min(tile_k, K - k0);
        decode_tile(pp, sp, K, n0, rows, k0, cols, scratch.data_ptr<T>());
        torch::Tensor w_tile = scratch.narrow(0, 0, rows * cols).view({rows, cols});
        // out_tile = (k0 == 0 ? 0 : out_tile) + x[:, k0:k0+cols] @ w_tile^T
        out_tile.addmm_(x.narrow(1, k0, cols), w_tile.t(), /*beta=*/k0 == 0 ? 0.0 : 1.0);
      }
    }
  });
  return out;
}

torch::Tensor matmul(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                     int64_t gemv_max_m, int64_t tile_n, int64_t tile_k, const std::string& variant) {
  check_inputs(x, packed, scale);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  if (x.size(0) <= gemv_max_m) return (bf16 ? matmul_gemv_bf16 : matmul_gemv)(x, packed, scale, variant);
  if (bf16) return matmul_tiled<at::BFloat16>(x, packed, scale, tile_n, tile_k);
  return matmul_tiled<float>(x, packed, scale, tile_n, tile_k);
}

// The approximate path (_native_int8.h): x rounded to int8 per block of 32 (once), integer products.
// Parallel over output rows like matmul_gemv; groups of up to kMaxRows rows of x per pass over W.
torch::Tensor matmul_int8_x(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                            const std::string& variant) {
  check_inputs(x, packed, scale);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  torch::Tensor out = torch::empty({M, N}, x.options());
  const bool vnni = mxfp4_int8::vnni_variant(variant);
  mxfp4_int8::LaidOutRows xr;
  mxfp4_int8::lay_out_rows(x.data_ptr<float>(), K, M, xr);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, gemv_grain(K), [&](int64_t n_begin, int64_t n_end) {
    mxfp4_int8::multiply(xr, M, pp, sp, K, op, N, n_begin, n_end, vnni);
  });
  return out;
}

// Histograms for the atlas scan (k3.atlas.stats), 65,536 bins each. Single-threaded on purpose: the scan
// runs one per worker thread, with the GIL released. Counts go to a uint32 table (256 KiB, stays in L2)
// that is added into the int64 output after every 2^31 elements, so no count can overflow.
constexpr int64_t kBins = 1 << 16;
constexpr int64_t kFlushEvery = int64_t(1) << 31;

void check_histogram_out(const torch::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == torch::kInt64 && out.is_contiguous() && out.numel() == kBins,
              "out must be a contiguous int64 tensor of 65,536 counts");
}

void flush(std::vector<uint32_t>& table, int64_t* out) {
  for (int64_t b = 0; b < kBins; ++b) {
    out[b] += table[b];
    table[b] = 0;
  }
}

// out[pattern] += occurrences of every 16-bit pattern in `data` (BF16, F16, int16: any 2-byte dtype).
void histogram_u16(const torch::Tensor& data, torch::Tensor& out) {
  TORCH_CHECK(data.is_contiguous() && data.element_size() == 2, "data must be a contiguous 16-bit tensor");
  check_histogram_out(out);
  const auto* p = static_cast<const uint16_t*>(data.data_ptr());
  const int64_t n = data.numel();
  std::vector<uint32_t> table(kBins, 0);
  for (int64_t start = 0; start < n; start += kFlushEvery) {
    const int64_t end = std::min(n, start + kFlushEvery);
    for (int64_t i = start; i < end; ++i) ++table[p[i]];
    flush(table, out.data_ptr<int64_t>());
  }
}

// out[scale * 256 + byte] += 1 for every packed byte, `scale` being its block's E8M0 byte:
// packed uint8 [blocks * 16], scale uint8 [blocks] (MXFP4: 16 bytes = 32 codes per scale).
void histogram_scaled_bytes(const torch::Tensor& packed, const torch::Tensor& scale, torch::Tensor& out) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && scale.scalar_type() == torch::kUInt8,
              "packed and scale must be uint8");
  TORCH_CHECK(packed.is_contiguous() && scale.is_contiguous(), "packed and scale must be contiguous");
  TORCH_CHECK(packed.numel() == kBlockBytes * scale.numel(), "packed must hold 16 bytes per scale byte");
  check_histogram_out(out);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  const int64_t blocks = scale.numel();
  const int64_t flush_blocks = kFlushEvery / kBlockBytes;
  std::vector<uint32_t> table(kBins, 0);
  for (int64_t start = 0; start < blocks; start += flush_blocks) {
    const int64_t end = std::min(blocks, start + flush_blocks);
    for (int64_t b = start; b < end; ++b) {
      uint32_t* row = table.data() + (static_cast<uint32_t>(sp[b]) << 8);
      const uint8_t* bytes = pp + b * kBlockBytes;
      for (int64_t j = 0; j < kBlockBytes; ++j) ++row[bytes[j]];
    }
    flush(table, out.data_ptr<int64_t>());
  }
}



// The routed experts of one token in one call (k3/ops/mxfp4/experts.py holds the same steps in torch):
//     out[L] = sum_j weight_j * W2_j act(W1_j z, W3_j z)
// act 0: SiLU-GLU silu(g) u; act 1: SiTU b tanh(g/b) sigmoid(g) c tanh(u/c), b = beta, c = linear_beta
// (k3_math::GatedActivation, as the decode step applies it).
// `gemv(j, matrix, x, out)` applies matrix 0 (W1, [m, L]), 1 (W3) or 2 (W2, [L, m]) of expert j; the
// experts are split across threads, the weighted sum runs in expert order.
template <typename Gemv>
torch::Tensor run_experts(const torch::Tensor& z, int64_t k, int64_t m, const Gemv& gemv,
                          const torch::Tensor& weights, int64_t act, double beta, double linear_beta) {
  TORCH_CHECK(z.dim() == 2 && z.size(0) == 1 && z.scalar_type() == torch::kFloat32 && z.is_contiguous(),
              "z must be a contiguous float32 [1, L] tensor");
  TORCH_CHECK(weights.scalar_type() == torch::kFloat32 && weights.is_contiguous() && weights.numel() == k,
              "weights must be k contiguous float32 values");
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (SiLU-GLU) or 1 (SiTU)");
  const int64_t L = z.size(1);
  std::vector<float> per_expert(k * L);
  const k3_math::GatedActivation f{act, static_cast<float>(beta), static_cast<float>(linear_beta)};
  at::parallel_for(0, k, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> gate(m), up(m);
    for (int64_t j = j0; j < j1; ++j) {
      gemv(j, 0, z.data_ptr<float>(), gate.data());
      gemv(j, 1, z.data_ptr<float>(), up.data());
      f.apply(gate.data(), up.data(), m);
      gemv(j, 2, gate.data(), per_expert.data() + j * L);
    }
  });
  torch::Tensor out = torch::zeros({1, L}, z.options());
  float* op = out.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t l = 0; l < L; ++l) op[l] += w[j] * per_expert[j * L + l];
  }
  return out;
}

// MXFP4 experts: w1, w3 packed [m, L/2] + scales [m, L/32]; w2 [L, m/2] + [L, m/32]. `int8_x`: each
// matrix's input rounded to int8 per block first (_native_int8.h), else exact.
torch::Tensor experts_one_token(const torch::Tensor& z, const std::vector<torch::Tensor>& packed,
                                const std::vector<torch::Tensor>& scale, const torch::Tensor& weights,
                                int64_t act, double beta, double linear_beta, const std::string& variant,
                                bool int8_x) {
  const bool wide = mxfp4_rows512::wide_variant(variant);
  const int64_t k = static_cast<int64_t>(packed.size()) / 3;
  TORCH_CHECK(k > 0 && packed.size() == 3 * k && scale.size() == packed.size(),
              "packed and scale: (w1, w3, w2) of each expert, in expert order");
  const int64_t L = z.size(1), m = packed[0].size(0);
  TORCH_CHECK(m % kBlock == 0 && L % kBlock == 0, "the experts' sizes must be multiples of 32");
  for (int64_t i = 0; i < 3 * k; ++i) {
    const bool down = i % 3 == 2;
    TORCH_CHECK(packed[i].scalar_type() == torch::kUInt8 && scale[i].scalar_type() == torch::kUInt8 &&
                    packed[i].is_contiguous() && scale[i].is_contiguous() && packed[i].dim() == 2 &&
                    scale[i].dim() == 2,
                "packed weights and scales must be contiguous uint8 matrices");
    const int64_t rows = down ? L : m, cols = down ? m : L;
    TORCH_CHECK(packed[i].size(0) == rows && packed[i].size(1) * 2 == cols && scale[i].size(0) == rows &&
                    scale[i].size(1) * kBlock == cols,
                "expert ", i / 3, ": w1/w3 must be [m, L/2] (+ [m, L/32]), w2 [L, m/2] (+ [L, m/32])");
  }
  auto gemv = [&](int64_t j, int matrix, const float* x, float* out) {
    const int64_t i = 3 * j + matrix, rows = matrix == 2 ? L : m, cols = matrix == 2 ? m : L;
    const uint8_t* pp = packed[i].data_ptr<uint8_t>();
    const uint8_t* sp = scale[i].data_ptr<uint8_t>();
    if (int8_x) return mxfp4_int8::rows_product(x, 1, pp, sp, cols, out, 0, 0, rows, wide && mxfp4_int8::vnni_here());
    thread_local std::vector<float> storage;  // x in the kernels' order
    const float* xd = mxfp4_rows512::lay_out(x, cols, 1, wide, storage).data;
    mxfp4_rows512::kernel(wide, 1, 1)(xd, 0, pp, sp, cols, out, 0, 0, rows);
  };
  return run_experts(z, k, m, gemv, weights, act, beta, linear_beta);
}

// Plain fp32 experts: w1, w3 [m, L]; w2 [L, m].
torch::Tensor experts_one_token_dense(const torch::Tensor& z, const std::vector<torch::Tensor>& dense,
                                      const torch::Tensor& weights, int64_t act, double beta,
                                      double linear_beta) {
  const int64_t k = static_cast<int64_t>(dense.size()) / 3;
  TORCH_CHECK(k > 0 && dense.size() == 3 * k, "dense: (w1, w3, w2) of each expert, in expert order");
  const int64_t L = z.size(1), m = dense[0].size(0);
  for (int64_t i = 0; i < 3 * k; ++i) {
    const bool down = i % 3 == 2;
    TORCH_CHECK(dense[i].scalar_type() == torch::kFloat32 && dense[i].is_contiguous() && dense[i].dim() == 2 &&
                    dense[i].size(0) == (down ? L : m) && dense[i].size(1) == (down ? m : L),
                "expert ", i / 3, ": w1/w3 must be contiguous float32 [m, L], w2 [L, m]");
  }
  auto gemv = [&](int64_t j, int matrix, const float* x, float* out) {
    const int64_t rows = matrix == 2 ? L : m, cols = matrix == 2 ? m : L;
    gemv_dense(x, dense[3 * j + matrix].data_ptr<float>(), cols, rows, out);
  };
  return run_experts(z, k, m, gemv, weights, act, beta, linear_beta);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "k3 MXFP4 native CPU kernels (AVX2 + FMA) and the atlas scan's byte histograms";
  m.def("matmul", &matmul, "x[M, K] fp32 or bf16 @ W^T with W packed MXFP4 [N, K/2] + scales [N, K/32]",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("gemv_max_m"), py::arg("tile_n"),
        py::arg("tile_k"), py::arg("variant") = "auto");
  m.def("matmul_int8_x", &matmul_int8_x,
        "x[M, K] fp32 rounded to int8 per block of 32, @ W^T with W packed MXFP4 (integer products)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("variant") = "auto");
  m.def("gemv_variant", &mxfp4_rows512::gemv_variant, "the M = 1 GEMV in use: 'avx512' or 'avx2'");
  m.def("int8_vnni_supported", &mxfp4_int8::vnni_supported,
        "whether x rounded to int8 is multiplied with AVX-512 VNNI (vpdpbusd) rather than AVX2 (the same bits)");
  m.def("bf16_gemv_supported", &mxfp4_bf16::cpu_supported,
        "whether few rows of a bfloat16 x use bf16 dot products (AVX-512 BF16) rather than fp32 FMAs");
  m.def("histogram_u16", &histogram_u16, "out[65536] int64 += counts of the 16-bit patterns of data",
        py::arg("data"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("histogram_scaled_bytes", &histogram_scaled_bytes,
        "out[65536] int64 += counts of (block scale byte * 256 + packed byte)", py::arg("packed"),
        py::arg("scale"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("experts_one_token", &experts_one_token,
        "sum_j weight_j W2_j act(W1_j z, W3_j z) over one token's MXFP4 experts ((w1, w3, w2) per expert)",
        py::arg("z"), py::arg("packed"), py::arg("scale"), py::arg("weights"), py::arg("act"), py::arg("beta"),
        py::arg("linear_beta"), py::arg("variant") = "auto", py::arg("int8_x") = false);
  m.def("experts_one_token_dense", &experts_one_token_dense,
        "the same for plain float32 experts", py::arg("z"), py::arg("dense"), py::arg("weights"),
        py::arg("act"), py::arg("beta"), py::arg("linear_beta"));
  K3_NATIVE_COMMON(m);  // source_hash, cpu_supported(), cpu_features()
}
