// Flush-to-zero and denormals-are-zero on the calling thread while in scope (x86's MXCSR), restored
// after. Vectorized code may compute values it then discards: GCC if-converts exp's clamp into both
// branches for every lane, so SiLU-and-multiply computed gate / (1 + e^88), a denormal for most gates.
// On Intel CPUs each denormal result costs a microcode assist: that op took 4.9 ms of a 16-stream
// decode step, 0.8 ms under this (bench/README.md, "Denormals"). Values below 1.2e-38 become zero.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  static constexpr unsigned kFlushToZero = 0x8000, kDenormalsAreZero = 0x0040;
  unsigned saved_;
};
#else
struct FlushDenormals {};
#endif
