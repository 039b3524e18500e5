// tape/cpu_features.h: what the CPU runs, for the kernels compiled for one instruction set
// (the depthwise convolution, the small GEMM), which are called only where it has it.
#pragma once

namespace torchreplay::capture {

// Whether this CPU has AVX2 and FMA.
inline bool HasAvx2AndFma() {
#if defined(__x86_64__)
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return available;
#else
  return false;
#endif
}

}  // namespace torchreplay::capture
