"""Repository rule that finds LibTorch in the project virtualenv.

It asks the venv's python where torch keeps its headers and shared libraries, where Python's
headers are, and which libstdc++ ABI torch was built with, then exposes:
  @torch//:torch         ATen/c10 headers and libtorch, libtorch_cpu, libc10
  @torch//:torch_cuda    adds libtorch_cuda/libc10_cuda and the CUDA runtime headers
  @torch//:torch_python  adds libtorch_python and Python's headers (for the extension module)
The libraries are linked by absolute path with an rpath to torch/lib, so they load from where pip
put them and their own $ORIGIN rpaths (the nvidia-* wheels) keep working.
"""

_QUERY = """
import os, sysconfig, torch
lib = os.path.join(os.path.dirname(torch.__file__), "lib")
inc = os.path.join(os.path.dirname(torch.__file__), "include")
print(inc)
print(lib)
print(sysconfig.get_paths()["include"])
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.version.cuda or "")
print(torch.__version__)
# The CUDA runtime torch itself loads (the nvidia-* wheels), and their headers.
import glob
site = os.path.dirname(os.path.dirname(torch.__file__))
cudart = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so.*")) +
                glob.glob(os.path.join(lib, "libcudart*.so*")))
print(cudart[0] if cudart else "")
heads = sorted(glob.glob(os.path.join(site, "nvidia", "*", "include", "cuda_runtime_api.h")))
print(os.path.dirname(heads[0]) if heads else "")
"""

_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "torch",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh"], allow_empty = True),
    includes = ["include", "include/torch/csrc/api/include"],
    defines = ["_GLIBCXX_USE_CXX11_ABI={abi}"],
    # libgomp: torch's own OpenMP runtime (code that parallelizes with at::parallel_for is
    # compiled with -fopenmp and must share torch's threads).
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-Wl,--no-as-needed", "-ltorch", "-ltorch_cpu", "-lc10", "-l:libgomp.so.1", "-Wl,--as-needed"],
)

cc_library(
    name = "cuda_headers",
    hdrs = glob(["cuda/include/**/*.h", "cuda/include/**/*.hpp", "cuda/include/**/*.inl"], allow_empty = True),
    includes = ["cuda/include"],
)

cc_library(
    name = "torch_cuda",
    deps = [":torch", ":cuda_headers"],
    defines = ["TORCHREPLAY_WITH_CUDA=1"],
    linkopts = ["-L{lib}", "-Wl,--no-as-needed", "-ltorch_cuda", "-lc10_cuda", "-Wl,--as-needed"] + {cudart},
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python/**/*.h"], allow_empty = True),
    includes = ["python"],
)

cc_library(
    name = "torch_python",
    deps = [":torch", ":python_headers"],
    linkopts = ["-L{lib}", "-ltorch_python"],
)

exports_files(["version.txt"])
"""

def _torch_repository_impl(ctx):
    python = ctx.path(str(ctx.path(Label("//:WORKSPACE")).dirname) + "/" + ctx.attr.python)
    if not python.exists:
        fail("torchreplay: %s not found; run tools/setup.sh first" % python)
    res = ctx.execute([str(python), "-c", _QUERY])
    if res.return_code != 0:
        fail("torchreplay: could not import torch from %s:\n%s" % (python, res.stderr))
    inc, lib, py_inc, abi, cuda, version, cudart, wheel_cuda_inc = (res.stdout.rstrip("\n") + "\n").split("\n")[:8]
    ctx.symlink(inc, "include")
    ctx.symlink(py_inc, "python")
    # CUDA headers: CUDA_HOME's toolkit, else the headers of the nvidia-* wheels torch depends on.
    cuda_home = ctx.os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if ctx.path(cuda_home + "/include/cuda_runtime_api.h").exists:
        ctx.symlink(cuda_home + "/include", "cuda/include")
    elif wheel_cuda_inc:
        ctx.symlink(wheel_cuda_inc, "cuda/include")
    else:
        ctx.file("cuda/include/.empty", "")
    cudart_opts = []
    if cudart:
        cudart_dir = cudart.rpartition("/")[0]
        cudart_opts = ["-L" + cudart_dir, "-Wl,-rpath," + cudart_dir, "-l:" + cudart.rpartition("/")[2]]
    ctx.file("version.txt", "torch %s cuda %s abi %s\n" % (version, cuda, abi))
    ctx.file("BUILD", _BUILD.format(lib = lib, abi = abi, cudart = repr(cudart_opts)))

torch_repository = repository_rule(
    implementation = _torch_repository_impl,
    attrs = {"python": attr.string(mandatory = True)},
    environ = ["CUDA_HOME"],
    local = True,
)
