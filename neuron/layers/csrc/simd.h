// What the CPU kernels (paged_attention_cpu.cpp, cpu_ops.cpp) share: one register's worth of
// floats as a vector type with its loads, stores and horizontal sum, and a vectorisable 2^x.
// neuron/utils/native.py keys each library's cache entry on the headers of this folder too, so a
// change here rebuilds both.
#pragma once

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// One register's worth of floats, VL of them (GCC splits a width the CPU lacks into the
// registers it has).
#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
typedef float vecf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t veci __attribute__((vector_size(VL * sizeof(int32_t))));  // the same lanes' bits as int32

// Asks for the cache line at p, into every level. GCC's dead-code elimination drops a
// __builtin_prefetch from a loop that does nothing else (the attention kernel's loops over a
// tile's rows had lost every one), so on x86 the instruction is written out.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
    __builtin_prefetch(p, 0, 3);
#endif
}

inline vecf vload(const float* p) {
    vecf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void vstore(float* p, vecf v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(vecf v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
    const __m256 x = reinterpret_cast<__m256>(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
#else
    float s = 0.0f;
    for (int l = 0; l < VL; ++l) s += v[l];
    return s;
#endif
}

// f(std::integral_constant<int, n>{}) for a run-time count 1 <= n <= N: a loop over a tile of n
// rows compiled for each count, so its accumulators stay in registers whatever n is.
template <int N, typename F>
inline void with_count(int64_t n, F&& f) {
    if constexpr (N > 1) {
        if (n < N) {
            with_count<N - 1>(n, f);
            return;
        }
    }
    f(std::integral_constant<int, N>{});
}

// x rounded to bf16 as torch's .to(torch.bfloat16) rounds it: to nearest even, NaN to 0x7fc0.
inline uint16_t bf16_bits(float x) {
    if (std::isnan(x)) return 0x7fc0;
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// 2^f for f in [-0.5, 0.5], a float or a vector of them: the degree-6 polynomial of exp2_neg and
// exp2_neg_v, one copy so that the two give the same bits.
template <typename T>
inline T exp2_fraction(T f) {
    T p = T{} + 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6184355e-3f;
    p = p * f + 5.5503366e-2f;
    p = p * f + 2.4022648e-1f;
    p = p * f + 6.9314718e-1f;
    return p * f + 1.0f;
}

// 2^x for x <= 0 (softmax exponents, already in base 2), vectorisable: split x into an integer n
// and a fraction f in [-0.5, 0.5], a degree-6 polynomial for 2^f (relative error ~2e-7), and n
// added to the float's exponent. Below -126 (a masked key's -inf included) the result is 0: a
// score that far below the row's maximum contributes nothing in fp32.
#pragma omp declare simd
inline float exp2_neg(float x_in) {
    const float x = std::max(x_in, -126.0f);
    float n = std::nearbyint(x);
    float f = x - n;
    float p = exp2_fraction(f);
    int32_t bits;
    std::memcpy(&bits, &p, 4);
    bits += int32_t(n) << 23;
    std::memcpy(&p, &bits, 4);
    return x_in < -126.0f ? 0.0f : p;
}

// exp2_neg on VL lanes at once, the same operations lane by lane (so the same bits), written with
// vector types: GCC left the loops around the scalar one unvectorised where it could not turn its
// selects and bit copies into masks (every AVX2 build: its softmax ran one lane at a time, a
// quarter of a prefill's attention). The rounding adds and removes 1.5 x 2^23, which leaves no
// fraction bits for |x| <= 126: nearbyint's result, ties to even.
//
// With AVX-512 the rounding is one roundscale and the exponent's addition one scalef (p x 2^n, the
// same value as adding n to p's exponent wherever the result is normal, which is every unmasked
// lane: n = -126 only where f >= 0, so p >= 1): 10 vector operations against 15, the same bits.
inline vecf exp2_neg_v(vecf x_in) {
#if defined(__AVX512F__)
    const __m512 x = reinterpret_cast<__m512>(x_in);
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);  // x >= -126, or NaN
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vecf p = exp2_fraction(x_in - reinterpret_cast<vecf>(n));
    return reinterpret_cast<vecf>(_mm512_maskz_scalef_ps(kept, reinterpret_cast<__m512>(p), n));
#else
    const vecf lowest = vecf{} - 126.0f;
    const vecf x = x_in < lowest ? lowest : x_in;
    const vecf round = vecf{} + 12582912.0f;
    const vecf n = (x + round) - round;
    const vecf f = x - n;
    const vecf p = exp2_fraction(f);
    const veci bits = reinterpret_cast<veci>(p) + (__builtin_convertvector(n, veci) << 23);
    return x_in < lowest ? vecf{} : reinterpret_cast<vecf>(bits);
#endif
}

}  // namespace
