// The gated delta rule's one-token update of Qwen3.5's linear attention (models/gated_deltanet.py,
// delta_step), each head's [dk, dv] fp32 state updated in place in two passes over it instead of
// PyTorch's six (decay, the read by k, the write, the read by q, and their temporaries):
//
//   S <- S exp(g);  delta = (v - S^T k) beta;  S <- S + k delta^T;  o = S^T q
//
// Pass one decays each row of S and accumulates S^T k; pass two writes k_i delta into each row and
// accumulates S^T q. A fresh sequence (offset 0) starts from a zero state. Included at the end of
// cpu_ops.cpp (its build, its library).
#include <cmath>
#include <cstdint>
#include <cstring>

constexpr int64_t DELTA_MAX_DV = 1024;  // a value head's width the stack buffer holds

extern "C" {

// state [slots, heads, dk, dv] (slots[b] the row of sequence b; fresh[b] nonzero: zero it first);
// q, k [batch, heads, dk], v and out [batch, heads, dv], g and beta [batch, heads]; all fp32 and
// contiguous. -1 for a value head wider than DELTA_MAX_DV (the caller keeps PyTorch's way).
int neuron_delta_step(float* state, const int64_t* slots, const uint8_t* fresh, int64_t batch, int64_t heads,
                      int64_t dk, int64_t dv, const float* q, const float* k, const float* v, const float* g,
                      const float* beta, float* out, int threads) {
    if (dv > DELTA_MAX_DV) return -1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (batch * heads * dk * dv >= (1 << 16))
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t bh = b * heads + h;
            float* __restrict s = state + (slots[b] * heads + h) * dk * dv;
            const float* __restrict kh = k + bh * dk;
            const float* __restrict qh = q + bh * dk;
            const float* __restrict vh = v + bh * dv;
            float* __restrict o = out + bh * dv;
            if (fresh[b]) std::memset(s, 0, sizeof(float) * dk * dv);
            const float decay = std::exp(g[bh]), bt = beta[bh];
            float delta[DELTA_MAX_DV];
            for (int64_t j = 0; j < dv; ++j) delta[j] = 0.0f;
            for (int64_t i = 0; i < dk; ++i) {
                float* __restrict row = s + i * dv;
                const float ki = kh[i];
#pragma omp simd
                for (int64_t j = 0; j < dv; ++j) {
                    row[j] *= decay;
                    delta[j] += row[j] * ki;
                }
            }
            for (int64_t j = 0; j < dv; ++j) {
                delta[j] = (vh[j] - delta[j]) * bt;
                o[j] = 0.0f;
            }
            for (int64_t i = 0; i < dk; ++i) {
                float* __restrict row = s + i * dv;
                const float ki = kh[i], qi = qh[i];
#pragma omp simd
                for (int64_t j = 0; j < dv; ++j) {
                    row[j] += ki * delta[j];
                    o[j] += row[j] * qi;
                }
            }
        }
    }
    return 0;
}

}  // extern "C"
