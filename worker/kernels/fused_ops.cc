// Fused elementwise ops of the Llama decoder layer, float32 on x86 CPUs with AVX-512F:
//
//   fd_add_rms_norm(x, residual, weight, eps) -> (normed, summed)
//       summed = x + residual; normed = summed * rsqrt(mean(summed^2) + eps) * weight
//   fd_rms_norm(x, weight, eps) -> normed          (the first layer's norm: no residual yet)
//   fd_silu_and_mul(gate_up) -> out                 out = silu(gate) * up, gate | up = the two halves of each row
//
// Each replaces two to four Paddle ops (and their intermediate tensors) with one pass over the rows.
// Numerics follow Paddle's CPU fused_rms_norm: the mean of squares of a row is accumulated in float32
// lanes (16 partial sums, then a reduction), the scale is 1 / sqrt(mean + eps), and the output is
// (x * scale) * weight in that order. silu uses an AVX-512 expf (Cody-Waite range reduction, degree-7
// Taylor polynomial, exponent applied with vscalefps), accurate to ~2 ulp, then g / (1 + exp(-g)).
//
// Threads: entering an OpenMP parallel region costs ~50 us with libiomp5, more than a decode step's
// whole norm, so small inputs run on the calling thread (the `if` clauses); only schedule(static) is
// used (libiomp5 lacks gcc's dynamic-schedule entry points, see build.py).
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "paddle/extension.h"

namespace {

constexpr int64_t kLanes = 16;
// Below this many floats per call the whole op runs on the calling thread (see the header).
constexpr int64_t kParallelFloats = 1 << 16;

inline __mmask16 tail_mask(int64_t left) {
  return left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// One row: optionally summed = x + residual (stored), then normed = summed * rsqrt(mean sq + eps) * w.
void norm_row(const float* x, const float* residual, const float* w, float* summed, float* normed, int64_t n,
              float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = tail_mask(n - i);
    __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    if (residual != nullptr) {
      v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, residual + i));
      _mm512_mask_storeu_ps(summed + i, mask, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float* src = residual != nullptr ? summed : x;
  const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(n);
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, src + i);
    const __m512 out = _mm512_mul_ps(_mm512_mul_ps(v, scale), _mm512_maskz_loadu_ps(mask, w + i));
    _mm512_mask_storeu_ps(normed + i, mask, out);
  }
}

void norm_rows(const float* x, const float* residual, const float* w, float* summed, float* normed, int64_t rows,
               int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelFloats)
  for (int64_t r = 0; r < rows; ++r) {
    norm_row(x + r * n, residual != nullptr ? residual + r * n : nullptr, w,
             summed != nullptr ? summed + r * n : nullptr, normed + r * n, n, eps);
  }
}

// expf for 16 lanes: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 Taylor polynomial
// (Horner), times 2^k by vscalefps (which also gives inf / 0 past the float range).
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, ln2_hi, x);
  r = _mm512_fnmadd_ps(k, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = tail_mask(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
    const __m512 u = _mm512_maskz_loadu_ps(mask, up + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(out + i, mask, _mm512_mul_ps(silu, u));
  }
}

void silu_mul_rows(const float* gate_up, float* out, int64_t rows, int64_t half) {
#pragma omp parallel for schedule(static) if (rows * half >= kParallelFloats)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = gate_up + r * 2 * half;
    silu_mul_row(row, row + half, out + r * half, half);
  }
}

void check_float_cpu(const paddle::Tensor& t, const char* what) {
  PD_CHECK(t.is_cpu(), what, " must be on the CPU");
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, what, " must be float32");
}

}  // namespace

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& residual,
                                       const paddle::Tensor& weight, float eps) {
  check_float_cpu(x, "fd_add_rms_norm: x");
  check_float_cpu(residual, "fd_add_rms_norm: residual");
  check_float_cpu(weight, "fd_add_rms_norm: weight");
  const int64_t n = x.shape().back();
  PD_CHECK(residual.shape() == x.shape(), "fd_add_rms_norm: residual shape differs from x");
  PD_CHECK(weight.numel() == n, "fd_add_rms_norm: weight length differs from the last dimension of x");
  const int64_t rows = n > 0 ? x.numel() / n : 0;
  auto normed = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto summed = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (rows > 0) {
    norm_rows(x.data<float>(), residual.data<float>(), weight.data<float>(), summed.data<float>(),
              normed.data<float>(), rows, n, eps);
  }
  return {normed, summed};
}

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& weight, float eps) {
  check_float_cpu(x, "fd_rms_norm: x");
  check_float_cpu(weight, "fd_rms_norm: weight");
  const int64_t n = x.shape().back();
  PD_CHECK(weight.numel() == n, "fd_rms_norm: weight length differs from the last dimension of x");
  const int64_t rows = n > 0 ? x.numel() / n : 0;
  auto normed = paddle::empty(x.shape(), paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (rows > 0) {
    norm_rows(x.data<float>(), nullptr, weight.data<float>(), nullptr, normed.data<float>(), rows, n, eps);
  }
  return {normed};
}

std::vector<paddle::Tensor> SiluAndMul(const paddle::Tensor& gate_up) {
  check_float_cpu(gate_up, "fd_silu_and_mul: gate_up");
  const int64_t width = gate_up.shape().back();
  PD_CHECK(width % 2 == 0, "fd_silu_and_mul: the last dimension must be even (gate | up halves)");
  const int64_t half = width / 2;
  std::vector<int64_t> shape = gate_up.shape();
  shape.back() = half;
  auto out = paddle::empty(shape, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const int64_t rows = width > 0 ? gate_up.numel() / width : 0;
  if (rows > 0 && half > 0) silu_mul_rows(gate_up.data<float>(), out.data<float>(), rows, half);
  return {out};
}

std::vector<std::vector<int64_t>> AddRmsNormShape(const std::vector<int64_t>& x, const std::vector<int64_t>& r,
                                                  const std::vector<int64_t>& w) {
  return {x, x};
}

std::vector<paddle::DataType> AddRmsNormDtype(const paddle::DataType& x, const paddle::DataType& r,
                                              const paddle::DataType& w) {
  return {paddle::DataType::FLOAT32, paddle::DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> RmsNormShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  return {x};
}

std::vector<paddle::DataType> RmsNormDtype(const paddle::DataType& x, const paddle::DataType& w) {
  return {paddle::DataType::FLOAT32};
}

std::vector<std::vector<int64_t>> SiluAndMulShape(const std::vector<int64_t>& x) {
  std::vector<int64_t> out(x);
  if (!out.empty() && out.back() > 0) out.back() /= 2;
  return {out};
}

std::vector<paddle::DataType> SiluAndMulDtype(const paddle::DataType& x) { return {paddle::DataType::FLOAT32}; }

PD_BUILD_OP(fd_add_rms_norm)
    .Inputs({"X", "Residual", "Weight"})
    .Outputs({"Normed", "Summed"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(AddRmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AddRmsNormDtype));

PD_BUILD_OP(fd_rms_norm)
    .Inputs({"X", "Weight"})
    .Outputs({"Normed"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormDtype));

PD_BUILD_OP(fd_silu_and_mul)
    .Inputs({"GateUp"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(SiluAndMul))
    .SetInferShapeFn(PD_INFER_SHAPE(SiluAndMulShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SiluAndMulDtype));
