// Every kernel's torch op: its schema and its CPU implementation (declared in ops.h), for torch.ops.<KVSERVE_NS>.
//
// Why one file: torch/library.h is the heaviest header the kernels would include (~7 s of GCC's time per
// file on the 2-core dev machine, more than most kernels' own code), and only registration needs it. Kept
// here, the other files parse ATen's Tensor headers alone, and a variant's first build is ~a third shorter.
// A new kernel's op is declared in ops.h and registered below; a kernel file alone compiles but reaches no op.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(KVSERVE_NS, m) {
  // argmax.cpp
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("race_sample_rows(Tensor x, Tensor inv_temp, Tensor uniform) -> Tensor");
  m.def("top_p_mask_(Tensor(a!) logits, Tensor probs, Tensor top_p, int[] rows) -> ()");
  m.def("top_k_mask_(Tensor(a!) logits, Tensor top_k) -> ()");
  m.def("min_p_mask_(Tensor(a!) logits, Tensor probs, Tensor min_p) -> ()");
  m.def("apply_penalties_(Tensor(a!) logits, Tensor prompt_ids, Tensor prompt_offsets, Tensor output_ids, "
        "Tensor output_offsets, Tensor repetition, Tensor presence, Tensor frequency, bool use_repetition, "
        "bool use_counts) -> ()");
  // decoder_stack.cpp
  m.def("decoder_stack_(Tensor(a!) x, Tensor(b!) residual, Tensor positions, Tensor?[] weights, "
        "Tensor(c!)[] k_caches, Tensor(d!)[] v_caches, Tensor cos_sin, Tensor slots, Tensor row_token, "
        "Tensor row_seq, Tensor row_len, Tensor block_tables, int num_heads, float eps, float scale, "
        "int[] windows, float[] k_scales, float[] v_scales, Tensor? row_last=None, Tensor? out_rows=None) -> ()");
  // dense_linear.cpp
  m.def("dense_linear(Tensor x, Tensor weight, ScalarType? out_dtype=None) -> Tensor");
  // dense_linear_amx.cpp
  m.def("amx_bf16_ready() -> bool", &kvserve_cpu::amx_bf16_ready);  // no tensors: no dispatch key
  m.def("dense_linear_amx(Tensor x, Tensor packed, ScalarType? out_dtype=None) -> Tensor");
  // eagle_head.cpp
  m.def("eagle_step(Tensor feature, Tensor embedding, Tensor?[] weights, float eps) -> (Tensor, Tensor)");
  m.def("eagle_greedy_step(Tensor feature, Tensor embedding, Tensor?[] weights, Tensor vocab_ids, float eps) "
        "-> (Tensor, Tensor)");
  m.def("eagle_top_step(Tensor feature, Tensor embedding, Tensor?[] weights, Tensor vocab_ids, int k, float eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("eagle_draft_chains(Tensor feature, Tensor tokens, Tensor?[] weights, Tensor vocab_ids, Tensor embed_qs, "
        "Tensor? embed_scales, Tensor? embed_mins, int k, int[] depths, float[] rates, float min_gain, float eps) "
        "-> (Tensor, Tensor, Tensor)");
  // elementwise.cpp
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("gemma_rms_norm(Tensor x, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos_sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  // paged_attention.cpp
  m.def("paged_attention_(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, Tensor row_token, "
        "Tensor row_seq, Tensor row_len, Tensor block_tables, float scale, int window, float k_scale=1.0, "
        "float v_scale=1.0, Tensor? row_last=None) -> ()");
  m.def("cache_kv_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, float k_scale=1.0, "
        "float v_scale=1.0) -> ()");
  m.def("copy_slots_(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] src, int[] dst) -> ()");
  // quant_linear.cpp, quant_linear_x8.cpp, quant_linear_x16.cpp
  m.def("quant_linear(Tensor x, Tensor wq, Tensor scales, Tensor? mins, int group, ScalarType? out_dtype=None) -> Tensor");
  m.def("quant_linear_x8(Tensor x, Tensor wq, Tensor scales, Tensor? mins, ScalarType? out_dtype=None) -> Tensor");
  m.def("quant_embedding_x8(Tensor ids, Tensor wq, Tensor scales, Tensor? mins, ScalarType dtype) -> Tensor");
  m.def("quant_linear_x16(Tensor x, Tensor wq, Tensor scales, Tensor? mins, ScalarType? out_dtype=None) -> Tensor");
  m.def("quant_embedding_x16(Tensor ids, Tensor wq, Tensor scales, Tensor? mins, ScalarType dtype) -> Tensor");
  // uniform.cpp
  m.def("mt19937_uniform_(Tensor(a!) out, Generator? generator) -> ()");
}

TORCH_LIBRARY_IMPL(KVSERVE_NS, CPU, m) {
  using namespace kvserve_cpu;
  m.impl("argmax_rows", &argmax_rows);
  m.impl("race_sample_rows", &race_sample_rows);
  m.impl("top_p_mask_", &top_p_mask_);
  m.impl("top_k_mask_", &top_k_mask_);
  m.impl("min_p_mask_", &min_p_mask_);
  m.impl("apply_penalties_", &apply_penalties_);
  m.impl("decoder_stack_", &decoder_stack_);
  m.impl("dense_linear", &dense_linear);
  m.impl("dense_linear_amx", &dense_linear_amx);
  m.impl("eagle_step", &eagle_step);
  m.impl("eagle_greedy_step", &eagle_greedy_step);
  m.impl("eagle_top_step", &eagle_top_step);
  m.impl("eagle_draft_chains", &eagle_draft_chains);
  m.impl("fused_add_rms_norm_", &fused_add_rms_norm_);
  m.impl("gemma_rms_norm", &gemma_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("paged_attention_", &paged_attention_);
  m.impl("cache_kv_", &cache_kv_);
  m.impl("copy_slots_", &copy_slots_);
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_x8", &quant_linear_x8);
  m.impl("quant_embedding_x8", &quant_embedding_x8);
  m.impl("quant_linear_x16", &quant_linear_x16);
  m.impl("quant_embedding_x16", &quant_embedding_x16);
  m.impl("mt19937_uniform_", &mt19937_uniform_);
}
