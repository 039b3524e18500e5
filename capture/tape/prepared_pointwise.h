// capture/tape/prepared_pointwise.h: kernel tape steps for pointwise ops on a TensorIterator built once.
//
// Note [Prepared pointwise steps]
// What is left of a typed out= call on small tensors is mostly ATen building a TensorIterator:
// shapes, strides, dtypes, overlap checks, all fixed under one guard key. For the commonest
// structured pointwise ops (unary float ops, neg, silu, add/sub/mul/div, comparisons, clamp_min:
// relu) the step builds the TensorIterator once, the way the op's meta function does, and replay calls the op's
// own CPU kernel stub on it: the same kernel on the same iterator, so results are bitwise those
// of the op. Per-call tensors (same geometry under the key) are swapped in by data pointer; if a
// constant tensor moved (the arena grew for a larger key) the iterator is rebuilt. Only used when
// no operand needs a dtype cast (the iterator would hold a copy made at build time).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <memory>
#include <vector>

#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape {

// The prepared step of an out= pointwise op, wrapping its typed call `typed` (used whenever the
// iterator cannot be prepared); returns `typed` itself for any other op, or where this build
// has no prepared steps (only x86-64 builds do). `args` follow the out= schema: tensor inputs,
// [scalar], out; `slot_of[i]` is argument i's per-call slot, or -1.
std::unique_ptr<TypedCall> MakePrepared(const c10::OperatorHandle& op, const Slots& args,
                                        const std::vector<int>& slot_of,
                                        std::unique_ptr<TypedCall> typed);

// The step of torchreplay::_scaled_dot_product_flash_attention_for_cpu.out (Note [Attention on
// planned buffers] in prepared_pointwise.cc): ATen's flash attention kernel stub called on the
// planned buffers, no dispatch. nullptr where its arguments are not those of a typed step (or
// where this build has no prepared steps: the out= op runs through the dispatcher then).
std::unique_ptr<TypedCall> MakeFlashAttention(const Slots& args, const std::vector<int>& slot_of);

// The step of torchreplay::native_layer_norm.out (Note [Layer norm on planned buffers] in
// prepared_pointwise.cc): ATen's LayerNormKernel stub called on the planned buffers, no dispatch.
// nullptr where its arguments are not those of a typed step, or where this build has none.
std::unique_ptr<TypedCall> MakeLayerNorm(const Slots& args, const std::vector<int>& slot_of);

}  // namespace torchreplay::capture::tape
