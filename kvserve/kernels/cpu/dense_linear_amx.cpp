// Dense bfloat16 linear layers on AMX tiles (Intel Sapphire Rapids and later): y = x @ W^T with bfloat16
// activations and weights, float32 sums, every row computed alike whatever else is in the call.
//
// Why: on such a CPU torch's bfloat16 matmuls (oneDNN on AMX) ran prompts of 64-256 rows 4-6x as fast as
// dense_linear.cpp's AVX-512 FMAs, which the engine uses for float weights because they round a row the same in
// any step; torch's do not (they pick a kernel and blocking by shape). AMX keeps that property: tdpbf16ps adds
// each output's products over K in a fixed order, one row of A at a time, so a row's sums do not depend on the
// rows beside it, and every row count runs the same instructions.
//
// Its bits are its own: tdpbf16ps accumulates one float32 sum per output in K's order, where dense_linear keeps
// sixteen partial sums and adds them as a tree. So a layer takes one kernel for good, chosen at load
// (kvserve/layers/quantization/methods.py, FloatMethod).
//
// Layout (amx_pack in methods.py): W [N, K] as [N/16, K/32, 16, 16, 2]: for tile t (weight rows 16t ..) and
// k-step s (K values 32s ..), an AMX B tile of 16 rows of 64 bytes, row i holding, for each of the 16 weight
// rows, the pair of values at K 32s + 2i and + 1 ("VNNI" order). N % 16 == 0 and K % 32 == 0.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "ops.h"
#include "vec.h"

namespace {

#ifdef KVSERVE_VEC_AVX512
using namespace kvserve_cpu;

constexpr int64_t kTileRows = 16;  // activation rows an A tile holds
constexpr int64_t kStep = 32;      // K values a tile's rows hold (64 bytes of bfloat16)
constexpr int64_t kGroup = 4;      // weight tiles that share each A tile: four C tiles, 64 outputs
constexpr int64_t kTileElems = 16 * kStep;  // bfloat16 values of one B tile (1 KB)
// A row or two of x leave the tiles idle and the weights' read bound; the hardware prefetcher follows four
// streams a weight tile apart poorly, so each is asked for kAhead k-steps (4 KB) ahead, as the quantized kernels do.
constexpr int64_t kAhead = 4;

// Tiles 0-3: float32 sums of a group's four weight tiles (R rows x 16); 4: activations (R rows x 32);
// 5, 6: weights, alternating so that a load can run while the previous tile multiplies.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) void configure(int64_t R) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(R);
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // Not _tile_loadconfig: GCC 12's tells the compiler that it reads 8 bytes, which let it drop the stores of the
  // rows and widths (the tiles were then unconfigured, and the first tile load an illegal instruction).
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

// A function of its own: gemm's parallel_for lambda is not compiled for AMX, so the intrinsic cannot be inlined there.
__attribute__((target("amx-tile"))) void release() { _tile_release(); }

// Sums of R rows of x (ld values apart) with G (1 or kGroup) weight tiles from w, over S k-steps, into
// out [R][64] (tile j's outputs at 16j). The tiles must be configured for R rows.
template <int G>
__attribute__((target("amx-tile,amx-bf16")))
void group_sums(const c10::BFloat16* x, int64_t ld, const c10::BFloat16* w, int64_t S, float (*out)[64]) {
  const int64_t tile_stride = S * kTileElems;  // one weight tile's K
  _tile_zero(0);
  if constexpr (G == kGroup) {
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < S; ++s) {
    const c10::BFloat16* b = w + s * kTileElems;
    for (int j = 0; j < G; ++j)  // the G streams' tiles kAhead steps on (past a tile's K: the next group's)
      for (int64_t l = 0; l < kTileElems; l += 32)
        _mm_prefetch(reinterpret_cast<const char*>(b + j * tile_stride + kAhead * kTileElems + l), _MM_HINT_T0);
    _tile_loadd(4, x + s * kStep, ld * 2);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (G == kGroup) {
      _tile_loadd(6, b + tile_stride, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b + 2 * tile_stride, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, b + 3 * tile_stride, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, out[0], 256);
  if constexpr (G == kGroup) {
    _tile_stored(1, out[0] + 16, 256);
    _tile_stored(2, out[0] + 32, 256);
    _tile_stored(3, out[0] + 48, 256);
  }
}

template <typename T>
void gemm(const c10::BFloat16* x, const c10::BFloat16* w, int64_t M, int64_t K, int64_t N, T* y) {
  const int64_t tiles = N / 16, S = K / kStep, groups = (tiles + kGroup - 1) / kGroup;
  // Threads split the weight tiles in groups; within a group the passes over x's rows reuse the group's
  // weights from L2, so a prompt's rows read them from DRAM once.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float out[kTileRows][64];
    int64_t configured = 0;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t0 = g * kGroup, nt = std::min(kGroup, tiles - t0);
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int64_t R = std::min(kTileRows, M - m);
        if (R != configured) configure(configured = R);
        const c10::BFloat16* xr = x + m * K;
        if (nt == kGroup) {
          group_sums<kGroup>(xr, K, w + t0 * S * kTileElems, S, out);
        } else {
          for (int64_t j = 0; j < nt; ++j) {  // a last group of fewer tiles, one at a time
            float one[kTileRows][64];
            group_sums<1>(xr, K, w + (t0 + j) * S * kTileElems, S, one);
            for (int64_t r = 0; r < R; ++r) std::copy(one[r], one[r] + 16, out[r] + 16 * j);
          }
        }
        for (int64_t r = 0; r < R; ++r)
          for (int64_t j = 0; j < nt; ++j)
            store(y + (m + r) * N + (t0 + j) * 16, load16(out[r] + 16 * j), 16);
      }
    }
    if (configured) release();
  });
}

bool request_amx() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: ask for AMX's tile state
  return __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") &&
         syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

}  // namespace

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

bool amx_bf16_ready() {
#ifdef KVSERVE_VEC_AVX512
  static const bool ready = request_amx();  // once per process; the permission holds for every thread
  return ready;
#else
  return false;  // the AVX2 build has no AMX code
#endif
}

// x [.., K] bfloat16, weight packed as above -> y [.., N] of out_dtype (bfloat16 by default, or float32).
at::Tensor dense_linear_amx(const at::Tensor& x, const at::Tensor& packed, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(amx_bf16_ready(), "dense_linear_amx: this CPU (or this build, or Linux) gives no AMX-BF16");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "dense_linear_amx: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "dense_linear_amx: bfloat16 activations and weights, got ", x.scalar_type(), " and ",
              packed.scalar_type());
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.size(2) == 16 && packed.size(3) == 16 &&
              packed.size(4) == 2, "dense_linear_amx: weight packed [N/16, K/32, 16, 16, 2], got ", packed.sizes());
  const int64_t K = x.size(-1), N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 32 == K, "dense_linear_amx: weight packed for in_features ", packed.size(1) * 32,
              ", activations have ", K);
  const auto yt = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(yt == at::kFloat || yt == at::kBFloat16, "dense_linear_amx: float32 or bfloat16 output, got ", yt);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty(out_shape, x.options().dtype(yt));
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t M = xc.size(0);
  if (M == 0 || N == 0) return y;
#ifdef KVSERVE_VEC_AVX512
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  if (yt == at::kFloat) gemm<float>(xp, wp, M, K, N, y.data_ptr<float>());
  else gemm<c10::BFloat16>(xp, wp, M, K, N, y.data_ptr<c10::BFloat16>());
#endif
  return y;
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
