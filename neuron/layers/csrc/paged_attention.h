// The CPU paged-attention kernel's arguments (paged_attention_cpu.cpp), also built by the fused
// decoder layers (decoder_layers.cpp) for each layer's call of that kernel.
#pragma once

#include <cstdint>

struct PagedAttentionArgs {
    void* out;
    const void* q;
    const void* k_pool;
    const void* v_pool;
    const int32_t* block_tables;
    const int32_t* query_start;
    const int32_t* kv_lens;
    int64_t num_seqs, heads, kv_heads, head_dim, block_size, table_stride;
    int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h, pool_stride_h, pool_stride_row;
    float scale_log2;  // softmax scale times log2(e): scores go straight into exp2
};
