// torch.rand's float32 uniforms on the CPU, the same numbers from the same generator, left in the same state.
//
// Why a kernel: sampling draws one uniform per vocabulary entry and row (the exponential race, kvserve/
// sampling/sampler.py), and torch's CPU generator makes them one at a time behind a serial TensorIterator
// loop: ~0.3-0.4 ms for a 49,152-token row on two AVX2 cores, ~5% of a batch-1 decode step and more of a
// speculative verification, whose rows each draw. Here the Mersenne Twister's state update and its output
// tempering run eight words at a time.
//
// What must match torch (ATen/core/MT19937RNGEngine.h, ATen/core/TransformationHelper.h): each float is one
// 32-bit output, (y & (2^24 - 1)) * 2^-24; a call decrements the engine's `left_` and regenerates its 624
// words when that reaches zero, then takes word `next_`. The generator's mutex is held throughout, as in
// torch's own kernel, and the engine's state is written back, so a torch.rand after this one continues the
// same stream (tests/test_cpu_uniform.py checks both against torch.rand).
// AVX2 intrinsics only: the same code runs in the AVX-512 build.
#include <ATen/core/Tensor.h>
#include <ATen/CPUGeneratorImpl.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "ops.h"

namespace {

constexpr int kN = 624, kM = 397;
constexpr uint32_t kMatrixA = 0x9908b0dfu, kUpper = 0x80000000u, kLower = 0x7fffffffu;

inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & kUpper) | (v & kLower)) >> 1) ^ ((v & 1u) ? kMatrixA : 0u);
}

inline __m256i twist8(__m256i u, __m256i v) {
  const __m256i mixed = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(kUpper))),
                                        _mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(kLower))));
  const __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(v, _mm256_set1_epi32(1)), _mm256_set1_epi32(1));
  const __m256i matrix_a = _mm256_set1_epi32(static_cast<int>(kMatrixA));
  return _mm256_xor_si256(_mm256_srli_epi32(mixed, 1), _mm256_and_si256(odd, matrix_a));
}

inline __m256i load8(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The engine's next_state(): word j becomes word (j + 397) mod 624, xor the twist of words j and j + 1. The
// first 227 read words not yet rewritten, the rest words rewritten earlier in this pass (j - 227 < j - 7), so
// eight at a time read nothing a lane of the same group writes.
void next_state(uint32_t* s) {
  int j = 0;
  for (; j + 8 <= kN - kM; j += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + j),
                        _mm256_xor_si256(load8(s + j + kM), twist8(load8(s + j), load8(s + j + 1))));
  for (; j < kN - kM; ++j) s[j] = s[j + kM] ^ twist(s[j], s[j + 1]);
  for (; j + 8 <= kN - 1; j += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + j),
                        _mm256_xor_si256(load8(s + j + kM - kN), twist8(load8(s + j), load8(s + j + 1))));
  for (; j < kN - 1; ++j) s[j] = s[j + kM - kN] ^ twist(s[j], s[j + 1]);
  s[kN - 1] = s[kM - 1] ^ twist(s[kN - 1], s[0]);
}

inline float to_uniform(uint32_t y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return static_cast<float>(y & 0xFFFFFFu) * (1.0f / 16777216.0f);
}

// Tempered words -> uniforms in [0, 1): out[i] for words w[i], i < n.
void uniforms(const uint32_t* w, int64_t n, float* out) {
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0x9d2c5680u));
  const __m256i m2 = _mm256_set1_epi32(static_cast<int>(0xefc60000u));
  const __m256i low24 = _mm256_set1_epi32(0xFFFFFF);
  const __m256 scale = _mm256_set1_ps(1.0f / 16777216.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i y = load8(w + i);
    y = _mm256_xor_si256(y, _mm256_srli_epi32(y, 11));
    y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_slli_epi32(y, 7), m1));
    y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_slli_epi32(y, 15), m2));
    y = _mm256_xor_si256(y, _mm256_srli_epi32(y, 18));
    // Below 2^24: exact as a float, and the multiply by 2^-24 is exact too.
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(y, low24)), scale));
  }
  for (; i < n; ++i) out[i] = to_uniform(w[i]);
}

}  // namespace

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// Fills out (float32, contiguous, on the CPU) as out.uniform_(0, 1, generator=generator) would (torch.rand);
// the default CPU generator where generator is None.
void mt19937_uniform_(const at::Tensor& out, const std::optional<at::Generator>& generator) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "mt19937_uniform_: a contiguous float32 CPU tensor");
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(generator, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  at::mt19937 engine = gen->engine();
  at::mt19937_data_pod d = engine.data();
  float* p = out.data_ptr<float>();
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n;) {
    // A call that brings left_ to zero regenerates the words first, then takes word 0 with left_ = 624.
    if (d.left_ == 1) {
      next_state(d.state_.data());
      d.left_ = kN + 1;
      d.next_ = 0;
    }
    const int64_t take = std::min<int64_t>(n - i, d.left_ - 1);
    uniforms(d.state_.data() + d.next_, take, p + i);
    d.next_ += static_cast<uint32_t>(take);
    d.left_ -= static_cast<int>(take);
    i += take;
  }
  engine.set_data(d);
  gen->set_engine(engine);
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
