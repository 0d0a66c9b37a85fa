// Causal attention over the paged KV cache on CPU, reading each KV row where it lies in the pool.
//
// The interface is neuron/layers/paged_attention.py's: a step is T flat query tokens over B
// sequences; sequence b's queries are rows query_start[b]..query_start[b+1] of q and sit at its last
// query_len positions; its position p is pool row block_table[b][p / block_size] * block_size +
// p % block_size of every KV head. Plain C++ with OpenMP and no torch headers: the Python side
// passes data pointers and strides through ctypes, so the library builds in seconds with the
// system compiler (-O3 -march=native vectorises the loops below for the machine it is built on).
//
// A work item is (sequence, KV head, tile of the sequence's queries). Its rows are the tile's
// queries times the query heads sharing the KV head, so each K and V row is loaded once for the
// whole GQA group. Keys are walked in tiles of TILE_N positions with a flash-style online softmax
// in fp32: one max and one rescale of the accumulators per tile, not per key. An item takes one
// of two paths by its number of rows:
// - few rows (decodes): bound by reading K and V, so a score is a plain dot product of a query row
//   with a key row, one row at a time (16 keys' dot products reduced together), and P V holds a
//   GQA group's accumulators in registers;
// - many rows (prefill chunks): bound by arithmetic, as Q K^T and P V over a key tile are small
//   matrix products; they run as register-blocked products with the rows along the vector lanes
//   (see "Blocked path" below).
#include "paged_attention.h"
#include "simd.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int TILE_N = 32;      // key positions per softmax tile
// the same for the blocked path: half the accumulators' rescales and reloads of 32 (a 6,000-token
// prefill of SmolLM2 2-4 % faster, its attention alone 0-9 %)
constexpr int BLOCK_KEYS = 64;
constexpr int MAX_KEYS = std::max(TILE_N, BLOCK_KEYS);
constexpr int MAX_ROWS = 32;    // queries x group heads per item of the per-row path: the accumulators stay in L1
constexpr int BLOCK_ROWS = 64;  // the same for the blocked path: each K and V tile serves twice the rows of 32
constexpr int LANES = 16;       // independent partial sums of a dot product (one AVX-512 or two AVX2 registers)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
// Below this many multiply-adds (query rows x keys x head_dim over the step) one thread does the
// whole step: a parallel region ends in a barrier that waits for every thread of the team, which
// costs more than a few keys' attention (torch's own ops skip threads for small work the same way,
// at::parallel_for's grain size). Above it the team splits the KV heads: a batch-1 decode step of
// the 191M model (16 heads of 128) goes parallel past 32 positions. Measured there, Q8_0 at batch 1
// over 256 tokens, alternated on the 2-core VM: 2^16 gave 104-123 tok/s against 94-107 for 2^21
// (a decode's attention on one thread, 8 % of the step) and 107-110 for 2^13.
constexpr int64_t MIN_PARALLEL_WORK = int64_t(1) << 16;

// Pool element types: fp32 in place; bf16 and fp16 are widened to fp32 as they are read.
struct bf16 { uint16_t bits; };

inline float widen(float x) { return x; }
inline float widen(bf16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float widen(_Float16 x) { return float(x); }

inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, _Float16* out) { *out = _Float16(x); }
inline void narrow(float x, bf16* out) { out->bits = bf16_bits(x); }

template <int DT>
inline float dot(const float* __restrict a, const float* __restrict b, int d_runtime) {
    const int D = DT ? DT : d_runtime;
    float part[LANES] = {};
    int d = 0;
    for (; d + LANES <= D; d += LANES) {
#pragma omp simd
        for (int l = 0; l < LANES; ++l) part[l] += a[d + l] * b[d + l];
    }
    float s = 0.0f;
    for (; d < D; ++d) s += a[d] * b[d];
    for (int l = 0; l < LANES; ++l) s += part[l];
    return s;
}

template <int DT>
inline void axpy(float* __restrict y, float a, const float* __restrict x, int d_runtime) {
    const int D = DT ? DT : d_runtime;
#pragma omp simd
    for (int d = 0; d < D; ++d) y[d] += a * x[d];
}

constexpr int CHUNK = VL == 16 ? 8 : 4;  // accumulator vectors per row held in registers at once

using Args = PagedAttentionArgs;

// One work item: the rows of queries [q0, q0 + nq) of sequence b against KV head h.
struct Item {
    int64_t b, h, q0, nq;
    bool blocked;  // takes the blocked path
};

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Per-thread scratch, sized at each call for its largest item (its rows padded to VL). The
// blocked path keeps its queries transposed in q and its probabilities as s[key][row].
struct Scratch {
    std::vector<float> q, acc, k, v, s, m, l, alpha, zero;
    void size_for(int64_t rows, int64_t dim) {
        rows = round_up(rows, VL);
        q.resize(rows * dim);
        acc.resize(rows * dim);
        k.resize(MAX_KEYS * dim);
        v.resize(MAX_KEYS * dim);
        s.resize(rows * MAX_KEYS);
        m.resize(rows);
        l.resize(rows);
        alpha.resize(rows);
        zero.assign(dim, 0.0f);
    }
};

template <int DT>
inline int64_t dim(const Args& a) { return DT ? DT : a.head_dim; }

// One register of keys or values read from the pool and widened there: the decode path reads a
// 16-bit pool this way, in place, where the copy widened into scratch cost more than the bytes it
// saved (a decode's few query rows do little arithmetic per key).
inline vecf vload_kv(const float* p) { return vload(p); }
inline vecf vload_kv(const _Float16* p) {
#if defined(__AVX512F__)
    return reinterpret_cast<vecf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__AVX2__) && defined(__F16C__)
    return reinterpret_cast<vecf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    vecf v;
    for (int l = 0; l < VL; ++l) v[l] = widen(p[l]);
    return v;
#endif
}
inline vecf vload_kv(const bf16* p) {
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return reinterpret_cast<vecf>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#elif defined(__AVX2__)
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<vecf>(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
    vecf v;
    for (int l = 0; l < VL; ++l) v[l] = widen(p[l]);
    return v;
#endif
}

// D 16-bit values widened to fp32 a register at a time (vload_kv), the rest one by one: the
// scalar loop alone converted one value per call.
template <typename T>
inline void widen_row(const T* src, int64_t D, float* dst) {
    // The tail from a bound computed once: continuing the vector loop's index, GCC warned of overflow
    // in a tail it could not see was empty at constant head sizes.
    const int64_t whole = D - D % VL;
    for (int64_t d = 0; d < whole; d += VL) vstore(dst + d, vload_kv(src + d));
    for (int64_t d = whole; d < D; ++d) dst[d] = widen(src[d]);
}

// Whether the per-row path reads the pool's rows in place (widened in registers): fp32 always, a
// 16-bit pool at the head sizes with constant-size vector loops.
template <typename TKV, int DT>
constexpr bool IN_PLACE = std::is_same_v<TKV, float> || (DT != 0 && DT % (2 * VL) == 0);

// The pool rows of consecutive positions from n0 on: one division for the first, then a walk along
// the block table. A division per position (the block size is a run-time value) cost a decode
// tile more than its scores.
struct RowWalk {
    const int32_t* table;
    int64_t block_size, block, offset;
    RowWalk(const Args& a, const int32_t* t, int64_t n0)
        : table(t), block_size(a.block_size), block(n0 / a.block_size), offset(n0 % a.block_size) {}
    int64_t next() {
        const int64_t row = int64_t(table[block]) * block_size + offset;
        if (++offset == block_size) {
            offset = 0;
            ++block;
        }
        return row;
    }
};

// The pool rows of positions [n0, n0 + nn) of KV head h, where they lie.
template <typename TKV, int DT>
void pool_rows(const Args& a, const void* pool, const int32_t* table, int64_t h, int64_t n0, int nn,
               const TKV** rows) {
    RowWalk walk(a, table, n0);
    for (int n = 0; n < nn; ++n)
        rows[n] = static_cast<const TKV*>(pool) + h * a.pool_stride_h + walk.next() * a.pool_stride_row;
}

// K or V rows of positions [n0, n0 + nn) of KV head h as fp32 pointers: into the pool for fp32,
// into `buf` (widened) for the 16-bit types.
template <typename T, int DT>
void load_rows(const Args& a, const void* pool, const int32_t* table, int64_t h, int64_t n0, int nn,
               float* buf, const float** rows) {
    const int64_t D = dim<DT>(a);
    RowWalk walk(a, table, n0);
    for (int n = 0; n < nn; ++n) {
        const T* src = static_cast<const T*>(pool) + h * a.pool_stride_h + walk.next() * a.pool_stride_row;
        if constexpr (std::is_same_v<T, float>) {
            rows[n] = src;
        } else {
            float* dst = buf + n * D;
            widen_row(src, D, dst);
            rows[n] = dst;
        }
    }
}

// K or V rows of positions [n0, n0 + TILE_N) of KV head h (pool type T), asked for into cache one
// row at a time: the current tile's loops ask for one row of the next tile each time they read
// one of theirs. A block's rows are contiguous but blocks lie anywhere in the pool, so the
// hardware prefetcher starts over at each; asked for in one burst before the tile, the next
// tile's 16 KiB (SmolLM2) came no sooner. Spread through the loops, SmolLM2's 64-row decode steps
// of attention took 25.2-26.2 ms from memory against 28.8-32.8; in cache, where the requests only
// cost, 9-10.5 against 7.6-8.7. Slots past the positions before `end` repeat the last row, so the
// loops ask without a test. An item's last tile asks for the first tile of the thread's next item
// (NoAhead where there is none). The key rows are asked for a share of their lines per row of the
// scores (`fetch_lines`): asked for in the first row's pass alone, they filled the core's
// outstanding misses in a burst and stalled the loads around them.
template <typename T, int DT>
struct Ahead {
    static constexpr int64_t LINES = DT ? (DT * int64_t(sizeof(T)) + 63) / 64 : 0;  // 0: the head size at run time
    const T* rows[TILE_N];
    int64_t lines = LINES;
    Ahead(const Args& a, const void* pool, const int32_t* table, int64_t h, int64_t n0, int64_t end) {  // n0 < end
        if constexpr (DT == 0) lines = (a.head_dim * int64_t(sizeof(T)) + 63) / 64;
        const int count = int(std::min<int64_t>(end - n0, TILE_N));
        pool_rows<T, DT>(a, pool, table, h, n0, count, rows);
        std::fill(rows + count, rows + TILE_N, rows[count - 1]);
    }
    // Into L2 (x86): a request into L1 holds one of the core's few line fill buffers until its line
    // arrives, and with every buffer waiting on memory one core read 10-11 GB/s of blocks; into L2,
    // where more misses are outstanding at once, 12-13. SmolLM2's 64-sequence decode attention from
    // memory took 31.4-31.8 ms against 36.4-37.7 on an Intel AVX-512 VM (docs/benchmarks.md).
    static void line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
        asm volatile("prefetcht1 %0" : : "m"(*p));
#else
        __builtin_prefetch(p, 0, 2);
#endif
    }
    void fetch_lines(int n, int l0, int l1) const {  // lines [l0, l1) of row n
        const char* row = reinterpret_cast<const char*>(rows[n]);
        for (int l = l0; l < l1; ++l) line(row + 64 * l);
    }
    void fetch(int n) const {
        const char* row = reinterpret_cast<const char*>(rows[n]);
        if constexpr (LINES > 0) {
            for (int l = 0; l < LINES; ++l) line(row + 64 * l);
        } else {
            for (int64_t l = 0; l < lines; ++l) line(row + 64 * l);
        }
    }
};

struct NoAhead {
    void fetch_lines(int, int, int) const {}
    void fetch(int) const {}
};

// The first tile's keys and values asked for before the queries are read (a decode step's short
// contexts are mostly first tiles); the tile loop asks for each next tile as it goes.
template <typename T, int DT>
void prefetch_first(const Args& a, const int32_t* table, int64_t h, int64_t end) {
    const Ahead<T, DT> k(a, a.k_pool, table, h, 0, end), v(a, a.v_pool, table, h, 0, end);
    for (int n = 0, nn = int(std::min<int64_t>(TILE_N, end)); n < nn; ++n) {
        k.fetch(n);
        v.fetch(n);
    }
}

// The item's query rows (row = query * group + head in the group), widened and pre-scaled.
template <typename T, int DT>
void load_queries(const Args& a, const Item& it, int64_t group, float* qbuf) {
    const int64_t D = dim<DT>(a), first = a.query_start[it.b] + it.q0;
    for (int64_t qi = 0; qi < it.nq; ++qi) {
        for (int64_t g = 0; g < group; ++g) {
            const T* src = static_cast<const T*>(a.q) + (first + qi) * a.q_stride_t + (it.h * group + g) * a.q_stride_h;
            float* dst = qbuf + (qi * group + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = widen(src[d]) * a.scale_log2;
        }
    }
}

// VL vectors of partial sums, one key's each, reduced to one vector of the keys' sums (lane n: key
// n's): at each level, lanes of one partner hold a pair's sum of the one key's partials, the other
// lanes the other key's, halving the keys' spread, so every key's sum is the same tree of adds
// whatever the other lanes hold. VL - 1 vector adds and twice as many shuffles for VL keys, where a
// horizontal sum per key takes about as many as VL adds.
template <int STEP, int... L>
inline vecf pair_sums(vecf a, vecf b, std::integer_sequence<int, L...>) {
    // lane l: from a where (l & STEP) == 0, else from b (b's lanes are VL + l); each lane adds the
    // pair l and l ^ STEP
    const vecf lo = __builtin_shufflevector(a, b, ((L & STEP) == 0 ? L : VL + L - STEP)...);
    const vecf hi = __builtin_shufflevector(a, b, ((L & STEP) == 0 ? L + STEP : VL + L)...);
    return lo + hi;
}
template <int STEP>
inline vecf pair_sums(vecf a, vecf b) {
    return pair_sums<STEP>(a, b, std::make_integer_sequence<int, VL>{});
}
inline vecf key_sums(vecf* v) {
    for (int n = 0; n < VL / 2; ++n) v[n] = pair_sums<1>(v[2 * n], v[2 * n + 1]);
    for (int n = 0; n < VL / 4; ++n) v[n] = pair_sums<2>(v[2 * n], v[2 * n + 1]);
    for (int n = 0; n < VL / 8; ++n) v[n] = pair_sums<4>(v[2 * n], v[2 * n + 1]);
    if constexpr (VL == 16) v[0] = pair_sums<8>(v[0], v[1]);
    return v[0];
}

// Scores of every row against the tile's keys; a key past a row's own position is masked out.
template <int DT, typename TK, typename A>
void scores(const Args& a, int64_t rows, int64_t group, int64_t first_pos, int64_t n0, int nn,
            const TK* const* krows, const A& ahead, Scratch& w) {
    const int64_t D = dim<DT>(a);
    if constexpr (DT != 0 && DT % (2 * VL) == 0) {
        // a row's query held in registers against VL keys at a time, their sums reduced together
        constexpr int NV = DT / VL, LINES = (DT * int(sizeof(TK)) + 63) / 64;
        const int shares = int(std::min<int64_t>(rows, LINES));  // rows that ask for the next keys' lines
        for (int64_t r = 0; r < rows; ++r) {
            const int l0 = r < shares ? LINES * int(r) / shares : 0;
            const int l1 = r < shares ? LINES * (int(r) + 1) / shares : 0;
            vecf q[NV];
            for (int j = 0; j < NV; ++j) q[j] = vload(&w.q[r * DT + j * VL]);
            for (int k0 = 0; k0 < nn; k0 += VL) {
                vecf part[VL];
                for (int n = 0; n < VL; ++n) {
                    if (k0 + n >= nn) {  // past the tile's keys: a zero row
                        part[n] = vecf{};
                        continue;
                    }
                    const TK* k = krows[k0 + n];
                    ahead.fetch_lines(k0 + n, l0, l1);
                    vecf s0 = q[0] * vload_kv(k), s1 = q[1] * vload_kv(k + VL);
                    for (int j = 2; j < NV; j += 2) {
                        s0 += q[j] * vload_kv(k + j * VL);
                        s1 += q[j + 1] * vload_kv(k + (j + 1) * VL);
                    }
                    part[n] = s0 + s1;
                }
                const vecf sums = key_sums(part);
                float* out = &w.s[r * TILE_N + k0];
                if (k0 + VL <= nn)
                    vstore(out, sums);
                else
                    for (int n = 0; n < nn - k0; ++n) out[n] = sums[n];
            }
        }
    } else {
        for (int n = 0; n < nn; ++n) {
            ahead.fetch(n);
            for (int64_t r = 0; r < rows; ++r) w.s[r * TILE_N + n] = dot<DT>(&w.q[r * D], krows[n], D);
        }
    }
    if (n0 + nn - 1 <= first_pos) return;  // every key of the tile is visible to every row
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t visible = first_pos + r / group - n0 + 1;  // keys of the tile this row sees
        for (int64_t n = std::max<int64_t>(visible, 0); n < nn; ++n) w.s[r * TILE_N + n] = NEG_INF;
    }
}

// Online softmax: fold the tile's scores into each row's running max, sum and accumulator.
template <int DT, typename TV, typename A>
void accumulate(const Args& a, int64_t rows, int nn, const TV* const* vrows, const A& ahead, Scratch& w) {
    const int64_t D = dim<DT>(a);
    // first each row's new maximum, its factor alpha and its probabilities (in s); a row for which
    // every key of the tile lies after its query keeps its state: alpha 1 and p 0 (its values are
    // finite: rows of this step or earlier ones)
    for (int64_t r = 0; r < rows; ++r) {
        float* s = &w.s[r * TILE_N];
        float tile_max = NEG_INF;
        for (int n = 0; n < nn; ++n) tile_max = std::max(tile_max, s[n]);
        if (tile_max == NEG_INF) {
            std::fill(s, s + nn, 0.0f);
            w.alpha[r] = 1.0f;
            continue;
        }
        const float m_new = std::max(w.m[r], tile_max);
        const float alpha = w.m[r] == NEG_INF ? 0.0f : exp2_neg(w.m[r] - m_new);
        int n = 0;
        for (; n + VL <= nn; n += VL) vstore(s + n, exp2_neg_v(vload(s + n) - m_new));
        for (; n < nn; ++n) s[n] = exp2_neg(s[n] - m_new);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < nn; ++j) sum += s[j];
        w.alpha[r] = alpha;
        w.l[r] = w.l[r] * alpha + sum;
        w.m[r] = m_new;
    }
    // then P V: RB rows x CH vectors of their accumulators in registers, each value vector loaded
    // once for the RB rows (a GQA group's rows share the keys)
    if constexpr (DT != 0 && DT % VL == 0) {
        constexpr int CH = std::min(CHUNK, DT / VL);
        constexpr int RB = std::max(1, 2 * CHUNK / CH);  // rows per block: RB x CH accumulators, 2 x CHUNK
        static_assert(DT % (CH * VL) == 0, "whole chunks of the head");
        auto block = [&](auto rb, int64_t r0) {
            constexpr int R = decltype(rb)::value;
            for (int c = 0; c < DT; c += CH * VL) {
                vecf part[R][CH];
                for (int i = 0; i < R; ++i)
                    for (int j = 0; j < CH; ++j)
                        part[i][j] = vload(&w.acc[(r0 + i) * D + c + j * VL]) * w.alpha[r0 + i];
                for (int n = 0; n < nn; ++n) {
                    if (r0 == 0 && c == 0) ahead.fetch(n);
                    vecf v[CH];
                    for (int j = 0; j < CH; ++j) v[j] = vload_kv(vrows[n] + c + j * VL);
                    for (int i = 0; i < R; ++i) {
                        const float p = w.s[(r0 + i) * TILE_N + n];
                        for (int j = 0; j < CH; ++j) part[i][j] += p * v[j];
                    }
                }
                for (int i = 0; i < R; ++i)
                    for (int j = 0; j < CH; ++j) vstore(&w.acc[(r0 + i) * D + c + j * VL], part[i][j]);
            }
        };
        int64_t r = 0;
        for (; r + RB <= rows; r += RB) block(std::integral_constant<int, RB>{}, r);
        // the rest in one block of their own count (a decode's GQA group of 3 under RB 4), so each
        // value vector is loaded once for them and their accumulators' chains interleave
        if constexpr (RB > 1)
            if (r < rows) with_count<RB - 1>(rows - r, [&](auto rb) { block(rb, r); });
    } else {
        for (int64_t r = 0; r < rows; ++r) {
            float* acc = &w.acc[r * D];
            const float alpha = w.alpha[r];
            if (alpha != 1.0f) {
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
            }
            for (int n = 0; n < nn; ++n) {
                if (r == 0) ahead.fetch(n);
                axpy<DT>(acc, w.s[r * TILE_N + n], vrows[n], D);
            }
        }
    }
}

// The item's rows out of the accumulators: row r's element d at acc[r * D + d], or at acc[d * rp + r]
// where they are held TRANSPOSED (VALUES_BY_ROWS; rp the padded rows).
template <typename T, int DT, bool TRANSPOSED = false>
void store(const Args& a, const Item& it, int64_t group, const Scratch& w, int64_t rp = 0) {
    const int64_t D = dim<DT>(a), first = a.query_start[it.b] + it.q0;
    const int64_t row_stride = TRANSPOSED ? 1 : D, dim_stride = TRANSPOSED ? rp : 1;
    for (int64_t qi = 0; qi < it.nq; ++qi) {
        for (int64_t g = 0; g < group; ++g) {
            const int64_t r = qi * group + g;
            T* dst = static_cast<T*>(a.out) + (first + qi) * a.out_stride_t + (it.h * group + g) * a.out_stride_h;
            const float inv = 1.0f / w.l[r];  // every row sees at least its own position, so l > 0
            const float* acc = &w.acc[r * row_stride];
            for (int64_t d = 0; d < D; ++d) narrow(acc[d * dim_stride] * inv, &dst[d]);
        }
    }
}

// The end of item `it`'s keys: its last query's position + 1 (keys past it are never seen).
inline int64_t item_end(const Args& a, const Item& it) {
    const int64_t query_len = a.query_start[it.b + 1] - a.query_start[it.b];
    return a.kv_lens[it.b] - query_len + it.q0 + it.nq;
}

// `next`: the thread's next item of the per-row path, whose first tile the last tile asks for.
template <typename TQ, typename TKV, int DT>
void attend_item(const Args& a, const Item& it, const Item* next, Scratch& w) {
    const int64_t D = dim<DT>(a), group = a.heads / a.kv_heads, rows = it.nq * group;
    const int64_t end = item_end(a, it), first_pos = end - it.nq;  // the tile's first query's position
    const int32_t* table = a.block_tables + it.b * a.table_stride;
    prefetch_first<TKV, DT>(a, table, it.h, end);
    load_queries<TQ, DT>(a, it, group, w.q.data());
    std::fill(w.acc.begin(), w.acc.begin() + rows * D, 0.0f);
    std::fill(w.m.begin(), w.m.begin() + rows, NEG_INF);
    std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
    // the tile's key and value rows: in the pool where the loops read its type, else widened into scratch
    using Row = std::conditional_t<IN_PLACE<TKV, DT>, TKV, float>;
    const Row* krows[TILE_N];
    const Row* vrows[TILE_N];
    for (int64_t n0 = 0; n0 < end; n0 += TILE_N) {
        const int nn = int(std::min<int64_t>(TILE_N, end - n0));
        if constexpr (IN_PLACE<TKV, DT>) {
            pool_rows<TKV, DT>(a, a.k_pool, table, it.h, n0, nn, krows);
            pool_rows<TKV, DT>(a, a.v_pool, table, it.h, n0, nn, vrows);
        } else {
            load_rows<TKV, DT>(a, a.k_pool, table, it.h, n0, nn, w.k.data(), krows);
            load_rows<TKV, DT>(a, a.v_pool, table, it.h, n0, nn, w.v.data(), vrows);
        }
        auto tile = [&](const auto& k_ahead, const auto& v_ahead) {
            scores<DT>(a, rows, group, first_pos, n0, nn, krows, k_ahead, w);
            accumulate<DT>(a, rows, nn, vrows, v_ahead, w);
        };
        if (n0 + TILE_N < end) {
            tile(Ahead<TKV, DT>(a, a.k_pool, table, it.h, n0 + TILE_N, end),
                 Ahead<TKV, DT>(a, a.v_pool, table, it.h, n0 + TILE_N, end));
        } else if (next) {
            const int32_t* next_table = a.block_tables + next->b * a.table_stride;
            const int64_t next_end = item_end(a, *next);
            tile(Ahead<TKV, DT>(a, a.k_pool, next_table, next->h, 0, next_end),
                 Ahead<TKV, DT>(a, a.v_pool, next_table, next->h, 0, next_end));
        } else {
            tile(NoAhead{}, NoAhead{});
        }
    }
    store<TQ, DT>(a, it, group, w);
}

// ---- Blocked path ----
//
// The item's queries are stored transposed, qt[d][r], so that one vector holds element d of VL
// rows: a block of SCORE_VECS x VL rows by SCORE_KEYS keys accumulates its scores in registers
// from one broadcast of k[n][d] per key and element, without horizontal sums, reading the key
// rows where they lie in the pool (no copy for fp32). The scores come out as s[n][r], so the
// online softmax's max, exponentials and sums run down the tile's keys with the rows along the
// lanes. P V broadcasts p[n][r] against value rows (head_dim along the lanes) into a block of
// VALUE_ROWS rows x VALUE_VECS vectors of the output held in registers; AVX2 builds keep the
// output transposed instead (VALUES_BY_ROWS). Only the tiles that reach past the item's first
// query (the diagonal) are masked.
//
// AVX2 has 16 vector registers, and its blocks of 2 x 4 left 8 accumulators, as many as its two
// FMA units keep in flight at their latency, with GCC folding each query load into every FMA that
// reads it (12 loads per 8 FMAs). Blocks of 3 row vectors x 4 keys or elements (12 accumulators, the
// row vectors kept in registers) took a 512-query chunk's attention from 44-50 to 54-67 GFLOP/s on one
// core here, the same bits (docs/benchmarks.md, twenty-second session).

constexpr int SCORE_VECS = VL == 16 ? 2 : 3;  // row vectors of a score block
constexpr int SCORE_KEYS = VL == 16 ? 8 : 4;  // its keys: SCORE_VECS x SCORE_KEYS accumulators
constexpr int VALUE_ROWS = 4;                 // rows of a P V block
constexpr int VALUE_VECS = VL == 16 ? 4 : 2;  // its vectors of head_dim: VALUE_ROWS x VALUE_VECS accumulators
static_assert(BLOCK_KEYS % SCORE_KEYS == 0 && VL % VALUE_ROWS == 0, "blocks tile the key tile and the padded rows");
constexpr bool VALUES_BY_ROWS = VL == 8;     // P V with the output transposed (value_block)
constexpr int VALUE_DIMS = 4;                 // its elements of head_dim: SCORE_VECS x VALUE_DIMS accumulators
template <int DT>  // head sizes the blocked path takes: known at compile time, whole P V blocks
constexpr bool BLOCKABLE = DT != 0 && DT % (VALUE_VECS * VL) == 0;
// An item of fewer rows takes the per-row path: where the two cross on AVX-512 (rows padded to 16),
// measured on single items over 2,000 positions (8 rows of 64 blocked are 10 % faster, of 128 20 % slower).
template <int DT>
constexpr int MIN_BLOCK_ROWS = DT <= 64 ? 8 : 12;

// The item's query rows, widened, pre-scaled and transposed: qt[d * rp + r], padding rows zero.
template <typename T, int DT>
void load_queries_transposed(const Args& a, const Item& it, int64_t group, int64_t rp, float* qt) {
    const int64_t first = a.query_start[it.b] + it.q0;
    std::fill(qt, qt + DT * rp, 0.0f);
    for (int64_t qi = 0; qi < it.nq; ++qi) {
        for (int64_t g = 0; g < group; ++g) {
            const T* src = static_cast<const T*>(a.q) + (first + qi) * a.q_stride_t + (it.h * group + g) * a.q_stride_h;
            const int64_t r = qi * group + g;
            for (int64_t d = 0; d < DT; ++d) qt[d * rp + r] = widen(src[d]) * a.scale_log2;
        }
    }
}

// A vector GCC must hold in a register rather than read again from memory into each FMA that uses
// it (AVX2 builds; AVX-512 ones broadcast from memory and keep their code as measured, and builds
// without AVX have no register of a vector's width).
inline void in_register(vecf& v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    asm("" : "+x"(v));
#else
    (void)v;
#endif
}

// Scores of RV x VL rows (qt, row stride rp) against SCORE_KEYS key rows k, into s[n * rp + r].
template <int DT, int RV>
inline void score_block(const float* __restrict qt, int64_t rp, const float* const* k, float* __restrict s) {
    vecf acc[SCORE_KEYS][RV] = {};
    for (int d = 0; d < DT; ++d) {
        vecf q[RV];
#pragma GCC unroll 4
        for (int j = 0; j < RV; ++j) {
            q[j] = vload(qt + d * rp + j * VL);
            in_register(q[j]);
        }
#pragma GCC unroll 8
        for (int n = 0; n < SCORE_KEYS; ++n) {
            const float kd = k[n][d];
#pragma GCC unroll 4
            for (int j = 0; j < RV; ++j) acc[n][j] += kd * q[j];
        }
    }
    for (int n = 0; n < SCORE_KEYS; ++n)
        for (int j = 0; j < RV; ++j) vstore(s + n * rp + j * VL, acc[n][j]);
}

// s[n][r] for the tile's nn keys, a key past a row's own position masked out.
template <int DT>
void block_scores(int64_t rp, int64_t group, int64_t first_pos, int64_t n0, int nn, const float** krows,
                  Scratch& w) {
    for (int k0 = 0; k0 < nn; k0 += SCORE_KEYS) {
        const float* k[SCORE_KEYS];
        for (int n = 0; n < SCORE_KEYS; ++n) k[n] = k0 + n < nn ? krows[k0 + n] : w.zero.data();
        float* s = &w.s[k0 * rp];
        int64_t r = 0;
        for (; r + SCORE_VECS * VL <= rp; r += SCORE_VECS * VL) score_block<DT, SCORE_VECS>(&w.q[r], rp, k, s + r);
        if constexpr (SCORE_VECS > 2)
            for (; r + 2 * VL <= rp; r += 2 * VL) score_block<DT, 2>(&w.q[r], rp, k, s + r);
        for (; r < rp; r += VL) score_block<DT, 1>(&w.q[r], rp, k, s + r);
    }
    if (n0 + nn - 1 <= first_pos) return;  // every key of the tile is visible to every row
    for (int n = 0; n < nn; ++n) {
        const int64_t hidden = std::min(rp, (n0 + n - first_pos) * group);  // rows before the key's position
        for (int64_t r = 0; r < hidden; ++r) w.s[n * rp + r] = NEG_INF;
    }
}

// Online softmax down the tile's keys, every row at once: s becomes p, and alpha the factor by
// which each row's accumulator and sum shrink for the new maximum.
inline void block_softmax(int64_t rp, int nn, Scratch& w) {
    float* __restrict s = w.s.data();
    const vecf neg_inf = vecf{} + NEG_INF, one = vecf{} + 1.0f;
    for (int64_t r = 0; r < rp; r += VL) {  // rp: whole vectors of rows
        vecf shift = vload(s + r);
        for (int n = 1; n < nn; ++n) {
            const vecf v = vload(s + n * rp + r);
            shift = shift < v ? v : shift;
        }
        // a row that has seen no key yet (every one so far masked) keeps m = -inf and p = 0
        const vecf m = vload(&w.m[r]);
        const vecf m_new = m < shift ? shift : m;
        const auto none = m_new == neg_inf;
        const vecf alpha = none ? one : exp2_neg_v(m - m_new);
        shift = none ? vecf{} : m_new;
        vstore(&w.alpha[r], alpha);
        vstore(&w.m[r], m_new);
        vecf l = vload(&w.l[r]) * alpha;
        for (int n = 0; n < nn; ++n) {
            const vecf p = exp2_neg_v(vload(s + n * rp + r) - shift);
            vstore(s + n * rp + r, p);
            l += p;
        }
        vstore(&w.l[r], l);
    }
}

// acc[r] = alpha[r] * acc[r] + sum over the tile's keys of p[n][r] * v[n], for rows [0, rows).
template <int DT>
void block_values(int64_t rows, int64_t rp, int nn, const float** vrows, Scratch& w) {
    const float* __restrict s = w.s.data();
    for (int64_t r0 = 0; r0 < rows; r0 += VALUE_ROWS) {
        for (int c = 0; c < DT; c += VALUE_VECS * VL) {
            vecf o[VALUE_ROWS][VALUE_VECS];
            for (int i = 0; i < VALUE_ROWS; ++i)
                for (int j = 0; j < VALUE_VECS; ++j)
                    o[i][j] = vload(&w.acc[(r0 + i) * DT + c + j * VL]) * w.alpha[r0 + i];
            for (int n = 0; n < nn; ++n) {
                vecf v[VALUE_VECS];
#pragma GCC unroll 4
                for (int j = 0; j < VALUE_VECS; ++j) v[j] = vload(vrows[n] + c + j * VL);
                const float* p = s + n * rp + r0;
#pragma GCC unroll 4
                for (int i = 0; i < VALUE_ROWS; ++i) {
                    const float pi = p[i];
#pragma GCC unroll 4
                    for (int j = 0; j < VALUE_VECS; ++j) o[i][j] += pi * v[j];
                }
            }
            for (int i = 0; i < VALUE_ROWS; ++i)
                for (int j = 0; j < VALUE_VECS; ++j) vstore(&w.acc[(r0 + i) * DT + c + j * VL], o[i][j]);
        }
    }
}

// The same into the output held transposed, acc[d * rp + r] (VALUES_BY_ROWS): RV row vectors x
// VALUE_DIMS elements from elements d0 on, from RV loads of p and VALUE_DIMS broadcasts of v per key,
// the rows along the lanes as in score_block. Each output is the same sum in the same order.
template <int RV>
inline void value_block(const float* __restrict s, int64_t rp, int nn, const float* const* v, int d0,
                        const float* alpha, float* __restrict acc) {
    vecf o[VALUE_DIMS][RV];
    for (int j = 0; j < RV; ++j) {
        const vecf shrink = vload(alpha + j * VL);
        for (int e = 0; e < VALUE_DIMS; ++e) o[e][j] = vload(acc + (d0 + e) * rp + j * VL) * shrink;
    }
    for (int n = 0; n < nn; ++n) {
        vecf p[RV];
#pragma GCC unroll 4
        for (int j = 0; j < RV; ++j) {
            p[j] = vload(s + n * rp + j * VL);
            in_register(p[j]);
        }
        const float* vn = v[n] + d0;
#pragma GCC unroll 4
        for (int e = 0; e < VALUE_DIMS; ++e) {
            const float ve = vn[e];
#pragma GCC unroll 4
            for (int j = 0; j < RV; ++j) o[e][j] += ve * p[j];
        }
    }
    for (int e = 0; e < VALUE_DIMS; ++e)
        for (int j = 0; j < RV; ++j) vstore(acc + (d0 + e) * rp + j * VL, o[e][j]);
}

template <int DT, int RV>
inline void value_blocks(int64_t r, int64_t rp, int nn, const float** vrows, Scratch& w) {
    for (int d0 = 0; d0 < DT; d0 += VALUE_DIMS) value_block<RV>(&w.s[r], rp, nn, vrows, d0, &w.alpha[r], &w.acc[r]);
}

// acc as block_values, held transposed, for every padded row.
template <int DT>
void block_values_by_rows(int64_t rp, int nn, const float** vrows, Scratch& w) {
    int64_t r = 0;
    for (; r + SCORE_VECS * VL <= rp; r += SCORE_VECS * VL) value_blocks<DT, SCORE_VECS>(r, rp, nn, vrows, w);
    for (; r + 2 * VL <= rp; r += 2 * VL) value_blocks<DT, 2>(r, rp, nn, vrows, w);
    for (; r < rp; r += VL) value_blocks<DT, 1>(r, rp, nn, vrows, w);
}

template <typename TQ, typename TKV, int DT>
void attend_item_blocked(const Args& a, const Item& it, Scratch& w) {
    const int64_t group = a.heads / a.kv_heads, rows = it.nq * group, rp = round_up(rows, VL);
    const int64_t end = item_end(a, it), first_pos = end - it.nq;
    const int32_t* table = a.block_tables + it.b * a.table_stride;
    load_queries_transposed<TQ, DT>(a, it, group, rp, w.q.data());
    std::fill(w.acc.begin(), w.acc.begin() + rp * DT, 0.0f);
    std::fill(w.m.begin(), w.m.begin() + rp, NEG_INF);
    std::fill(w.l.begin(), w.l.begin() + rp, 0.0f);
    // No prefetching here, unlike the per-row path: each tile serves up to 64 rows and a long
    // prompt's keys are read again by each of its query tiles, so they are mostly in cache, and
    // asking for the next tile only evicted (4,000-token prefill 6-10 % slower, measured).
    const float* krows[BLOCK_KEYS];
    const float* vrows[BLOCK_KEYS];
    for (int64_t n0 = 0; n0 < end; n0 += BLOCK_KEYS) {
        const int nn = int(std::min<int64_t>(BLOCK_KEYS, end - n0));
        load_rows<TKV, DT>(a, a.k_pool, table, it.h, n0, nn, w.k.data(), krows);
        load_rows<TKV, DT>(a, a.v_pool, table, it.h, n0, nn, w.v.data(), vrows);
        block_scores<DT>(rp, group, first_pos, n0, nn, krows, w);
        block_softmax(rp, nn, w);
        if constexpr (VALUES_BY_ROWS)
            block_values_by_rows<DT>(rp, nn, vrows, w);
        else
            block_values<DT>(round_up(rows, VALUE_ROWS), rp, nn, vrows, w);
    }
    if constexpr (VALUES_BY_ROWS)
        store<TQ, DT, true>(a, it, group, w, rp);
    else
        store<TQ, DT>(a, it, group, w);
}

// Work items, the longest queries first so that dynamic scheduling ends with the short ones. A
// sequence's queries are cut into tiles of the per-row or the blocked path's size by the rows it
// brings (the blocked path needs a head size with constant-size loops); a tile of a blocked
// sequence left with few rows takes the per-row path.
template <int DT>
std::vector<Item> plan(const Args& a) {
    const int64_t group = a.heads / a.kv_heads;
    std::vector<Item> items;
    for (int64_t b = 0; b < a.num_seqs; ++b) {
        const int64_t query_len = a.query_start[b + 1] - a.query_start[b];
        const bool blocked = BLOCKABLE<DT> && query_len * group >= MIN_BLOCK_ROWS<DT>;
        const int64_t per_tile = std::max<int64_t>(1, (blocked ? BLOCK_ROWS : MAX_ROWS) / group);
        for (int64_t q0 = 0; q0 < query_len; q0 += per_tile) {
            const int64_t nq = std::min(per_tile, query_len - q0);
            const bool tile_blocked = blocked && nq * group >= MIN_BLOCK_ROWS<DT>;
            for (int64_t h = 0; h < a.kv_heads; ++h) items.push_back({b, h, q0, nq, tile_blocked});
        }
    }
    std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
        return a.kv_lens[x.b] - x.q0 > a.kv_lens[y.b] - y.q0;
    });
    return items;
}

template <typename TQ, typename TKV, int DT>
void run(const Args& a, int threads) {
    const int64_t group = a.heads / a.kv_heads;
    const std::vector<Item> items = plan<DT>(a);
    const int64_t n = int64_t(items.size());
    int64_t work = 0, rows = 0;
    for (const Item& it : items) {
        work += it.nq * group * (a.kv_lens[it.b] - it.q0) * a.head_dim;
        rows = std::max(rows, it.nq * group);
    }
    // Items go to the threads one at a time as each finishes its last (dynamic scheduling), each
    // thread taking its next one before it starts the current one, so that the current one's last
    // tile asks for the next one's first keys (SmolLM2's 64-row decode steps from memory: 21.1-21.3
    // ms against 22.0-22.6 without).
    std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(threads) if (work >= MIN_PARALLEL_WORK)
    {
        // each thread's scratch is kept from call to call and only grows: made anew, its buffers'
        // allocation and zeroing cost a decode step's short attention more than its arithmetic
        static thread_local Scratch w;
        w.size_for(rows, dim<DT>(a));
        int64_t i = taken.fetch_add(1, std::memory_order_relaxed);
        for (int64_t next; i < n; i = next) {
            next = taken.fetch_add(1, std::memory_order_relaxed);
            if constexpr (BLOCKABLE<DT>) {
                if (items[i].blocked) {
                    attend_item_blocked<TQ, TKV, DT>(a, items[i], w);
                    continue;
                }
            }
            attend_item<TQ, TKV, DT>(a, items[i], next < n && !items[next].blocked ? &items[next] : nullptr, w);
        }
    }
}

// The head sizes models use get loops with a constant trip count; any other size runs the same
// code with the size read at run time.
template <typename TQ, typename TKV>
void run_dim(const Args& a, int threads) {
    switch (a.head_dim) {
        case 64: return run<TQ, TKV, 64>(a, threads);
        case 128: return run<TQ, TKV, 128>(a, threads);
        case 256: return run<TQ, TKV, 256>(a, threads);
        default: return run<TQ, TKV, 0>(a, threads);
    }
}

}  // namespace

// dtype: the queries' and the output's, kv_dtype: the pools' (0 fp32, 1 bf16, 2 fp16). 16-bit keys
// and values are widened as they are read: fp32 queries take any pool (an fp32 model's 16-bit KV
// cache), 16-bit ones a pool of their own type. Returns 0, or 1 for a pair it does not take.
extern "C" int neuron_paged_attention(const Args* a, int dtype, int kv_dtype, int threads) {
    if (dtype == 0 && kv_dtype == 0) run_dim<float, float>(*a, threads);
    else if (dtype == 0 && kv_dtype == 1) run_dim<float, bf16>(*a, threads);
    else if (dtype == 0 && kv_dtype == 2) run_dim<float, _Float16>(*a, threads);
    else if (dtype == 1 && kv_dtype == 1) run_dim<bf16, bf16>(*a, threads);
    else if (dtype == 2 && kv_dtype == 2) run_dim<_Float16, _Float16>(*a, threads);
    else return 1;
    return 0;
}
