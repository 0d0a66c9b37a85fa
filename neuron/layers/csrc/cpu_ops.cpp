// The CPU step's non-attention kernels for fp32: the small-batch matrix product and the
// element-wise passes between the matrix products, each one loop over the data.
//
// Same build as paged_attention_cpu.cpp (neuron/utils/native.py): plain C++ with OpenMP, no torch
// headers, called through ctypes with data pointers and row strides (every last dimension is
// contiguous; the Python side checks). -O3 -march=native vectorises the loops for the machine.
//
// linear: y[m, n] = x[m, k] W[n, k]^T (+ bias) for a few rows of x (decode at small batch). It is
// bound by reading W once from memory: tiles of NB weight rows are dotted with up to RB rows of x
// at a time in vector accumulators, and the threads take contiguous ranges of weight rows, so each
// streams its share of W exactly once. Larger batches go to oneDNN (cpu_linear.py).
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

// 1 / sqrt(mean(x^2) + eps) over one row.
inline float inverse_rms(const float* __restrict x, int64_t width, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; ++i) squares += x[i] * x[i];
    return 1.0f / std::sqrt(squares / float(width) + eps);
}

inline int team(int64_t elements, int threads) { return elements >= MIN_PARALLEL_ELEMENTS ? threads : 1; }

}  // namespace

extern "C" {

void neuron_linear(const float* x, int64_t m, int64_t xs, const float* w, int64_t n, int64_t k, int64_t ws,
                   const float* bias, float* y, int64_t ys, int threads) {
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

// Each head of each token: RMSNorm over head_dim, then the rotary embedding in the half-split
// layout (the first half pairs with the second): with n = normed head,
// out[i] = n[i] cos[i] - n[i + h] sin[i] and out[i + h] = n[i + h] cos[i + h] + n[i] sin[i + h].
void neuron_norm_rope(const float* x, int64_t tokens, int64_t heads, int64_t xs_t, int64_t xs_h, int64_t head_dim,
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
            const float inv = inverse_rms(xr, head_dim, eps);
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = xr[i] * inv * weight[i];
                const float b = xr[i + half] * inv * weight[i + half];
                orow[i] = a * ct[i] - b * st[i];
                orow[i + half] = b * ct[i + half] + a * st[i + half];
            }
        }
    }
}

// out = silu(gate) * up = gate * sigmoid(gate) * up, sigmoid from e = exp(-|gate|) so that it
// never overflows: 1 / (1 + e) for gate >= 0, e / (1 + e) below.
void neuron_silu_mul(const float* gate, int64_t gs, const float* up, int64_t us, int64_t rows, int64_t width,
                     float* out, int64_t os, int threads) {
    constexpr float LOG2E = 1.4426950408889634f;
#pragma omp parallel for schedule(static) num_threads(team(rows * width, threads))
    for (int64_t r = 0; r < rows; ++r) {
        const float* __restrict g = gate + r * gs;
        const float* __restrict u = up + r * us;
        float* __restrict o = out + r * os;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
            const float e = exp2_neg(-std::fabs(g[i]) * LOG2E);
            const float sigmoid = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = g[i] * sigmoid * u[i];
        }
    }
}

}  // extern "C"
