// Math the compiler vectorizes, shared by the kernels in this folder.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) in plain arithmetic the compiler vectorizes (a call to expf would not be): Cephes' expf,
// x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n through the exponent bits.
// Within 2 ulp of expf over [-87, 88]; clamped outside.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
