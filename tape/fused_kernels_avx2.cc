// The fused elementwise kernel for ATen's AVX2 capability (flags in tape/BUILD).
#define TORCHREPLAY_FUSED_ISA avx2
#include "tape/fused_kernels_impl.h"
