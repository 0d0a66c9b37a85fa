// GGUF's quantized blocks rewritten as neuron's codes at load (models/gguf.py), one pass over the
// blocks instead of numpy's several: a block's codes as the decoders there hold them, int8 per value
// (Q5_0 and Q5_1, Q2_K, Q3_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), or for Q4_K its 4-bit codes packed in
// neuron's layout (per 32 values, byte i: value i in the low nibble, value i + 16 in the high one).
// Each block's scales stay with numpy: they are a sixteenth of the bytes or less.
//
// Included at the end of cpu_ops.cpp (its build, its library).
#include <cstdint>
#include <cstring>

namespace {

// ggml's type ids
enum GGMLType { Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };

// IQ4_NL's and IQ4_XS's codebook: code i stands for IQ4[i]
constexpr int8_t IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q5_0's and Q5_1's 32 values: low four bits in 16 bytes (value i low nibble, value i + 16 high),
// the fifth bit of value i at bit i of the little-endian u32 `high`; minus `bias`.
inline void five_bits(const uint8_t* high, const uint8_t* qs, int bias, int8_t* out) {
    uint32_t h;
    std::memcpy(&h, high, 4);
    for (int i = 0; i < 16; ++i) {
        out[i] = int8_t(((qs[i] & 0x0F) | (((h >> i) & 1) << 4)) - bias);
        out[i + 16] = int8_t(((qs[i] >> 4) | (((h >> (i + 16)) & 1) << 4)) - bias);
    }
}

// Q2_K's and Q3_K's low two bits: value h*128 + j*32 + l is bits 2j..2j+1 of byte h*32 + l.
inline int two_bits(const uint8_t* qs, int h, int j, int l) { return (qs[h * 32 + l] >> (2 * j)) & 3; }

// One block of `kind` at b into out: 0, or -1 for a type not rewritten here.
inline int block_codes(int kind, const uint8_t* b, uint8_t* out_bytes) {
    int8_t* out = reinterpret_cast<int8_t*>(out_bytes);
    switch (kind) {
        case Q5_0:  // d, qh, qs: codes q - 16
            five_bits(b + 2, b + 6, 16, out);
            return 0;
        case Q5_1:  // d, m, qh, qs: codes 0..31
            five_bits(b + 4, b + 8, 0, out);
            return 0;
        case Q2_K:  // scales, qs, d, dmin: codes 0..3
            for (int h = 0; h < 2; ++h)
                for (int j = 0; j < 4; ++j)
                    for (int l = 0; l < 32; ++l) out[h * 128 + j * 32 + l] = int8_t(two_bits(b + 16, h, j, l));
            return 0;
        case Q3_K:  // hmask, qs, scales, d: the low two bits, 4 lower where value v's hmask bit (bit v/32 of byte v%32) is clear
            for (int h = 0; h < 2; ++h)
                for (int j = 0; j < 4; ++j)
                    for (int l = 0; l < 32; ++l) {
                        const int set = (b[l] >> (h * 4 + j)) & 1;
                        out[h * 128 + j * 32 + l] = int8_t(two_bits(b + 32, h, j, l) - 4 + 4 * set);
                    }
            return 0;
        case Q4_K: {  // d, dmin, scales, qs: chunk j's byte l holds value j*64 + l (low) and j*64 + 32 + l (high)
            const uint8_t* qs = b + 16;
            for (int j = 0; j < 4; ++j) {
                const uint8_t* c = qs + j * 32;
                uint8_t* low = out_bytes + j * 32;  // the group of values j*64 .. j*64 + 31
                uint8_t* high = low + 16;           // the group of values j*64 + 32 .. j*64 + 63
                for (int i = 0; i < 16; ++i) {
                    low[i] = uint8_t((c[i] & 0x0F) | ((c[i + 16] & 0x0F) << 4));
                    high[i] = uint8_t((c[i] >> 4) | (c[i + 16] & 0xF0));
                }
            }
            return 0;
        }
        case Q5_K: {  // d, dmin, scales, qh, qs: value (2j + s)*32 + l: nibble s of qs[j*32 + l], bit 2j + s of qh[l]
            const uint8_t *qh = b + 16, *qs = b + 48;
            for (int j = 0; j < 4; ++j)
                for (int s = 0; s < 2; ++s)
                    for (int l = 0; l < 32; ++l)
                        out[(2 * j + s) * 32 + l] =
                            int8_t(((qs[j * 32 + l] >> (4 * s)) & 0x0F) | (((qh[l] >> (2 * j + s)) & 1) << 4));
            return 0;
        }
        case Q6_K: {  // ql, qh, scales, d: value h*128 + w: nibble w/64 of ql[h*64 + w%64], bits 2(w/32) of qh[h*32 + w%32]
            const uint8_t *ql = b, *qh = b + 128;
            for (int h = 0; h < 2; ++h)
                for (int q = 0; q < 4; ++q)  // w = q*32 + l
                    for (int l = 0; l < 32; ++l) {
                        const int low = (ql[h * 64 + (q & 1) * 32 + l] >> (4 * (q >> 1))) & 0x0F;
                        const int high = (qh[h * 32 + l] >> (2 * q)) & 3;
                        out[h * 128 + q * 32 + l] = int8_t((low | (high << 4)) - 32);
                    }
            return 0;
        }
        case IQ4_NL:  // d, qs: value i the codebook's entry for the low nibble of byte i, i + 16 the high one
            for (int i = 0; i < 16; ++i) {
                out[i] = IQ4[b[2 + i] & 0x0F];
                out[i + 16] = IQ4[b[2 + i] >> 4];
            }
            return 0;
        case IQ4_XS:  // d, scales_h, scales_l, qs: eight runs of 32 values as IQ4_NL's
            for (int s = 0; s < 8; ++s)
                for (int i = 0; i < 16; ++i) {
                    const uint8_t q = b[8 + s * 16 + i];
                    out[s * 32 + i] = IQ4[q & 0x0F];
                    out[s * 32 + i + 16] = IQ4[q >> 4];
                }
            return 0;
        default:
            return -1;
    }
}

}  // namespace

extern "C" {

// `n` blocks of GGUF type `kind` (ggml's id), each `block_bytes` long and contiguous, rewritten into
// out, `out_bytes` per block (a block's int8 codes, or Q4_K's packed ones). 0, or -1 for a type
// this does not rewrite (the caller keeps its own way).
int neuron_gguf_codes(int kind, const uint8_t* blocks, int64_t n, int64_t block_bytes, uint8_t* out,
                      int64_t out_bytes, int threads) {
    uint8_t probe[256];
    if (n == 0 || block_codes(kind, blocks, probe) != 0) return n == 0 ? 0 : -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (n * out_bytes >= (int64_t(1) << 20))
    for (int64_t i = 0; i < n; ++i) block_codes(kind, blocks + i * block_bytes, out + i * out_bytes);
    return 0;
}

}  // extern "C"
