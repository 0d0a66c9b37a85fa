// A CPU fp32 step's decoder layers, every layer in one call: a small model's decode step spends
// most of its time between kernels (a ctypes call and a torch allocation each, a dozen per layer),
// not in them. A projection's weight is fp32 or quantized (the kernels of quantized.py), or several
// parts of either stacked along the outputs (a GGUF file's q and k as Q4_K, v as Q6_K).
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
// A model served with LoRA adapters gives each projection its adapter pool (layers/lora.py) and
// each step the pool slot of every row: after a projection (and before its all-reduce), each row
// gains (x A^T) B^T with its own adapter's A and B.
//
// A plan (the weights of every layer, the shapes, scratch buffers for MAX rows) is built once per
// model; a step brings its hidden states, rotary tables and attention metadata.
#include "paged_attention.h"
#include "simd.h"

#include <algorithm>
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
typedef int (*AttentionFn)(const PagedAttentionArgs*, int, int, int);
typedef int (*AllReduceFn)(void*, int, void*, int64_t, int, int64_t, const uint32_t*, int);
// neuron_qlinear / neuron_qlinear_int (cpu_ops.cpp): x, m, x's row stride, the weight's layout, bias, y, y's row stride
typedef void (*QLinearFn)(const float*, int64_t, int64_t, const void*, const float*, float*, int64_t, int);
typedef int (*QRowsFn)(const void*, const int64_t*, int64_t, float*, int64_t);
// neuron_qlinear_int_stack (cpu_ops.cpp): x, m, x's stride, the parts' layouts and count, y, y's stride
typedef int (*QStackFn)(const float*, int64_t, int64_t, const void* const*, int64_t, float*, int64_t, int);
}

// One part of a projection's weight: `rows` outputs, fp32 [rows, in] (`dense`) or a quantized
// layout multiplied by `qlinear`, and by `many` (nullable) in a step of more than `few` rows.
struct Part {
    const float* dense;
    const void* layout;
    QLinearFn qlinear;
    int64_t rows;
    QLinearFn many;
    int64_t few;
};

// A projection: its parts' outputs side by side, then the bias (nullable) where it is not summed
// across ranks first. `stack` (nullable): multiplies every part in one call, for parts that all
// take neuron_qlinear_int; where it declines, the parts go one by one.
struct Projection {
    const Part* parts;
    int64_t count;
    const float* bias;
    QStackFn stack;
};
constexpr int64_t MAX_STACK = 8;  // parts neuron_qlinear_int_stack takes

// A projection's LoRA pool: slot s holds A [width, in] at a + s * width * in and B transposed (and
// scaled) [width, out] at bt + s * width * out; a null `a`: no adapters. A merged projection (q/k/v,
// gate/up) has one A/B pair per part: rows j of B^T for part j / rank are zero outside that part's
// outputs, `parts` [start, size] pairs, and are read only within them.
struct Lora {
    const float* a;
    const float* bt;
    int64_t width, rank;
    const int64_t* parts;
};

struct LayerWeights {
    const float *input_norm, *q_norm, *k_norm, *post_norm;  // q/k norms nullable
    Projection qkv, o, gate_up, down;
    void *k_pool, *v_pool;  // of the plan's kv_dtype
    Lora qkv_lora, o_lora, gate_up_lora, down_lora;
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
    int64_t kv_dtype;  // what the pools hold, in the attention kernel's codes: 0 fp32, 1 bf16, 2 fp16
    float eps, scale_log2;
    float *h, *qkv, *q, *k, *attn, *o, *mid, *gate_up, *act, *down;  // scratch of MAX rows each
    float* lora_u;  // scratch of MAX rows x the largest adapter rank: each row's A x
    const float* final_norm;  // the model's last norm and output projection (tp 1); null: no head
    Projection head;
    int64_t head_rows;  // the projection's outputs: the vocabulary (a shard's padding included)
    // The step's inputs from token ids and positions (tp 1): the embedding table, dense fp32 or
    // quantized (its layout, read by qrows), and the rotary tables [rope_len, head_dim]; null: none.
    const float* embed_dense;
    const void* embed_layout;
    QRowsFn embed_qrows;
    int64_t embed_rows;
    const float *rope_cos, *rope_sin;
    int64_t rope_len;
    float *x_buf, *cos_buf, *sin_buf;  // scratch of MAX rows: the embedded tokens, their cos and sin
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
    const int64_t* lora_slots;  // [rows]: each row's LoRA pool slot, -1 for the base model; null: none
    float* logits;  // [rows, head_rows]: every row's logits through the plan's head; null: out alone
    // [rows] each: with the plan's inputs, x and cos/sin are made here from these (x, cos, sin unused)
    const int64_t *token_ids, *positions;
    // The rows the head reads (ascending, kept_rows of them; null: every row) and their queries'
    // starts per sequence ([num_seqs + 1]): past storing its keys and values, the last layer runs
    // these rows alone, and `out` holds their outputs in its first kept_rows rows.
    const int64_t* kept;
    int64_t kept_rows;
    const int32_t* kept_query_start;
    const int64_t* kept_lora_slots;  // [kept_rows]: their LoRA pool slots (with lora_slots)
};

namespace {

constexpr int ATTENTION_REFUSED = 100;
constexpr int INPUT_OUT_OF_RANGE = 101;  // a token id past the embedding table, or a position past the rotary's
constexpr int NO_INPUTS = 102;  // token ids for a plan without the embedding and rotary tables

// The step's embedded tokens and rotary rows into the plan's scratch, as the embedding and
// Rotary.tables make them (row copies; a quantized table's rows dequantized as stored()).
int make_inputs(const Plan& p, const Step& s) {
    const int64_t m = s.rows, H = p.hidden, D = p.head_dim;
    for (int64_t r = 0; r < m; ++r)
        if (s.token_ids[r] < 0 || s.token_ids[r] >= p.embed_rows || s.positions[r] < 0 || s.positions[r] >= p.rope_len)
            return INPUT_OUT_OF_RANGE;
    if (p.embed_dense) {
        for (int64_t r = 0; r < m; ++r)
            std::memcpy(p.x_buf + r * H, p.embed_dense + s.token_ids[r] * H, size_t(H) * sizeof(float));
    } else if (p.embed_qrows(p.embed_layout, s.token_ids, m, p.x_buf, H) != 0) {
        return INPUT_OUT_OF_RANGE;
    }
    for (int64_t r = 0; r < m; ++r) {
        std::memcpy(p.cos_buf + r * D, p.rope_cos + s.positions[r] * D, size_t(D) * sizeof(float));
        std::memcpy(p.sin_buf + r * D, p.rope_sin + s.positions[r] * D, size_t(D) * sizeof(float));
    }
    return 0;
}

// y [m, n] = x [m, k] W^T (+ the bias, when `with_bias`), each part through the kernel the Python
// layer calls for it, with the same arguments: one part takes the bias into its kernel; parts
// stacked write their columns (all in one call where `stack` takes them: the same numbers), then
// the bias is added, as torch.cat(...) + bias.
void project(const Plan& p, const Projection& j, const float* x, int64_t m, int64_t k, float* y, int64_t n,
             bool with_bias, int th) {
    const float* bias = with_bias ? j.bias : nullptr;
    const bool single = j.count == 1;
    bool done = false;
    bool few = true;  // every part takes this step through `qlinear` (the stack's kernel)
    for (int64_t i = 0; i < j.count; ++i) few = few && !(j.parts[i].many && m > j.parts[i].few);
    if (j.stack && !single && j.count <= MAX_STACK && few) {
        const void* layouts[MAX_STACK];
        for (int64_t i = 0; i < j.count; ++i) layouts[i] = j.parts[i].layout;
        done = j.stack(x, m, k, layouts, j.count, y, n, th) == 0;
    }
    int64_t col = 0;
    for (int64_t i = 0; i < j.count && !done; ++i) {
        const Part& part = j.parts[i];
        const float* b = single ? bias : nullptr;
        if (part.dense)
            p.linear(x, m, k, part.dense, part.rows, k, k, b, y + col, n, th);
        else
            (part.many && m > part.few ? part.many : part.qlinear)(x, m, k, part.layout, b, y + col, n, th);
        col += part.rows;
    }
    if (!single && bias)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t c = 0; c < n; ++c) y[r * n + c] += bias[c];
}

float dot(const float* a, const float* b, int64_t k) {
    vecf acc0 = {}, acc1 = {};
    int64_t i = 0;
    for (; i + 2 * VL <= k; i += 2 * VL) {
        acc0 += vload(a + i) * vload(b + i);
        acc1 += vload(a + i + VL) * vload(b + i + VL);
    }
    for (; i + VL <= k; i += VL) acc0 += vload(a + i) * vload(b + i);
    float sum = hsum(acc0 + acc1);
    for (; i < k; ++i) sum += a[i] * b[i];
    return sum;
}

// y [m, n] += (x [m, k] A^T) B^T with each row's own adapter (LoraPool.add_to's sum), in one
// parallel region: u = A x for every row and rank, then each row adds u_j times row j of B^T,
// by blocks of outputs. A step that mixes many adapters has runs of a row or two; a pair of kernel
// calls per run (two parallel regions on a rank-16 matrix each) cost more than the products.
void add_lora(int64_t rows, const int64_t* slots, const Lora& l, const float* x, int64_t k, float* y, int64_t n,
              float* u, int th) {
    if (!slots || !l.a) return;
    const int64_t w = l.width;
    if (std::all_of(slots, slots + rows, [](int64_t slot) { return slot < 0; })) return;
    constexpr int64_t BLOCK = 512;  // outputs per item: a row's block of y stays in L1 across j
    // a decode step's one or two rows are a few hundred thousand multiply-adds: waking the other
    // threads for them cost more than the products (a fifth of a batch-1 step, in libgomp)
    const bool parallel = rows * w * (k + n) >= (int64_t(1) << 20);
#pragma omp parallel num_threads(th) if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * w; ++i) {
            const int64_t r = i / w, slot = slots[r];
            u[i] = slot < 0 ? 0.0f : dot(l.a + (slot * w + i % w) * k, x + r * k, k);
        }
#pragma omp for schedule(static)
        for (int64_t c0 = 0; c0 < n; c0 += BLOCK) {
            const int64_t c1 = std::min(n, c0 + BLOCK);
            for (int64_t r = 0; r < rows; ++r) {
                if (slots[r] < 0) continue;
                float* yr = y + r * n;
                for (int64_t j = 0; j < w; ++j) {
                    const int64_t* part = l.parts + 2 * (j / l.rank);
                    const int64_t lo = std::max(c0, part[0]), hi = std::min(c1, part[0] + part[1]);
                    const float uj = u[r * w + j];
                    const float* bt = l.bt + (slots[r] * w + j) * n;
                    for (int64_t c = lo; c < hi; ++c) yr[c] += uj * bt[c];
                }
            }
        }
    }
}

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

// D values at `out` in the pools' type (fp32 copied; 16-bit rounded to nearest even, as torch's
// .to() rounds what the Python layers write).
inline void store_row(const float* x, int64_t D, void* out, int64_t kv_dtype) {
    if (kv_dtype == 0) {
        std::memcpy(out, x, size_t(D) * sizeof(float));
    } else if (kv_dtype == 1) {
        uint16_t* o = static_cast<uint16_t*>(out);
        for (int64_t d = 0; d < D; ++d) o[d] = bf16_bits(x[d]);
    } else {
        _Float16* o = static_cast<_Float16*>(out);
        for (int64_t d = 0; d < D; ++d) o[d] = _Float16(x[d]);
    }
}

// The step's keys (roped, [rows, kv_heads, head_dim]) and values (a slice of the q/k/v output) at
// their pool rows.
void write_kv(const Plan& p, const Step& s, const LayerWeights& w, int64_t qkv_width) {
    const int64_t D = p.head_dim, kw = p.kv_heads * D;
    const int64_t size = p.kv_dtype == 0 ? 4 : 2;  // bytes per element
    char* k_pool = static_cast<char*>(w.k_pool);
    char* v_pool = static_cast<char*>(w.v_pool);
    for (int64_t t = 0; t < s.rows; ++t) {
        const int64_t row = s.write_rows[t] * p.pool_stride_row;
        const float* v = p.qkv + t * qkv_width + p.heads * D + kw;
        for (int64_t h = 0; h < p.kv_heads; ++h) {
            store_row(p.k + t * kw + h * D, D, k_pool + (h * p.pool_stride_h + row) * size, p.kv_dtype);
            store_row(v + h * D, D, v_pool + (h * p.pool_stride_h + row) * size, p.kv_dtype);
        }
    }
}

}  // namespace

extern "C" int neuron_decoder_layers(const Plan* plan, const Step* step) {
    const Plan& p = *plan;
    const Step& s = *step;
    const int64_t H = p.hidden, D = p.head_dim, I = p.inter;
    int64_t m = s.rows;
    const int64_t* lora = s.lora_slots;  // each of the m rows' LoRA slot
    const int64_t qw = p.heads * D, kw = p.kv_heads * D, qkvw = qw + 2 * kw;
    const int th = int(s.threads);
    PagedAttentionArgs a{p.attn, p.q, nullptr, nullptr, s.block_tables, s.query_start, s.kv_lens, s.num_seqs,
                         p.heads, p.kv_heads, D, s.block_size, s.table_stride, qw, D, qw, D, p.pool_stride_h,
                         p.pool_stride_row, p.scale_log2};
    const float *x = s.x, *cos = s.cos, *sin = s.sin;
    if (s.token_ids) {
        if (!p.x_buf) return NO_INPUTS;
        if (const int status = make_inputs(p, s)) return status;
        x = p.x_buf, cos = p.cos_buf, sin = p.sin_buf;
    }
    for (int64_t l = 0; l < p.num_layers; ++l) {
        const LayerWeights& w = p.layers[l];
        p.rms_norm(x, m, H, H, w.input_norm, p.eps, p.h, H, th);
        project(p, w.qkv, p.h, m, H, p.qkv, qkvw, true, th);
        add_lora(m, lora, w.qkv_lora, p.h, H, p.qkv, qkvw, p.lora_u, th);
        p.norm_rope(p.qkv, m, p.heads, qkvw, D, D, w.q_norm, p.eps, cos, sin, D, p.q, qw, D, th);
        p.norm_rope(p.qkv + qw, m, p.kv_heads, qkvw, D, D, w.k_norm, p.eps, cos, sin, D, p.k, kw, D, th);
        write_kv(p, s, w, qkvw);
        if (s.kept && l == p.num_layers - 1) {  // the head's rows alone from here, gathered in place
            for (int64_t j = 0; j < s.kept_rows; ++j) {
                std::memmove(p.q + j * qw, p.q + s.kept[j] * qw, size_t(qw) * sizeof(float));
                std::memmove(s.out + j * H, x + s.kept[j] * H, size_t(H) * sizeof(float));
            }
            x = s.out;
            m = s.kept_rows;
            lora = s.lora_slots ? s.kept_lora_slots : nullptr;
            a.query_start = s.kept_query_start;
        }
        a.k_pool = w.k_pool;
        a.v_pool = w.v_pool;
        if (p.attention(&a, 0, int(p.kv_dtype), th)) return ATTENTION_REFUSED;
        project(p, w.o, p.attn, m, qw, p.o, H, false, th);
        add_lora(m, lora, w.o_lora, p.attn, qw, p.o, H, p.lora_u, th);
        if (const int status = reduce(p, s, p.o, m * H, w.o.bias, H)) return status;
        p.add_rms_norm(x, H, p.o, H, m, H, w.post_norm, p.eps, p.mid, H, p.h, H, th);
        project(p, w.gate_up, p.h, m, H, p.gate_up, 2 * I, true, th);
        add_lora(m, lora, w.gate_up_lora, p.h, H, p.gate_up, 2 * I, p.lora_u, th);
        p.silu_mul(p.gate_up, 2 * I, p.gate_up + I, 2 * I, m, I, p.act, I, th);
        project(p, w.down, p.act, m, I, p.down, H, false, th);
        add_lora(m, lora, w.down_lora, p.act, I, p.down, H, p.lora_u, th);
        if (const int status = reduce(p, s, p.down, m * H, w.down.bias, H)) return status;
        for (int64_t i = 0; i < m * H; ++i) s.out[i] = p.mid[i] + p.down[i];
        x = s.out;
    }
    if (s.logits && p.final_norm) {
        p.rms_norm(s.out, m, H, H, p.final_norm, p.eps, p.h, H, th);
        project(p, p.head, p.h, m, H, s.logits, p.head_rows, false, th);
    }
    return 0;
}
