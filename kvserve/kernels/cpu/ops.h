// The kernels' entry points, declared for kernels that call others directly (decoder_stack.cpp) instead of
// through the dispatcher. Each build (one per instruction set) defines them in its own inline namespace,
// as vec.h does for its helpers, so two builds loaded into one process never bind to each other's code.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#ifndef KVSERVE_NS
#error "KVSERVE_NS (the torch.ops namespace of this build, e.g. kvserve_avx2) must be defined"
#endif

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& x);

// elementwise.cpp
void fused_add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor gemma_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                          double eps);
void rotary_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin);
at::Tensor silu_and_mul(const at::Tensor& x);

// paged_attention.cpp
void paged_attention_(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& row_token, const at::Tensor& row_seq,
                      const at::Tensor& row_len, const at::Tensor& block_tables, double scale, int64_t window,
                      double k_scale, double v_scale);
void cache_kv_(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& slots, double k_scale, double v_scale);

// quant_linear_x8.cpp
at::Tensor quant_linear_x8(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins);

// quant_linear_x16.cpp
at::Tensor quant_linear_x16(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                            const std::optional<at::Tensor>& mins);

// A weight in either tiled layout: x16's qs has four dimensions, x8's five (q4) or six (q8).
inline at::Tensor quant_linear_tiled(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                     const std::optional<at::Tensor>& mins) {
  if (wq.dim() == 4) return quant_linear_x16(x, wq, scales, mins);
  return quant_linear_x8(x, wq, scales, mins);
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
