"""Max pooling on the CPU tape through torchreplay's kernel (Note [Max pooling] in
capture/kernels/max_pool.h): a contiguous float map's max_pool2d replays with eager's values and
indices, bit for bit, for every window geometry, width, thread count and special value (NaNs with
their payloads, signed zeros, infinities, ties), and the step that ran is the kernel's."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchreplay
from configs import config
from differential import assert_bitwise
from test_conditions import threads as at_threads


class Pool(nn.Module):
    def __init__(self, before=False, indices=True, **kw):
        super().__init__()
        self.before, self.indices, self.kw = before, indices, kw

    def forward(self, x):
        if self.before:  # the map an earlier step wrote (a planned buffer), not the caller's tensor
            x = x * 1.0
        return F.max_pool2d(x, return_indices=self.indices, **self.kw)


def capture(model, args):
    return torchreplay.capture(model, args, config=config())


def pool_kinds(step, args):
    return [r["kind"] for r in step.profile(*args, iterations=2) if "max_pool2d" in r["op"]]


def specials(shape, seed):
    """Values whose maximum eager's rule decides: ties of few distinct values, signed zeros, NaNs
    with distinct payloads and signs (the last in a window wins), infinities."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, shape, generator=g).float()
    bits = x.view(torch.int32)
    pick = torch.rand(shape, generator=g)
    x[pick < 0.15] = 0.0
    bits[(pick >= 0.15) & (pick < 0.3)] = -2**31  # -0.0
    for k, payload in enumerate((0x7FC00001, 0x7FC12345, -0x3FFFFF)):  # -0x3FFFFF: a negative NaN
        bits[(pick >= 0.3 + 0.01 * k) & (pick < 0.31 + 0.01 * k)] = payload
    x[(pick >= 0.34) & (pick < 0.36)] = float("inf")
    x[(pick >= 0.36) & (pick < 0.40)] = float("-inf")
    return x


# (kernel_size, stride, padding, dilation, ceil_mode, input shape)
GEOMETRIES = [
    (3, 2, 0, 1, True, (1, 5, 109, 109)),    # squeezenet's
    (3, 2, 1, 1, False, (1, 4, 112, 112)),   # resnet's stem
    (2, 2, 0, 1, False, (2, 3, 32, 32)),     # VGG's
    (3, 1, 1, 1, False, (1, 3, 40, 37)),     # stride 1
    ((3, 2), (2, 1), (1, 0), 1, True, (1, 2, 23, 71)),
    (3, 2, 1, 2, False, (1, 2, 30, 45)),     # dilated
    (5, 3, 2, 1, True, (1, 2, 29, 53)),      # stride 3: the scalar loop
    (4, 2, 2, 1, True, (1, 2, 9, 9)),        # a partly outside window on every side
    (3, 2, 0, 1, False, (3, 4, 5)),          # narrower than a vector
    (2, 1, 0, 1, False, (1, 1, 3, 300)),     # a long row
    (1, 1, 0, 1, False, (1, 2, 7, 19)),
    (3, 2, 1, 1, True, (6, 17, 33)),          # a 3-d map (C, H, W)
]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("before", [False, True], ids=["caller_map", "planned_map"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"k{g[0]}s{g[1]}p{g[2]}d{g[3]}c{int(g[4])}_{'x'.join(map(str, g[5]))}")
def test_max_pool_replays_eager_values_and_indices(geometry, before, threads):
    kernel, stride, padding, dilation, ceil_mode, shape = geometry
    model = Pool(before, kernel_size=kernel, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil_mode)
    with at_threads(threads), torch.no_grad():
        step = capture(model, (specials(shape, 0),))
        for seed in range(3):
            x = specials(shape, seed)
            assert_bitwise(step(x), model(x), f"seed {seed}")
            x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
            assert_bitwise(step(x), model(x), f"randn seed {seed}")
        assert pool_kinds(step, (x,)) == ["max pool"]
        assert step.stats()["replays"] >= 6


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("geometry", GEOMETRIES[:3] + GEOMETRIES[-3:], ids=lambda g: "x".join(map(str, g[5])))
def test_values_without_their_indices_replay_bitwise(geometry, threads):
    """Where nothing reads the indices, the kernel does not write them: the values stay eager's."""
    kernel, stride, padding, dilation, ceil_mode, shape = geometry
    model = nn.Sequential(Pool(True, False, kernel_size=kernel, stride=stride, padding=padding, dilation=dilation,
                               ceil_mode=ceil_mode), nn.ReLU())
    with at_threads(threads), torch.no_grad():
        step = capture(model, (specials(shape, 0),))
        for seed in range(3):
            x = specials(shape, seed)
            assert_bitwise(step(x), model(x), f"seed {seed}")
        assert pool_kinds(step, (x,)) == ["max pool"]
        assert step.stats()["replays"] >= 3


@pytest.mark.parametrize("indices", [True, False])
def test_a_key_captured_before_the_arena_grew_writes_where_its_buffers_are_now(indices):
    """Sizes captured small, then large (the arena grows and moves), then small again: the first
    key's step writes into its buffers' new place."""
    model = Pool(True, indices, kernel_size=3, stride=2, ceil_mode=True)
    make = lambda n, seed: specials((1, 4, n, n), seed)  # noqa: E731
    with torch.no_grad():
        step = torchreplay.capture(model, (make(20, 0),), dynamic=True)
        for n in (20, 90, 20, 150, 20, 90):
            for seed in range(3):
                assert_bitwise(step(make(n, seed)), model(make(n, seed)), f"{n}x{n}, seed {seed}")
        assert pool_kinds(step, (make(20, 0),)) == ["max pool"]
        assert step.stats()["replays"] >= 6


def test_every_window_of_minus_infinity_keeps_its_first_index():
    model = Pool(kernel_size=3, stride=2, padding=1)
    x = torch.full((1, 2, 40, 40), float("-inf"))
    with torch.no_grad():
        step = capture(model, (x,))
        assert_bitwise(step(x), model(x))
        assert pool_kinds(step, (x,)) == ["max pool"]


def test_a_channels_last_map_keeps_eager_s_own_kernel_and_its_bits():
    model = Pool(kernel_size=3, stride=2, ceil_mode=True)
    x = specials((1, 8, 21, 21), 1).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        step = capture(model, (x,))
        assert_bitwise(step(x), model(x))
        assert pool_kinds(step, (x,)) == ["boxed out="]
        # a contiguous map afterwards: traced again for its strides, through the kernel
        y = specials((1, 8, 21, 21), 2)
        assert_bitwise(step(y), model(y))


def test_max_pool_through_torch_compile_replays_bitwise():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True)).eval()
    compiled = torch.compile(model, backend="torchreplay", mode="reduce-overhead")
    seen = {s["name"] for s in torchreplay.stats()}
    with torch.no_grad():
        for seed in range(4):
            x = torch.randn(1, 3, 45, 45, generator=torch.Generator().manual_seed(seed))
            assert_bitwise(compiled(x), model(x), f"seed {seed}")
    assert sum(s["replays"] for s in torchreplay.stats() if s["name"] not in seen) >= 2


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="the AVX2 copy is the one this CPU runs already")
def test_the_avx2_copy_replays_the_same_bits():
    """The kernel's AVX2 copy, which CPUs without AVX-512 run: this file's cases at one thread in a
    process whose ATen runs its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    check = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert check.stdout.strip() == "AVX2", check.stdout + check.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "(replays_eager_values and -1]) or without_their_indices or minus_infinity"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], \
        run.stdout[-3000:] + run.stderr[-3000:]
