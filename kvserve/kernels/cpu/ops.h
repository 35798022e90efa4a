// The kernels' entry points: registered with torch in bindings.cpp, and called directly by kernels that use
// others (decoder_stack.cpp, eagle_head.cpp) instead of through the dispatcher. Each build (one per
// instruction set) defines them in its own inline namespace, as vec.h does for its helpers, so two builds
// loaded into one process never bind to each other's code.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/remainder.h>

#include <optional>
#include <tuple>

#ifndef KVSERVE_NS
#error "KVSERVE_NS (the torch.ops namespace of this build, e.g. kvserve_avx2) must be defined"
#endif

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor race_sample_rows(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& uniform);
void top_p_mask_(const at::Tensor& logits, const at::Tensor& probs, const at::Tensor& top_p, at::IntArrayRef rows);
void top_k_mask_(const at::Tensor& logits, const at::Tensor& top_k);
void min_p_mask_(const at::Tensor& logits, const at::Tensor& probs, const at::Tensor& min_p);
void apply_penalties_(const at::Tensor& logits, const at::Tensor& prompt_ids, const at::Tensor& prompt_offsets,
                      const at::Tensor& output_ids, const at::Tensor& output_offsets, const at::Tensor& repetition,
                      const at::Tensor& presence, const at::Tensor& frequency, bool use_repetition, bool use_counts);

// decoder_stack.cpp
void decoder_stack_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& positions,
                    const c10::List<std::optional<at::Tensor>>& weights, at::TensorList k_caches,
                    at::TensorList v_caches, const at::Tensor& cos_sin, const at::Tensor& slots,
                    const at::Tensor& row_token, const at::Tensor& row_seq, const at::Tensor& row_len,
                    const at::Tensor& block_tables, int64_t num_heads, double eps, double scale,
                    at::IntArrayRef windows, at::ArrayRef<double> k_scales, at::ArrayRef<double> v_scales,
                    const std::optional<at::Tensor>& row_last, const std::optional<at::Tensor>& out_rows);

// dense_linear.cpp
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, std::optional<at::ScalarType> out_dtype);

// dense_linear_amx.cpp
bool amx_bf16_ready();
at::Tensor dense_linear_amx(const at::Tensor& x, const at::Tensor& packed, std::optional<at::ScalarType> out_dtype);

// eagle_head.cpp
std::tuple<at::Tensor, at::Tensor> eagle_step(const at::Tensor& feature, const at::Tensor& embedding,
                                              const c10::List<std::optional<at::Tensor>>& weights, double eps);
std::tuple<at::Tensor, at::Tensor> eagle_greedy_step(const at::Tensor& feature, const at::Tensor& embedding,
                                                     const c10::List<std::optional<at::Tensor>>& weights,
                                                     const at::Tensor& vocab_ids, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle_top_step(const at::Tensor& feature, const at::Tensor& embedding,
                                                              const c10::List<std::optional<at::Tensor>>& weights,
                                                              const at::Tensor& vocab_ids, int64_t k, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle_draft_chains(
    const at::Tensor& feature, const at::Tensor& tokens, const c10::List<std::optional<at::Tensor>>& weights,
    const at::Tensor& vocab_ids, const at::Tensor& embed_qs, const std::optional<at::Tensor>& embed_scales,
    const std::optional<at::Tensor>& embed_mins, int64_t k, at::IntArrayRef depths, at::ArrayRef<double> rates,
    double min_gain, double eps);

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
                      double k_scale, double v_scale, const std::optional<at::Tensor>& row_last);
void cache_kv_(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& slots, double k_scale, double v_scale);
void copy_slots_(at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef src, at::IntArrayRef dst);

// quant_linear.cpp
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t group,
                        std::optional<at::ScalarType> out_dtype = std::nullopt);

// quant_linear_x8.cpp
at::Tensor quant_linear_x8(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                           const std::optional<at::Tensor>& mins, std::optional<at::ScalarType> out_dtype = std::nullopt);
at::Tensor quant_embedding_x8(const at::Tensor& ids, const at::Tensor& wq, const at::Tensor& scales,
                              const std::optional<at::Tensor>& mins, at::ScalarType dtype);

// quant_linear_x16.cpp
at::Tensor quant_linear_x16(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                            const std::optional<at::Tensor>& mins, std::optional<at::ScalarType> out_dtype = std::nullopt);
at::Tensor quant_embedding_x16(const at::Tensor& ids, const at::Tensor& wq, const at::Tensor& scales,
                               const std::optional<at::Tensor>& mins, at::ScalarType dtype);

// uniform.cpp
void mt19937_uniform_(const at::Tensor& out, const std::optional<at::Generator>& generator);

// A weight in either tiled layout: x16's qs has four dimensions, x8's five (q4) or six (q8); y in x's dtype.
inline at::Tensor quant_linear_tiled(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                                     const std::optional<at::Tensor>& mins) {
  if (wq.dim() == 4) return quant_linear_x16(x, wq, scales, mins);
  return quant_linear_x8(x, wq, scales, mins);
}

// An embedding in either tiled layout (as quant_linear_tiled tells them apart).
inline at::Tensor quant_embedding_tiled(const at::Tensor& ids, const at::Tensor& wq, const at::Tensor& scales,
                                        const std::optional<at::Tensor>& mins, at::ScalarType dtype) {
  if (wq.dim() == 4) return quant_embedding_x16(ids, wq, scales, mins, dtype);
  return quant_embedding_x8(ids, wq, scales, mins, dtype);
}

// A linear layer in any weight format the engine's CPU layers multiply on these kernels, as
// kvserve/layers/quantization/methods.py does: quantized tiles (scales present) on quant_linear_tiled; a float
// weight [N, K] on dense_linear, or one packed into AMX tiles [N/16, K/32, 16, 16, 2] on dense_linear_amx
// (bfloat16 tiles: x rounded to bfloat16 first and y bfloat16, as FloatMethod.apply does; else y in x's
// dtype). Native code that runs a model's layers (decoder_stack.cpp, eagle_head.cpp)
// takes each layer as (weight, scales, mins), scales and mins None for a float weight.
inline at::Tensor any_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                             const std::optional<at::Tensor>& mins) {
  if (scales.has_value()) return quant_linear_tiled(x, weight, *scales, mins);
  if (weight.dim() == 5) return dense_linear_amx(x.to(at::kBFloat16), weight, std::nullopt);
  return dense_linear(x, weight, std::nullopt);
}

// An embedding's rows ids [n] in dtype, its weight in any of any_linear's formats (for a float one,
// FloatMethod.embedding's rows: a packed row is spread over its block's tiles, lane id % 16 of each).
inline at::Tensor any_embedding(const at::Tensor& ids, const at::Tensor& weight,
                                const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& mins,
                                at::ScalarType dtype) {
  if (scales.has_value()) return quant_embedding_tiled(ids, weight, *scales, mins, dtype);
  if (weight.dim() == 2) return weight.index_select(0, ids).to(dtype);
  const int64_t n = ids.size(0);
  const at::Tensor blocks = weight.index_select(0, at::floor_divide(ids, 16));  // [n, K/32, 16, 16, 2]
  const at::Tensor lane = at::remainder(ids, 16).view({n, 1, 1, 1, 1}).expand({n, weight.size(1), 16, 1, 2});
  return blocks.gather(3, lane).reshape({n, -1}).to(dtype);
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
