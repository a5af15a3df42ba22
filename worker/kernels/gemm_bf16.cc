// bfloat16-weight linear layer for x86 CPUs with AVX512-BF16: out[M, N] = x[M, K] @ W[K, N].
//
// x and out are float32; W is stored in bfloat16 in a packed layout made once at load time
// (worker/kernels/gemm.py, pack_bf16): chunks of 64 output columns, and inside a chunk the rows
// of W taken two at a time and interleaved, so each 64-byte piece holds the (k, k+1) pairs of 16
// columns: packed[chunk][k / 2][column % 64][k % 2]. A chunk is one sequential stream over K (what
// the hardware prefetcher follows best), and each 64-byte piece is the operand of vdpbf16ps, which
// multiplies bf16 pairs and adds both products into a float32 lane: x (rounded to bf16 once per
// call) contributes a broadcast (x[m, k], x[m, k+1]) pair. Accumulation is float32 throughout.
//
// Work split: a register tile is up to kMaxRows rows x one chunk (4 blocks of 16 columns), 16 float32
// accumulators; OpenMP threads take chunks of W, and each chunk serves every row tile
// of x while it is hot in cache. At M = 1 the kernel streams W once (half the bytes of float32).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"

namespace {

constexpr int64_t kBlock = 16;   // output columns per zmm of float32
constexpr int kBlocks = 4;       // blocks per chunk (64 columns): one register tile's width
constexpr int kMaxRows = 4;      // rows of x per register tile

// Rows of x rounded to bf16 (round to nearest even, as vcvtneps2bf16), as (k, k+1) pairs packed in
// uint32; an odd K gets a zero partner for its last element (its W row pair is zero-padded too).
void convert_rows(const float* x, int64_t rows, int64_t k, uint32_t* out, int64_t pairs) {
#pragma omp parallel for schedule(static) if (rows * k > (1 << 15))
  for (int64_t m = 0; m < rows; ++m) {
    const float* src = x + m * k;
    uint16_t* dst = reinterpret_cast<uint16_t*>(out + m * pairs);
    dst[2 * pairs - 1] = 0;
    for (int64_t i = 0; i < k; i += 16) {
      const int64_t left = std::min<int64_t>(16, k - i);
      const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
      const __m512 values = _mm512_maskz_loadu_ps(mask, src + i);
      const __m256bh rounded = _mm512_cvtneps_pbh(values);
      _mm256_mask_storeu_epi16(dst + i, mask, reinterpret_cast<const __m256i&>(rounded));
    }
  }
}

// One register tile: R rows x one chunk, full K. `w` points at the chunk; `valid` is the number of
// real output columns from the chunk's start (the packed padding columns are never stored).
template <int R>
void tile(const uint32_t* xb, int64_t pairs, const uint16_t* w, float* out, int64_t ldo, int64_t valid) {
  constexpr int B = kBlocks;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + (p * B + b) * 2 * kBlock));
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xb[r * pairs + p])));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int b = 0; b < B && b * kBlock < valid; ++b) {
    const int64_t cols = std::min<int64_t>(kBlock, valid - b * kBlock);
    const __mmask16 mask = static_cast<__mmask16>(cols >= 16 ? 0xFFFFu : ((1u << cols) - 1u));
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo + b * kBlock, mask, acc[r][b]);
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, float*, int64_t, int64_t);

TileFn tile_for(int rows) {
  switch (rows) {
    case 1: return tile<1>;
    case 2: return tile<2>;
    case 3: return tile<3>;
    default: return tile<4>;
  }
}

void gemm(const uint32_t* xb, int64_t rows, int64_t pairs, const uint16_t* w, int64_t n, float* out) {
  const int64_t chunk_cols = kBlocks * kBlock;
  const int64_t chunks = (n + chunk_cols - 1) / chunk_cols;
  const int64_t chunk_stride = pairs * 2 * chunk_cols;
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t col = chunk * chunk_cols;
    const uint16_t* wchunk = w + chunk * chunk_stride;
    for (int64_t m = 0; m < rows; m += kMaxRows) {
      const int nrows = static_cast<int>(std::min<int64_t>(kMaxRows, rows - m));
      tile_for(nrows)(xb + m * pairs, pairs, wchunk, out + m * n + col, n, n - col);
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> Bf16Linear(const paddle::Tensor& x, const paddle::Tensor& w, int64_t n) {
  PD_CHECK(x.is_cpu(), "fd_bf16_linear: x must be on the CPU");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "fd_bf16_linear: x must be float32");
  PD_CHECK(w.dtype() == paddle::DataType::INT16, "fd_bf16_linear: w must be the int16 view of packed bf16");
  const auto& xshape = x.shape();
  const int64_t k = xshape.back();
  const int64_t pairs = (k + 1) / 2;
  const int64_t chunks = (n + kBlocks * kBlock - 1) / (kBlocks * kBlock);
  PD_CHECK(w.shape().size() == 3 && w.shape()[0] == chunks && w.shape()[1] == pairs &&
               w.shape()[2] == 2 * kBlocks * kBlock,
           "fd_bf16_linear: packed weight shape does not match K and N");
  const int64_t rows = x.numel() / std::max<int64_t>(k, 1);
  std::vector<int64_t> out_shape(xshape.begin(), xshape.end());
  out_shape.back() = n;
  auto out = paddle::empty(out_shape, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (rows == 0) return {out};
  std::vector<uint32_t> xb(static_cast<size_t>(rows * pairs));
  convert_rows(x.data<float>(), rows, k, xb.data(), pairs);
  gemm(xb.data(), rows, pairs, reinterpret_cast<const uint16_t*>(w.data<int16_t>()), n, out.data<float>());
  return {out};
}

std::vector<std::vector<int64_t>> Bf16LinearShape(const std::vector<int64_t>& x_shape,
                                                  const std::vector<int64_t>& w_shape, int64_t n) {
  std::vector<int64_t> out(x_shape);
  out.back() = n;
  return {out};
}

std::vector<paddle::DataType> Bf16LinearDtype(const paddle::DataType& x_dtype, const paddle::DataType& w_dtype) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fd_bf16_linear)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .Attrs({"n: int64_t"})
    .SetKernelFn(PD_KERNEL(Bf16Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16LinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16LinearDtype));
