// capture/kernels/cpu_features.h: what the CPU runs, for the kernels compiled for one instruction set
// (the depthwise convolution, the small GEMM, the fused elementwise kernel), which are called only
// where it has it.
#pragma once

#include <ATen/Version.h>

namespace torchreplay::capture::kernels {

// Whether this CPU has AVX2 and FMA.
inline bool HasAvx2AndFma() {
#if defined(__x86_64__)
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return available;
#else
  return false;
#endif
}

// Whether ATen runs its AVX512 kernels (its CPU capability: the CPU's, or lower where
// ATEN_CPU_CAPABILITY says so). The kernels compiled for both pick their copy by it, as ATen's
// DispatchStub does.
inline bool AtenAvx512() {
  static const bool avx512 = at::get_cpu_capability() == "AVX512";
  return avx512;
}

}  // namespace torchreplay::capture::kernels
