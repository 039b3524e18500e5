// The fused elementwise kernel for ATen's AVX512 capability (flags in tape/BUILD).
#define TORCHREPLAY_FUSED_ISA avx512
#include "tape/fused_kernels_impl.h"
