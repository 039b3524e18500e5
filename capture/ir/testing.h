// capture/ir/testing.h: what the C++ tests share to build graphs (testonly).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "capture/ir/graph.h"

namespace torchreplay::capture::testing {

// The first output of a new `name` node; a failure fails the test (and gives -1).
inline ValueId Op(GraphBuilder& b, const std::string& name, std::vector<Arg> args,
                  std::vector<std::pair<std::string, Arg>> kwargs = {}) {
  auto out = b.AddOp(name, std::move(args), std::move(kwargs));
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? (*out)[0] : -1;
}

}  // namespace torchreplay::capture::testing
