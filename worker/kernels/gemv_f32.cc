// float32 linear layer for a few rows (decode): out[M, N] = x[M, K] @ W[K, N], W in its usual row-major
// [in, out] layout (the one Paddle's matmul reads; nothing is packed or copied).
//
// With a few rows the layer is bound by reading W from memory. MKL's sgemv/sgemm path for M = 1 reads
// W at about one core's bandwidth (~35-40 GB/s here); two cores streaming disjoint halves of W reach
// ~60-80 GB/s on these machines. So the threads split W into contiguous pieces, each read once,
// front to back:
//
// - K split (narrow layers): thread t takes rows [k_t, k_t+1) of W, a contiguous region, and sums its
//   rows' contributions into a float32 partial [M, N] (L1/L2 resident); the partials are then added.
// - N split (wide layers, e.g. the LM head): thread t takes columns [n_t, n_t+1), long runs of every
//   row, and accumulates straight into out.
//
// Inner loop: 4 rows of W at a time (4 vector loads per 16 columns) feed every row of x, whose
// accumulators are loaded and stored once per 4 rows of W. Accumulation is float32 in a different
// order than MKL's, so results may differ from paddle.matmul in the last bits.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"

namespace {

constexpr int kMaxRows = 8;          // rows of x this op serves (more: the caller uses matmul)
constexpr int64_t kWideColumns = 8192;  // from this width on, threads split columns instead of rows of W
constexpr int kRowsPerPass = 4;      // rows of W per accumulator load/store

// acc[m, n0:n1] += sum over k in [k0, k1) of x[m, k] * W[k, n0:n1], for M rows of x.
template <int M>
void accumulate(const float* x, int64_t K, const float* w, int64_t N, int64_t k0, int64_t k1, int64_t n0,
                int64_t n1, float* acc, int64_t ld_acc) {
  int64_t k = k0;
  for (; k + kRowsPerPass <= k1; k += kRowsPerPass) {
    __m512 xv[M][kRowsPerPass];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kRowsPerPass; ++r) xv[m][r] = _mm512_set1_ps(x[m * K + k + r]);
    const float* w0 = w + k * N;
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16) {
      __m512 wv[kRowsPerPass];
      for (int r = 0; r < kRowsPerPass; ++r) wv[r] = _mm512_loadu_ps(w0 + r * N + n);
      for (int m = 0; m < M; ++m) {
        float* a = acc + m * ld_acc + n;
        __m512 sum = _mm512_loadu_ps(a);
        for (int r = 0; r < kRowsPerPass; ++r) sum = _mm512_fmadd_ps(xv[m][r], wv[r], sum);
        _mm512_storeu_ps(a, sum);
      }
    }
    if (n < n1) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (n1 - n)) - 1u);
      __m512 wv[kRowsPerPass];
      for (int r = 0; r < kRowsPerPass; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w0 + r * N + n);
      for (int m = 0; m < M; ++m) {
        float* a = acc + m * ld_acc + n;
        __m512 sum = _mm512_maskz_loadu_ps(mask, a);
        for (int r = 0; r < kRowsPerPass; ++r) sum = _mm512_fmadd_ps(xv[m][r], wv[r], sum);
        _mm512_mask_storeu_ps(a, mask, sum);
      }
    }
  }
  for (; k < k1; ++k) {  // the last K % 4 rows
    for (int64_t n = n0; n < n1; n += 16) {
      const __mmask16 mask = n + 16 <= n1 ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << (n1 - n)) - 1u);
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + k * N + n);
      for (int m = 0; m < M; ++m) {
        float* a = acc + m * ld_acc + n;
        _mm512_mask_storeu_ps(a, mask, _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv,
                                                       _mm512_maskz_loadu_ps(mask, a)));
      }
    }
  }
}

using AccumulateFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                              float*, int64_t);

AccumulateFn accumulate_for(int64_t rows) {
  switch (rows) {
    case 1: return accumulate<1>;
    case 2: return accumulate<2>;
    case 3: return accumulate<3>;
    case 4: return accumulate<4>;
    case 5: return accumulate<5>;
    case 6: return accumulate<6>;
    case 7: return accumulate<7>;
    default: return accumulate<8>;
  }
}

// Equal shares of [0, total) for `parts` threads, boundaries rounded to `align`.
int64_t share_begin(int64_t total, int64_t parts, int64_t part, int64_t align) {
  const int64_t begin = total * part / parts;
  return std::min(total, (begin + align - 1) / align * align);
}

void linear(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out) {
  const AccumulateFn run = accumulate_for(M);
  std::memset(out, 0, sizeof(float) * M * N);
  const bool split_columns = N >= kWideColumns;
  std::vector<float> partials;  // K split: threads 1.. accumulate here, thread 0 into out
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    if (split_columns) {
      const int64_t n0 = share_begin(N, threads, t, 16), n1 = share_begin(N, threads, t + 1, 16);
      if (n0 < n1) run(x, K, w, N, 0, K, n0, n1, out, N);
    } else {
#pragma omp single
      partials.assign(static_cast<size_t>((threads - 1) * M * N), 0.0f);  // implicit barrier after single
      const int64_t k0 = share_begin(K, threads, t, kRowsPerPass), k1 = share_begin(K, threads, t + 1, kRowsPerPass);
      float* acc = t == 0 ? out : partials.data() + (t - 1) * M * N;
      if (k0 < k1) run(x, K, w, N, k0, k1, 0, N, acc, N);
#pragma omp barrier
      // out += every partial, columns shared out among the threads.
      const int64_t n0 = share_begin(N, threads, t, 16), n1 = share_begin(N, threads, t + 1, 16);
      for (int64_t p = 0; p + 1 < threads; ++p)
        for (int64_t m = 0; m < M; ++m) {
          const float* src = partials.data() + (p * M + m) * N;
          float* dst = out + m * N;
          for (int64_t n = n0; n < n1; ++n) dst[n] += src[n];
        }
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> F32SmallLinear(const paddle::Tensor& x, const paddle::Tensor& w) {
  PD_CHECK(x.is_cpu() && w.is_cpu(), "fd_f32_small_linear: CPU tensors only");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && w.dtype() == paddle::DataType::FLOAT32,
           "fd_f32_small_linear: x and w must be float32");
  PD_CHECK(x.shape().size() == 2 && w.shape().size() == 2, "fd_f32_small_linear: x [M, K] and w [K, N]");
  const int64_t M = x.shape()[0], K = x.shape()[1], N = w.shape()[1];
  PD_CHECK(w.shape()[0] == K, "fd_f32_small_linear: x and w disagree on K");
  PD_CHECK(M >= 1 && M <= kMaxRows, "fd_f32_small_linear: serves 1 to 8 rows (use matmul for more)");
  auto out = paddle::empty({M, N}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  linear(x.data<float>(), M, K, w.data<float>(), N, out.data<float>());
  return {out};
}

std::vector<std::vector<int64_t>> F32SmallLinearShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  return {{x[0], w[1]}};
}

std::vector<paddle::DataType> F32SmallLinearDtype(const paddle::DataType& x, const paddle::DataType&) {
  return {x};
}

PD_BUILD_OP(fd_f32_small_linear)
    .Inputs({"X", "W"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(F32SmallLinear))
    .SetInferShapeFn(PD_INFER_SHAPE(F32SmallLinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(F32SmallLinearDtype));
