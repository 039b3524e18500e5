// capture/tape/: the CPU backend, a tape of kernel calls captured per guard key and replayed step
// by step into arena buffers. The core here; two folders of this package:
//
//   kernel_tape.h         the backend's entry points: CaptureKernelTape, and CheckTapeNode, the
//                         check the recording run makes for the tape (RunAndRecord's `check`);
//                         emitter.cc captures (plan to steps), kernel_tape.cc replays, sharing
//                         the private kernel_tape_internal.h (Step, KernelTape)
//   tape_plan.h           everything decided per node and value at capture, printable
//   step_kinds.h          the families a node's step can be, one table: a Match the plan calls,
//                         a Make the emitter calls (Note [Step kinds]); copy_steps.cc: copies
//   typed_call.h          steps called unboxed (Note [Typed steps]), and copies
//   prepared_pointwise.h  pointwise steps, sums and means on a TensorIterator built once
//   collective_steps.h    torch.distributed's collectives as steps (Note [Collective steps])
//   check_frozen.cc       torchreplay::check_frozen, the frozen-weight check of numerics "close"
// fused/ (the fused elementwise step):
//   fused_elementwise.h   runs of elementwise nodes as one step (Note [Fused elementwise steps]);
//                         the step itself in fused_step.cc
//   fused_kernels.h       the fused step's program and kernel (fused_kernels_impl.h, compiled per
//                         instruction set in fused_kernels_avx2.cc and fused_kernels_avx512.cc)
// checked/ (kernel families checked bitwise against eager at capture):
//   conv_steps.h          checked convolutions (Note [Checked convolutions])
//   gemm_steps.h          checked matrix products (Note [Checked GEMMs])
//   lstm_steps.h          checked LSTMs (Note [Checked LSTMs]); kernel_check.h: what the checks
//                         of all three share
//
// The hand-written kernels its steps call (the small GEMM, the depthwise convolution, the GRU
// layer) are capture/kernels/. Namespace torchreplay::capture (and ::fused). Depends on
// capture/ir, capture/kernels, memory_pool (the arena), ATen and Abseil; never on capture/cuda.
#pragma once

#include "capture/tape/checked/conv_steps.h"
#include "capture/tape/checked/gemm_steps.h"
#include "capture/tape/checked/lstm_steps.h"
#include "capture/tape/collective_steps.h"
#include "capture/tape/fused/fused_elementwise.h"
#include "capture/tape/fused/fused_kernels.h"
#include "capture/tape/kernel_tape.h"
#include "capture/tape/prepared_pointwise.h"
#include "capture/tape/step_kinds.h"
#include "capture/tape/tape_plan.h"
#include "capture/tape/typed_call.h"
