"""torchair's reduce-overhead example (test_compile.py) on the CPU with torchreplay: a parameter,
a buffer, a tensor input and a scalar input; dynamic=False by default (TEST_COMPILE_DYNAMIC=1 for dynamic=True, and
TEST_COMPILE_MARK_STATIC=1 to mark the input static)."""
import logging
import os

os.environ.setdefault("TORCHREPLAY_LOG_LEVEL", "1")   # the C++ side's log (captures)
import torch
import torch.nn as nn

import torchreplay

logging.basicConfig(level=logging.INFO)
logging.getLogger("torchreplay").setLevel(logging.DEBUG)


class DemoModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(64))   # buffer
        self.linear1 = nn.Linear(128, 64)                         # weight and bias: parameters

    def forward(self, x, scale_factor):
        x = self.linear1(x)
        x = x - self.running_mean
        x = x * scale_factor
        return x


dynamic = os.environ.get("TEST_COMPILE_DYNAMIC", "0") == "1"
demo_model = DemoModel()
config = torchreplay.CompilerConfig()
config.mode = "reduce-overhead"
config.debug.graph_dump.type = "py"
config.debug.graph_dump.path = os.environ.get("TEST_COMPILE_DUMP", "/tmp/torchreplay_dump")
backend = torchreplay.get_backend(compiler_config=config)
compiled = torch.compile(demo_model, dynamic=dynamic, fullgraph=True, backend=backend)

inp = torch.randn(100, 128)
if os.environ.get("TEST_COMPILE_MARK_STATIC") == "1":
    torch._dynamo.mark_static(inp)
scale_factor = 100

ok = True
for i in range(4):
    out = compiled(inp, scale_factor)
    ok = ok and torch.equal(out, demo_model(inp, scale_factor))
print("stats:", backend.stats())
print("matches eager:", ok)
