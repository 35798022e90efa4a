// Fused elementwise ops of the decoder layer, for CPUs with AVX-512 or AVX2 (on vec.h's Vec16): residual add + RMSNorm
// (Llama's, and Gemma's), rotary embedding in place, SiLU(gate) * up. Each replaces 4-10 torch ops (each a pass over memory and a
// dispatch, ~10 us of overhead apiece at small batches) with one pass.
//
// bfloat16 results are rounded at the same points as the torch code they replace (kvserve/layers), so
// the two agree to within a rounding step: RMSNorm normalises in float32, rounds, then multiplies by
// the weight; SiLU rounds before the multiply by `up`.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops.h"
#include "vec.h"

namespace {

using namespace kvserve_cpu;

// What storing to T and loading back gives: the rounding of an intermediate result.
template <typename T>
inline Vec16 round_to(Vec16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return round_bf16(v);
  }
}

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* weight, int64_t rows, int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* xr = x + row * n;
      T* rr = residual + row * n;
      Vec16 sq = zero();
      for (int64_t i = 0; i < n; i += 16) {
        const Vec16 h = round_to<T>(load(xr + i, n - i) + load(rr + i, n - i));
        store(rr + i, h, n - i);
        sq = fmadd(h, h, sq);
      }
      const Vec16 inv = broadcast(1.f / std::sqrt(reduce_add(sq) / static_cast<float>(n) + static_cast<float>(eps)));
      for (int64_t i = 0; i < n; i += 16) {
        const Vec16 normed = round_to<T>(load(rr + i, n - i) * inv);
        store(xr + i, load(weight + i, n - i) * normed, n - i);
      }
    }
  });
}

// Gemma's RMSNorm: x / rms(x) * (1 + weight) in float32, rounded once (kvserve/layers/norm.py, GemmaRMSNorm);
// with a residual, residual += x first (rounded to T, as torch's add is) and the sum is normalised. Rows are
// x's [.., n] rows at x + (row / inner) * s0 + (row % inner) * s1: a [T, H, D] view of the fused qkv
// projection (the per-head q/k norms) or plain [rows, n]; out is contiguous.
template <typename T>
void gemma_norm_rows(const T* x, int64_t s0, int64_t s1, int64_t inner, T* residual, const T* weight, T* out,
                     int64_t rows, int64_t n, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + (row / inner) * s0 + (row % inner) * s1;
      const T* src = xr;
      Vec16 sq = zero();
      if (residual != nullptr) {
        T* rr = residual + row * n;
        for (int64_t i = 0; i < n; i += 16) {
          const Vec16 h = round_to<T>(load(xr + i, n - i) + load(rr + i, n - i));
          store(rr + i, h, n - i);
          sq = fmadd(h, h, sq);
        }
        src = rr;
      } else {
        for (int64_t i = 0; i < n; i += 16) {
          const Vec16 h = load(xr + i, n - i);
          sq = fmadd(h, h, sq);
        }
      }
      const Vec16 inv = broadcast(1.f / std::sqrt(reduce_add(sq) / static_cast<float>(n) + static_cast<float>(eps)));
      T* o = out + row * n;
      for (int64_t i = 0; i < n; i += 16)
        store(o + i, (load(src + i, n - i) * inv) * (broadcast(1.f) + load(weight + i, n - i)), n - i);
    }
  });
}

template <typename T>
void rotary_rows(T* x, int64_t tokens, int64_t heads, int64_t row_stride, int64_t D, const int64_t* positions,
                 const float* cos_sin) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + positions[t] * D;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* a = x + t * row_stride + h * D;
        T* b = a + half;
        for (int64_t i = 0; i < half; i += 16) {
          const int64_t m = half - i;
          const Vec16 x1 = load(a + i, m), x2 = load(b + i, m), c = load(cos + i, m), s = load(sin + i, m);
          store(a + i, x1 * c - x2 * s, m);
          store(b + i, x2 * c + x1 * s, m);
        }
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = x + row * 2 * n;
      const T* up = gate + n;
      T* o = out + row * n;
      for (int64_t i = 0; i < n; i += 16) {
        const Vec16 g = load(gate + i, n - i);
        const Vec16 silu = round_to<T>(g / (broadcast(1.f) + exp_ps(zero() - g)));
        store(o + i, silu * load(up + i, n - i), n - i);
      }
    }
  });
}

template <typename F>
void dispatch(at::ScalarType t, const char* name, F&& f) {
  if (t == at::kBFloat16) f(c10::BFloat16{});
  else if (t == at::kFloat) f(float{});
  else TORCH_CHECK(false, name, ": bfloat16 or float32 only");
}

}  // namespace

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// residual += x; x = rms_norm(residual) * weight. x, residual: [rows, n] contiguous; weight [n].
void fused_add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
              x.sizes() == residual.sizes() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "fused_add_rms_norm_: x, residual [.., n] contiguous and weight [n]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "fused_add_rms_norm_: one dtype for x, residual and weight");
  const int64_t n = weight.size(0), rows = n ? x.numel() / n : 0;
  dispatch(x.scalar_type(), "fused_add_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), weight.data_ptr<T>(), rows, n, eps);
  });
}

// Gemma's RMSNorm of x [rows, n] or [T, H, n] (last dim contiguous, other strides free) -> a new contiguous
// tensor of x's shape. With residual ([rows, n] contiguous, x then contiguous too): residual += x first, in
// place, and the sum is what is normalised.
at::Tensor gemma_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                          double eps) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1 && weight.is_contiguous() && weight.dim() == 1 &&
              x.size(-1) == weight.size(0) && x.scalar_type() == weight.scalar_type(),
              "gemma_rms_norm: x [rows, n] or [T, H, n] with contiguous rows, weight [n] of x's dtype");
  const bool add = residual.has_value() && residual->defined();
  if (add)
    TORCH_CHECK(x.is_contiguous() && residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type(), "gemma_rms_norm: residual like x, both contiguous");
  const int64_t n = weight.size(0), inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t rows = x.dim() == 3 ? x.size(0) * x.size(1) : x.size(0);
  const int64_t s0 = x.stride(0), s1 = x.dim() == 3 ? x.stride(1) : 0;
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x.scalar_type(), "gemma_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    gemma_norm_rows<T>(x.data_ptr<T>(), s0, s1, inner, add ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                       out.data_ptr<T>(), rows, n, eps);
  });
  return out;
}

// Rotate-half RoPE in place on x [T, H, D] (rows may be strided, heads and dims contiguous), at
// positions [T], from cos_sin [P, D] float32 (cos in the first half of each row, sin in the second).
void rotary_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "rotary_: x must be [T, H, D] with contiguous heads");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == x.size(0));
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.size(1) == x.size(2));
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "rotary_: position ", pos[t], " out of range");
  dispatch(x.scalar_type(), "rotary_", [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0), x.size(2), pos, cos_sin.data_ptr<float>());
  });
}

// SiLU(gate) * up over x = [.., 2n] (gate first): returns [.., n].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "silu_and_mul: x must be contiguous, last dim even");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, x.options());
  const int64_t n = sizes.back(), rows = n ? out.numel() / n : 0;
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows<T>(x.data_ptr<T>(), out.data_ptr<T>(), rows, n);
  });
  return out;
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
