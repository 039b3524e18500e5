// cuda/: the CUDA backend, a captured CUDA graph per guard key replayed from torchreplay's private
// pool (opt-in: EngineOptions.cuda_graphs; without CUDA it refuses every capture).
//
//   cuda_graph.h       the backend: its host-side plan (PlanCudaCapture, tested without a GPU in
//                      cuda_plan_test.cc), capture and replay
//
// Namespace torchreplay::capture, kept from when ir/, tape/ and cuda/ were one capture/ package.
// Depends on ir/ and memory_pool/ (the CUDA private pool), ATen and Abseil; never on tape/.
#pragma once

#include "capture/cuda/cuda_graph.h"
