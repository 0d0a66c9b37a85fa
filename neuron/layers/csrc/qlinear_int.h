// The quantized product with the activations rounded to int8 (`neuron_qlinear_int`), included by
// cpu_ops.cpp after its QuantizedWeight (the library is one translation unit; native.py keys its
// cache on this folder's headers too).
//
// Each row of x is rounded once per call to int8 in blocks of XBLOCK (32) inputs, symmetrically:
// d = max|x| / 127, q = round(x / d). A step of the loop takes one register of a weight row's codes
// (64 bytes with AVX-512, 32 otherwise): the codes times the rounded activations in integers,
// summed into 32-bit lanes (VNNI's dpbusd, or maddubs + madd), the lanes turned into floats and
// multiplied by their block's d and their weight group's scale. Lanes never straddle a group or a
// block (groups are multiples of 16 inputs), so groups of 16 (Q6_K), 32 (Q8_0, the K-quants), more
// (AWQ's 128) and one per row (int8 at load) all work the same way; each lane's group comes from a
// small index vector made once per call. Offsets are subtracted once per row, z(n, g) times the
// sum of the rounded x over the group: then the error is sum((s q - z)(x' - x)), the weights' own
// times the rounding's, where the exact sum of x would leave s sum(q (x' - x)), whose codes are
// all positive (0..15 against an offset of 8 in Q4_0) and so several times larger.
//
// int8 codes, four inputs per lane: the unsigned operand is the code with 128 added (a xor), and
// 128 * sum(q) of each lane, precomputed with the activations, is subtracted, under VNNI; without
// VNNI, |w| against x with w's sign (maddubs saturates at 16 bits, and 255 * 127 * 2 would).
//
// 4-bit codes, eight inputs per lane (128 per AVX-512 step: four groups of 32). A group's byte i
// holds input i in its low nibble and input i + 16 in its high one, so both nibbles of a byte
// belong to one group and one block: the register masked to its low nibbles and to its high ones
// gives two registers whose lane l covers the same group. The activations are stored once per call
// in the matching order (per chunk, every group's inputs 0..15, then every group's 16..31:
// chunk_pos), so the codes are never shuffled; both registers' products go into the same lanes,
// and the float work (convert, scale, accumulate) is paid once per 128 inputs, not per 64.
// Under VNNI neither nibble is shifted down: the high one stays in place (code x 16) and the low one
// is shifted up to match, so every lane's sum is 16 times the true one, exactly (8 products of at
// most 240 x 127 fit 32 bits, and their sum, under 2^24, converts to float exactly); the 1/16 is
// folded into the lanes' activation scales (LANE_UNIT, a power of two: exact). maddubs adds pairs
// into 16 bits with saturation, and 240 x 127 x 2 would overflow: without VNNI (and with AVX2,
// 64 inputs a step) the high nibbles are shifted down instead, and the two registers' pairs (at
// most 15 x 127 x 4 together) added in 16 bits before the one madd. A row's last chunk may hold
// 32, 64 or 96 inputs (k is a multiple of 32): its codes are loaded masked, and its missing
// activations are zeros under a scale of 0.
//
// The result differs from dequantize-then-matmul by the activations' rounding (a relative error of
// 2e-5 to 4e-5 in the mean square, tests/test_quant_int.py), as llama.cpp's products do. Two-level
// factors at a few rows round them per 256 inputs instead, in builds without VNNI (below).
#pragma once

#include <deque>
#include <type_traits>

namespace {

constexpr int XBLOCK = 32;  // activations under one int8 scale
// Weight rows per integer tile: their factors are made once per tile, and a chunk of x meets them all
// at once. Up to three rows of x, 4-bit products are bound by reading W from memory, and four rows'
// streams were read faster than eight; from four rows of x on they are bound by their arithmetic
// and did better with eight (x read from memory in the product) even where the accumulators spill.
// int8 codes hold x in registers and stay at four. Either way the codes are fetched PREFETCH_ROWS
// ahead: further was slower with the weights in memory.
constexpr int INB = 4, WIDE_INB = 8;
constexpr int PREFETCH_ROWS = PREFETCH_TILES * INB;
constexpr int64_t MIN_PARALLEL_ROUNDING = 8192;  // activations rounded by the team rather than the caller

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define NEURON_INT_AVX512 1
constexpr int LANES = 16;
typedef __m512i Bytes;    // a register of codes or activations, four bytes per lane
typedef __m512i LaneInts;  // LANES 32-bit sums
typedef __m512 LaneFloats;
#elif defined(__AVX2__)
#define NEURON_INT_AVX2 1
constexpr int LANES = 8;
typedef __m256i Bytes;
typedef __m256i LaneInts;
typedef __m256 LaneFloats;
#else
constexpr int LANES = 8;
struct Bytes {
    int32_t v[LANES * 4];
};
typedef int32_t LaneInts __attribute__((vector_size(LANES * 4)));
typedef float LaneFloats __attribute__((vector_size(LANES * 4)));
#endif
#if defined(NEURON_INT_AVX512) && defined(__AVX512VNNI__)
#define NEURON_INT_VNNI 1
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

constexpr int REG_BYTES = LANES * 4;
// Inputs per step: one register of codes.
template <int BITS>
constexpr int CHUNK = REG_BYTES * 8 / BITS;
// What the integer lanes count in: 1/16 for 4-bit codes under VNNI (both nibbles times 16).
template <int BITS>
constexpr float LANE_UNIT = BITS == 4 && VNNI ? 1.0f / 16 : 1.0f;

// Where input i of a chunk sits among the chunk's activation bytes, and back: 4-bit chunks hold
// every group's first halves, then every group's second halves (one register each).
template <int BITS>
inline int chunk_pos(int i) {
    if constexpr (BITS == 4) return (i % 32 / 16) * REG_BYTES + (i / 32) * 16 + i % 16;
    return i;
}
template <int BITS>
inline int pos_input(int pos) {
    if constexpr (BITS == 4) return (pos % REG_BYTES / 16) * 32 + (pos / REG_BYTES) * 16 + pos % 16;
    return pos;
}

#if defined(NEURON_INT_AVX512)
inline Bytes load_x(const int8_t* p) { return _mm512_loadu_si512(p); }
inline LaneInts load_ints(const int32_t* p) { return _mm512_loadu_si512(p); }
inline LaneFloats load_floats(const float* p) { return _mm512_loadu_ps(p); }
// A register of codes; TAIL: only the first `bytes` exist (a multiple of 16), the rest read as zeros.
template <bool TAIL>
inline Bytes load_codes(const uint8_t* p, int bytes) {
    return TAIL ? _mm512_maskz_loadu_epi8(~0ull >> (64 - bytes), p) : _mm512_loadu_si512(p);
}
// A register of 4-bit codes as its low nibbles and its high ones, in the lanes' unit (LANE_UNIT).
inline void nibbles(Bytes b, Bytes& lo, Bytes& hi) {
#if defined(NEURON_INT_VNNI)
    const __m512i top = _mm512_set1_epi8(char(0xF0));
    lo = _mm512_and_si512(_mm512_slli_epi16(b, 4), top);
    hi = _mm512_and_si512(b, top);
#else
    const __m512i low = _mm512_set1_epi8(15);
    lo = _mm512_and_si512(b, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
#endif
}
inline LaneInts idot4(Bytes lo, Bytes hi, Bytes xlo, Bytes xhi) {
#if defined(NEURON_INT_VNNI)
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
#else
    const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(lo, xlo), _mm512_maddubs_epi16(hi, xhi));
    return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#endif
}
// Each lane's four int8 code x activation products summed; `corr` is the lane's -128 * sum(q) (VNNI).
inline LaneInts idot8(Bytes w, Bytes x, LaneInts corr) {
#if defined(NEURON_INT_VNNI)
    return _mm512_dpbusd_epi32(corr, _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))), x);
#else
    (void)corr;
    const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    return _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_x), _mm512_set1_epi16(1));
#endif
}
inline LaneFloats to_floats(LaneInts v) { return _mm512_cvtepi32_ps(v); }
inline LaneFloats fmadd(LaneFloats a, LaneFloats b, LaneFloats c) { return _mm512_fmadd_ps(a, b, c); }
inline LaneFloats fmul(LaneFloats a, LaneFloats b) { return _mm512_mul_ps(a, b); }
inline float lane_sum(LaneFloats v) { return _mm512_reduce_add_ps(v); }
// p[idx[l]] for each lane (idx < LANES).
inline LaneFloats spread(LaneInts idx, const float* p) { return _mm512_permutexvar_ps(idx, _mm512_loadu_ps(p)); }
inline LaneFloats splat(float v) { return _mm512_set1_ps(v); }
inline LaneFloats fnmadd(LaneFloats a, LaneFloats b, LaneFloats c) { return _mm512_fnmadd_ps(a, b, c); }
inline LaneInts add_ints(LaneInts a, LaneInts b) { return _mm512_add_epi32(a, b); }
// 128 bits in every 128 bits of a register; 128 or 256 bits in a register's first, the rest zeros.
inline Bytes in_quads(__m128i v) { return _mm512_broadcast_i32x4(v); }
inline LaneInts zero_extended(__m128i v) { return _mm512_zextsi128_si512(v); }
inline LaneInts zero_extended(__m256i v) { return _mm512_zextsi256_si512(v); }
// Byte i of the result: byte ctl[i] of v's 128 bits that hold i.
inline Bytes shuffle_bytes(Bytes v, Bytes ctl) { return _mm512_shuffle_epi8(v, ctl); }
// As idot4 without VNNI, each lane's two pairs times the lane's int16 in `by` (maddubs, then madd).
inline LaneInts idot4_by(Bytes lo, Bytes hi, Bytes xlo, Bytes xhi, Bytes by) {
    return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, xlo), _mm512_maddubs_epi16(hi, xhi)), by);
}
// As idot8 without VNNI, each lane's two pairs times the lane's int16 in `by`.
inline LaneInts idot8_by(Bytes w, Bytes x, Bytes by) {
    const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    return _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_x), by);
}
// The largest |x| of one block of XBLOCK activations.
inline float block_amax(const float* xb) {
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
}
// One block of XBLOCK activations times `inv` (127 over the largest |x| of a block that holds it)
// rounded to int8 into q (to nearest, ties to even: never past 127 but by a rounding error, so never
// 128), the sums of its two halves of 16 into `halves`.
inline void round_with(const float* xb, float inv, int8_t* q, int32_t halves[2]) {
    const __m512 by = _mm512_set1_ps(inv);
    constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), by), NEAREST);
    const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16), by), NEAREST);
    _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qb));
    halves[0] = _mm512_reduce_add_epi32(qa);
    halves[1] = _mm512_reduce_add_epi32(qb);
}
#elif defined(NEURON_INT_AVX2)
inline Bytes load_x(const int8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline LaneInts load_ints(const int32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline LaneFloats load_floats(const float* p) { return _mm256_loadu_ps(p); }
template <bool TAIL>
inline Bytes load_codes(const uint8_t* p, int bytes) {
    if (!TAIL) return _mm256_loadu_si256((const __m256i*)p);
    const __m256i words = _mm256_cmpgt_epi32(_mm256_set1_epi32(bytes / 4), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_epi32((const int*)p, words);
}
inline void nibbles(Bytes b, Bytes& lo, Bytes& hi) {
    const __m256i low = _mm256_set1_epi8(15);
    lo = _mm256_and_si256(b, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
}
inline LaneInts idot4(Bytes lo, Bytes hi, Bytes xlo, Bytes xhi) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
inline LaneInts idot8(Bytes w, Bytes x, LaneInts) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                             _mm256_set1_epi16(1));
}
inline LaneFloats to_floats(LaneInts v) { return _mm256_cvtepi32_ps(v); }
inline LaneFloats fmadd(LaneFloats a, LaneFloats b, LaneFloats c) { return _mm256_fmadd_ps(a, b, c); }
inline LaneFloats fmul(LaneFloats a, LaneFloats b) { return _mm256_mul_ps(a, b); }
inline float lane_sum(LaneFloats v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline LaneFloats spread(LaneInts idx, const float* p) { return _mm256_permutevar8x32_ps(_mm256_loadu_ps(p), idx); }
inline LaneFloats splat(float v) { return _mm256_set1_ps(v); }
inline LaneFloats fnmadd(LaneFloats a, LaneFloats b, LaneFloats c) { return _mm256_fnmadd_ps(a, b, c); }
inline LaneInts add_ints(LaneInts a, LaneInts b) { return _mm256_add_epi32(a, b); }
inline Bytes in_quads(__m128i v) { return _mm256_broadcastsi128_si256(v); }
inline LaneInts zero_extended(__m128i v) { return _mm256_zextsi128_si256(v); }
inline LaneInts zero_extended(__m256i v) { return v; }
inline Bytes shuffle_bytes(Bytes v, Bytes ctl) { return _mm256_shuffle_epi8(v, ctl); }
inline LaneInts idot4_by(Bytes lo, Bytes hi, Bytes xlo, Bytes xhi, Bytes by) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), by);
}
inline LaneInts idot8_by(Bytes w, Bytes x, Bytes by) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), by);
}
inline int32_t int_sum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}
inline float block_amax(const float* xb) {
    __m256 m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
inline void round_with(const float* xb, float inv, int8_t* q, int32_t halves[2]) {
    const __m256 by = _mm256_set1_ps(inv);
    __m256i n[4];
    for (int i = 0; i < 4; ++i)
        n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), by),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packs interleave the 128-bit halves: the last permute puts the four eights back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    halves[0] = int_sum(_mm256_add_epi32(n[0], n[1]));
    halves[1] = int_sum(_mm256_add_epi32(n[2], n[3]));
}
#else
inline Bytes load_x(const int8_t* p) {
    Bytes b;
    for (int i = 0; i < REG_BYTES; ++i) b.v[i] = p[i];
    return b;
}
inline LaneInts load_ints(const int32_t* p) {
    LaneInts v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline LaneFloats load_floats(const float* p) {
    LaneFloats v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
// The bytes as they are (0..255); idot8 reads them as int8.
template <bool TAIL>
inline Bytes load_codes(const uint8_t* p, int bytes) {
    Bytes b;
    for (int i = 0; i < REG_BYTES; ++i) b.v[i] = !TAIL || i < bytes ? p[i] : 0;
    return b;
}
inline void nibbles(const Bytes& b, Bytes& lo, Bytes& hi) {
    for (int i = 0; i < REG_BYTES; ++i) lo.v[i] = b.v[i] & 15, hi.v[i] = b.v[i] >> 4;
}
inline LaneInts idot4(const Bytes& lo, const Bytes& hi, const Bytes& xlo, const Bytes& xhi) {
    LaneInts s = {};
    for (int l = 0; l < LANES; ++l)
        for (int t = 4 * l; t < 4 * l + 4; ++t) s[l] += lo.v[t] * xlo.v[t] + hi.v[t] * xhi.v[t];
    return s;
}
inline LaneInts idot8(const Bytes& w, const Bytes& x, LaneInts) {
    LaneInts s = {};
    for (int l = 0; l < LANES; ++l)
        for (int t = 4 * l; t < 4 * l + 4; ++t) s[l] += int8_t(w.v[t]) * x.v[t];
    return s;
}
inline LaneFloats to_floats(LaneInts v) { return __builtin_convertvector(v, LaneFloats); }
inline LaneFloats fmadd(LaneFloats a, LaneFloats b, LaneFloats c) { return a * b + c; }
inline LaneFloats fmul(LaneFloats a, LaneFloats b) { return a * b; }
inline LaneFloats splat(float v) { return LaneFloats{} + v; }
inline float lane_sum(LaneFloats v) {
    float s = 0.0f;
    for (int l = 0; l < LANES; ++l) s += v[l];
    return s;
}
inline LaneFloats spread(LaneInts idx, const float* p) {
    LaneFloats v;
    for (int l = 0; l < LANES; ++l) v[l] = p[idx[l]];
    return v;
}
inline float block_amax(const float* xb) {
    float amax = 0.0f;
    for (int t = 0; t < XBLOCK; ++t) amax = std::max(amax, std::fabs(xb[t]));
    return amax;
}
inline void round_with(const float* xb, float inv, int8_t* q, int32_t halves[2]) {
    halves[0] = halves[1] = 0;
    for (int t = 0; t < XBLOCK; ++t) {
        // the default rounding: to nearest, ties to even (NaN clamped, not converted)
        q[t] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[t] * inv))));
        halves[t / 16] += q[t];
    }
}
#endif

// One block of XBLOCK activations rounded to int8 into q under its own scale d = max|x| / 127, the
// sums of its two halves of 16 into `halves`; returns d.
inline float round_block(const float* xb, int8_t* q, int32_t halves[2]) {
    const float amax = block_amax(xb);
    round_with(xb, amax > 0.0f ? 127.0f / amax : 0.0f, q, halves);
    return amax / 127.0f;
}

// x's rows rounded for one call, in the kernel's chunk order, and what the weights' groups need.
struct RoundedRows {
    int64_t chunks, groups;
    int64_t sum_stride;  // groups rounded up to whole LANES, the rest zeros (whole vectors in dot_lanes)
    const int8_t* q;      // [m][chunks * CHUNK], zero past k
    const float* d;       // [m][chunks * LANES]: each lane's block scale, in LANE_UNIT
    const float* bd;      // [m][chunks * CHUNK / XBLOCK]: each block's scale
    const int32_t* corr;  // [m][chunks * LANES]: -128 * the sum of each lane's four q (VNNI, int8 codes)
    const float* sum;     // [m][sum_stride]: the rounded x summed over each weight group (offsets), or null
    const int32_t* lane_group;  // [chunks * LANES]: each lane's group, less the chunk's first
    const int64_t* first_group;  // [chunks]
};

// Row r of x into `rows`' buffers (the caller sized them).
template <int BITS>
inline void round_row(const float* x, int64_t k, int64_t group, int8_t* q, float* d, float* bd, int32_t* corr,
                      float* sum, int64_t sum_stride, int64_t chunks) {
    constexpr int C = CHUNK<BITS>;
    if (sum) std::fill(sum, sum + sum_stride, 0.0f);
    int64_t g = 0, left = group;  // the group of the half-block at hand, and its inputs from there on
    for (int64_t c = 0; c < chunks; ++c) {
        float block_d[C / XBLOCK];
        int8_t* qc = q + c * C;
        for (int b = 0; b < C / XBLOCK; ++b) {
            const int64_t at = c * C + b * XBLOCK;
            int8_t rounded[XBLOCK] = {};  // the tail chunk's missing blocks: zeros under a scale of 0
            int32_t halves[2];
            bd[c * (C / XBLOCK) + b] = block_d[b] = at < k ? round_block(x + at, rounded, halves) : 0.0f;
            // a block's two halves of 16 sit apart in the 4-bit order (chunk_pos)
            std::memcpy(qc + chunk_pos<BITS>(b * XBLOCK), rounded, 16);
            std::memcpy(qc + chunk_pos<BITS>(b * XBLOCK + 16), rounded + 16, 16);
            for (int h = 0; sum && at < k && h < 2; ++h) {  // groups are multiples of 16 inputs
                sum[g] += block_d[b] * float(halves[h]);
                if ((left -= 16) == 0) ++g, left = group;
            }
        }
        for (int l = 0; l < LANES; ++l) {
            d[c * LANES + l] = block_d[pos_input<BITS>(4 * l) / XBLOCK] * LANE_UNIT<BITS>;
            if (corr) corr[c * LANES + l] = -128 * (qc[4 * l] + qc[4 * l + 1] + qc[4 * l + 2] + qc[4 * l + 3]);
        }
    }
}

// The codes of the tile PREFETCH_ROWS ahead, fetched a few lines per step by a tile's first product.
struct Ahead {
    const char* next;
    int64_t lines;
    int per_step;
};

// The codes of the tile at o + PREFETCH_ROWS (none past W's end), a tile's worth of registers a step.
inline Ahead ahead_of(const QuantizedWeight& w, int64_t o, int tile) {
    const int64_t row = o + PREFETCH_ROWS;
    return Ahead{reinterpret_cast<const char*>(w.codes + row * w.code_stride),
                 row + tile <= w.n ? tile * w.code_stride / 64 : 0, std::max(1, tile * REG_BYTES / 64)};
}

// Where x's block scales go (at one row of x and groups of XBLOCK inputs, they are folded into each
// weight row's group scales as irows makes them, so that a register's product is one FMA by the
// spread scales rather than also a load of x's lane scales and a multiply):
constexpr int UNFOLDED = 0;  // multiplied in per register
constexpr int FOLDED = 1;
constexpr int FOLDED_ONE = 2;  // folded, int8 codes whose groups are a register's inputs (Q8_0 with
                               // AVX2): one scale a register, broadcast (8 instructions a register and
                               // weight row rather than 10)

// y[r][o + j] for RB rows of x from r0 and NBT weight rows from o, before scales per row, offsets
// and bias, in lanes still to be summed. `gs` holds each weight row's group scales (PLAIN: unused),
// and x's block scales too unless UNFOLDED (folded only where RB is 1).
template <int NBT, int RB, int BITS, bool PLAIN, int FOLD>
inline void itile(const RoundedRows& a, int64_t r0, const QuantizedWeight& w, int64_t o, const float* gs,
                  int64_t gstride, LaneFloats acc[RB][NBT], Ahead ahead) {
    constexpr int C = CHUNK<BITS>;
    for (int r = 0; r < RB; ++r)
        for (int j = 0; j < NBT; ++j) acc[r][j] = LaneFloats{};
    const uint8_t* rows[NBT];
    for (int j = 0; j < NBT; ++j) rows[j] = w.codes + (o + j) * w.code_stride;
    const char* next = ahead.next;
    const int64_t lines = ahead.lines;
    int64_t line = 0;
    const int64_t full = w.k / C;
    const int tail_bytes = int(w.k % C) * BITS / 8;
    const int64_t xq_stride = a.chunks * C, lane_stride = a.chunks * LANES;
    auto step = [&](int64_t c, auto tail) {
        constexpr bool TAIL = decltype(tail)::value;
        for (int p = 0; p < ahead.per_step; ++p)
            if (line < lines) __builtin_prefetch(next + 64 * line++, 0, 3);
        // 4-bit: x's chunk read where it is used (the loads fold into the products), as RB x NBT
        // accumulators and RB x 2 registers of x would not fit the registers; 8-bit: held in them.
        const int8_t* xq[RB];  // 4-bit: the groups' first halves, then their second halves
        const float* xd[RB];
        Bytes x8[RB];
        LaneFloats d8[RB];
        LaneInts c8[RB];
        for (int r = 0; r < RB; ++r) {
            xq[r] = a.q + (r0 + r) * xq_stride + c * C;
            xd[r] = a.d + (r0 + r) * lane_stride + c * LANES;
            if constexpr (BITS == 8) {
                x8[r] = load_x(xq[r]);
                d8[r] = load_floats(xd[r]);
                c8[r] = VNNI ? load_ints(a.corr + (r0 + r) * lane_stride + c * LANES) : LaneInts{};
            }
        }
        LaneInts idx{};
        if constexpr (!PLAIN) idx = load_ints(a.lane_group + c * LANES);
        const int64_t g0 = a.first_group[c];
        for (int j = 0; j < NBT; ++j) {
            const Bytes codes = load_codes<TAIL>(rows[j] + c * REG_BYTES, tail_bytes);
            Bytes lo, hi;
            if constexpr (BITS == 4) nibbles(codes, lo, hi);
            if constexpr (FOLD == FOLDED_ONE) {
                acc[0][j] = fmadd(to_floats(idot8(codes, x8[0], c8[0])), splat(gs[j * gstride + c]), acc[0][j]);
                continue;
            }
            LaneFloats sw{};
            if constexpr (!PLAIN) sw = spread(idx, gs + j * gstride + g0);
            for (int r = 0; r < RB; ++r) {
                LaneInts s;
                LaneFloats d;
                if constexpr (BITS == 4)
                    s = idot4(lo, hi, load_x(xq[r]), load_x(xq[r] + REG_BYTES)), d = load_floats(xd[r]);
                else
                    s = idot8(codes, x8[r], c8[r]), d = d8[r];
                if constexpr (FOLD == FOLDED)
                    acc[r][j] = fmadd(to_floats(s), sw, acc[r][j]);
                else
                    acc[r][j] = fmadd(to_floats(s), PLAIN ? d : fmul(d, sw), acc[r][j]);
            }
        }
    };
    for (int64_t c = 0; c < full; ++c) step(c, std::false_type{});
    if (full < a.chunks) step(full, std::true_type{});
}

// sum(z[i] s[i]) over n (whole LANES) in lanes still to be summed.
inline LaneFloats dot_lanes(const float* z, const float* s, int64_t n) {
    LaneFloats t{};
    for (int64_t i = 0; i < n; i += LANES) t = fmadd(load_floats(z + i), load_floats(s + i), t);
    return t;
}

inline void prefetch_row(const void* p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(static_cast<const char*>(p) + at, 0, 3);
}

template <int PER_SUPER, typename T>
inline void two_level(const T* top, const int8_t* sub, int64_t groups, float* out) {
    for (int64_t s = 0; s < groups / PER_SUPER; ++s) {
        const float t = widen_half(top[s]);
#if defined(__AVX2__)  // GCC leaves the plain loop scalar
        for (int i = 0; i < PER_SUPER; i += 8) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sub + s * PER_SUPER + i)));
            _mm256_storeu_ps(out + s * PER_SUPER + i, _mm256_mul_ps(_mm256_set1_ps(t), _mm256_cvtepi32_ps(q)));
        }
#else
        for (int i = 0; i < PER_SUPER; ++i) out[s * PER_SUPER + i] = t * float(sub[s * PER_SUPER + i]);
#endif
    }
}

// n fp16 values widened (GCC leaves the plain loop a call per value).
inline void widen_halves(const _Float16* p, int64_t n, float* out) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
    for (; i < n; ++i) out[i] = widen_half(p[i]);
}

// One row's factor per group: the top-level float per `per_super` groups, times the int8 sub-factor.
template <typename T>
inline void group_factors(const T* top, const int8_t* sub, int64_t groups, int per_super, float* out) {
    if (!sub && per_super == 1) {  // a loop, not memcpy: a call costs as much as a short row's copy
        if constexpr (std::is_same_v<T, _Float16>) return widen_halves(top, groups, out);
#pragma omp simd
        for (int64_t i = 0; i < groups; ++i) out[i] = float(top[i]);
        return;
    }
    if (sub && per_super == 8) return two_level<8>(top, sub, groups, out);  // Q4_K, Q5_K
    if (sub && per_super == 16) return two_level<16>(top, sub, groups, out);  // Q6_K
    for (int64_t i = 0; i < groups; ++i) out[i] = widen_half(top[i / per_super]) * (sub ? float(sub[i]) : 1.0f);
}

// The same for a row of `w`'s scales (or offsets) at `tops`, fp32 or fp16 (per_super 1: the tops alone).
inline void group_factors(const QuantizedWeight& w, const void* tops, const int8_t* sub, int64_t groups, int per_super,
                          float* out) {
    if (w.half_factors)
        group_factors(static_cast<const _Float16*>(tops), sub, groups, per_super, out);
    else
        group_factors(static_cast<const float*>(tops), sub, groups, per_super, out);
}

// A weight row's group scales (groups of XBLOCK inputs) times the block scales of x's one row, in
// the lanes' unit.
template <int BITS>
inline void fold_block_scales(float* g, const float* bd, int64_t groups) {
#pragma omp simd
    for (int64_t i = 0; i < groups; ++i) g[i] *= bd[i] * LANE_UNIT<BITS>;
}

// NBT weight rows from o against every row of x: the group scales (and offsets) of those rows made
// once into `gs` and `zs`, then the x rows RB at a time. `tile`: the rows of a whole tile (prefetches).
template <int NBT, int BITS, bool PLAIN, int FOLD>
inline void irows(const RoundedRows& a, int64_t m, const QuantizedWeight& w, int64_t o, float* y, int64_t ys,
                  const float* bias, float* gs, float* zs, int64_t gstride, int tile) {
    const int64_t groups = a.groups;
    if constexpr (!PLAIN) {
        // The scales and offsets are streams of their own, a few lines per row: fetched a few tiles
        // ahead like the codes (the loads of the factors below missed the cache without it).
        const int64_t ahead = o + 2 * PREFETCH_ROWS, fbytes = w.half_factors ? 2 : 4;
        const char* scales = static_cast<const char*>(w.scale);
        const char* offsets = static_cast<const char*>(w.offset);
        if (ahead + NBT <= w.n)
            for (int j = 0; j < NBT; ++j) {
                prefetch_row(scales + (ahead + j) * w.scale_stride * fbytes, (groups / w.per_super) * fbytes);
                if (w.scale_sub) prefetch_row(w.scale_sub + (ahead + j) * w.scale_sub_stride, groups);
                if (w.offset)
                    prefetch_row(offsets + (ahead + j) * w.offset_stride * fbytes, (groups / w.per_super) * fbytes);
                if (w.offset_sub) prefetch_row(w.offset_sub + (ahead + j) * w.offset_sub_stride, groups);
            }
        for (int j = 0; j < NBT; ++j) {
            const int64_t row = o + j;
            group_factors(w, scales + row * w.scale_stride * fbytes,
                          w.scale_sub ? w.scale_sub + row * w.scale_sub_stride : nullptr, groups, w.per_super,
                          gs + j * gstride);
            if constexpr (FOLD != UNFOLDED) fold_block_scales<BITS>(gs + j * gstride, a.bd, groups);
            if (w.offset)
                group_factors(w, offsets + row * w.offset_stride * fbytes,
                              w.offset_sub ? w.offset_sub + row * w.offset_sub_stride : nullptr, groups, w.per_super,
                              zs + j * gstride);
        }
    }
    Ahead ahead = ahead_of(w, o, tile);
    auto finish = [&](auto rb, int64_t r0) {
        constexpr int RB = decltype(rb)::value;
        LaneFloats acc[RB][NBT];
        itile<NBT, RB, BITS, PLAIN, FOLD>(a, r0, w, o, gs, gstride, acc, ahead);
        ahead.lines = 0;  // fetched once
        for (int r = 0; r < RB; ++r)
            for (int j = 0; j < NBT; ++j) {
                LaneFloats lanes = acc[r][j];
                if (!PLAIN && w.offset)  // one horizontal sum for both
                    lanes -= dot_lanes(zs + j * gstride, a.sum + (r0 + r) * a.sum_stride, a.sum_stride);
                float v = lane_sum(lanes);
                if constexpr (PLAIN) v *= top_factor(w.scale, (o + j) * w.scale_stride, w.half_factors);
                y[(r0 + r) * ys + o + j] = bias ? v + bias[o + j] : v;
            }
    };
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) finish(std::integral_constant<int, 4>{}, r);
    for (; r + 2 <= m; r += 2) finish(std::integral_constant<int, 2>{}, r);
    for (; r < m; ++r) finish(std::integral_constant<int, 1>{}, r);
}

// Buffers reused from call to call by the calling thread (the team writes into them).
struct RoundingBuffers {
    std::vector<int8_t> q;
    std::vector<float> d, bd, sum;
    std::vector<int32_t> corr;
    std::vector<int16_t> gsum;  // the two-level path's
};

// Each chunk's first group and each lane's group less that one: the same for every call on rows of
// k inputs in groups of `group`, so made once per shape by each calling thread (the divisions cost
// as much as rounding the activations when made per call).
struct LaneGroups {
    int64_t k, group;
    std::vector<int32_t> lane;
    std::vector<int64_t> first;
};

template <int BITS>
const LaneGroups& lane_groups(int64_t k, int64_t group) {
    constexpr int C = CHUNK<BITS>;
    constexpr size_t SHAPES = 64;  // more than a model has; past it the tables start again
    static thread_local std::deque<LaneGroups> made;
    for (const LaneGroups& t : made)
        if (t.k == k && t.group == group) return t;
    if (made.size() == SHAPES) made.clear();
    const int64_t chunks = (k + C - 1) / C;
    LaneGroups& t = made.emplace_back(LaneGroups{k, group, std::vector<int32_t>(chunks * LANES), {}});
    for (int64_t c = 0; c < chunks; ++c) {
        t.first.push_back(c * C / group);
        for (int l = 0; l < LANES; ++l)
            t.lane[c * LANES + l] = int32_t((c * C + pos_input<BITS>(4 * l)) / group - t.first[c]);
    }
    return t;
}

// One weight of a product by several side by side (a merged projection's q, k and v; gate and up):
// its outputs start at column `col` of y.
struct StackPart {
    const QuantizedWeight* w;
    int64_t col;
};
constexpr int64_t MAX_STACK = 8;

// TILE-row tiles of every part shared out in one parallel region, after the rows of x up to `rounded`
// were rounded by the caller (`round(r)` rounds row r in the team): `prepare()` once per thread,
// then `rows(w, o, width, y_of_part)` per tile, a width of TILE (or 1, for each row of a ragged end).
template <int TILE, class Round, class Prepare, class Rows>
void share_tiles(int64_t m, int64_t rounded, const StackPart* parts, int64_t count, float* y, int threads,
                 const Round& round, const Prepare& prepare, const Rows& rows) {
    int64_t first[MAX_STACK + 1] = {0}, work = 0;  // each part's first tile
    for (int64_t p = 0; p < count; ++p) {
        first[p + 1] = first[p] + (parts[p].w->n + TILE - 1) / TILE;
        work += m * parts[p].w->n * parts[p].w->k;
    }
    const int64_t tiles = first[count];
#pragma omp parallel num_threads(threads) if (work >= MIN_PARALLEL_LINEAR)
    {
        if (rounded < m) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; ++r) round(r);
        }
        prepare();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            int64_t p = 0;
            while (t >= first[p + 1]) ++p;
            const QuantizedWeight& w = *parts[p].w;
            float* yp = y + parts[p].col;
            const int64_t o = (t - first[p]) * TILE;
            if (o + TILE <= w.n) {
                rows(w, o, std::integral_constant<int, TILE>{}, yp);
            } else {
                for (int64_t j = o; j < w.n; ++j) rows(w, j, std::integral_constant<int, 1>{}, yp);
            }
        }
    }
}

// The product of TILE-row tiles of every part (share_tiles), each thread's group factors for its
// tile kept from call to call in buffers of its own, zeros past the groups. `bias`: a single part's
// (a stack's is added by the caller).
template <int BITS, bool PLAIN, int TILE, int FOLD, class Round>
void multiply(const RoundedRows& a, int64_t m, int64_t rounded, const StackPart* parts, int64_t count,
              const float* bias, float* y, int64_t ys, int threads, const Round& round) {
    const bool offsets = parts[0].w->offset;  // the parts agree (neuron_qlinear_int_stack checks)
    // a chunk's spread reads up to LANES scales from its first group, dot_lanes sum_stride offsets
    const int64_t gstride = a.sum_stride + LANES;
    static thread_local std::vector<float> gs, zs;  // (each thread of the team sees its own)
    share_tiles<TILE>(
        m, rounded, parts, count, y, threads, round,
        [&] {
            gs.assign(PLAIN ? 0 : TILE * gstride, 0.0f);
            zs.assign(offsets && !PLAIN ? TILE * gstride : 0, 0.0f);
        },
        [&](const QuantizedWeight& w, int64_t o, auto width, float* yp) {
            irows<decltype(width)::value, BITS, PLAIN, FOLD>(a, m, w, o, yp, ys, bias, gs.data(), zs.data(), gstride,
                                                            TILE);
        });
}

// x times the parts side by side, x rounded once for all of them (they share k, the groups and
// whether they have offsets).
template <int BITS, bool PLAIN>
void qlinear_int(const float* x, int64_t m, int64_t xs, const StackPart* parts, int64_t count, const float* bias,
                 float* y, int64_t ys, int threads) {
    constexpr int C = CHUNK<BITS>;
    const QuantizedWeight& w = *parts[0].w;
    static thread_local RoundingBuffers buf;
    const int64_t chunks = (w.k + C - 1) / C, groups = w.k / w.group;
    const int64_t sum_stride = (groups + LANES - 1) / LANES * LANES;
    const bool corr = VNNI && BITS == 8, sums = w.offset && !PLAIN;
    buf.q.resize(m * chunks * C);
    buf.d.resize(m * chunks * LANES);
    buf.bd.resize(m * chunks * (C / XBLOCK));
    buf.corr.resize(corr ? m * chunks * LANES : 0);
    buf.sum.resize(sums ? m * sum_stride : 0);
    const LaneGroups& lanes = lane_groups<BITS>(w.k, w.group);
    const RoundedRows a{chunks, groups, sum_stride, buf.q.data(), buf.d.data(), buf.bd.data(),
                        corr ? buf.corr.data() : nullptr, sums ? buf.sum.data() : nullptr, lanes.lane.data(),
                        lanes.first.data()};
    auto round = [&](int64_t r) {
        round_row<BITS>(x + r * xs, w.k, w.group, const_cast<int8_t*>(a.q) + r * chunks * C,
                        const_cast<float*>(a.d) + r * chunks * LANES,
                        const_cast<float*>(a.bd) + r * chunks * (C / XBLOCK),
                        corr ? const_cast<int32_t*>(a.corr) + r * chunks * LANES : nullptr,
                        sums ? const_cast<float*>(a.sum) + r * sum_stride : nullptr, sum_stride, chunks);
    };
    // (the team's threads see their own `buf`: they reach the caller's through `a` alone)
    // A few rows are rounded before the team starts: a barrier between rounding and multiplying
    // costs more than the rounding on cores shared with other work.
    const int64_t rounded = m * w.k <= MIN_PARALLEL_ROUNDING ? m : 0;
    for (int64_t r = 0; r < rounded; ++r) round(r);
    if constexpr (BITS == 4)
        if (m >= 4)
            return multiply<BITS, PLAIN, WIDE_INB, UNFOLDED>(a, m, rounded, parts, count, bias, y, ys, threads, round);
    if constexpr (!PLAIN)
        if (m == 1 && w.group == XBLOCK) {
            if (BITS == 8 && w.group == C)
                return multiply<BITS, PLAIN, INB, FOLDED_ONE>(a, m, rounded, parts, count, bias, y, ys, threads, round);
            return multiply<BITS, PLAIN, INB, FOLDED>(a, m, rounded, parts, count, bias, y, ys, threads, round);
        }
    multiply<BITS, PLAIN, INB, UNFOLDED>(a, m, rounded, parts, count, bias, y, ys, threads, round);
}

// ---------------------------------------------------------------------------------------------
// Two-level weights (GGUF's K-quants and IQ4_XS) at a few rows, in builds without VNNI. Their groups
// of 16 or 32 have int8 sub-scales (and sub-offsets) under one float per 256 inputs. With the
// activations rounded under one scale per SUPER (256) inputs rather than per 32, as llama.cpp's Q8_K
// rounds them, the sub-scales multiply in integers: madd takes each lane's sub-scale where the path
// above takes ones, the lanes sum a super-block in 32 bits, and their conversion and scaling (the
// super-block's float times x's scale) come once per 256 inputs. The path above pays a conversion, a
// multiply of the block's and the group's scales and an FMA per register, and makes every weight
// row's group factors. The offsets (float x sub-offset per group) meet each group's integer sum of
// the rounded x, a madd per super-block. Bounds: a lane's pairs add to at most 2 x 2 x 15 x 127 =
// 7,620 (4-bit codes) or 2 x 128 x 127 = 32,512 (int8) in 16 bits, times a sub-scale of at most 128
// in magnitude, two to a lane: under 2^24 a register, and at most eight registers to a super-block.
// The cost is the rounding: its error follows the largest |x| of 256 inputs, not of 32
// (tests/test_quant_int.py states the bound). With VNNI, dpbusd adds four products straight into 32
// bits, with no 16-bit step for the sub-scale, and the path is not built.
#if !defined(NEURON_INT_VNNI) && (defined(NEURON_INT_AVX512) || defined(NEURON_INT_AVX2))
#define NEURON_INT_SUPER 1
#endif
constexpr int SUPER = 256;  // inputs under one activation scale on the two-level path
constexpr int SUPER_ROWS = 4;  // rows of x it takes fewer of (from four on, the WIDE_INB tiles above)

// 4-bit codes in groups of 32, int8 codes in groups of 16 or 32, sub-factors under a float per SUPER
// inputs, in whole super-blocks.
inline bool super_layout(const QuantizedWeight& w) {
#if defined(NEURON_INT_SUPER)
    const bool groups = w.bits == 4 ? w.group == 32 : w.group == 16 || w.group == 32;
    return groups && !w.fp8 && w.group * w.per_super == SUPER && w.scale_sub && w.k % SUPER == 0 &&
           (!w.offset || w.offset_sub);
#else
    (void)w;
    return false;
#endif
}

#if defined(NEURON_INT_SUPER)
// x's rows rounded for the two-level path.
struct SuperRows {
    int64_t k;
    const int8_t* q;       // [m][k] in the chunk order of the codes' width
    const float* d;        // [m][k / SUPER]: each super-block's scale
    const int16_t* gsum;   // [m][k / group]: each group's sum of the rounded x (at most 32 x 127)
};

template <int BITS, int GROUP>
inline void round_row_super(const float* x, int64_t k, int8_t* q, float* d, int16_t* gsum) {
    constexpr int C = CHUNK<BITS>, BLOCKS = SUPER / XBLOCK;
    for (int64_t s = 0; s < k / SUPER; ++s) {
        const float* xs = x + s * SUPER;
        float amax = 0.0f;
        for (int b = 0; b < BLOCKS; ++b) amax = std::max(amax, block_amax(xs + b * XBLOCK));
        d[s] = amax / 127.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int b = 0; b < BLOCKS; ++b) {
            int8_t rounded[XBLOCK];
            int32_t halves[2];
            round_with(xs + b * XBLOCK, inv, rounded, halves);
            const int64_t at = s * SUPER + b * XBLOCK;
            int8_t* qc = q + at / C * C;
            std::memcpy(qc + chunk_pos<BITS>(at % C), rounded, 16);
            std::memcpy(qc + chunk_pos<BITS>(at % C + 16), rounded + 16, 16);
            if constexpr (GROUP == 16) {
                gsum[2 * (at / XBLOCK)] = int16_t(halves[0]);
                gsum[2 * (at / XBLOCK) + 1] = int16_t(halves[1]);
            } else {
                gsum[at / XBLOCK] = int16_t(halves[0] + halves[1]);
            }
        }
    }
}

// For each register of codes in a super-block, the bytes that shuffle_bytes takes to put each lane's
// group's sub-scale in both 16-bit halves of the lane, from the eight sub-scales (words_in_quads) of
// the run of eight groups that holds the register's.
template <int BITS, int GROUP>
struct SubShuffles {
    static constexpr int REGS = SUPER / CHUNK<BITS>;
    alignas(64) int8_t at[REGS][REG_BYTES];
    SubShuffles() {
        for (int c = 0; c < REGS; ++c)
            for (int b = 0; b < REG_BYTES; ++b)
                at[c][b] = int8_t(2 * ((c * CHUNK<BITS> + pos_input<BITS>(b / 4 * 4)) / GROUP % 8) + b % 2);
    }
};
template <int BITS, int GROUP>
const SubShuffles<BITS, GROUP> sub_shuffles;

// Eight int8 values widened to int16, in every 128 bits of a register (for shuffle_bytes).
inline Bytes words_in_quads(const int8_t* p) { return in_quads(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p))); }

// N (8 or 16) int8 sub-offsets times N int16 sums, in pairs into the first N / 2 lanes (the rest 0).
template <int N>
inline LaneInts group_dot(const int8_t* m, const int16_t* g) {
    if constexpr (N == 8)
        return zero_extended(
            _mm_madd_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)m)), _mm_loadu_si128((const __m128i*)g)));
    else
        return zero_extended(_mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)m)),
                                               _mm256_loadu_si256((const __m256i*)g)));
}

// y[r][o + j] for every row of x (fewer than SUPER_ROWS) and NBT weight rows from o, plus bias.
// `tops`: room for 2 x NBT x the super-blocks (the rows' scales, then their offsets).
template <int NBT, int BITS, int GROUP>
inline void super_rows(const SuperRows& a, int64_t m, const QuantizedWeight& w, int64_t o, float* y, int64_t ys,
                       const float* bias, float* tops, Ahead ahead) {
    constexpr int C = CHUNK<BITS>, PER = SUPER / C;  // registers of codes a super-block
    constexpr int GROUPS = SUPER / GROUP, PER_WORDS = 8 * GROUP / C;  // registers a load of sub-scales serves
    const int64_t supers = w.k / SUPER, fbytes = w.half_factors ? 2 : 4;
    float* mins = tops + NBT * supers;
    const uint8_t* rows[NBT];
    const int8_t* subs[NBT];
    const int8_t* msubs[NBT];
    for (int j = 0; j < NBT; ++j) {
        const int64_t row = o + j;
        rows[j] = w.codes + row * w.code_stride;
        subs[j] = w.scale_sub + row * w.scale_sub_stride;
        group_factors(w, static_cast<const char*>(w.scale) + row * w.scale_stride * fbytes, nullptr, supers, 1,
                      tops + j * supers);
        if (w.offset) {
            msubs[j] = w.offset_sub + row * w.offset_sub_stride;
            group_factors(w, static_cast<const char*>(w.offset) + row * w.offset_stride * fbytes, nullptr, supers, 1,
                          mins + j * supers);
        }
    }
    const auto& shuffles = sub_shuffles<BITS, GROUP>;
    int64_t line = 0;
    for (int64_t r = 0; r < m; ++r) {
        const int8_t* xq = a.q + r * a.k;
        const float* xd = a.d + r * supers;
        const int16_t* xg = a.gsum + r * supers * GROUPS;
        LaneFloats acc[NBT];
        for (int j = 0; j < NBT; ++j) acc[j] = LaneFloats{};
        for (int64_t s = 0; s < supers; ++s) {
            for (int p = 0; p < ahead.per_step * PER; ++p)
                if (line < ahead.lines) __builtin_prefetch(ahead.next + 64 * line++, 0, 3);
            for (int j = 0; j < NBT; ++j) {
                Bytes by;
                LaneInts sum{};
                for (int c = 0; c < PER; ++c) {
                    if (c % PER_WORDS == 0) by = words_in_quads(subs[j] + s * GROUPS + c / PER_WORDS * 8);
                    const int64_t at = s * PER + c;
                    const Bytes codes = load_codes<false>(rows[j] + at * REG_BYTES, 0);
                    const Bytes scales = shuffle_bytes(by, load_x(shuffles.at[c]));
                    if constexpr (BITS == 4) {
                        Bytes lo, hi;
                        nibbles(codes, lo, hi);
                        sum = add_ints(sum, idot4_by(lo, hi, load_x(xq + at * C), load_x(xq + at * C + REG_BYTES),
                                                     scales));
                    } else {
                        sum = add_ints(sum, idot8_by(codes, load_x(xq + at * C), scales));
                    }
                }
                acc[j] = fmadd(to_floats(sum), splat(xd[s] * tops[j * supers + s]), acc[j]);
                if (w.offset)  // each group's sub-offset times its sum of x, in pairs of groups a lane
                    acc[j] = fnmadd(to_floats(group_dot<GROUPS>(msubs[j] + s * GROUPS, xg + s * GROUPS)),
                                    splat(xd[s] * mins[j * supers + s]), acc[j]);
            }
        }
        for (int j = 0; j < NBT; ++j) {
            const float v = lane_sum(acc[j]);
            y[r * ys + o + j] = bias ? v + bias[o + j] : v;
        }
    }
}

template <int BITS, int GROUP>
void qlinear_super(const float* x, int64_t m, int64_t xs, const StackPart* parts, int64_t count, const float* bias,
                   float* y, int64_t ys, int threads) {
    const int64_t k = parts[0].w->k, supers = k / SUPER;
    static thread_local RoundingBuffers buf;
    buf.q.resize(m * k);
    buf.d.resize(m * supers);
    buf.gsum.resize(m * (k / GROUP));
    const SuperRows a{k, buf.q.data(), buf.d.data(), buf.gsum.data()};
    auto round = [&](int64_t r) {
        round_row_super<BITS, GROUP>(x + r * xs, k, const_cast<int8_t*>(a.q) + r * k,
                                     const_cast<float*>(a.d) + r * supers,
                                     const_cast<int16_t*>(a.gsum) + r * (k / GROUP));
    };
    const int64_t rounded = m * k <= MIN_PARALLEL_ROUNDING ? m : 0;  // as qlinear_int
    for (int64_t r = 0; r < rounded; ++r) round(r);
    static thread_local std::vector<float> tops;
    share_tiles<INB>(
        m, rounded, parts, count, y, threads, round, [&] { tops.resize(2 * INB * supers); },
        [&](const QuantizedWeight& w, int64_t o, auto width, float* yp) {
            super_rows<decltype(width)::value, BITS, GROUP>(a, m, w, o, yp, ys, bias, tops.data(),
                                                             ahead_of(w, o, INB));
        });
}
#endif

inline bool plain_layout(const QuantizedWeight& w) { return w.group == w.k && !w.offset && !w.scale_sub; }

// Which of the kernel's variants multiplies `count` parts, or -1 where they need different ones or
// different roundings of x: 0 4-bit codes, 1 int8 with one scale per row, 2 int8 with groups; where
// super_layout, at fewer than SUPER_ROWS rows the two-level path (above them 0's and 2's): 3 4-bit
// codes, 4 int8 in groups of 16, 5 int8 in groups of 32.
inline int variant(const StackPart* parts, int64_t count) {
    const QuantizedWeight& w = *parts[0].w;
    const int v = w.bits == 4         ? (super_layout(w) ? 3 : 0)
                  : plain_layout(w)   ? 1
                  : super_layout(w)   ? (w.group == 16 ? 4 : 5)
                                      : 2;
    for (int64_t p = 1; p < count; ++p) {
        const QuantizedWeight& o = *parts[p].w;
        if (o.bits != w.bits || o.fp8 || o.k != w.k || o.group != w.group || !o.offset != !w.offset ||
            plain_layout(o) != plain_layout(w) || super_layout(o) != super_layout(w))
            return -1;
    }
    return w.fp8 ? -1 : v;
}

void qlinear_int_parts(const float* x, int64_t m, int64_t xs, const StackPart* parts, int64_t count,
                       const float* bias, float* y, int64_t ys, int threads, int v) {
#if defined(NEURON_INT_SUPER)
    if (v >= 3 && m < SUPER_ROWS) {
        if (v == 3) return qlinear_super<4, 32>(x, m, xs, parts, count, bias, y, ys, threads);
        if (v == 4) return qlinear_super<8, 16>(x, m, xs, parts, count, bias, y, ys, threads);
        return qlinear_super<8, 32>(x, m, xs, parts, count, bias, y, ys, threads);
    }
#endif
    if (v == 0 || v == 3)
        qlinear_int<4, false>(x, m, xs, parts, count, bias, y, ys, threads);
    else if (v == 1)
        qlinear_int<8, true>(x, m, xs, parts, count, bias, y, ys, threads);
    else
        qlinear_int<8, false>(x, m, xs, parts, count, bias, y, ys, threads);
}

}  // namespace

extern "C" {

// As neuron_qlinear, for int8 and 4-bit codes (not FP8), k a multiple of 32; the caller
// (quantized.py) checks.
void neuron_qlinear_int(const float* x, int64_t m, int64_t xs, const QuantizedWeight* w, const float* bias, float* y,
                        int64_t ys, int threads) {
    const StackPart part{w, 0};
    qlinear_int_parts(x, m, xs, &part, 1, bias, y, ys, threads, variant(&part, 1));
}

// The inputs under one activation scale where neuron_qlinear_int multiplies `rows` rows by W: SUPER on
// the two-level path, else XBLOCK (the tests round x as the kernel does).
int neuron_qlinear_int_block(const QuantizedWeight* w, int64_t rows) {
    return super_layout(*w) && rows < SUPER_ROWS ? SUPER : XBLOCK;
}

// y [m, sum of the parts' n] = x times `count` weights side by side, each as neuron_qlinear_int
// multiplies it, bit for bit, in one call: x rounded once and every part's tiles shared out in
// one parallel region, where a call per part rounds x again and starts and joins the team again
// (a merged q/k/v projection read from a GGUF file is three weights). Returns 1, having done
// nothing, where the parts differ in what the rounding or the kernel's variant depends on (their
// codes, inputs, groups or offsets) or are more than MAX_STACK; the caller then goes part by part.
int neuron_qlinear_int_stack(const float* x, int64_t m, int64_t xs, const QuantizedWeight* const* ws,
                             int64_t count, float* y, int64_t ys, int threads) {
    if (count < 1 || count > MAX_STACK) return 1;
    StackPart parts[MAX_STACK];
    int64_t col = 0;
    for (int64_t p = 0; p < count; ++p) {
        parts[p] = StackPart{ws[p], col};
        col += ws[p]->n;
    }
    const int v = variant(parts, count);
    if (v < 0) return 1;
    qlinear_int_parts(x, m, xs, parts, count, nullptr, y, ys, threads, v);
    return 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Steps of many rows (prefill chunks, large decode batches) with the activations rounded as above:
// `neuron_qlinear_int_many`, under AVX-512 or AVX-VNNI (see ManyRegs). The decode kernel streams each weight
// row past a few rows of x; here the arithmetic binds, so each thread repacks one panel of MANY_PN
// outputs at a time into a buffer of its own, [k / 4][MANY_PN][4 codes] as unsigned bytes (4-bit
// codes as they are, int8 codes with 128 added) beside [groups][MANY_PN] scales and offsets, and
// multiplies its share of rows into it while it is in cache: a tile of MANY_RB rows x MANY_PN
// outputs takes one dpbusd per row, register of outputs and 4 inputs (four multiply-adds a lane),
// where an fp32 FMA does one. Each block of 32 inputs is summed in integers, less 128 times the
// block's rounded x for int8 codes, then converted and scaled once by its block's d and its group's
// scale; the offset is subtracted per block as z times d times the block's rounded sum (the decode
// kernel's arithmetic, summed in another order). Groups of 16 (Q6_K, Q3_K, Q2_K: int8 codes) are
// summed and scaled per half block instead (SUB 16): the same integer products, with twice the
// conversions and scalings, against each half's own sum of rounded x for the offsets.
namespace {

// The registers of a tile: AVX-512's (16 lanes, 6 rows) or, with AVX-VNNI and no AVX-512 (Intel's
// cores since Alder Lake, and any AVX-512 CPU's AVX2 build), AVX2's (8 lanes, 3 rows in 16
// registers). `dot` is one dpbusd under VNNI. AVX-512 without VNNI (Skylake-SP) takes 4-bit codes
// only: maddubs sums each pair of code x activation products into 16 bits (at most 2 x 15 x 127),
// a block's eight steps are added in 16 bits (at most 30,480) and one madd widens them; int8 codes
// would saturate maddubs and keep the panels. AVX2 without VNNI has no tile of its own: the same
// 4-bit tile at that width was no faster than the decode kernel, which beats the panels there at
// every row count (one SmolLM2-shaped layer, 512 rows: Q4_K 14.6 against 20.0 ms), so its 4-bit
// steps of many rows go through the decode kernel (NEURON_INT_MANY_DECODE).
#if defined(NEURON_INT_AVX512)
#define NEURON_INT_MANY 1
struct ManyRegs {
    static constexpr int LANES = 16, ROWS = 6;  // 12 integer and 12 float accumulators, 2 codes, the broadcast
    static constexpr bool VNNI_DOT = VNNI;
    typedef __m512i I;
    typedef __m512 F;
    static I load(const void* p) { return _mm512_loadu_si512(p); }
    static I set1(int32_t v) { return _mm512_set1_epi32(v); }
#if defined(NEURON_INT_VNNI)
    static I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
#endif
    static I pairs(I acc16, I w, I x) { return _mm512_add_epi16(acc16, _mm512_maddubs_epi16(w, x)); }
    static I widen(I acc16) { return _mm512_madd_epi16(acc16, _mm512_set1_epi16(1)); }
    static F floats(I v) { return _mm512_cvtepi32_ps(v); }
    static F loadf(const float* p) { return _mm512_loadu_ps(p); }
    static F set1f(float v) { return _mm512_set1_ps(v); }
    static F zero() { return _mm512_setzero_ps(); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
    static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#elif defined(NEURON_INT_AVX2) && defined(__AVXVNNI__) && !defined(__AVX512F__)
#define NEURON_INT_MANY 1
struct ManyRegs {
    static constexpr int LANES = 8, ROWS = 3;  // 6 + 6 accumulators, 2 codes, the broadcast: 15 of 16
    static constexpr bool VNNI_DOT = true;
    typedef __m256i I;
    typedef __m256 F;
    static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
    static I set1(int32_t v) { return _mm256_set1_epi32(v); }
    static I dot(I acc, I w, I x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
    static F floats(I v) { return _mm256_cvtepi32_ps(v); }
    static F loadf(const float* p) { return _mm256_loadu_ps(p); }
    static F set1f(float v) { return _mm256_set1_ps(v); }
    static F zero() { return _mm256_setzero_ps(); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
    static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#elif defined(NEURON_INT_AVX2) && !defined(__AVX512F__)
#define NEURON_INT_MANY_DECODE 1
#endif

// Whether W's codes take the integer path for many rows: 4-bit codes in groups of 32, and with VNNI
// int8 codes in groups of 16 or more.
inline bool many_codes(const QuantizedWeight& w, bool vnni) {
    const bool codes = w.bits == 4 ? w.group % 32 == 0 : vnni && w.bits == 8 && w.group % 16 == 0;
    return !w.fp8 && codes && w.k % 32 == 0 && w.k % w.group == 0 && w.k > 0;
}

#if defined(NEURON_INT_MANY)
constexpr int MANY_PN = 2 * ManyRegs::LANES;  // outputs of a panel: two registers of lanes
constexpr int MANY_RB = ManyRegs::ROWS;
static_assert(ManyRegs::LANES == VL, "a panel's words transpose in blocks of the build's vector width");

struct ManyRows {  // x rounded: per row, k codes, per block of 32 its d, per sub-block its codes' sum
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> sum;  // [rows][subs]: per block of 32, or per half block where W's groups are 16
    int64_t blocks = 0, subs = 0;
};

struct ManyPanel {  // one panel of W repacked
    std::vector<uint8_t> codes;
    std::vector<float> scale, offset;
};

inline bool many_takes(const QuantizedWeight& w) { return many_codes(w, ManyRegs::VNNI_DOT); }

// Inputs summed in integers before a scaling: a block of 32, or half of one where W's groups are 16.
inline int many_sub(const QuantizedWeight& w) { return w.group % 32 == 0 ? 32 : 16; }

// Weight rows [o, o + outputs) (outputs <= MANY_PN, the rest zero) into `p`.
inline void repack_many(const QuantizedWeight& w, int64_t o, int64_t outputs, ManyPanel& p) {
    const int64_t k = w.k, words = k / 4, groups = k / w.group;
    const int shift = __builtin_ctz(unsigned(w.per_super));
    p.codes.resize(size_t(k) * MANY_PN);
    p.scale.assign(size_t(groups) * MANY_PN, 0.0f);
    p.offset.assign(w.offset ? size_t(groups) * MANY_PN : 0, 0.0f);
    static thread_local std::vector<uint32_t> rows;  // [MANY_PN][words]: each row's bytes in input order
    rows.resize(size_t(MANY_PN) * words);
    for (int64_t j = 0; j < MANY_PN; ++j) {
        uint8_t* dst = reinterpret_cast<uint8_t*>(rows.data() + j * words);
        if (j >= outputs) {
            std::memset(dst, w.bits == 4 ? 0 : 0x80, size_t(k));  // code 0 either way
            continue;
        }
        const int64_t row = o + j;
        const uint8_t* codes = w.codes + row * w.code_stride;
        if (w.bits == 4) {
            for (int64_t b = 0; b < k; b += 32) {  // 32 inputs in 16 bytes, the first 16 in the low nibbles
                const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b / 2));
                const __m128i low = _mm_set1_epi8(15);
                _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b), _mm_and_si128(v, low));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b + 16), _mm_and_si128(_mm_srli_epi16(v, 4), low));
            }
        } else {
            for (int64_t c = 0; c < k; ++c) dst[c] = uint8_t(codes[c] ^ 0x80);
        }
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t top = g >> shift;
            p.scale[g * MANY_PN + j] = group_factor(w.scale, w.half_factors, w.scale_stride, w.scale_sub,
                                                    w.scale_sub_stride, row, g, top);
            if (w.offset)
                p.offset[g * MANY_PN + j] = group_factor(w.offset, w.half_factors, w.offset_stride, w.offset_sub,
                                                         w.offset_sub_stride, row, g, top);
        }
    }
    // words (four codes) transposed to [words][MANY_PN], VL x VL at a time
    uint32_t* out = reinterpret_cast<uint32_t*>(p.codes.data());
    int64_t c = 0;
    for (; c + VL <= words; c += VL)
        for (int jj = 0; jj < MANY_PN; jj += VL)
            transpose_block(reinterpret_cast<const float*>(rows.data() + jj * words + c), words,
                            reinterpret_cast<float*>(out + c * MANY_PN + jj), MANY_PN);
    for (; c < words; ++c)
        for (int j = 0; j < MANY_PN; ++j) out[c * MANY_PN + j] = rows[j * words + c];
}

// (V a parameter, so that only the branch for the build's kind of dot is made)
template <int RB, int SUB, typename V = ManyRegs>
inline void many_tile(const ManyRows& x, int64_t r0, const QuantizedWeight& w, const ManyPanel& p, float* y,
                      int64_t ys, int64_t cols, const float* bias) {
    constexpr int L = V::LANES, QUADS = SUB / 4;
    const int64_t k = w.k, subs = k / SUB, per_group = w.group / SUB;
    const bool signed_codes = w.bits != 4, offsets = w.offset != nullptr;
    typename V::F acc[RB][2];
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = V::zero();
    for (int64_t b = 0; b < subs; ++b) {
        typename V::I isum[RB][2];
        for (int r = 0; r < RB; ++r) {
            const int32_t start = signed_codes ? -128 * x.sum[(r0 + r) * x.subs + b] : 0;
            isum[r][0] = isum[r][1] = V::set1(start);
        }
        const uint8_t* wc = p.codes.data() + b * QUADS * MANY_PN * 4;
        for (int quad = 0; quad < QUADS; ++quad) {
            const typename V::I w0 = V::load(wc + quad * MANY_PN * 4);
            const typename V::I w1 = V::load(wc + quad * MANY_PN * 4 + L * 4);
            for (int r = 0; r < RB; ++r) {
                int32_t four;
                std::memcpy(&four, x.q.data() + (r0 + r) * k + b * SUB + quad * 4, 4);
                const typename V::I xb = V::set1(four);
                if constexpr (V::VNNI_DOT) {
                    isum[r][0] = V::dot(isum[r][0], w0, xb);
                    isum[r][1] = V::dot(isum[r][1], w1, xb);
                } else {  // 4-bit codes: the block's pairs summed in 16 bits (start 0), widened below
                    isum[r][0] = V::pairs(isum[r][0], w0, xb);
                    isum[r][1] = V::pairs(isum[r][1], w1, xb);
                }
            }
        }
        if constexpr (!V::VNNI_DOT)
            for (int r = 0; r < RB; ++r) {
                isum[r][0] = V::widen(isum[r][0]);
                isum[r][1] = V::widen(isum[r][1]);
            }
        const int64_t g = b / per_group, block = b * SUB / 32;
        const typename V::F s0 = V::loadf(p.scale.data() + g * MANY_PN);
        const typename V::F s1 = V::loadf(p.scale.data() + g * MANY_PN + L);
        for (int r = 0; r < RB; ++r) {
            const typename V::F dv = V::set1f(x.d[(r0 + r) * x.blocks + block]);
            acc[r][0] = V::fmadd(V::floats(isum[r][0]), V::mul(s0, dv), acc[r][0]);
            acc[r][1] = V::fmadd(V::floats(isum[r][1]), V::mul(s1, dv), acc[r][1]);
        }
        if (offsets) {
            const typename V::F z0 = V::loadf(p.offset.data() + g * MANY_PN);
            const typename V::F z1 = V::loadf(p.offset.data() + g * MANY_PN + L);
            for (int r = 0; r < RB; ++r) {
                const float xs_value = x.d[(r0 + r) * x.blocks + block] * float(x.sum[(r0 + r) * x.subs + b]);
                const typename V::F xs = V::set1f(xs_value);
                acc[r][0] = V::fnmadd(z0, xs, acc[r][0]);
                acc[r][1] = V::fnmadd(z1, xs, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < RB; ++r) {
        float out[MANY_PN];
        V::store(out, acc[r][0]);
        V::store(out + L, acc[r][1]);
        for (int64_t j = 0; j < cols; ++j) y[(r0 + r) * ys + j] = bias ? out[j] + bias[j] : out[j];
    }
}
#endif

}  // namespace

extern "C" {

// Whether neuron_qlinear_int_many takes W: 4-bit codes in whole groups of 32 in builds with AVX-512
// or AVX2, and int8 codes in whole groups of 16 in those with VNNI (AVX-512 VNNI or AVX-VNNI).
// quantized.py asks once per weight.
int neuron_qlinear_int_many_takes(const QuantizedWeight* w) {
#if defined(NEURON_INT_MANY)
    return many_takes(*w) ? 1 : 0;
#elif defined(NEURON_INT_MANY_DECODE)
    return many_codes(*w, false) ? 1 : 0;
#else
    (void)w;
    return 0;
#endif
}

// As neuron_qlinear_int, for steps of many rows, where neuron_qlinear_int_many_takes(w) (the caller
// checks; elsewhere it does nothing).
void neuron_qlinear_int_many(const float* x, int64_t m, int64_t xs, const QuantizedWeight* weight, const float* bias,
                             float* y, int64_t ys, int threads) {
#if defined(NEURON_INT_MANY)
    const QuantizedWeight& w = *weight;
    if (m <= 0 || !many_takes(w)) return;
    const int64_t k = w.k, n = w.n, panels = (n + MANY_PN - 1) / MANY_PN;
    const int sub = many_sub(w);
    static thread_local ManyRows rounded;  // the calling thread's; the team reads it
    rounded.blocks = k / 32;
    rounded.subs = k / sub;
    rounded.q.resize(size_t(m) * k);
    rounded.d.resize(size_t(m) * rounded.blocks);
    rounded.sum.resize(size_t(m) * rounded.subs);
    ManyRows& a = rounded;
    const bool parallel = m * n * k >= MIN_PARALLEL_LINEAR;
#pragma omp parallel num_threads(threads) if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t b = 0; b < a.blocks; ++b) {
                int32_t halves[2];
                a.d[r * a.blocks + b] = round_block(x + r * xs + b * 32, a.q.data() + r * k + b * 32, halves);
                if (sub == 16) {
                    a.sum[r * a.subs + 2 * b] = halves[0];
                    a.sum[r * a.subs + 2 * b + 1] = halves[1];
                } else {
                    a.sum[r * a.subs + b] = halves[0] + halves[1];
                }
            }
        static thread_local ManyPanel panel;
        int64_t held = -1;  // the panel in `panel`
        thread_share(panels, m, [&](int64_t u, int64_t r0, int64_t rows) {
            const int64_t o = u * MANY_PN, cols = std::min<int64_t>(MANY_PN, n - o);
            if (u != held) {
                repack_many(w, o, cols, panel);
                held = u;
            }
            const float* b = bias ? bias + o : nullptr;
            row_tiles<MANY_RB>(rows, [&](int64_t r, auto rb) {
                if (sub == 16)
                    many_tile<decltype(rb)::value, 16>(a, r0 + r, w, panel, y + o, ys, cols, b);
                else
                    many_tile<decltype(rb)::value, 32>(a, r0 + r, w, panel, y + o, ys, cols, b);
            });
        });
    }
#elif defined(NEURON_INT_MANY_DECODE)
    if (m > 0 && many_codes(*weight, false)) neuron_qlinear_int(x, m, xs, weight, bias, y, ys, threads);
#else
    (void)x, (void)m, (void)xs, (void)weight, (void)bias, (void)y, (void)ys, (void)threads;
#endif
}

}  // extern "C"
