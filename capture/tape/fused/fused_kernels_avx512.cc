// The fused elementwise kernel for ATen's AVX512 capability (flags in capture/tape/BUILD).
#define TORCHREPLAY_FUSED_ISA avx512
#include "capture/tape/fused/fused_kernels_impl.h"
