// Paged attention for CPUs with AVX-512 or AVX2 (one source on vec.h's Vec16, built once per ISA), K/V
// read in place from the head-major paged cache ([Hkv, num_blocks, block_size, D]) through block tables.
//
// The unit of work is a "row": one query token that sees the keys [max(0, len - window), len) of its
// sequence. A decode token is one row with len = its context; a prefill chunk of n tokens is n rows
// with len = position + 1 each (the causal mask, offset by any cached prefix, falls out of that).
//
// Why a kernel: the torch path gathers every decode row's K/V into a padded copy and runs two batched
// matmuls over it (~45% of a decode step at batch 64), and torch's CPU flash attention ran prefill at
// ~35 GFLOP/s. Here each (row, KV head) reads its K and V once, with no copy and no padding, and the G
// query heads sharing the KV head reuse each converted K/V row from registers. A sequence's rows (a prompt
// chunk's, a verification step's) go two at a time, each K/V row widened once for both (attend_pair), and
// re-read by each pair: from cache for short contexts (64 KB per head for 256 bfloat16 tokens); past 2048
// keys a long chunk's rows share each block of keys, two at a time within it (attend_rows). (Taking a
// verification step's 5 rows together measured
// slower: 3 items on 2 threads instead of 15, and their K/V were in cache. So did converting the keys all its
// rows see to float32 once, into an L1 chunk every row read, with the run
// split for the threads: 0.79-0.93x for 5-17 rows over 400 or 2,000 bfloat16 keys, 2 threads, the Intel Xeon;
// through that chunk one row alone ran 0.73x. Reading a row's bfloat16 values as pairs instead, even and odd
// lanes widened by a shift and a mask, queries read and outputs stored in that order, ran 2-9 rows over 400-1000
// keys 1.06-1.11x as fast and one row 1.02-1.04x: ~0.25 ms of a ~9 ms 9-row step. Not kept (git 3d6f6a1,
// reverted): each lane then adds its products in another order, which flipped the default model's near-tie
// greedy choices, and on the speculative benchmark's prompts the new outputs drafted worse (summaries'
// acceptance 54% where it was 64%; one copy request wandered for 158 tokens where it had stopped at 26). The
// one-stream ratios moved with the outputs (copies 1.90 -> 1.79x, summaries 1.38 -> 1.24x) by far more than
// the step saved, so no gain could be shown end to end.)
//
// Registered as torch.ops.<KVSERVE_NS>.paged_attention_ (in place on `out`). Scores and softmax are float32
// whatever the cache dtype (bfloat16 or float32).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using namespace kvserve_cpu;

constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kChunk = 16;     // keys scored together (one vector of scores)
// A long prompt chunk's rows that see at least kGroupMinKeys keys are taken up to kGroupRows at a time,
// kKeyBlock keys at a time (attend_rows): 1.3-1.7x the speed for a 2048-token chunk after 2048-6144 cached
// tokens with the blocks scattered through the pool (Intel Xeon, AVX-512, benchmarks/prefill_attention.py;
// 8 or 32 rows a group measured slower), ~1.04x end to end where a fresh prompt's blocks lie in order. Rows
// with fewer keys go in pairs (attend_pair), as a verification step's do: their K/V stay in cache, and a pair
// widens each K/V row once for both rows. Against rows one by one (and groups from 512 keys, as before), one
// layer of the default model's prompt attention ran 1.05x for 32 prompts of 64 tokens, 1.16x for 8 of 256,
// 1.22x for 4 of 512, and, with two rows at a time inside the groups from 2048 keys, 1.15-1.29x for 2048-token
// chunks after 0-6144 cached tokens (Intel Xeon, AVX-512; 1.12-1.19x with AVX2 forced). Pairs alone beat those
// groups up to ~2048 keys (2 x 256 after 768: 1.28x), and lost past it (after 6144: 0.85x).
// Runs of fewer than kMinRunRows rows of a sequence are never grouped: a verification step's rows would make
// too few work items for the threads.
constexpr int64_t kGroupRows = 16;
constexpr int64_t kGroupMinKeys = 2048;
constexpr int64_t kKeyBlock = 256;  // a multiple of kChunk
constexpr int64_t kMinRunRows = 32;
// Shorter runs (a verification step's rows) go two rows at a time from kPairFromRows rows up (attend_pair), for
// heads up to 128 wide (Gemma 3's 256-wide rows already spill one row's vectors to the stack).
constexpr int64_t kPairFromRows = 3;
template <int kC> constexpr bool kPairs = kC <= 8;

template <typename T, int64_t D>
inline void prefetch_row(const T* row) {
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + off, _MM_HINT_T0);
}

// Walks a sequence's tokens [first, len) through its block table, one cache row at a time. The last one,
// len - 1, is read from index last_at: a tree draft's alternative sits at its position but is stored past
// its siblings (last_at == len - 1 everywhere else). Read in the same order as a plain row, so a row whose
// key is stored elsewhere computes bit for bit what it would with the key in place.
template <typename T, int64_t D>
struct RowCursor {
  const T* cache;
  const int64_t* table;
  int64_t head_base, bs, last_blk, blk, off, pos, end;
  const T* last;
  const T* row;

  RowCursor(const T* cache_, const int64_t* table_, int64_t head_base_, int64_t bs_, int64_t first, int64_t len,
            int64_t last_at)
      : cache(cache_), table(table_), head_base(head_base_), bs(bs_), last_blk((len - 1) / bs_), blk(first / bs_),
        off(first % bs_), pos(first), end(len), last(at(last_at / bs_, last_at % bs_)),
        row(first == len - 1 ? last : at(blk, off)) {}
  const T* at(int64_t b, int64_t o) const { return cache + ((head_base + table[b]) * bs + o) * D; }
  // Blocks sit anywhere in the pool, so the hardware prefetcher stops at each block's end: prefetch the
  // same row of the next block (from DRAM the kernel ran ~2.5x slower without this).
  void prefetch_next_block() const { prefetch_row<T, D>(at(std::min(blk + 1, last_blk), off)); }
  void advance() {
    if (++off == bs) { off = 0; ++blk; row = blk <= last_blk ? at(blk, 0) : row; }
    else row += D;
    if (++pos == end - 1) row = last;
  }
};

// s[i][t] = q_i . k_(first + t) for kN query vectors over the keys [first, first + n), sixteen keys at a time:
// q[i] is one query head's kC vectors, already scaled (heads of one row, or of two rows that both see these
// keys: attend_pair); s[i] is its row of scores. A key's products and sums do not depend on the others here.
template <typename C, int kC, int kN>
void score_keys(const Vec16* const* q, const C* k_cache, const int64_t* table, int64_t head_base, int64_t bs,
                int64_t first, int64_t n, int64_t last_at, float* const* s) {
  constexpr int64_t D = kC * 16;
  Vec16 qr[kN][kC];  // copied in so that they live in registers
  for (int h = 0; h < kN; ++h)
    for (int c = 0; c < kC; ++c) qr[h][c] = q[h][c];
  RowCursor<C, D> k(k_cache, table, head_base, bs, first, first + n, last_at);
  Vec16 part[kN][kChunk];
  for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
    const int64_t m = std::min(kChunk, n - t0);
    for (int64_t j = 0; j < m; ++j, k.advance()) {
      k.prefetch_next_block();
      Vec16 kv[kC];
      for (int c = 0; c < kC; ++c) kv[c] = load16(k.row + c * 16);
      for (int h = 0; h < kN; ++h) {
        Vec16 acc = qr[h][0] * kv[0];
        for (int c = 1; c < kC; ++c) acc = fmadd(qr[h][c], kv[c], acc);
        part[h][j] = acc;
      }
    }
    for (int h = 0; h < kN; ++h) {
      for (int64_t j = m; j < kChunk; ++j) part[h][j] = zero();
      store(s[h] + t0, sum_each16(part[h]), m);
    }
  }
}

// out[i] = inv_sum[i] * sum_t p[i][t] v_(first + t) for kN query vectors (out[i], D wide; heads of one row or of
// two, as score_keys) over the keys [first, first + n); p[i] is vector i's n weights. With AVX2, heads wider
// than 64 are taken 64 lanes (four vectors) at a time, one pass over the keys each: a whole 256-wide row's
// accumulators and V vectors needed 64 of AVX2's sixteen registers. The same bits; for Gemma 3's heads (Zen 3,
// 2 threads, 18 layers' caches in turn) 1.12x at one decode row of 512 tokens and 1.16x for a 256-row prefill
// chunk.
// Narrower passes for 64-wide heads (two vectors of three heads) measured 0.93-0.95x at one decode row.
// Heads of 128 or more, whose queries go several at a time (kHeadBlock), take as many vectors a pass as leave
// the accumulators of all kN queries in at most 16 of AVX-512's registers (8 of AVX2's).
#ifdef KVSERVE_VEC_AVX512
template <int kC, int kN> constexpr int kPvWidth = kC <= 4 ? kC : std::min(kC, std::max(1, 16 / kN));
#else
template <int kC, int kN> constexpr int kPvWidth = kC < 4 ? kC : kC == 4 ? 4 : std::min(4, std::max(1, 8 / kN));
#endif
template <typename T, typename C, int kC, int kN, int kW = kPvWidth<kC, kN>>
void accumulate_pv(const C* v_cache, const int64_t* table, int64_t head_base, int64_t bs, int64_t first, int64_t n,
                   int64_t last_at, const float* const* p, float* const* acc_io, bool fresh, T* const* out,
                   const float* inv_sum, int c_begin = 0, int c_end = kC) {
  // Adds p[i][t] v_(first + t) in key order to the accumulators: zero if fresh, else acc_io's. Then, given out,
  // out[i] = inv_sum[i] * acc[i]; else acc_io keeps them for the next keys. The same multiply-adds on the same
  // values whether a row's keys come in one call or in consecutive ranges (attend_rows), and whichever of the
  // vectors [c_begin, c_end) a call takes kW at a time (each lane is its own sum), so the same bits.
  constexpr int64_t D = kC * 16;
  for (int c0 = c_begin; c0 < c_end; c0 += kW) {
    Vec16 acc[kN][kW];
    for (int h = 0; h < kN; ++h)
      for (int c = 0; c < kW; ++c) acc[h][c] = fresh ? zero() : load16(acc_io[h] + (c0 + c) * 16);
    RowCursor<C, D> v(v_cache, table, head_base, bs, first, first + n, last_at);
    for (int64_t t = 0; t < n; ++t, v.advance()) {
      if (c0 == c_begin) v.prefetch_next_block();  // later passes find the rows in cache
      Vec16 vv[kW];
      for (int c = 0; c < kW; ++c) vv[c] = load16(v.row + (c0 + c) * 16);
      for (int h = 0; h < kN; ++h) {
        const Vec16 w = broadcast(p[h][t]);
        for (int c = 0; c < kW; ++c) acc[h][c] = fmadd(w, vv[c], acc[h][c]);
      }
    }
    for (int h = 0; h < kN; ++h)
      for (int c = 0; c < kW; ++c) {
        if (out != nullptr) store(out[h] + (c0 + c) * 16, acc[h][c] * broadcast(inv_sum[h]), 16);
        else store(acc_io[h] + (c0 + c) * 16, acc[h][c], 16);
      }
  }
}

// Softmax over each head's n scores (rows ld apart), in place: exp(s - max); inv_sum[g] = v_scale / sum.
inline void softmax_rows(float* s, int64_t ld, int64_t n, int64_t G, float v_scale, float* inv_sum) {
  for (int64_t g = 0; g < G; ++g) {
    float* row = s + g * ld;
    Vec16 mx = broadcast(-3.0e38f);
    for (int64_t i = 0; i < n; i += 16) mx = max_first(mx, load(row + i, n - i), n - i);
    const Vec16 mv = broadcast(reduce_max(mx));
    Vec16 sum = zero();
    for (int64_t i = 0; i < n; i += 16) {
      const Vec16 e = keep_first(exp_ps(load(row + i, n - i) - mv), n - i);
      store(row + i, e, n - i);
      sum = sum + e;
    }
    inv_sum[g] = v_scale / reduce_add(sum);
  }
}

template <typename T>
struct RowRef {
  const T* q;
  T* out;
  int64_t first, len, last_at;  // visible keys [first, len); key len - 1 stored at last_at
};

// A row's G query heads (kC vectors each), scaled: what score_keys multiplies the keys by.
template <int kC, typename T>
inline void load_queries(const T* q, int64_t G, float scale, Vec16 (*qv)[kC]) {
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < kC; ++c) qv[g][c] = load16(q + (g * kC + c) * 16) * broadcast(scale);
}

// Calls f(std::integral_constant<int, n>{}, g0) for the query heads [g0, g0 + n) of a KV head's G: blocks of kB,
// then the rest in blocks of kB / 2, kB / 4, ..., 1. A count known at compile time: indexed by a run-time count,
// queries and accumulators stayed in memory, a load (and in pass 2 a store) around every multiply-add.
template <int kB, typename F>
inline void for_head_blocks(int64_t G, F&& f, int64_t g0 = 0) {
  for (; g0 + kB <= G; g0 += kB) f(std::integral_constant<int, kB>{}, g0);
  if constexpr (kB > 1) {
    if (g0 < G) for_head_blocks<kB / 2>(G, f, g0);
  }
}

// Query heads per score_keys / accumulate_pv call for one row: kC = D / 16 vectors per K/V row, fixed at compile
// time so a row lives in registers beside its heads' queries. Heads of 128 or more go four at a time although their
// queries then sit in L1, not in registers: each K/V row is widened from bfloat16 once for the four instead of once
// per head, which had been most of a wide head's work (a K row of 256 is 32 instructions to widen, 16 to multiply).
template <int kC> constexpr int kHeadBlock = kC <= 4 ? 12 / kC : 4;

// Two rows of one sequence that see the same first key (a verification step's), one KV head. Over the keys both
// see, [first, shared), each K and V row is loaded and widened once for both rows' query heads; each row's own
// last keys [shared, len) then go as a single row's do, and accumulate_pv goes on from the shared part's sums.
// Per row the same operations in the same order as attend_rows alone, so the same bits.
// Why: a K/V row's widening from bfloat16 is a quarter of the work per key and query head. With the default
// model's geometry (30 layers' bfloat16 caches, 2 threads, Intel Xeon), 3-9 rows ran 1.04-1.34x as fast over
// 400-2000 keys with AVX-512 (1.01-1.16x over 100), and 1.11-1.26x with AVX2 over 400-1000 (where a pair's
// vectors spill to the stack). Two rows alone are not paired: their 3 KV heads as 3 items left one of 2 threads idle a third of the
// time, as fast as 6 items of one row (1.00-1.03x).
template <typename T, typename C, int kC>
void attend_pair(const RowRef<T>* rows, const C* k_cache, const C* v_cache, const int64_t* table, int64_t head_base,
                 int64_t bs, int64_t G, float scale, float v_scale, std::vector<float>& scores,
                 std::vector<float>& accs) {
  constexpr int64_t D = kC * 16;
  const int64_t first = rows[0].first, shared = std::min(rows[0].len, rows[1].len) - 1, n = shared - first;
  const int64_t ld = std::max(rows[0].len, rows[1].len) - first;
  scores.resize(static_cast<size_t>(2 * G * ld));
  accs.resize(static_cast<size_t>(2 * G * D));
  Vec16 qv[2][kMaxGroup][kC];
  for (int r = 0; r < 2; ++r) load_queries<kC>(rows[r].q, G, scale, qv[r]);
  auto s_row = [&](int r, int64_t g) { return scores.data() + (r * G + g) * ld; };
  auto acc_row = [&](int r, int64_t g) { return accs.data() + (r * G + g) * D; };

  // Both rows' scores over the shared keys (the last of them in place: each row's len - 1 is past it).
  for_head_blocks<kHeadBlock<kC>>(G, [&](auto heads, int64_t g0) {
    constexpr int kN = decltype(heads)::value;
    const Vec16* q[2 * kN];
    float* s[2 * kN];
    for (int r = 0; r < 2; ++r)
      for (int j = 0; j < kN; ++j) q[r * kN + j] = qv[r][g0 + j], s[r * kN + j] = s_row(r, g0 + j);
    score_keys<C, kC, 2 * kN>(q, k_cache, table, head_base, bs, first, n, shared - 1, s);
  });
  // Each row's own keys, then its softmax.
  float inv_sum[2][kMaxGroup];
  for (int r = 0; r < 2; ++r) {
    const RowRef<T>& row = rows[r];
    for_head_blocks<kHeadBlock<kC>>(G, [&](auto heads, int64_t g0) {
      constexpr int kN = decltype(heads)::value;
      const Vec16* q[kN];
      float* s[kN];
      for (int j = 0; j < kN; ++j) q[j] = qv[r][g0 + j], s[j] = s_row(r, g0 + j) + n;
      score_keys<C, kC, kN>(q, k_cache, table, head_base, bs, shared, row.len - shared, row.last_at, s);
    });
    softmax_rows(s_row(r, 0), ld, row.len - first, G, v_scale, inv_sum[r]);
  }
  // P @ V over the shared keys for both rows, kept in accs; then each row's own keys, into its output.
  for_head_blocks<kHeadBlock<kC>>(G, [&](auto heads, int64_t g0) {
    constexpr int kN = decltype(heads)::value;
    const float* p[2 * kN];
    float* acc[2 * kN];
    for (int r = 0; r < 2; ++r)
      for (int j = 0; j < kN; ++j) p[r * kN + j] = s_row(r, g0 + j), acc[r * kN + j] = acc_row(r, g0 + j);
    accumulate_pv<T, C, kC, 2 * kN>(v_cache, table, head_base, bs, first, n, shared - 1, p, acc, true, nullptr,
                                    nullptr);
  });
  for (int r = 0; r < 2; ++r) {
    const RowRef<T>& row = rows[r];
    for_head_blocks<kHeadBlock<kC>>(G, [&](auto heads, int64_t g0) {
      constexpr int kN = decltype(heads)::value;
      const float* p[kN];
      float* acc[kN];
      T* out[kN];
      for (int j = 0; j < kN; ++j)
        p[j] = s_row(r, g0 + j) + n, acc[j] = acc_row(r, g0 + j), out[j] = row.out + (g0 + j) * D;
      accumulate_pv<T, C, kC, kN>(v_cache, table, head_base, bs, shared, row.len - shared, row.last_at, p, acc, false,
                                  out, inv_sum[r] + g0);
    });
  }
}

// Rows of one sequence, one KV head: for each row, scores for the G query heads over its visible keys,
// softmax, then P @ V. A single row takes its keys in one range; several rows take them kKeyBlock at a time,
// each row in turn over the same block, so that a long context's K and V come from L1/L2 once per block and
// rows instead of from L3 or DRAM once per row; within a block, two rows that both see all of it and neither of
// whose last keys it holds go together, as attend_pair takes them. Every row's arithmetic is the same either way
// (blocks are multiples of score_keys' 16 keys, and accumulate_pv adds in key order), so its bits do not depend
// on which rows share its call. Two rows alone go to attend_pair.
// The cache (C) holds q's dtype, or float8 e4m3 holding K / k_scale and V / v_scale.
template <typename T, typename C, int kC>
void attend_rows(const RowRef<T>* rows, int64_t R, const C* k_cache, const C* v_cache, const int64_t* table,
                 int64_t head_base, int64_t bs, int64_t G, float scale, float v_scale, std::vector<float>& scores,
                 std::vector<float>& accs) {
  constexpr int64_t D = kC * 16;
  if constexpr (kPairs<kC>) {
    if (R == 2 && rows[0].first == rows[1].first &&
        std::min(rows[0].len, rows[1].len) - 1 - rows[0].first >= kChunk)
      return attend_pair<T, C, kC>(rows, k_cache, v_cache, table, head_base, bs, G, scale, v_scale, scores, accs);
  }
  int64_t ld = 0;  // the longest row's visible keys: each row's scores are G rows this far apart
  for (int64_t r = 0; r < R; ++r) ld = std::max(ld, rows[r].len - rows[r].first);
  const int64_t step = R == 1 ? ld : kKeyBlock;
  scores.resize(static_cast<size_t>(R * G * ld));
  auto keys_of = [&](int64_t r) { return rows[r].len - rows[r].first; };
  // Calls f(r, pair, b0, m, last_at, last_range) for each row's keys [first + b0, first + b0 + m), a block of keys
  // at a time, each row in turn; the last of them is stored at last_at (in place unless it is the row's key
  // len - 1). pair: rows r and r + 1 take the block together (attend_pair's sharing of each widened K/V row), where
  // both see all of it and it holds neither's last key.
  auto for_each_range = [&](auto&& f) {
    for (int64_t b0 = 0; b0 < ld; b0 += step)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t n = keys_of(r);
        if (b0 >= n) continue;
        const int64_t m = std::min(step, n - b0);
        if (kPairs<kC> && R > 1 && r + 1 < R && rows[r + 1].first == rows[r].first && b0 + m < n &&
            b0 + m < keys_of(r + 1)) {
          f(r, true, b0, m, rows[r].first + b0 + m - 1, false);
          ++r;
          continue;
        }
        f(r, false, b0, m, b0 + m == n ? rows[r].last_at : rows[r].first + b0 + m - 1, b0 + m == n);
      }
  };

  // Pass 1: scores[r][g][t - first] = q_g . k_t.
  for_each_range([&](int64_t r, bool pair, int64_t b0, int64_t m, int64_t last_at, bool) {
    Vec16 qv[kPairs<kC> ? 2 : 1][kMaxGroup][kC];
    load_queries<kC>(rows[r].q, G, scale, qv[0]);
    if constexpr (kPairs<kC>) {
      if (pair) load_queries<kC>(rows[r + 1].q, G, scale, qv[1]);
    }
    for_head_blocks<kHeadBlock<kC>>(G, [&](auto heads, int64_t g0) {
      constexpr int kN = decltype(heads)::value;
      const Vec16* q[2 * kN];
      float* s[2 * kN];
      for (int i = 0; i < (pair ? 2 : 1); ++i)
        for (int j = 0; j < kN; ++j)
          q[i * kN + j] = qv[i][g0 + j], s[i * kN + j] = scores.data() + ((r + i) * G + g0 + j) * ld + b0;
      if constexpr (kPairs<kC>) {
        if (pair) return score_keys<C, kC, 2 * kN>(q, k_cache, table, head_base, bs, rows[r].first + b0, m, last_at, s);
      }
      score_keys<C, kC, kN>(q, k_cache, table, head_base, bs, rows[r].first + b0, m, last_at, s);
    });
  });

  // Softmax over each head's scores, in place; inv_sum is applied to the output at the end.
  float inv_sum[kGroupRows][kMaxGroup];
  for (int64_t r = 0; r < R; ++r)
    softmax_rows(scores.data() + r * G * ld, ld, keys_of(r), G, v_scale, inv_sum[r]);

  // Pass 2: out_g = inv_sum[g] * sum_t p[g][t] v_t (a single row keeps its accumulators in registers).
  if (R > 1) accs.resize(static_cast<size_t>(R * G * D));
  for_each_range([&](int64_t r, bool pair, int64_t b0, int64_t m, int64_t last_at, bool last_range) {
    for_head_blocks<kHeadBlock<kC>>(G, [&](auto heads, int64_t g0) {
      constexpr int kN = decltype(heads)::value;
      const float* p[2 * kN];
      float* acc[2 * kN];
      T* out[2 * kN];
      for (int i = 0; i < (pair ? 2 : 1); ++i)
        for (int j = 0; j < kN; ++j) {
          p[i * kN + j] = scores.data() + ((r + i) * G + g0 + j) * ld + b0;
          acc[i * kN + j] = R > 1 ? accs.data() + ((r + i) * G + g0 + j) * D : nullptr;
          out[i * kN + j] = rows[r + i].out + (g0 + j) * D;
        }
      if constexpr (kPairs<kC>) {
        if (pair)
          return accumulate_pv<T, C, kC, 2 * kN>(v_cache, table, head_base, bs, rows[r].first + b0, m, last_at, p,
                                                 acc, b0 == 0, nullptr, nullptr);
      }
      accumulate_pv<T, C, kC, kN>(v_cache, table, head_base, bs, rows[r].first + b0, m, last_at, p, acc, b0 == 0,
                                    last_range ? out : nullptr, inv_sum[r] + g0);
    });
  });
}

struct Rows {
  const int64_t* token;  // row of q / out
  const int64_t* seq;    // row of block_tables
  const int64_t* len;    // keys [len - window, len) are visible
  const int64_t* last;   // where key len - 1 is stored (null: at len - 1)
  int64_t count;

  int64_t visible(int64_t r, int64_t window) const { return window > 0 ? std::min(len[r], window) : len[r]; }
};

// Row r's RowRef for KV head h: its G query heads in q (tokens q_stride apart) and in out ([T, H, D]).
template <typename T>
inline RowRef<T> row_ref(const Rows& rows, int64_t r, int64_t h, const T* qp, T* op, int64_t q_stride, int64_t H,
                         int64_t G, int64_t D, int64_t window) {
  const int64_t len = rows.len[r];
  return {qp + rows.token[r] * q_stride + h * G * D, op + (rows.token[r] * H + h * G) * D,
          window > 0 ? std::max<int64_t>(0, len - window) : 0, len, rows.last != nullptr ? rows.last[r] : len - 1};
}

// Fewer (row, KV head) items than threads (a decode step of one sequence of a model with one KV head, Gemma 3's:
// the second thread sat idle through attention). Each item is split in two without changing a bit: its scores
// by keys (each key's score is its own; the halves meet at a multiple of score_keys' 16 keys), then the softmax,
// then P @ V by output vectors (each lane sums its keys in key order whatever the others do): three passes, each
// shared out to the threads. Gemma 3 270M's geometry, one row over 1024 keys: 1.55x (Intel Xeon, AVX-512). With
// more items than threads but not a multiple (the default model's 3 KV heads on 2 threads) it measured 0.90x: a
// half-item's passes cost more than the idle third they save.
template <typename T, typename C, int kC>
void attend_split(const T* qp, T* op, int64_t q_stride, const C* kp, const C* vp, const Rows& rows,
                  const int64_t* tables, int64_t W, int64_t NB, int64_t bs, int64_t H, int64_t Hkv, int64_t G,
                  int64_t window, float scale, float v_scale, int64_t threads) {
  constexpr int64_t D = kC * 16;
  const int64_t items = rows.count * Hkv;
  int64_t ld = 0;
  for (int64_t r = 0; r < rows.count; ++r) ld = std::max(ld, rows.visible(r, window));
  std::vector<float> scores(static_cast<size_t>(items * G * ld)), inv_sums(static_cast<size_t>(items * G));
  auto item_row = [&](int64_t i) { return row_ref(rows, i / Hkv, i % Hkv, qp, op, q_stride, H, G, D, window); };
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < 2 * items; ++k) {  // scores, each item's keys in two halves
      const int64_t i = k / 2, r = i / Hkv, h = i % Hkv;
      const RowRef<T> row = item_row(i);
      const int64_t n = row.len - row.first, half = (n / 2 + kChunk - 1) / kChunk * kChunk;
      const int64_t b0 = k % 2 == 0 ? 0 : half, m = k % 2 == 0 ? std::min(half, n) : n - half;
      if (m <= 0) continue;
      const int64_t last_at = b0 + m == n ? row.last_at : row.first + b0 + m - 1;
      Vec16 qv[kMaxGroup][kC];
      load_queries<kC>(row.q, G, scale, qv);
      for_head_blocks<kHeadBlock<kC>>(G, [&](auto heads, int64_t g0) {
        constexpr int kN = decltype(heads)::value;
        const Vec16* q[kN];
        float* s[kN];
        for (int j = 0; j < kN; ++j) q[j] = qv[g0 + j], s[j] = scores.data() + (i * G + g0 + j) * ld + b0;
        score_keys<C, kC, kN>(q, kp, tables + rows.seq[r] * W, h * NB, bs, row.first + b0, m, last_at, s);
      });
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const RowRef<T> row = item_row(i);
      softmax_rows(scores.data() + i * G * ld, ld, row.len - row.first, G, v_scale, inv_sums.data() + i * G);
    }
    // P @ V, each item's output vectors in two halves (one pass for 16-wide heads).
    constexpr int kParts = kC >= 2 ? 2 : 1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < kParts * items; ++k) {
      const int64_t i = k / kParts, r = i / Hkv, h = i % Hkv;
      const RowRef<T> row = item_row(i);
      const int c_begin = static_cast<int>(k % kParts) * (kC / kParts), c_end = c_begin + kC / kParts;
      for_head_blocks<kHeadBlock<kC>>(G, [&](auto heads, int64_t g0) {
        constexpr int kN = decltype(heads)::value;
        constexpr int kW = std::min(kC / kParts, kPvWidth<kC, kN>);
        const float* p[kN];
        T* out[kN];
        for (int j = 0; j < kN; ++j) p[j] = scores.data() + (i * G + g0 + j) * ld, out[j] = row.out + (g0 + j) * D;
        accumulate_pv<T, C, kC, kN, kW>(vp, tables + rows.seq[r] * W, h * NB, bs, row.first, row.len - row.first,
                                        row.last_at, p, nullptr, true, out, inv_sums.data() + i * G + g0, c_begin,
                                        c_end);
      });
    }
  }
}

template <typename T, typename C, int kC>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const Rows& rows, const at::Tensor& block_tables, double scale,
                          int64_t window, double k_scale, double v_scale) {
  const int64_t H = q.size(1), Hkv = k_cache.size(0), NB = k_cache.size(1), bs = k_cache.size(2);
  const int64_t G = H / Hkv, W = block_tables.size(1), q_stride = q.stride(0);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  constexpr int64_t D = kC * 16;
  // Row groups: in a run of at least kMinRunRows consecutive rows of one sequence (a prompt chunk, not a
  // verification step), rows that see kGroupMinKeys keys or more, up to kGroupRows a group; other rows of a run of
  // kPairFromRows or more, pairs: a row joins the one before it where that one started a group of its own (in a
  // long run whose lengths do not rise, a tree's, the group before may be a full one).
  auto visible = [&](int64_t r) { return rows.visible(r, window); };
  std::vector<int64_t> group_start;
  group_start.reserve(static_cast<size_t>(rows.count) + 1);  // one allocation per call (every layer, every step)
  for (int64_t run = 0, end = 0; run < rows.count; run = end) {
    for (end = run + 1; end < rows.count && rows.seq[end] == rows.seq[run]; ++end) {
    }
    for (int64_t r = run; r < end; ++r) {
      const int64_t g = group_start.empty() ? -1 : group_start.back();
      const bool joins =
          end - run >= kMinRunRows && visible(r) >= kGroupMinKeys
              ? g >= run && r - g < kGroupRows && visible(g) >= kGroupMinKeys
              : kPairs<kC> && window <= 0 && end - run >= kPairFromRows && (r - run) % 2 == 1 && g == r - 1;
      if (!joins) group_start.push_back(r);
    }
  }
  group_start.push_back(rows.count);
  const int64_t groups = static_cast<int64_t>(group_start.size()) - 1, items = groups * Hkv;
  const int64_t threads = at::get_num_threads();
  if (items < threads && groups == rows.count) {
    return attend_split<T, C, kC>(qp, op, q_stride, kp, vp, rows, tables, W, NB, bs, H, Hkv, G, window,
                                  static_cast<float>(scale * k_scale), static_cast<float>(v_scale), threads);
  }
  // Items are (row group, KV head) pairs of very different cost (a prefill's rows grow along its prompt), so
  // threads take them dynamically rather than in the equal contiguous ranges of at::parallel_for. Chunks
  // of 4 keep the hand-out cheap in big steps; a step of a few rows takes items one at a time, else the
  // first thread takes a whole decode row's 3-4 heads and the others wait.
  const int chunk = items >= 16 * threads ? 4 : 1;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores, accs;
    RowRef<T> refs[kGroupRows];
#pragma omp for schedule(dynamic, chunk)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t g = i / Hkv, h = i % Hkv, r0 = group_start[g], R = group_start[g + 1] - r0;
      for (int64_t j = 0; j < R; ++j) refs[j] = row_ref(rows, r0 + j, h, qp, op, q_stride, H, G, D, window);
      attend_rows<T, C, kC>(refs, R, kp, vp, tables + rows.seq[r0] * W, h * NB, bs, G,
                            static_cast<float>(scale * k_scale), static_cast<float>(v_scale), scores, accs);
    }
  }
}

}  // namespace

namespace kvserve_cpu {
inline namespace KVSERVE_NS {

// q, out: [T, H, D] (q's heads contiguous, its tokens possibly strided: a view of the fused QKV
// projection); k_cache, v_cache: [Hkv, NB, bs, D] of q's dtype, or float8_e4m3fn holding K / k_scale and
// V / v_scale; row_token, row_seq, row_len: [R]
// int64 (q/out row, block_tables row and visible length of each row); block_tables: [S, W] int64.
// window <= 0: no sliding window. Rows of out not named in row_token are left alone. row_last: [R] int64,
// where each row's last visible key (len - 1) is stored, at or after len - 1 (tree drafts); none: in place.
void paged_attention_(const at::Tensor& q, const at::Tensor& out, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& row_token, const at::Tensor& row_seq,
                      const at::Tensor& row_len, const at::Tensor& block_tables, double scale, int64_t window,
                      double k_scale, double v_scale, const std::optional<at::Tensor>& row_last) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  for (const at::Tensor* t : {&out, &k_cache, &v_cache, &row_token, &row_seq, &row_len, &block_tables})
    TORCH_CHECK(t->is_contiguous(), "paged_attention_: inputs must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention_: q's heads must be contiguous");
  // The cache's dtype is independent of q's: products and softmax are float32 whatever either is (a
  // bfloat16 cache under float32 queries halves the bytes read per key).
  const auto cache_type = k_cache.scalar_type();
  const bool fp8 = cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
              out.scalar_type() == q.scalar_type() &&
              (cache_type == at::kFloat || cache_type == at::kBFloat16 || fp8) && v_cache.scalar_type() == cache_type,
              "paged_attention_: q and out must share a dtype, float32 or bfloat16; the cache float32, bfloat16 or "
              "float8_e4m3fn");
  for (const at::Tensor* t : {&row_token, &row_seq, &row_len, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kLong, "paged_attention_: index tensors must be int64");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0 && H / Hkv <= kMaxGroup, "unsupported head layout");
  TORCH_CHECK(row_seq.size(0) == row_token.size(0) && row_len.size(0) == row_token.size(0));
  if (row_last.has_value())
    TORCH_CHECK(row_last->is_contiguous() && row_last->scalar_type() == at::kLong &&
                row_last->dim() == 1 && row_last->size(0) == row_token.size(0), "paged_attention_: row_last [R] int64");
  const Rows rows{row_token.data_ptr<int64_t>(), row_seq.data_ptr<int64_t>(), row_len.data_ptr<int64_t>(),
                  row_last.has_value() ? row_last->data_ptr<int64_t>() : nullptr, row_token.size(0)};
  // Indices are checked up front (O(rows + table entries)): a bad one would otherwise read out of bounds
  // inside the parallel region, where an exception cannot be raised.
  const int64_t T = q.size(0), S = block_tables.size(0), W = block_tables.size(1), NB = k_cache.size(1);
  const int64_t bs = k_cache.size(2);
  for (int64_t r = 0; r < rows.count; ++r) {
    TORCH_CHECK(rows.token[r] >= 0 && rows.token[r] < T && rows.seq[r] >= 0 && rows.seq[r] < S,
                "paged_attention_: row ", r, " names a token or sequence out of range");
    TORCH_CHECK(rows.len[r] >= 1 && rows.len[r] <= W * bs, "paged_attention_: row ", r, " has length ",
                rows.len[r], " outside [1, ", W * bs, "]");
    TORCH_CHECK(rows.last == nullptr || (rows.last[r] >= rows.len[r] - 1 && rows.last[r] < W * bs),
                "paged_attention_: row ", r, " stores its last key outside [len - 1, ", W * bs, ")");
  }
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < S * W; ++i)
    TORCH_CHECK(tables[i] >= 0 && tables[i] < NB, "paged_attention_: block id ", tables[i], " out of range");
  auto with_cache = [&](auto q_tag, auto cache_tag) {
    using T = decltype(q_tag);
    using C = decltype(cache_tag);
    switch (D) {
      case 16: return paged_attention_impl<T, C, 1>(q, out, k_cache, v_cache, rows, block_tables, scale, window, k_scale, v_scale);
      case 32: return paged_attention_impl<T, C, 2>(q, out, k_cache, v_cache, rows, block_tables, scale, window, k_scale, v_scale);
      case 64: return paged_attention_impl<T, C, 4>(q, out, k_cache, v_cache, rows, block_tables, scale, window, k_scale, v_scale);
      case 128: return paged_attention_impl<T, C, 8>(q, out, k_cache, v_cache, rows, block_tables, scale, window, k_scale, v_scale);
      // Gemma 3's heads: a K/V row is 16 vectors, more than the registers hold, so the compiler keeps some
      // on the stack (L1); still one pass over the cache where the torch path gathered a padded copy.
      case 256: return paged_attention_impl<T, C, 16>(q, out, k_cache, v_cache, rows, block_tables, scale, window, k_scale, v_scale);
      default: TORCH_CHECK(false, "paged_attention_: head_dim must be 16, 32, 64, 128 or 256, got ", D);
    }
  };
  auto run = [&](auto q_tag) {
    if (fp8) with_cache(q_tag, c10::Float8_e4m3fn{});
    else if (cache_type == at::kBFloat16) with_cache(q_tag, c10::BFloat16{});
    else with_cache(q_tag, float{});
  };
  if (q.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else run(float{});
}

// Writes the new tokens' K and V ([T, Hkv, D], heads contiguous, tokens possibly strided: views of the
// fused QKV projection) into the head-major caches at their slots (block * bs + offset), converting to the
// cache's dtype. One call for what took a transpose, a copy and an index_copy_ per tensor.
// A float8 e4m3 cache stores K / k_scale and V / v_scale, rounded to nearest and saturated at +-448.
void cache_kv_(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& slots, double k_scale, double v_scale) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "cache_kv_: k, v [T, Hkv, D]; caches [Hkv, NB, bs, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
              slots.scalar_type() == at::kLong && slots.size(0) == k.size(0), "cache_kv_: slots [T] int64");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "cache_kv_: heads must be contiguous");
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2), slots_per_head = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == Hkv && k_cache.size(3) == D, "cache_kv_: cache geometry does not match k");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "cache_kv_: k and v, and the two caches, must share a dtype");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots_per_head, "cache_kv_: slot ", sp[t], " out of range");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0), "cache_kv_: scales apply to a float8 cache only");
  auto copy = [&](auto in_tag, auto cache_tag) {
    using I = decltype(in_tag);
    using C = decltype(cache_tag);
    for (const auto& [src, dst, scale] : {std::tuple{&k, &k_cache, k_scale}, std::tuple{&v, &v_cache, v_scale}}) {
      const I* in = static_cast<const I*>(src->data_ptr());
      C* out = static_cast<C*>(dst->data_ptr());
      const int64_t stride = src->stride(0);
      const float inv = static_cast<float>(1.0 / scale);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < Hkv; ++h) {
          const I* row = in + t * stride + h * D;
          C* to = out + (h * slots_per_head + sp[t]) * D;
          if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
            // A handful of rows per layer and step: c10's scalar conversion (round to nearest even) will do.
            for (int64_t d = 0; d < D; ++d)
              to[d] = C(std::clamp(static_cast<float>(row[d]) * inv, -448.f, 448.f));
          } else {
            for (int64_t d = 0; d < D; d += 16) store(to + d, load(row + d, D - d), D - d);
          }
        }
    }
  };
  const auto in = k.scalar_type(), cache = k_cache.scalar_type();
  if (fp8 && in == at::kFloat) copy(float{}, c10::Float8_e4m3fn{});
  else if (fp8 && in == at::kBFloat16) copy(c10::BFloat16{}, c10::Float8_e4m3fn{});
  else if (in == at::kFloat && cache == at::kFloat) copy(float{}, float{});
  else if (in == at::kFloat && cache == at::kBFloat16) copy(float{}, c10::BFloat16{});
  else if (in == at::kBFloat16 && cache == at::kBFloat16) copy(c10::BFloat16{}, c10::BFloat16{});
  else if (in == at::kBFloat16 && cache == at::kFloat) copy(c10::BFloat16{}, float{});
  else TORCH_CHECK(false, "cache_kv_: unsupported dtypes ", in, " -> ", cache);
}

// Copies every layer's K and V at slots src[i] to slots dst[i] (caches [Hkv, NB, bs, D], any dtype): an
// accepted tree-draft alternative, stored past its siblings, moves to its position. One call for what took
// two indexing ops per layer and cache from Python (~0.4 ms a step for 30 layers).
void copy_slots_(at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef src, at::IntArrayRef dst) {
  TORCH_CHECK(src.size() == dst.size() && k_caches.size() == v_caches.size(), "copy_slots_: src, dst pairs");
  for (at::TensorList caches : {k_caches, v_caches})
    for (const at::Tensor& cache : caches) {
      TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), "copy_slots_: caches [Hkv, NB, bs, D], contiguous");
      const int64_t Hkv = cache.size(0), slots = cache.size(1) * cache.size(2);
      const int64_t row = cache.size(3) * static_cast<int64_t>(cache.element_size());
      char* base = static_cast<char*>(cache.data_ptr());
      for (size_t i = 0; i < src.size(); ++i) {
        TORCH_CHECK(src[i] >= 0 && src[i] < slots && dst[i] >= 0 && dst[i] < slots, "copy_slots_: slot out of range");
        for (int64_t h = 0; h < Hkv; ++h)
          std::memcpy(base + (h * slots + dst[i]) * row, base + (h * slots + src[i]) * row, static_cast<size_t>(row));
      }
    }
}

}  // namespace KVSERVE_NS
}  // namespace kvserve_cpu
