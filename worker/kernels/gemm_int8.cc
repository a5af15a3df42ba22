// Experimental int8-weight linear layer (AVX512-VNNI), measured by benchmarks/gemm.py --int8; not used by the
// model yet. out[M, N] = x[M, K] @ W[K, N] with W quantised per output column (symmetric int8, float scale)
// and x quantised per row at call time (symmetric, 127 levels) then shifted to uint8 (+128) because
// vpdpbusd multiplies unsigned by signed bytes; the shift is undone with the packed column sums:
//   sum_k (q_k + 128) w_k = sum_k q_k w_k + 128 * colsum.
// Layout (worker/kernels/gemm.py pack_int8): chunks of 64 columns, inside a chunk the rows taken four at
// a time: packed[chunk][k / 4][column % 64][k % 4], so each 64-byte piece is one vpdpbusd operand and a
// chunk is one sequential stream over K, as in gemm_bf16.cc.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paddle/extension.h"

namespace {

constexpr int64_t kBlock = 16;
constexpr int kBlocks = 4;
constexpr int kMaxRows = 4;

// Row m of x -> (k, k+1, k+2, k+3) uint8 quads in uint32 and its scale (max |x| / 127).
void quantise_rows(const float* x, int64_t rows, int64_t k, uint32_t* out, int64_t quads, float* scales) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* src = x + m * k;
    float peak = 0.f;
    for (int64_t i = 0; i < k; ++i) peak = std::max(peak, std::fabs(src[i]));
    const float scale = peak > 0.f ? peak / 127.f : 1.f;
    scales[m] = scale;
    uint8_t* dst = reinterpret_cast<uint8_t*>(out + m * quads);
    const float inverse = 1.f / scale;
    for (int64_t i = 0; i < 4 * quads; ++i) {
      const float value = i < k ? src[i] * inverse : 0.f;
      dst[i] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(value)) + 128);
    }
  }
}

template <int R>
void tile(const uint32_t* xq, int64_t quads, const int8_t* w, const float* row_scales, const float* col_scales,
          const int32_t* col_sums, float* out, int64_t ldo, int64_t valid) {
  constexpr int B = kBlocks;
  __m512i acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_si512();
  for (int64_t q = 0; q < quads; ++q) {
    __m512i wv[B];
    for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(w + (q * B + b) * 4 * kBlock);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xq[r * quads + q]));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], xv, wv[b]);
    }
  }
  for (int b = 0; b < B && b * kBlock < valid; ++b) {
    const int64_t cols = std::min<int64_t>(kBlock, valid - b * kBlock);
    const __mmask16 mask = static_cast<__mmask16>(cols >= 16 ? 0xFFFFu : ((1u << cols) - 1u));
    const __m512i shift = _mm512_slli_epi32(_mm512_loadu_si512(col_sums + b * kBlock), 7);  // 128 * colsum
    const __m512 scale = _mm512_loadu_ps(col_scales + b * kBlock);
    for (int r = 0; r < R; ++r) {
      const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][b], shift));
      const __m512 value = _mm512_mul_ps(_mm512_mul_ps(exact, scale), _mm512_set1_ps(row_scales[r]));
      _mm512_mask_storeu_ps(out + r * ldo + b * kBlock, mask, value);
    }
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const int8_t*, const float*, const float*, const int32_t*, float*,
                        int64_t, int64_t);

TileFn tile_for(int rows) {
  switch (rows) {
    case 1: return tile<1>;
    case 2: return tile<2>;
    case 3: return tile<3>;
    default: return tile<4>;
  }
}

}  // namespace

std::vector<paddle::Tensor> Int8Linear(const paddle::Tensor& x, const paddle::Tensor& w,
                                       const paddle::Tensor& col_scales, const paddle::Tensor& col_sums, int64_t n) {
  PD_CHECK(x.is_cpu() && x.dtype() == paddle::DataType::FLOAT32, "fd_int8_linear: x must be float32 on the CPU");
  PD_CHECK(w.dtype() == paddle::DataType::INT8, "fd_int8_linear: w must be the packed int8 weight");
  const int64_t k = x.shape().back();
  const int64_t quads = (k + 3) / 4;
  const int64_t chunk_cols = kBlocks * kBlock;
  const int64_t chunks = (n + chunk_cols - 1) / chunk_cols;
  PD_CHECK(w.shape().size() == 3 && w.shape()[0] == chunks && w.shape()[1] == quads && w.shape()[2] == 4 * chunk_cols,
           "fd_int8_linear: packed weight shape does not match K and N");
  PD_CHECK(col_scales.numel() == chunks * chunk_cols && col_sums.numel() == chunks * chunk_cols,
           "fd_int8_linear: scales / column sums must cover the padded columns");
  const int64_t rows = x.numel() / std::max<int64_t>(k, 1);
  std::vector<int64_t> out_shape = x.shape();
  out_shape.back() = n;
  auto out = paddle::empty(out_shape, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (rows == 0) return {out};
  std::vector<uint32_t> xq(static_cast<size_t>(rows * quads));
  std::vector<float> row_scales(static_cast<size_t>(rows));
  quantise_rows(x.data<float>(), rows, k, xq.data(), quads, row_scales.data());
  const int8_t* wp = w.data<int8_t>();
  const float* scales = col_scales.data<float>();
  const int32_t* sums = col_sums.data<int32_t>();
  float* o = out.data<float>();
  const int64_t chunk_stride = quads * 4 * chunk_cols;
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t col = chunk * chunk_cols;
    for (int64_t m = 0; m < rows; m += kMaxRows) {
      const int nrows = static_cast<int>(std::min<int64_t>(kMaxRows, rows - m));
      tile_for(nrows)(xq.data() + m * quads, quads, wp + chunk * chunk_stride, row_scales.data() + m, scales + col,
                      sums + col, o + m * n + col, n, n - col);
    }
  }
  return {out};
}

std::vector<std::vector<int64_t>> Int8LinearShape(const std::vector<int64_t>& x_shape,
                                                  const std::vector<int64_t>& w_shape,
                                                  const std::vector<int64_t>& s_shape,
                                                  const std::vector<int64_t>& c_shape, int64_t n) {
  std::vector<int64_t> out(x_shape);
  out.back() = n;
  return {out};
}

std::vector<paddle::DataType> Int8LinearDtype(const paddle::DataType& x, const paddle::DataType& w,
                                              const paddle::DataType& s, const paddle::DataType& c) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_int8_linear)
    .Inputs({"X", "W", "Scales", "ColSums"})
    .Outputs({"Out"})
    .Attrs({"n: int64_t"})
    .SetKernelFn(PD_KERNEL(Int8Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Int8LinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Int8LinearDtype));
