// torchreplay/format.h: the saved program, a .trp file: what it holds, and its writer and reader.
//
// Note [The .trp format]
// One file holds a captured model for a C++ program to load with no Python: the lowered graph
// (each op by its schema name, every argument by its schema name, constants, the graph's inputs
// with their kinds, dtypes and ranks, its outputs, which inputs are static), the tensors bound
// ahead of the call's arguments (parameters, buffers, constants; each by kind and name, storages
// shared between them kept shared), and what the trace assumed of the arguments (numbers it
// specialized on, the sizes and strides it holds for, the arguments it writes, how many outputs are the
// model's). Layout, every integer little-endian:
//   "TORCHRPL" | u32 format version | u32 0 | u64 payload bytes | u64 FNV-1a 64 of the payload |
//   payload: the torch version it was written with, then the sections above in that order.
// Values are tagged (none, bool, int, float, complex, string, device, a wrapped number, tensor,
// lists of ints, floats, bools, tensors); tensors are (dtype, sizes, strides, storage offset,
// storage), storages are their bytes. The reader executes nothing from the file: it checks the
// header, the checksum and the torch version, reads each field within the payload's bounds
// (counts, ranks, dtypes, devices, a tensor's reach within its storage, nesting depth), and rebuilds
// the graph through GraphBuilder, which resolves every op in this LibTorch and validates every
// argument, refusing the few ops that would let a hostile file reach outside its tensors' memory
// or into files (Note [Ops a file may call] in format.cc). Any failure is an error naming what is
// wrong (truncated, corrupted, another version, an op this LibTorch lacks or a file may not call),
// never a crash; format_test.cc fuzzes it (truncations, byte flips with and without a valid
// checksum) and tries hostile graphs. What is left is what any program does: a loaded graph
// computes what it says with its inputs and weights, so load files from a source you trust.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "capture/ir/graph.h"
#include "replay/call_checks.h"

namespace torchreplay::format {

inline constexpr uint32_t kFormatVersion = 2;  // 2: stride checks

struct BoundTensor {
  std::string kind;  // "parameter", "buffer", "constant"
  std::string name;  // as in the model: "layers.0.self_attn.k_cache"
  at::Tensor tensor;
};

// A saved program, in memory. Ownership: it shares the graph and holds the bound tensors.
struct SavedProgram {
  std::string name;  // the engine's name in logs and errors
  std::shared_ptr<const capture::Graph> graph;
  std::vector<BoundTensor> bound;  // the graph's leading inputs
  std::vector<std::pair<int, c10::IValue>> fixed;  // numbers the trace specialized on (by argument)
  std::vector<replay::SizeCheck> sizes;            // sizes it holds for
  std::vector<replay::StrideCheck> strides;        // strides it holds for
  std::vector<int> written;                        // arguments the graph writes
  int num_outputs = -1;                            // the model's outputs: the graph's first (-1: all)
};

// The file's bytes. InvalidArgument for what the format cannot hold (a CUDA tensor, a constant of
// another kind), naming it.
absl::StatusOr<std::string> Serialize(const SavedProgram& program);
// A program from the file's bytes; DataLoss (truncated, corrupted), FailedPrecondition (another
// format or torch version, an op or argument this LibTorch does not have), naming what.
absl::StatusOr<SavedProgram> Deserialize(std::string_view bytes);

absl::Status WriteFile(const SavedProgram& program, const std::string& path);
absl::StatusOr<SavedProgram> ReadFile(const std::string& path);

// The checksum the header holds for `payload` (what a hostile file would recompute).
uint64_t Checksum(std::string_view payload);
// Where the payload starts in the file.
inline constexpr size_t kHeaderBytes = 32;

}  // namespace torchreplay::format
