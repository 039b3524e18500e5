// The fused elementwise kernel for ATen's AVX512 capability (flags in capture/BUILD).
#define TORCHREPLAY_FUSED_ISA avx512
#include "capture/fused_kernels_impl.h"
