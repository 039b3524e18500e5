// torchreplay/torchreplay.h: torchreplay for C++ programs, with no Python at run time. The one
// public header: load a program saved from Python and call it.
//
//   # Python, once
//   step = torchreplay.capture(model, (ids, pos), config=config)
//   torchreplay.save(step, "decode.trp")
//
//   // C++
//   #include "torchreplay/torchreplay.h"
//   torchreplay::Program program = torchreplay::Load("decode.trp");
//   std::vector<c10::IValue> out = program.Run({ids, pos});  // warm-up, capture, replay
//
// A Program runs the same C++ engine as torchreplay.capture, on the same graph and weights, so its
// results are bitwise those of the captured model in Python (the differential tests check it).
//
// Ownership: a Program is a cheap handle; copies share one loaded program (its graph, its engine
// with the per-thread captures and pools, and its tensors), which lives until the last copy goes.
// Run's outputs are owned by the caller; like torchreplay.capture's, outputs in the engine's pool
// are views that the next call of the same program on the same thread reuses (reading one then
// raises a clear error; clone what you keep, or set EngineOptions::clone_outputs).
//
// Threads: Run may be called from many threads at once, as in Python: each thread warms up,
// captures and replays with its own pool. A program whose graph writes its buffers (a KV cache)
// writes the one copy all threads share: call such a program from one thread at a time.
//
// Errors: every function throws c10::Error (what() says what is wrong and what to do); Run throws
// a kernel's error of the class eager's kernel throws (c10::LinAlgError, c10::IndexError, ...) and
// a call's own mistake (arity, sizes, strides, dtypes) as c10::ValueError.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <vector>

#include "replay/options.h"

namespace torchreplay {

using EngineOptions = replay::EngineOptions;  // every setting, as in Python's CompilerConfig
using EngineStats = replay::EngineStats;      // calls, replays, captures, fallbacks and why

class Program {
 public:
  // One call with the model's arguments, flattened in the order they were captured (tensors and
  // numbers; ArgumentNames()). Returns the model's outputs, flattened. Checked before anything
  // runs, as in Python: the arity, dtypes, devices and ranks, the sizes the trace holds for, and
  // the numbers it was captured with.
  std::vector<c10::IValue> Run(std::vector<c10::IValue> args) const;

  // Warms up and captures the shapes of `arg_sets` ahead of time, largest first; each set runs
  // warmup_iters + 1 times, like that many calls (a graph writing its buffers writes them too).
  void Precapture(std::vector<std::vector<c10::IValue>> arg_sets) const;

  EngineStats Stats() const;
  const EngineOptions& Options() const;

  // The argument names, as the model's forward names them ("ids", "pos", "args[0]").
  std::vector<std::string> ArgumentNames() const;
  // The parameters, buffers and constants bound ahead of the arguments, by the model's names for
  // them ("layers.0.k_cache").
  std::vector<std::string> StateNames() const;
  // One of them: the very tensor the program reads and writes. Read it, or write into it between
  // calls (state.zero_() resets a KV cache); replacing it is not possible (its address is captured).
  at::Tensor State(const std::string& name) const;

 private:
  struct Impl;
  explicit Program(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
  friend Program Load(const std::string& path, EngineOptions options);
};

// Reads a .trp file written by torchreplay.save (format: torchreplay/format.h) and makes its
// program, on the CPU. `options` as for any engine; `name` and `bound_inputs` come from the file.
// Throws c10::Error for a missing, truncated, corrupted or hostile file, one saved with another
// torch or .trp version, or one with an op this LibTorch does not have; it never runs code from
// the file.
Program Load(const std::string& path, EngineOptions options = EngineOptions::Defaults());

}  // namespace torchreplay
