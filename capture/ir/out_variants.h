// capture/ir/out_variants.h: the out= overload of a functional op, for the kernel tape's steps that
// write into planned arena buffers.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <optional>

namespace torchreplay::capture {

struct OutVariant {
  c10::OperatorHandle op;
  // An argument appended before the out= buffers, for ops whose out= form is another op's
  // (aten::relu runs as aten::clamp_min.out with min 0, exactly what ATen's relu computes).
  c10::IValue extra_arg;
};

// For a functional op with tensor returns: the overload of the same name that takes the same
// arguments plus one keyword-only `out` tensor per return (aten::add.Tensor -> aten::add.out),
// when it has a CPU kernel of its own. nullopt for mutable ops and ops without one.
std::optional<OutVariant> FindOutVariant(const c10::OperatorHandle& op);

}  // namespace torchreplay::capture
