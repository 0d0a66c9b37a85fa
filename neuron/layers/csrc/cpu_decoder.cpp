// A CPU fp32 step's dense decoder layers, every layer in one call: a small model's decode step
// spends most of its time between kernels (a ctypes call and a torch allocation each, a dozen per
// layer), not in them.
//
// Each layer is Llama's (Mistral's, Qwen2's, Qwen3's): RMSNorm, the merged q/k/v projection (+
// bias), the rotary embedding (after a per-head RMSNorm for Qwen3), the step's keys and values
// written to their pool rows, paged attention, the output projection, the residual add + RMSNorm,
// the merged gate/up projection, silu(gate) * up, the down projection and the residual add. The
// pieces are the other libraries' entry points (cpu_ops.cpp, paged_attention_cpu.cpp), called
// through the pointers the Python side puts in the plan, in the order and with the arguments the
// Python layers give them, so the numbers are theirs bit for bit. At tp > 1 the output and down
// projections are summed across ranks by the shared-memory all-reduce (shm_allreduce.cpp), its
// entry point passed the same way; a failed all-reduce ends the loop and its status is returned.
//
// A plan (the weights of every layer, the shapes, scratch buffers for MAX rows) is built once per
// model; a step brings its hidden states, rotary tables and attention metadata.
#include "paged_attention.h"

#include <cstdint>
#include <cstring>

extern "C" {
typedef void (*LinearFn)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, const float*,
                         float*, int64_t, int);
typedef void (*RmsNormFn)(const float*, int64_t, int64_t, int64_t, const float*, float, float*, int64_t, int);
typedef void (*AddRmsNormFn)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, const float*, float,
                             float*, int64_t, float*, int64_t, int);
typedef void (*NormRopeFn)(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, float,
                           const float*, const float*, int64_t, float*, int64_t, int64_t, int);
typedef void (*SiluMulFn)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t, int);
typedef int (*AttentionFn)(const PagedAttentionArgs*, int, int);
typedef int (*AllReduceFn)(void*, int, void*, int64_t, int, int64_t, const uint32_t*, int);
}

struct LayerWeights {
    const float *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias;  // nullable: biases, q/k norms
    const float *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
    float *k_pool, *v_pool;
};

struct Plan {
    LinearFn linear;
    RmsNormFn rms_norm;
    AddRmsNormFn add_rms_norm;
    NormRopeFn norm_rope;
    SiluMulFn silu_mul;
    AttentionFn attention;
    AllReduceFn all_reduce;  // null at tp 1
    const uint32_t* abort_word;
    int64_t rank, timeout_ms;
    const LayerWeights* layers;
    int64_t num_layers;
    int64_t hidden, heads, kv_heads, head_dim, inter;  // this rank's heads and MLP width
    int64_t pool_stride_h, pool_stride_row;
    float eps, scale_log2;
    float *h, *qkv, *q, *k, *attn, *o, *mid, *gate_up, *act, *down;  // scratch of MAX rows each
};

struct Step {
    const float* x;  // [rows, hidden]: the embedded tokens
    float* out;      // [rows, hidden]: the last layer's output
    int64_t rows;
    const float *cos, *sin;  // [rows, head_dim]
    const int64_t* write_rows;  // [rows]: each token's pool row
    const int32_t *block_tables, *query_start, *kv_lens;
    int64_t num_seqs, table_stride, block_size;
    void* segment;  // the all-reduce's shared segment (tp > 1)
    int64_t threads;
};

namespace {

constexpr int ATTENTION_REFUSED = 100;

// y = sum over ranks of y, then + bias: RowParallelLinear's order.
int reduce(const Plan& p, const Step& s, float* y, int64_t n, const float* bias, int64_t width) {
    if (p.all_reduce) {
        const int status = p.all_reduce(s.segment, int(p.rank), y, n, 0, p.timeout_ms, p.abort_word, int(s.threads));
        if (status) return status;
    }
    if (bias)
        for (int64_t i = 0; i < n; ++i) y[i] += bias[i % width];
    return 0;
}

// The step's keys (roped, [rows, kv_heads, head_dim]) and values (a slice of the q/k/v output) at
// their pool rows.
void write_kv(const Plan& p, const Step& s, const LayerWeights& w, int64_t qkv_width) {
    const int64_t D = p.head_dim, kw = p.kv_heads * D, bytes = D * int64_t(sizeof(float));
    for (int64_t t = 0; t < s.rows; ++t) {
        const int64_t row = s.write_rows[t] * p.pool_stride_row;
        const float* v = p.qkv + t * qkv_width + p.heads * D + kw;
        for (int64_t h = 0; h < p.kv_heads; ++h) {
            std::memcpy(w.k_pool + h * p.pool_stride_h + row, p.k + t * kw + h * D, size_t(bytes));
            std::memcpy(w.v_pool + h * p.pool_stride_h + row, v + h * D, size_t(bytes));
        }
    }
}

}  // namespace

extern "C" int neuron_decoder_layers(const Plan* plan, const Step* step) {
    const Plan& p = *plan;
    const Step& s = *step;
    const int64_t m = s.rows, H = p.hidden, D = p.head_dim, I = p.inter;
    const int64_t qw = p.heads * D, kw = p.kv_heads * D, qkvw = qw + 2 * kw;
    const int th = int(s.threads);
    PagedAttentionArgs a{p.attn, p.q, nullptr, nullptr, s.block_tables, s.query_start, s.kv_lens, s.num_seqs,
                         p.heads, p.kv_heads, D, s.block_size, s.table_stride, qw, D, qw, D, p.pool_stride_h,
                         p.pool_stride_row, p.scale_log2};
    const float* x = s.x;
    for (int64_t l = 0; l < p.num_layers; ++l) {
        const LayerWeights& w = p.layers[l];
        p.rms_norm(x, m, H, H, w.input_norm, p.eps, p.h, H, th);
        p.linear(p.h, m, H, w.qkv, qkvw, H, H, w.qkv_bias, p.qkv, qkvw, th);
        p.norm_rope(p.qkv, m, p.heads, qkvw, D, D, w.q_norm, p.eps, s.cos, s.sin, D, p.q, qw, D, th);
        p.norm_rope(p.qkv + qw, m, p.kv_heads, qkvw, D, D, w.k_norm, p.eps, s.cos, s.sin, D, p.k, kw, D, th);
        write_kv(p, s, w, qkvw);
        a.k_pool = w.k_pool;
        a.v_pool = w.v_pool;
        if (p.attention(&a, 0, th)) return ATTENTION_REFUSED;
        p.linear(p.attn, m, qw, w.o, H, qw, qw, nullptr, p.o, H, th);
        if (const int status = reduce(p, s, p.o, m * H, w.o_bias, H)) return status;
        p.add_rms_norm(x, H, p.o, H, m, H, w.post_norm, p.eps, p.mid, H, p.h, H, th);
        p.linear(p.h, m, H, w.gate_up, 2 * I, H, H, w.gate_up_bias, p.gate_up, 2 * I, th);
        p.silu_mul(p.gate_up, 2 * I, p.gate_up + I, 2 * I, m, I, p.act, I, th);
        p.linear(p.act, m, I, w.down, H, I, I, nullptr, p.down, H, th);
        if (const int status = reduce(p, s, p.down, m * H, w.down_bias, H)) return status;
        for (int64_t i = 0; i < m * H; ++i) s.out[i] = p.mid[i] + p.down[i];
        x = s.out;
    }
    return 0;
}
