// Shared by the CPU kernels (paged_attention_cpu.cpp, cpu_ops.cpp). neuron/utils/native.py keys
// each library's cache entry on the headers of this folder too, so a change here rebuilds both.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// 2^x for x <= 0 (softmax exponents, already in base 2), vectorisable: split x into an integer n
// and a fraction f in [-0.5, 0.5], a degree-6 polynomial for 2^f (relative error ~2e-7), and n
// added to the float's exponent. Below -126 (a masked key's -inf included) the result is 0: a
// score that far below the row's maximum contributes nothing in fp32.
#pragma omp declare simd
inline float exp2_neg(float x_in) {
    const float x = std::max(x_in, -126.0f);
    float n = std::nearbyint(x);
    float f = x - n;
    float p = 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6184355e-3f;
    p = p * f + 5.5503366e-2f;
    p = p * f + 2.4022648e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    std::memcpy(&bits, &p, 4);
    bits += int32_t(n) << 23;
    std::memcpy(&p, &bits, 4);
    return x_in < -126.0f ? 0.0f : p;
}

}  // namespace
