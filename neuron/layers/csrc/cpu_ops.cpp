// The CPU step's non-attention kernels for fp32: the small-batch matrix product and the
// element-wise passes between the matrix products, each one loop over the data.
//
// Same build as paged_attention_cpu.cpp (neuron/utils/native.py): plain C++ with OpenMP, no torch
// headers, called through ctypes with data pointers and row strides (every last dimension is
// contiguous; the Python side checks). -O3 -march=native vectorises the loops for the machine.
//
// The layers hold an fp32 weight as panels from load (neuron_panel_linear), which take
// any number of rows. neuron_linear, below, multiplies a row-major weight (the layers' where they
// hold one: the kernels switched off for them, a weight that is not fp32):
//
// linear: y[m, n] = x[m, k] W[n, k]^T (+ bias) for the rows of a decode step. Up to four rows it is
// bound by reading W once from memory: tiles of NB weight rows are dotted with up to RB rows of x
// at a time in vector accumulators, and the threads take contiguous ranges of weight rows, so each
// streams its share of W exactly once. From five rows on the tiles are sized for the registers
// (tiled_rows), and from PANEL_ROWS on, where the arithmetic binds, panels of W are transposed as
// they are used (panel_rows); above cpu_ops.MAX_LINEAR_ROWS rows oneDNN is as fast (cpu_linear.py).
//
// The element-wise passes (RMSNorm, the residual add + RMSNorm, the per-head RMSNorm + rotary
// embedding of queries and keys, silu(gate) * up) each replace several PyTorch operations and
// their temporaries with one pass and one parallel region. Rows are split over threads only when
// there is enough work: a parallel region ends in a barrier for the whole team, and on cores shared
// with other processes that wait costs more than a small pass.
#include "simd.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int NB = 8;  // weight rows per linear tile
constexpr int64_t MIN_PARALLEL_LINEAR = int64_t(1) << 18;    // multiply-adds
constexpr int64_t MIN_PARALLEL_ELEMENTS = int64_t(1) << 15;  // elements of an element-wise pass

// RB rows of x against NB rows of W: RB x NB dot products of length k, written to y[r][j].
template <int NBT, int RB>
inline void tile(const float* x, int64_t xs, const float* w, int64_t ws, int64_t k, float* y, int64_t ys,
                 const float* bias) {
    vecf acc[RB][NBT] = {};
    int64_t c = 0;
    for (; c + VL <= k; c += VL) {
        vecf wv[NBT];
        for (int j = 0; j < NBT; ++j) wv[j] = vload(w + j * ws + c);
        for (int r = 0; r < RB; ++r) {
            const vecf xv = vload(x + r * xs + c);
            for (int j = 0; j < NBT; ++j) acc[r][j] += wv[j] * xv;
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int j = 0; j < NBT; ++j) {
            float s = hsum(acc[r][j]);
            for (int64_t t = c; t < k; ++t) s += w[j * ws + t] * x[r * xs + t];
            y[r * ys + j] = bias ? s + bias[j] : s;
        }
}

template <int NBT>
inline void weight_rows(const float* x, int64_t m, int64_t xs, const float* w, int64_t ws, int64_t k, float* y,
                        int64_t ys, const float* bias) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) tile<NBT, 4>(x + r * xs, xs, w, ws, k, y + r * ys, ys, bias);
    for (; r + 2 <= m; r += 2) tile<NBT, 2>(x + r * xs, xs, w, ws, k, y + r * ys, ys, bias);
    for (; r < m; ++r) tile<NBT, 1>(x + r * xs, xs, w, ws, k, y + r * ys, ys, bias);
}

// More rows than the streaming tiles take, fewer than PANEL_ROWS: the weight is read from the cache
// once per four rows of x, not from memory, so the tile is sized for the registers instead (RB x MNB
// accumulators, MNB weight vectors and one of x: 31 of AVX-512's 32, 16 of AVX2's 16), and each
// weight tile meets every row of x before the next tile is read.
constexpr int MNB = VL == 16 ? 6 : 3;

void tiled_rows(const float* x, int64_t m, int64_t xs, const float* w, int64_t n, int64_t k, int64_t ws,
                const float* bias, float* y, int64_t ys, int threads) {
    const int64_t tiles = (n + MNB - 1) / MNB;
#pragma omp parallel for schedule(static) num_threads(threads) if (m * n * k >= MIN_PARALLEL_LINEAR)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t o = t * MNB;
        if (o + MNB <= n) {
            weight_rows<MNB>(x, m, xs, w + o * ws, ws, k, y + o, ys, bias ? bias + o : nullptr);
        } else {
            for (int64_t j = o; j < n; ++j)
                weight_rows<1>(x, m, xs, w + j * ws, ws, k, y + j, ys, bias ? bias + j : nullptr);
        }
    }
}

// From PANEL_ROWS rows on, each weight is used by enough rows of x that the product is bound by
// the arithmetic, and a dot product per output (a vector of partial sums per row and
// weight, summed across its lanes at the end) spends a fifth of it on those sums. Instead each
// thread copies PN = 2 x VL weight rows at a time into a panel transposed to [k][PN] (vector
// transposes, in L1/L2), and each output vector accumulates x[r][c] x panel[c] over c: RB rows of x
// by PN outputs in 2 x RB accumulators, one broadcast of x and two panel loads per 2 x RB
// multiply-adds, no sums across lanes. The copy costs about 4/m of the arithmetic; a weight held
// as panels from load (neuron_panel_linear: the layers' fp32 weights) skips it. Each output is summed
// in input order, so it is not bit-equal to the tiles' sums below PANEL_ROWS rows.
constexpr int PN = 2 * VL;
// below this the copy costs more than the sums across lanes that it saves (docs/benchmarks.md)
constexpr int64_t PANEL_ROWS = 16;
#if defined(__AVX512F__)
constexpr int RB_PANEL = 14;  // 28 accumulators, two panel vectors and the broadcast: 31 of 32 registers
#else
constexpr int RB_PANEL = 6;   // 12 + 2 + 1 of AVX2's 16 registers
#endif
constexpr int64_t PANEL_PREFETCH = 128;  // floats ahead along a weight row while copying it

// dst[q * ds + i] = src[i * ss + q] for a VL x VL block.
inline void transpose_block(const float* src, int64_t ss, float* dst, int64_t ds) {
#if defined(__AVX512F__)
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) {
        r[i] = _mm512_loadu_ps(src + i * ss);
        __builtin_prefetch(src + i * ss + PANEL_PREFETCH);
    }
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; ++i) {
        _mm512_storeu_ps(dst + i * ds, _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
        _mm512_storeu_ps(dst + (8 + i) * ds, _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd));
        _mm512_storeu_ps(dst + (4 + i) * ds, _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88));
        _mm512_storeu_ps(dst + (12 + i) * ds, _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd));
    }
#elif defined(__AVX__)
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm256_loadu_ps(src + i * ss);
        __builtin_prefetch(src + i * ss + PANEL_PREFETCH);
    }
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(dst + i * ds, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
        _mm256_storeu_ps(dst + (4 + i) * ds, _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
    }
#else
    for (int i = 0; i < VL; ++i)
        for (int q = 0; q < VL; ++q) dst[q * ds + i] = src[i * ss + q];
#endif
}

// Weight rows [0, rows) of w (rows <= PN; the rest of the panel zeros) as panel[c][PN].
void pack_panel(const float* w, int64_t ws, int64_t rows, int64_t k, float* panel) {
    int64_t c = 0;
    if (rows == PN)
        for (; c + VL <= k; c += VL)
            for (int g = 0; g < 2; ++g) transpose_block(w + g * VL * ws + c, ws, panel + c * PN + g * VL, PN);
    for (; c < k; ++c)
        for (int j = 0; j < PN; ++j) panel[c * PN + j] = j < rows ? w[j * ws + c] : 0.0f;
}

// RB rows of x times the panel: y[r][0, cols) (+ bias). `ahead`: the next row-major panel's weight
// rows (ws apart), asked for as this one computes; `stream`: memory read in step with the panel
// (STREAM_AHEAD inputs ahead in a held one), asked for two lines a step.
template <int RB, bool AHEAD, bool STREAM>
void panel_loop(const float* x, int64_t xs, const float* panel, int64_t k, float* y, int64_t ys, int64_t cols,
                const float* bias, const float* ahead, int64_t ws, const float* stream) {
    vecf acc[RB][2];  // zeroed lane by lane: `= {}` had GCC memset a copy of them on the stack at every call
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = vecf{};
    for (int64_t c = 0; c < k; ++c) {
        if constexpr (STREAM) {
            prefetch_line(stream + c * PN);
            prefetch_line(stream + c * PN + VL);
        }
        if constexpr (AHEAD) {
            // the next panel's weight rows, a cache line of each of two rows per step
            constexpr int LINE = 16;
            const int64_t line = c * (PN / LINE);
            for (int j = 0; j < PN / LINE; ++j)
                __builtin_prefetch(ahead + ((line + j) % PN) * ws + (line + j) / PN * LINE, 0, 2);
        }
        const vecf p0 = vload(panel + c * PN), p1 = vload(panel + c * PN + VL);
        for (int r = 0; r < RB; ++r) {
            const float xv = x[r * xs + c];
            acc[r][0] += xv * p0;
            acc[r][1] += xv * p1;
        }
    }
    if (cols == PN) {  // a whole panel: straight from the registers (a copy of a run-time length is a call)
        for (int r = 0; r < RB; ++r) {
            vecf lo = acc[r][0], hi = acc[r][1];
            if (bias) {
                lo += vload(bias);
                hi += vload(bias + VL);
            }
            vstore(y + r * ys, lo);
            vstore(y + r * ys + VL, hi);
        }
        return;
    }
    for (int r = 0; r < RB; ++r) {
        float out[PN];
        vstore(out, acc[r][0]);
        vstore(out + VL, acc[r][1]);
        if (bias)
            for (int j = 0; j < cols; ++j) out[j] += bias[j];
        std::memcpy(y + r * ys, out, cols * sizeof(float));
    }
}

// One loop per kind of read-ahead, chosen here rather than tested in the loop: with the tests inside,
// AVX2's build kept the accumulators on the stack (16 registers leave the compiler no room for the
// branches' values), and its products ran at a third of the FMA peak.
template <int RB>
void panel_tile(const float* x, int64_t xs, const float* panel, int64_t k, float* y, int64_t ys, int64_t cols,
                const float* bias, const float* ahead, int64_t ws, const float* stream = nullptr) {
    if (ahead)
        panel_loop<RB, true, false>(x, xs, panel, k, y, ys, cols, bias, ahead, ws, nullptr);
    else if (stream)
        panel_loop<RB, false, true>(x, xs, panel, k, y, ys, cols, bias, nullptr, 0, stream);
    else
        panel_loop<RB, false, false>(x, xs, panel, k, y, ys, cols, bias, nullptr, 0, nullptr);
}

// f(r, rb) for the rows [0, m) in tiles of near-equal size, at most RB rows each (64 rows in tiles
// of 14: 12 + 13 + 13 + 13 + 13), rb the tile's row count as a compile-time constant.
// Inside a parallel region: f(u, r0, rows) for this thread's equal share of units x rows of m
// rows, in that order (a unit's rows may be split between two threads).
template <typename F>
inline void thread_share(int64_t units, int64_t m, F&& f) {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num(), total = units * m;
    for (int64_t at = total * t / team, end = total * (t + 1) / team; at < end;) {
        const int64_t u = at / m, r0 = at % m, rows = std::min(m - r0, end - at);
        f(u, r0, rows);
        at += rows;
    }
}

template <int RB, typename F>
inline void row_tiles(int64_t m, F&& f) {
    const int64_t tiles = (m + RB - 1) / RB;
    for (int64_t t = 0, r = 0; t < tiles; ++t) {
        const int64_t rows = (m - r) / (tiles - t);
        with_count<RB>(rows, [&](auto rb) { f(r, rb); });
        r += rows;
    }
}

void panel_rows(const float* x, int64_t m, int64_t xs, const float* w, int64_t n, int64_t k, int64_t ws,
               const float* bias, float* y, int64_t ys, int threads) {
    const int64_t panels = (n + PN - 1) / PN;
#pragma omp parallel num_threads(threads) if (m * n * k >= MIN_PARALLEL_LINEAR)
    {
        static thread_local std::vector<float> buffer;
        if (int64_t(buffer.size()) < k * PN) buffer.resize(k * PN);
        float* panel = buffer.data();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t o = p * PN, cols = std::min<int64_t>(PN, n - o);
            pack_panel(w + o * ws, ws, cols, k, panel);
            row_tiles<RB_PANEL>(m, [&](int64_t r, auto rb) {
                const float* ahead = r == 0 && o + 2 * PN <= n ? w + (o + PN) * ws : nullptr;  // the first tile asks
                panel_tile<decltype(rb)::value>(x + r * xs, xs, panel, k, y + r * ys + o, ys, cols,
                                                bias ? bias + o : nullptr, ahead, ws);
            });
        }
    }
}

// An fp32 weight [n, k] held from load as panels of PN outputs (cpu_ops.PanelWeight):
// data[p][c][j] = W[p * PN + j][c], the last panel's missing outputs zeros. Each thread streams whole
// panels, each one contiguous run of memory, which the hardware prefetcher follows at the speed of
// one stream (a row-major tile of 8 rows is 8 streams: 28 against 38 GB/s on one core here,
// docs/benchmarks.md), and no panel is copied or transposed on the way.
struct PanelLayout {
    const float* data;
    int64_t n, k;
};

// RB rows of x times U whole neighbouring panels (U PN outputs): 2 U RB accumulators, 2 U panel
// loads and RB broadcasts per 2 U RB multiply-adds. Each output is summed as panel_tile sums it (one
// accumulator, in input order), so the bits are the same. At each input `ahead(c, panel_row)` asks
// for what the tile will want later (the two uses below).
template <int RB, int U, class Ahead>
void panels_tile(const float* x, int64_t xs, const float* panel, int64_t k, float* y, int64_t ys, const float* bias,
                 Ahead ahead) {
    vecf acc[RB][U][2];  // zeroed lane by lane: `= {}` had GCC memset a copy of them on the stack at every call
    for (int r = 0; r < RB; ++r)
        for (int u = 0; u < U; ++u) acc[r][u][0] = acc[r][u][1] = vecf{};
    for (int64_t c = 0; c < k; ++c) {
        ahead(c, panel + c * PN);
        vecf p[U][2];
        for (int u = 0; u < U; ++u) {
            p[u][0] = vload(panel + u * k * PN + c * PN);
            p[u][1] = vload(panel + u * k * PN + c * PN + VL);
        }
        for (int r = 0; r < RB; ++r) {
            const float xv = x[r * xs + c];
            for (int u = 0; u < U; ++u) {
                acc[r][u][0] += xv * p[u][0];
                acc[r][u][1] += xv * p[u][1];
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int u = 0; u < U; ++u)
            for (int j = 0; j < 2; ++j) {
                vecf out = acc[r][u][j];
                if (bias) out += vload(bias + u * PN + j * VL);
                vstore(y + r * ys + u * PN + j * VL, out);
            }
}

// Two panels at a time where the arithmetic binds: RB_PAIR rows, 4 RB_PAIR accumulators, half the
// broadcasts per multiply-add of panel_tile's, with few enough rows of x that their addresses stay in
// registers. 24 accumulators, four panel vectors and the broadcast: 29 of AVX-512's 32 registers.
// AVX2's 16 hold no such tile with more reuse than panel_tile's (6 rows by one panel), so there the
// panels go one at a time.
constexpr int RB_PAIR = 6;
// from here two panels at a time (fewer rows: one, for the threads' balance)
constexpr int64_t PAIR_ROWS = VL == 16 ? 8 : std::numeric_limits<int64_t>::max();

// A unit's first row tile reads its panels from memory, the rest from L2; on its own that tile ran at
// memory latency, and a step of 16-64 rows (decode) at 60-75 % of the FMA peak on an Intel AVX-512
// VM. So each tile also asks for a share of the next unit's panels into L2 (`next`, `stride` bytes
// of it per input: the unit's first tiles between them cover the whole next unit), and the first
// tile finds them there: SmolLM2's products of 16-64 rows 11-19 % faster, 512 rows level
// (docs/benchmarks.md, twenty-fifth session).
struct NextUnit {
    const char* next;
    int64_t stride;
    void operator()(int64_t c, const float*) const {
        if (next) {
            __builtin_prefetch(next + c * stride, 0, 2);
            if (stride > 64) __builtin_prefetch(next + c * stride + 64, 0, 2);
        }
    }
};

// Below STREAM_ROWS rows a product is bound by reading the panels, each thread one run of memory at
// a time. The hardware's prefetcher alone kept fewer lines in flight than the row-major tiles'
// eight streams do where both cores read: at batch 1, 5-10 % slower than those tiles on two
// threads (25 % faster on one). Asking for each panel 32 inputs (4 KiB) ahead made it 7-19 %
// faster than them on two threads too (docs/benchmarks.md).
constexpr int64_t STREAM_ROWS = 8;
constexpr int64_t STREAM_AHEAD = 32;

// Below STREAM_ROWS rows one core's read of the panels is bound by how many lines it has in flight:
// one panel at a time is one stream of memory, and the hardware prefetcher runs only so far ahead on
// each. Reading several neighbouring panels at once, each asked for STREAM_AHEAD inputs ahead, kept
// more in flight: on an Intel AVX-512 VM one core streamed 17.0-17.5 GB/s of panels from memory four
// at a time against 14.7-15.2 one at a time (docs/benchmarks.md). STREAM_PANELS<RB> panels for RB
// rows: RB x 2 x that many accumulators. AVX2 builds keep one panel at a time (not measured there).
template <int RB>
constexpr int STREAM_PANELS = VL != 16 ? 1 : RB <= 3 ? 4 : 2;

// Each of U panels asked for STREAM_AHEAD inputs ahead of the one read now.
template <int U>
struct PanelsAhead {
    int64_t k;
    void operator()(int64_t, const float* row) const {
        for (int u = 0; u < U; ++u) {
            prefetch_line(row + u * k * PN + STREAM_AHEAD * PN);
            prefetch_line(row + u * k * PN + STREAM_AHEAD * PN + VL);
        }
    }
};

// The rows of x (fewer than STREAM_ROWS) times panels [p0, p1): STREAM_PANELS at a time while they
// are whole, the rest one at a time.
void stream_panels(const float* x, int64_t m, int64_t xs, const PanelLayout& w, int64_t p0, int64_t p1,
                   const float* bias, float* y, int64_t ys) {
    with_count<STREAM_ROWS - 1>(m, [&](auto rb) {
        constexpr int RB = decltype(rb)::value, U = STREAM_PANELS<RB>;
        const int64_t k = w.k, whole = w.n / PN;  // panels with every output
        int64_t p = p0;
        if constexpr (U > 1)
            for (; p + U <= std::min(p1, whole); p += U)
                panels_tile<RB, U>(x, xs, w.data + p * k * PN, k, y + p * PN, ys, bias ? bias + p * PN : nullptr,
                                   PanelsAhead<U>{k});
        for (; p < p1; ++p) {
            const float* panel = w.data + p * k * PN;
            const int64_t o = p * PN, cols = std::min<int64_t>(PN, w.n - o);
            panel_tile<RB>(x, xs, panel, k, y + o, ys, cols, bias ? bias + o : nullptr, nullptr, 0,
                           panel + STREAM_AHEAD * PN);
        }
    });
}

// The rows of x times panels [first, first + count) (count 1 or 2; two only where both are full).
void panels_rows(const float* x, int64_t m, int64_t xs, const PanelLayout& w, int64_t first, int64_t count,
                 const float* bias, float* y, int64_t ys) {
    const int64_t o = first * PN, k = w.k;
    const float* panel = w.data + first * k * PN;
    const float* b = bias ? bias + o : nullptr;
    if (count == 2) {
        // the next unit's bytes, a part per tile of this unit: 64 or 128 of them per input
        const int64_t panel_bytes = k * PN * int64_t(sizeof(float)), panels = (w.n + PN - 1) / PN;
        const int64_t ahead = std::min<int64_t>(2, panels - first - 2) * panel_bytes;
        const int64_t stride = (m + RB_PAIR - 1) / RB_PAIR >= 4 ? 64 : 128;  // four tiles or more: a line each
        const char* next = reinterpret_cast<const char*>(panel + 2 * k * PN);
        int64_t at = 0;
        row_tiles<RB_PAIR>(m, [&](int64_t r, auto rb) {
            const char* part = at < ahead ? next + at : nullptr;
            at += k * stride;
            panels_tile<decltype(rb)::value, 2>(x + r * xs, xs, panel, k, y + r * ys + o, ys, b, NextUnit{part, stride});
        });
        return;
    }
    const int64_t cols = std::min<int64_t>(PN, w.n - o);  // STREAM_ROWS rows or more: stream_panels takes fewer
    row_tiles<RB_PANEL>(m, [&](int64_t r, auto rb) {
        panel_tile<decltype(rb)::value>(x + r * xs, xs, panel, k, y + r * ys + o, ys, cols, b, nullptr, 0);
    });
}

// 1 / sqrt(mean(x^2) + eps) over one row.
inline float inverse_rms(const float* __restrict x, int64_t width, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; ++i) squares += x[i] * x[i];
    return 1.0f / std::sqrt(squares / float(width) + eps);
}

inline int team(int64_t elements, int threads) { return elements >= MIN_PARALLEL_ELEMENTS ? threads : 1; }

template <bool NORM>
void norm_rope(const float* x, int64_t tokens, int64_t heads, int64_t xs_t, int64_t xs_h, int64_t head_dim,
               const float* weight, float eps, const float* cos, const float* sin, int64_t cs, float* out,
               int64_t os_t, int64_t os_h, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(team(tokens * heads * head_dim, threads))
    for (int64_t t = 0; t < tokens; ++t) {
        const float* __restrict ct = cos + t * cs;
        const float* __restrict st = sin + t * cs;
        for (int64_t h = 0; h < heads; ++h) {
            const float* __restrict xr = x + t * xs_t + h * xs_h;
            float* __restrict orow = out + t * os_t + h * os_h;
            const float inv = NORM ? inverse_rms(xr, head_dim, eps) : 1.0f;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = NORM ? xr[i] * inv * weight[i] : xr[i];
                const float b = NORM ? xr[i + half] * inv * weight[i + half] : xr[i + half];
                orow[i] = a * ct[i] - b * st[i];
                orow[i + half] = b * ct[i + half] + a * st[i + half];
            }
        }
    }
}

}  // namespace

extern "C" {

void neuron_linear(const float* x, int64_t m, int64_t xs, const float* w, int64_t n, int64_t k, int64_t ws,
                   const float* bias, float* y, int64_t ys, int threads) {
    if (m >= PANEL_ROWS) {
        panel_rows(x, m, xs, w, n, k, ws, bias, y, ys, threads);
        return;
    }
    if (m > 4) {
        tiled_rows(x, m, xs, w, n, k, ws, bias, y, ys, threads);
        return;
    }
    const int64_t tiles = (n + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads) if (m * n * k >= MIN_PARALLEL_LINEAR)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t o = t * NB;
        if (o + NB <= n) {
            weight_rows<NB>(x, m, xs, w + o * ws, ws, k, y + o, ys, bias ? bias + o : nullptr);
        } else {
            for (int64_t j = o; j < n; ++j)
                weight_rows<1>(x, m, xs, w + j * ws, ws, k, y + j, ys, bias ? bias + j : nullptr);
        }
    }
}

// Rows [r0, r0 + rows) of x times unit u of the panels: two panels where there are rows enough (per 2),
// else one; the last unit (a lone or partial panel) goes one panel at a time.
inline void panel_unit(const float* x, int64_t xs, const PanelLayout& w, int64_t u, int64_t per, int64_t r0,
                       int64_t rows, const float* bias, float* y, int64_t ys) {
    const int64_t first = u * per, panels = (w.n + PN - 1) / PN;
    x += r0 * xs;
    y += r0 * ys;
    if (per == 2 && first + 2 <= w.n / PN) {
        panels_rows(x, rows, xs, w, first, 2, bias, y, ys);
    } else {
        for (int64_t p = first; p < std::min(first + per, panels); ++p) panels_rows(x, rows, xs, w, p, 1, bias, y, ys);
    }
}

// y[m, n] = x[m, k] W^T (+ bias) for a weight held as panels, any number of rows; the signature of
// neuron_qlinear, so the C decoder loop calls it as it calls a quantized part.
//
// Where the arithmetic binds (two panels at a time), each thread takes an equal share of units x
// rows, in that order: a weight of 9 units on two threads is 4.5 units each, the middle one's rows
// split between them, where a split by whole units gave one thread 5 and the other 4 (SmolLM2's
// o and down projections, a third of its layers' products, waited a ninth of their time at every
// step of many rows). Each output is still one sum in input order, so a row's bits do not change.
// Below that, each thread streams whole units: a unit read by both would cost its bytes twice.
// Where one panel at a time is bound by the arithmetic too (AVX2 builds, from STREAM_ROWS rows),
// the threads take whole units as they come free: an equal count each left one thread waiting at
// the product's end for the other, whichever ran slower (SmolLM2's prefill steps on a 2-core VM:
// the leader's thread spent 4.6 % of its time in OpenMP's barrier, then 0.7 %).
void neuron_panel_linear(const float* x, int64_t m, int64_t xs, const PanelLayout* weight, const float* bias, float* y,
                         int64_t ys, int threads) {
    const PanelLayout& w = *weight;
    const int64_t n = w.n, k = w.k, panels = (n + PN - 1) / PN;
    if (m <= 0) return;  // the tiles take 1 row and more
    const int64_t per = m >= PAIR_ROWS ? 2 : 1, units = (panels + per - 1) / per;
    const bool parallel = m * n * k >= MIN_PARALLEL_LINEAR;
    if (m < STREAM_ROWS) {  // bound by reading the panels: each thread an equal run of them
#pragma omp parallel num_threads(threads) if (parallel)
        {
            const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
            stream_panels(x, m, xs, w, panels * t / team, panels * (t + 1) / team, bias, y, ys);
        }
        return;
    }
    if (per == 1 && parallel) {  // STREAM_ROWS rows or more here
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int64_t u = 0; u < units; ++u) panel_unit(x, xs, w, u, per, 0, m, bias, y, ys);
        return;
    }
    if (per == 1 || !parallel) {
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
        for (int64_t u = 0; u < units; ++u) panel_unit(x, xs, w, u, per, 0, m, bias, y, ys);
        return;
    }
#pragma omp parallel num_threads(threads)
    thread_share(units, m, [&](int64_t u, int64_t r0, int64_t rows) {
        panel_unit(x, xs, w, u, per, r0, rows, bias, y, ys);
    });
}

// The outputs of the panels' layout: PN floats a panel.
int64_t neuron_panel_width() { return PN; }

// Rows ids[0, m) of a weight held as panels, into out (row stride os): an embedding table tied to
// the LM head. -1 for an id outside [0, n), as neuron_qrows.
int neuron_panel_rows(const PanelLayout* w, const int64_t* ids, int64_t m, float* out, int64_t os) {
    for (int64_t r = 0; r < m; ++r)
        if (ids[r] < 0 || ids[r] >= w->n) return -1;
    for (int64_t r = 0; r < m; ++r) {
        const float* column = w->data + (ids[r] / PN) * w->k * PN + ids[r] % PN;
        for (int64_t c = 0; c < w->k; ++c) out[r * os + c] = column[c * PN];
    }
    return 0;
}

// out = x / rms(x) * weight, row by row.
void neuron_rms_norm(const float* x, int64_t rows, int64_t xs, int64_t width, const float* weight, float eps,
                     float* out, int64_t os, int threads) {
#pragma omp parallel for schedule(static) num_threads(team(rows * width, threads))
    for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict xr = x + r * xs;
        float* __restrict orow = out + r * os;
        const float inv = inverse_rms(xr, width, eps);
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) orow[i] = xr[i] * inv * weight[i];
    }
}

// Each row's argmax, the first of its largest values; -1 for a row that holds a NaN or nothing
// above -inf (sampling._greedy's rule). One pass for the largest value and any NaN, one to find it.
void neuron_greedy(const float* x, int64_t rows, int64_t xs, int64_t width, int64_t* out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict xr = x + r * xs;
        float best = -std::numeric_limits<float>::infinity();
        int nan = 0;
#pragma omp simd reduction(max : best)
        for (int64_t i = 0; i < width; ++i) best = xr[i] > best ? xr[i] : best;
#pragma omp simd reduction(| : nan)
        for (int64_t i = 0; i < width; ++i) nan |= xr[i] != xr[i];
        int64_t at = -1;
        if (!nan && best > -std::numeric_limits<float>::infinity())
            for (int64_t i = 0; i < width; ++i)
                if (xr[i] == best) {
                    at = i;
                    break;
                }
        out[r] = at;
    }
}

// total = x + delta; out = total / rms(total) * weight.
void neuron_add_rms_norm(const float* x, int64_t xs, const float* delta, int64_t ds, int64_t rows, int64_t width,
                         const float* weight, float eps, float* total, int64_t ts, float* out, int64_t os,
                         int threads) {
#pragma omp parallel for schedule(static) num_threads(team(rows * width, threads))
    for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict xr = x + r * xs;
        const float* __restrict dr = delta + r * ds;
        float* __restrict tr = total + r * ts;
        float* __restrict orow = out + r * os;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) tr[i] = xr[i] + dr[i];
        const float inv = inverse_rms(tr, width, eps);
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) orow[i] = tr[i] * inv * weight[i];
    }
}

// Each head of each token: RMSNorm over head_dim (none where `weight` is null: Llama's heads), then
// the rotary embedding in the half-split layout (the first half pairs with the second): with
// n = normed head, out[i] = n[i] cos[i] - n[i + h] sin[i] and out[i + h] = n[i + h] cos[i + h] + n[i] sin[i + h].
void neuron_norm_rope(const float* x, int64_t tokens, int64_t heads, int64_t xs_t, int64_t xs_h, int64_t head_dim,
                      const float* weight, float eps, const float* cos, const float* sin, int64_t cs, float* out,
                      int64_t os_t, int64_t os_h, int threads) {
    if (weight)
        norm_rope<true>(x, tokens, heads, xs_t, xs_h, head_dim, weight, eps, cos, sin, cs, out, os_t, os_h, threads);
    else
        norm_rope<false>(x, tokens, heads, xs_t, xs_h, head_dim, weight, eps, cos, sin, cs, out, os_t, os_h, threads);
}

// out = silu(gate) * up = gate * sigmoid(gate) * up, sigmoid from e = exp(-|gate|) so that it
// never overflows: 1 / (1 + e) for gate >= 0, e / (1 + e) below. A register at a time through
// exp2_neg_v (GCC left the scalar form's loop unvectorised in AVX2 builds: 8 % of a prefill step
// there), the tail through exp2_neg: the same operations, so the same bits (a NaN gate's NaN aside).
void neuron_silu_mul(const float* gate, int64_t gs, const float* up, int64_t us, int64_t rows, int64_t width,
                     float* out, int64_t os, int threads) {
    constexpr float LOG2E = 1.4426950408889634f;
#pragma omp parallel for schedule(static) num_threads(team(rows * width, threads))
    for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict g = gate + r * gs;
        const float* __restrict u = up + r * us;
        float* __restrict o = out + r * os;
        int64_t i = 0;
        for (; i + VL <= width; i += VL) {
            const vecf gv = vload(g + i);
            const vecf magnitude = reinterpret_cast<vecf>(reinterpret_cast<veci>(gv) & 0x7fffffff);  // fabs
            const vecf e = exp2_neg_v(-magnitude * LOG2E);
            const vecf sigmoid = (gv >= 0.0f ? vecf{} + 1.0f : e) / (1.0f + e);
            vstore(o + i, gv * sigmoid * vload(u + i));
        }
        for (; i < width; ++i) {
            const float e = exp2_neg(-std::fabs(g[i]) * LOG2E);
            const float sigmoid = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = g[i] * sigmoid * u[i];
        }
    }
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Quantized weights (neuron/layers/quantized.py): y[m, n] = x[m, k] W[n, k]^T (+ bias) where
//   W[n][c] = s(n, g) * q[n][c] - z(n, g),  g = c / group,
// q the codes and s, z a scale and an offset per group of `group` inputs. The codes are int8
// (`bits` 8), FP8 e4m3 bytes (`bits` 8 and `fp8`), or for `bits` 4 two to a byte: in each group
// of 32 inputs, byte i holds input i in its low nibble and input i + 16 in its high one (GGUF's
// Q4_0 layout), values 0..15. A scale
// is a float per `per_super` groups, times an int8 sub-scale per group where those are given (the
// K-quants' two-level scales); the offset likewise, and absent for symmetric formats. The floats
// are fp32, or fp16 where `half_factors` is set (GGUF's blocks store them so: kept as they are, a
// Q8_0 row reads 34 bytes per 32 inputs instead of 36), widened exactly as they are read.
//
// Each weight vector is widened to floats and scaled once (W as the format dequantizes it, in
// fp32), then multiplied into every row of x, so the sums are those of dequantize-then-matmul up
// to their order. Like neuron_linear it is bound by reading W, now 1 or 0.5 bytes per weight.
struct QuantizedWeight {
    const uint8_t* codes;
    int64_t code_stride;  // bytes per weight row
    int64_t n, k;
    int32_t bits, group, per_super, fp8;
    const void* scale;  // float, or _Float16 (half_factors)
    int64_t scale_stride;
    const int8_t* scale_sub;  // nullable
    int64_t scale_sub_stride;
    const void* offset;  // nullable; as scale
    int64_t offset_stride;
    const int8_t* offset_sub;  // nullable
    int64_t offset_sub_stride;
    int32_t half_factors;  // scale and offset are fp16
};

namespace {

enum Codes { I8, U4, E4M3 };
constexpr int MAX_PER_SUPER = 16;  // groups under one top-level factor, at most (GGUF's Q6_K)
constexpr int QNB = 4;  // weight rows per quantized tile
constexpr int PREFETCH_TILES = 2;

// VL int8 codes as floats.
inline vecf widen_i8(const uint8_t* p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    vecf f;
    for (int l = 0; l < VL; ++l) f[l] = float(int8_t(p[l]));
#endif
    vecf v;
    std::memcpy(&v, &f, sizeof v);
    return v;
}

// The low (HIGH false) or high nibbles of VL bytes as floats.
template <bool HIGH>
inline vecf widen_u4(const uint8_t* p) {
#if defined(__AVX512F__)
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    b = HIGH ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15));
    const __m512 f = _mm512_cvtepi32_ps(b);
#elif defined(__AVX2__)
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    b = HIGH ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
    const __m256 f = _mm256_cvtepi32_ps(b);
#else
    vecf f;
    for (int l = 0; l < VL; ++l) f[l] = float(HIGH ? p[l] >> 4 : p[l] & 15);
#endif
    vecf v;
    std::memcpy(&v, &f, sizeof v);
    return v;
}

// VL FP8 e4m3 bytes as floats times 2^-120, exactly: the sign moved to bit 31 and the 7 bits of
// exponent and mantissa to bits 26..20 make a float whose exponent is e4m3's minus 120 for normal
// values (e4m3's bias is 7, fp32's 127) and whose subnormal is e4m3's subnormal times 2^-120 too.
// The kernel folds 2^120 into each group's scale, so no conversion instruction is needed.
inline vecf widen_e4m3(const uint8_t* p) {
#if defined(__AVX512F__)
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20),
                                         _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24));
    const __m512 f = _mm512_castsi512_ps(bits);
#elif defined(__AVX2__)
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20),
                                         _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24));
    const __m256 f = _mm256_castsi256_ps(bits);
#else
    vecf f;
    for (int l = 0; l < VL; ++l) {
        const uint32_t bits = (uint32_t(p[l] & 0x7F) << 20) | (uint32_t(p[l] & 0x80) << 24);
        std::memcpy(&f[l], &bits, 4);
    }
#endif
    vecf v;
    std::memcpy(&v, &f, sizeof v);
    return v;
}
constexpr float TWO_TO_120 = 0x1p120f;

// An fp16 value widened, exactly (F16C's instruction: GCC makes a library call of the plain cast).
inline float widen_half(_Float16 h) {
#if defined(__F16C__)
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return _cvtsh_ss(bits);
#else
    return float(h);
#endif
}
inline float widen_half(float f) { return f; }

// Entry i of a scale or offset array, fp32 or fp16.
inline float top_factor(const void* p, int64_t i, bool half) {
    return half ? widen_half(static_cast<const _Float16*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Row `row`'s factor for group g whose top-level entry is `top`: the float, times the int8
// sub-factor where there is one.
inline float group_factor(const void* tops, bool half, int64_t ts, const int8_t* sub, int64_t ss, int64_t row,
                          int64_t g, int64_t top) {
    const float f = top_factor(tops, row * ts + top, half);
    return sub ? f * float(sub[row * ss + g]) : f;
}

// The weight rows of a tile are short (a 1024-input int8 row is 16 cache lines), too short for the
// hardware's stream prefetcher to learn, so each step also prefetches one line of the tile PREFETCH_TILES
// ahead: the kernel read the 191M model's int8 weights at 13 GB/s without it and 30+ with it.
// With one row of x (PER_GROUP), the codes' products are summed per group and scaled once per
// group instead (s sum(q x) - z sum(x), sum(x) per group from `xsum`): fewer operations per
// weight, the same sums up to fp32 rounding.
template <int NBT, int RB, int CODES, bool PLAIN>
inline void qtile(const float* x, int64_t xs, const QuantizedWeight& w, int64_t o, float* y, int64_t ys,
                  const float* bias, const float* xsum) {
    constexpr bool PER_GROUP = !PLAIN && RB == 1;
    vecf acc[RB][NBT] = {};
    float zacc[NBT] = {};
    const int64_t groups = w.k / w.group;
    const int64_t ahead = o + PREFETCH_TILES * NBT;
    const char* next = reinterpret_cast<const char*>(w.codes + ahead * w.code_stride);
    const int64_t lines = ahead + NBT <= w.n ? NBT * w.code_stride / 64 : 0;
    int64_t line = 0;
    // groups per top-level entry: 1, or a power of two (8 and 16 in GGUF's K-quants), so a shift
    const int shift = __builtin_ctz(unsigned(w.per_super));
    // two-level factors (K-quants): a super-block's group factors made at once, one short vector loop
    float sfac[NBT][MAX_PER_SUPER], zfac[NBT][MAX_PER_SUPER];
    const bool two_level = w.scale_sub != nullptr;
    for (int64_t g = 0; g < groups; ++g) {
        vecf sv[NBT], zv[NBT], part[NBT] = {};
        float zs[NBT];
        if constexpr (!PLAIN) {
            const int64_t top = g >> shift, within = g & (w.per_super - 1);
            if (two_level && within == 0) {
                for (int j = 0; j < NBT; ++j) {
                    const float d = top_factor(w.scale, (o + j) * w.scale_stride + top, w.half_factors);
                    const int8_t* sub = w.scale_sub + (o + j) * w.scale_sub_stride + g;
                    for (int q = 0; q < w.per_super; ++q) sfac[j][q] = d * float(sub[q]);
                    if (w.offset) {
                        const float dm = top_factor(w.offset, (o + j) * w.offset_stride + top, w.half_factors);
                        const int8_t* msub = w.offset_sub + (o + j) * w.offset_sub_stride + g;
                        for (int q = 0; q < w.per_super; ++q) zfac[j][q] = dm * float(msub[q]);
                    }
                }
            }
            for (int j = 0; j < NBT; ++j) {
                const float s = two_level ? sfac[j][within]
                                          : group_factor(w.scale, w.half_factors, w.scale_stride, w.scale_sub,
                                                         w.scale_sub_stride, o + j, g, top);
                const float z = !w.offset ? 0.0f
                                : two_level ? zfac[j][within]
                                            : group_factor(w.offset, w.half_factors, w.offset_stride,
                                                           w.offset_sub, w.offset_sub_stride, o + j, g, top);
                sv[j] = vecf{} + (CODES == E4M3 ? s * TWO_TO_120 : s);
                zv[j] = vecf{} + z;
                zs[j] = z;
            }
        }
        const int64_t c0 = g * w.group;
        if constexpr (CODES != U4) {
            for (int64_t c = c0; c < c0 + w.group; c += VL) {
                vecf wv[NBT];
                if (line < lines) __builtin_prefetch(next + 64 * line++, 0, 3);
                for (int j = 0; j < NBT; ++j) {
                    const uint8_t* p = w.codes + (o + j) * w.code_stride + c;
                    wv[j] = CODES == E4M3 ? widen_e4m3(p) : widen_i8(p);
                    if constexpr (!PLAIN && !PER_GROUP) wv[j] = wv[j] * sv[j] - zv[j];
                }
                for (int r = 0; r < RB; ++r) {
                    const vecf xv = vload(x + r * xs + c);
                    for (int j = 0; j < NBT; ++j) {
                        if constexpr (PER_GROUP)
                            part[j] += wv[j] * xv;
                        else
                            acc[r][j] += wv[j] * xv;
                    }
                }
            }
        } else {
            for (int64_t b = 0; b < w.group; b += 32) {  // 32 inputs in 16 bytes
                for (int64_t i = 0; i < 16; i += VL) {
                    vecf lo[NBT], hi[NBT];
                    if (line < lines) __builtin_prefetch(next + 64 * line++, 0, 3);
                    for (int j = 0; j < NBT; ++j) {
                        const uint8_t* p = w.codes + (o + j) * w.code_stride + (c0 + b) / 2 + i;
                        lo[j] = widen_u4<false>(p);
                        hi[j] = widen_u4<true>(p);
                        if constexpr (!PLAIN && !PER_GROUP) lo[j] = lo[j] * sv[j] - zv[j], hi[j] = hi[j] * sv[j] - zv[j];
                    }
                    for (int r = 0; r < RB; ++r) {
                        const vecf xl = vload(x + r * xs + c0 + b + i);
                        const vecf xh = vload(x + r * xs + c0 + b + 16 + i);
                        for (int j = 0; j < NBT; ++j) {
                            if constexpr (PER_GROUP)
                                part[j] += lo[j] * xl + hi[j] * xh;
                            else
                                acc[r][j] += lo[j] * xl + hi[j] * xh;
                        }
                    }
                }
            }
        }
        if constexpr (PER_GROUP) {
            for (int j = 0; j < NBT; ++j) {
                acc[0][j] += part[j] * sv[j];
                if (xsum) zacc[j] += zs[j] * xsum[g];
            }
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int j = 0; j < NBT; ++j) {
            float s = hsum(acc[r][j]);
            if constexpr (PLAIN) s *= top_factor(w.scale, (o + j) * w.scale_stride, w.half_factors);
            if constexpr (PER_GROUP) s -= zacc[j];
            y[r * ys + j] = bias ? s + bias[j] : s;
        }
}

template <int NBT, int CODES, bool PLAIN>
inline void qweight_rows(const float* x, int64_t m, int64_t xs, const QuantizedWeight& w, int64_t o, float* y,
                         int64_t ys, const float* bias, const float* xsum) {
    const int64_t groups = w.k / w.group;
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) qtile<NBT, 4, CODES, PLAIN>(x + r * xs, xs, w, o, y + r * ys, ys, bias, nullptr);
    for (; r + 2 <= m; r += 2) qtile<NBT, 2, CODES, PLAIN>(x + r * xs, xs, w, o, y + r * ys, ys, bias, nullptr);
    for (; r < m; ++r)
        qtile<NBT, 1, CODES, PLAIN>(x + r * xs, xs, w, o, y + r * ys, ys, bias, xsum ? xsum + r * groups : nullptr);
}

template <int CODES, bool PLAIN>
void qlinear(const float* x, int64_t m, int64_t xs, const QuantizedWeight& w, const float* bias, float* y,
             int64_t ys, int threads) {
    const int64_t n = w.n, tiles = (n + QNB - 1) / QNB, groups = w.k / w.group;
    // each row's sum over each group, for the offsets of the one-row tiles
    std::vector<float> xsum(w.offset && !PLAIN ? m * groups : 0);
    for (int64_t r = 0; r < int64_t(xsum.size()) / std::max<int64_t>(groups, 1); ++r)
        for (int64_t g = 0; g < groups; ++g) {
            float t = 0.0f;
            for (int64_t c = g * w.group; c < (g + 1) * w.group; ++c) t += x[r * xs + c];
            xsum[r * groups + g] = t;
        }
    const float* sums = xsum.empty() ? nullptr : xsum.data();
#pragma omp parallel for schedule(static) num_threads(threads) if (m * n * w.k >= MIN_PARALLEL_LINEAR)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t o = t * QNB;
        if (o + QNB <= n) {
            qweight_rows<QNB, CODES, PLAIN>(x, m, xs, w, o, y + o, ys, bias ? bias + o : nullptr, sums);
        } else {
            for (int64_t j = o; j < n; ++j)
                qweight_rows<1, CODES, PLAIN>(x, m, xs, w, j, y + j, ys, bias ? bias + j : nullptr, sums);
        }
    }
}

// Weight rows [o, o + outputs) of W (outputs <= 2 PN; integer codes) dequantized as neuron_qrows
// dequantizes them, into panels[p][c][j] = W[o + p PN + j][c], rows past `outputs` zero: VL rows by
// VL inputs at a time, widened and scaled a row's vector at a time, then transposed.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void dequantize_panels(const QuantizedWeight& w, int64_t o, int64_t outputs, float* panels) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const int64_t k = w.k;
    const int shift = __builtin_ctz(unsigned(w.per_super));
    alignas(64) float block[VL * VL];
    for (int64_t j0 = 0; j0 < 2 * PN; j0 += VL) {
        float* panel = panels + (j0 / PN) * k * PN + j0 % PN;
        for (int64_t c0 = 0; c0 < k; c0 += VL) {
            const int64_t g = c0 / w.group, top = g >> shift;
            for (int i = 0; i < VL; ++i) {
                const int64_t row = o + j0 + i;
                if (j0 + i >= outputs) {
                    vstore(block + i * VL, vecf{});
                    continue;
                }
                const uint8_t* codes = w.codes + row * w.code_stride;
                // 4-bit: 32 inputs in 16 bytes, the first 16 in the low nibbles
                const vecf q = w.bits != 4          ? widen_i8(codes + c0)
                               : (c0 & 31) < 16 ? widen_u4<false>(codes + (c0 >> 5) * 16 + (c0 & 15))
                                                : widen_u4<true>(codes + (c0 >> 5) * 16 + (c0 & 15));
                const float s = group_factor(w.scale, w.half_factors, w.scale_stride, w.scale_sub,
                                             w.scale_sub_stride, row, g, top);
                vecf v = q * s;
                if (w.offset)
                    v = v - group_factor(w.offset, w.half_factors, w.offset_stride, w.offset_sub, w.offset_sub_stride,
                                         row, g, top);
                vstore(block + i * VL, v);
            }
            transpose_block(block, VL, panel + c0 * PN, PN);
        }
    }
}

}  // namespace

extern "C" {

// The caller (quantized.py) checks the layout: k a multiple of group, group a multiple of 16
// (of 32 for 4-bit codes), every pointer's rows as strided.
void neuron_qlinear(const float* x, int64_t m, int64_t xs, const QuantizedWeight* w, const float* bias, float* y,
                    int64_t ys, int threads) {
    const bool plain = w->group == w->k && !w->offset && !w->scale_sub;
    if (w->bits == 4)
        qlinear<U4, false>(x, m, xs, *w, bias, y, ys, threads);
    else if (w->fp8)
        qlinear<E4M3, false>(x, m, xs, *w, bias, y, ys, threads);
    else if (plain)
        qlinear<I8, true>(x, m, xs, *w, bias, y, ys, threads);
    else
        qlinear<I8, false>(x, m, xs, *w, bias, y, ys, threads);
}

// Rows `ids` of W dequantized as QuantizedWeight.stored() makes them (code x scale - offset per
// group, each product rounded to fp32), into out [m, k] with row stride os: an embedding lookup of
// a quantized table. Integer codes only (not FP8). Returns -1, writing nothing, if an id is outside
// [0, n). Not contracted into a fused multiply-add, which would round once where stored() rounds twice.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
int neuron_qrows(const QuantizedWeight* w, const int64_t* ids, int64_t m, float* out, int64_t os) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    for (int64_t r = 0; r < m; ++r)
        if (ids[r] < 0 || ids[r] >= w->n) return -1;
    const int64_t groups = w->k / w->group;
    const int shift = __builtin_ctz(unsigned(w->per_super));
    for (int64_t r = 0; r < m; ++r) {
        const int64_t row = ids[r];
        const uint8_t* codes = w->codes + row * w->code_stride;
        float* __restrict o = out + r * os;
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t top = g >> shift;
            const float s = group_factor(w->scale, w->half_factors, w->scale_stride, w->scale_sub,
                                         w->scale_sub_stride, row, g, top);
            const float z = !w->offset ? 0.0f
                                       : group_factor(w->offset, w->half_factors, w->offset_stride, w->offset_sub,
                                                      w->offset_sub_stride, row, g, top);
            for (int64_t i = g * w->group; i < (g + 1) * w->group; ++i) {
                float q;
                if (w->bits == 4) {  // 32 inputs in 16 bytes: the low nibbles are the first 16
                    const uint8_t byte = codes[(i >> 5) * 16 + (i & 15)];
                    q = float((i & 16) ? byte >> 4 : byte & 15);
                } else {
                    q = float(int8_t(codes[i]));
                }
                o[i] = w->offset ? q * s - z : q * s;
            }
        }
    }
    return 0;
}

// A step of many rows (a prefill) times W: each thread dequantizes W two panels (2 PN weight rows)
// at a time into a buffer of its own, laid out as neuron_panel_linear's panels, and multiplies every
// row of its share into it there, while the buffer is in its cache. Dequantizing the whole weight
// per call and handing it to torch's matmul cost a quantized model's prefill half the speed of the
// same model in fp32. The weights are those of neuron_qrows (code x scale - offset, each rounded),
// so the sums are dequantize-then-matmul's up to their order, as neuron_panel_linear's are.
void neuron_qlinear_panels(const float* x, int64_t m, int64_t xs, const QuantizedWeight* weight, const float* bias,
                           float* y, int64_t ys, int threads) {
    const QuantizedWeight& w = *weight;
    const int64_t n = w.n, k = w.k, units = (n + 2 * PN - 1) / (2 * PN);
    if (m <= 0) return;
#pragma omp parallel num_threads(threads) if (m * n * k >= MIN_PARALLEL_LINEAR)
    {
        static thread_local std::vector<float> buffer;
        if (int64_t(buffer.size()) < 2 * PN * k) buffer.resize(2 * PN * k);
        int64_t held = -1;  // the unit in the buffer
        thread_share(units, m, [&](int64_t u, int64_t r0, int64_t rows) {
            const int64_t o = u * 2 * PN, outputs = std::min<int64_t>(2 * PN, n - o);
            if (u != held) {
                dequantize_panels(w, o, outputs, buffer.data());
                held = u;
            }
            const PanelLayout unit{buffer.data(), outputs, k};
            const float* b = bias ? bias + o : nullptr;
            if (outputs == 2 * PN && rows >= PAIR_ROWS) {  // as neuron_panel_linear pairs them (never on AVX2)
                panels_rows(x + r0 * xs, rows, xs, unit, 0, 2, b, y + r0 * ys + o, ys);
            } else {
                for (int64_t p = 0; p * PN < outputs; ++p)
                    panels_rows(x + r0 * xs, rows, xs, unit, p, 1, b, y + r0 * ys + o, ys);
            }
        });
    }
}

}  // extern "C"

// The same product with the activations rounded to int8 and integer dot products.
#include "qlinear_int.h"

// GGUF blocks rewritten as neuron's codes at load (models/gguf.py).
#include "gguf_codes.h"

// The gated delta rule's one-token update (models/gated_deltanet.py).
#include "delta_step.h"
