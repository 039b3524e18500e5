// A C++ program that runs a model saved from Python (torchreplay.save), with no Python:
//
//   replay_saved MODEL.trp [CALLS]
//
// It loads the file, makes each call's arguments from the argument names the file holds (tensor
// arguments: the example's sizes are not in the file, so it takes the shapes of the attention
// example, (1, 1, 64) and a position; write your own inputs for your model), calls the program
// CALLS times, and prints each output's sum as a hexadecimal float (exact), then the stats.
//
// Built by Bazel (//examples:replay_saved) and by CMake against an installed torchreplay
// (examples/CMakeLists.txt: find_package(torchreplay)).
#include <ATen/ops/arange.h>
#include <ATen/ops/tensor.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "torchreplay/torchreplay.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: replay_saved MODEL.trp [CALLS]\n";
    return 2;
  }
  const int calls = argc > 2 ? std::atoi(argv[2]) : 3;
  try {
    torchreplay::Program program = torchreplay::Load(argv[1]);
    std::cout << "arguments:";
    for (const std::string& name : program.ArgumentNames()) std::cout << " " << name;
    std::cout << "\n";
    for (int i = 0; i < calls; ++i) {
      // The attention decode example's step i: x = arange(64) / 64 + i, pos = [i].
      const at::Tensor x = at::arange(64, at::kFloat).div(64).add(i).view({1, 1, 64});
      const at::Tensor pos = at::tensor({static_cast<int64_t>(i)});
      const std::vector<c10::IValue> out = program.Run({x, pos});
      for (size_t k = 0; k < out.size(); ++k) {
        if (!out[k].isTensor()) continue;
        std::printf("call %d: output %zu: %a\n", i, k, out[k].toTensor().sum().item<float>());
      }
    }
    const torchreplay::EngineStats s = program.Stats();
    std::cout << "calls " << s.calls << " captures " << s.captures << " replays " << s.replays << "\n";
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
