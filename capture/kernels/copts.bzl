"""Compiler flags the capture packages' per-instruction-set kernels share."""

# Kernels built on ATen's vector headers (the fused elementwise kernel, the GRU layer): ATen's
# flags for each instruction set, floating-point contraction off, OpenMP (torch's runtime).
ATEN_VEC_COPTS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]

# Kernels written with intrinsics (the depthwise convolution, the small GEMM).
INTRINSICS_COPTS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]

X86_64 = "//capture/kernels:x86_64"

def aten_avx2_copts():
    """ATen's AVX2 kernel flags, on x86-64."""
    return ATEN_VEC_COPTS + select({
        X86_64: ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
        "//conditions:default": [],
    })

def aten_avx512_copts():
    """ATen's AVX512 kernel flags, on x86-64."""
    return ATEN_VEC_COPTS + select({
        X86_64: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                 "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
        "//conditions:default": [],
    })

def intrinsics_copts(avx512 = False):
    """AVX2 and FMA, or AVX-512, for kernels written with intrinsics, on x86-64."""
    return INTRINSICS_COPTS + select({
        X86_64: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"] if avx512 else ["-mavx2", "-mfma"],
        "//conditions:default": [],
    })
