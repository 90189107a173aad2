// Small vector helpers shared by the CPU kernels.
#pragma once

#include <cstdint>

// a . b over n floats, in 16 independent sums (the compiler turns them into vector lanes)
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}
