// A loaded program (see torchreplay.h): the saved graph on an engine, its bound tensors, and the
// checks of what its trace assumed (replay/call_checks.h), as torchreplay.capture's Call makes
// them in Python.
#include "torchreplay/torchreplay.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "capture/ir/interpreter.h"
#include "replay/engine.h"
#include "replay/call_checks.h"
#include "torchreplay/format.h"

namespace torchreplay {

struct Program::Impl {
  std::shared_ptr<replay::Engine> engine;
  format::SavedProgram saved;
  std::vector<c10::IValue> bound;  // saved.bound's tensors, as the graph's leading inputs
};

namespace {

// A status as the c10::Error eager throws: a kernel's error of its class (Note [Kernel errors keep
// their type] in capture/ir/interpreter.h), a check of the call's arguments a c10::ValueError,
// anything else a c10::Error.
[[noreturn]] void Fail(const absl::Status& s) {
  capture::ThrowKernelError(s);
  TORCH_CHECK_VALUE(s.code() != absl::StatusCode::kInvalidArgument && s.code() != absl::StatusCode::kNotFound &&
                        s.code() != absl::StatusCode::kOutOfRange,
                    std::string(s.message()));
  TORCH_CHECK(false, std::string(s.message()));
}

}  // namespace

Program Load(const std::string& path, EngineOptions options) {
  absl::StatusOr<format::SavedProgram> saved = format::ReadFile(path);
  if (!saved.ok()) Fail(saved.status());
  auto impl = std::make_shared<Program::Impl>();
  impl->saved = *std::move(saved);
  for (const format::BoundTensor& b : impl->saved.bound) impl->bound.emplace_back(b.tensor);
  options.bound_inputs = static_cast<int>(impl->bound.size());
  if (options.name == EngineOptions().name) options.name = impl->saved.name;
  impl->engine = std::make_shared<replay::Engine>(impl->saved.graph, std::move(options));
  return Program(std::move(impl));
}

std::vector<c10::IValue> Program::Run(std::vector<c10::IValue> args) const {
  const Impl& p = *impl_;
  const size_t n_args = p.saved.graph->inputs().size() - p.bound.size();
  TORCH_CHECK_VALUE(args.size() == n_args, "torchreplay: program '", p.engine->options().name, "' takes ", n_args,
                    " arguments, got ", args.size());
  std::vector<c10::IValue> inputs;
  inputs.reserve(p.bound.size() + args.size());
  inputs.insert(inputs.end(), p.bound.begin(), p.bound.end());
  for (c10::IValue& a : args) inputs.push_back(std::move(a));
  for (const absl::Status& s : {replay::CheckOverlap(p.saved.written, p.bound.size(), inputs),
                                replay::CheckFixed(p.saved.fixed, p.bound.size(), inputs),
                                replay::CheckSizes(p.saved.sizes, *p.saved.graph, p.bound.size(), inputs),
                                replay::CheckStrides(p.saved.strides, p.bound.size(), inputs)}) {
    if (!s.ok()) Fail(s);
  }
  absl::StatusOr<std::vector<c10::IValue>> out = p.engine->Run(std::move(inputs));
  if (!out.ok()) Fail(out.status());
  if (p.saved.num_outputs >= 0) out->resize(p.saved.num_outputs);
  return *std::move(out);
}

void Program::Precapture(std::vector<std::vector<c10::IValue>> arg_sets) const {
  const Impl& p = *impl_;
  for (std::vector<c10::IValue>& args : arg_sets) args.insert(args.begin(), p.bound.begin(), p.bound.end());
  if (absl::Status s = p.engine->Precapture(std::move(arg_sets)); !s.ok()) Fail(s);
}

EngineStats Program::Stats() const { return impl_->engine->stats(); }

const EngineOptions& Program::Options() const { return impl_->engine->options(); }

std::vector<std::string> Program::ArgumentNames() const {
  const capture::Graph& g = *impl_->saved.graph;
  std::vector<std::string> names;
  for (size_t i = impl_->bound.size(); i < g.inputs().size(); ++i) names.push_back(g.values()[g.inputs()[i]].name);
  return names;
}

std::vector<std::string> Program::StateNames() const {
  std::vector<std::string> names;
  for (const format::BoundTensor& b : impl_->saved.bound) names.push_back(b.name);
  return names;
}

at::Tensor Program::State(const std::string& name) const {
  for (const format::BoundTensor& b : impl_->saved.bound) {
    if (b.name == name) return b.tensor;
  }
  TORCH_CHECK(false, "torchreplay: program '", impl_->engine->options().name, "' has no parameter, buffer or "
              "constant named '", name, "' (StateNames() lists them)");
}

}  // namespace torchreplay
