"""The CPU runtimes runtimes.py runs beside torchreplay, each wrapped as a callable on the
model's tensors: ONNX Runtime (IO binding), OpenVINO (a bound infer request), ExecuTorch with
XNNPACK (its thread pool set); and quiet(), which keeps what their exporters print out of the
tables. How each is configured is in runtimes.py's docstring."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch


def _tensors(args: tuple) -> List[torch.Tensor]:
    if not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError("the peers' wrappers here take tensor arguments only")
    return list(args)


@contextlib.contextmanager
def quiet(log: List[str]):
    """What the exporters, converters and runtimes print while a mode is built and checked
    (progress lines, warnings, native logs on file descriptors 1 and 2) goes into `log` instead,
    so that stdout holds the tables and stderr one line per mode; a failed mode shows its tail."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
                warnings.simplefilter("ignore")
                yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            f.seek(0)
            log.extend(f.read().decode(errors="replace").splitlines())


class OnnxRuntime:
    """torch.onnx.export(dynamo=True) into an ONNX Runtime session (CPU): `threads` intra-op
    threads, one inter-op thread, sequential execution, every graph optimization; IO binding with
    buffers bound once: each call copies its inputs into the bound input buffers and runs, and the
    outputs land in buffers bound once (returned as they are, like a pool's views). `quantize`:
    the exported model through ONNX Runtime's quantize_dynamic first ("dynamic": int8 weights,
    activations quantized per call, its int8 path for transformers) or its quantize_static
    ("static": QDQ, uint8 activations and int8 weights per channel calibrated on `calibration`,
    a list of input tuples; its int8 path for CNNs)."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple, threads: int, quantize: Optional[str] = None,
                 calibration: Sequence[tuple] = ()) -> None:
        import numpy as np
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        with tempfile.TemporaryDirectory(prefix="torchreplay-bench-") as tmp:
            path = os.path.join(tmp, "model.onnx")
            torch.onnx.export(model, tuple(example_inputs), path, dynamo=True, verbose=False)
            if quantize == "dynamic":
                from onnxruntime.quantization import QuantType, quantize_dynamic
                quantize_dynamic(path, path + ".int8", weight_type=QuantType.QInt8)
                path += ".int8"
            elif quantize == "static":
                from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                                      quantize_static)
                names = [i.name for i in ort.InferenceSession(path, providers=["CPUExecutionProvider"]).get_inputs()]

                class Reader(CalibrationDataReader):
                    def __init__(self) -> None:
                        self.feeds = iter([{n: x.numpy() for n, x in zip(names, _tensors(c))} for c in calibration])

                    def get_next(self) -> Optional[Dict[str, Any]]:
                        return next(self.feeds, None)
                quantize_static(path, path + ".int8", Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
                path += ".int8"
            self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.keeps_state = False  # a session keeps nothing between runs: a graph's writes are outputs or lost
        inputs = _tensors(example_inputs)
        names = [i.name for i in self.session.get_inputs()]
        if len(names) != len(inputs):
            raise RuntimeError(f"the ONNX model takes {len(names)} inputs, the model {len(inputs)}")
        self.inputs = [x.clone() for x in inputs]
        feeds = {n: x.numpy() for n, x in zip(names, self.inputs)}
        first = self.session.run(None, feeds)
        self.outputs = [torch.from_numpy(np.ascontiguousarray(o)).clone() for o in first]
        self.binding = self.session.io_binding()
        for name, x in zip(names, self.inputs):
            self.binding.bind_input(name, "cpu", 0, x.numpy().dtype, list(x.shape), x.data_ptr())
        for out, o in zip(self.session.get_outputs(), self.outputs):
            self.binding.bind_output(out.name, "cpu", 0, o.numpy().dtype, list(o.shape), o.data_ptr())

    def __call__(self, *args: Any) -> List[torch.Tensor]:
        for dst, src in zip(self.inputs, args):
            dst.copy_(src)
        self.session.run_with_iobinding(self.binding)
        return self.outputs


class OpenVino:
    """openvino.convert_model, compiled for the CPU with `threads` inference threads, the latency
    hint, one stream and f32 precision; one infer request whose input and output tensors are bound
    once on torch tensors' memory (shared): each call copies its inputs in and runs. `quantize`:
    the converted model through NNCF first, OpenVINO's own quantization ("static": nncf.quantize,
    int8 weights and activations calibrated on `calibration`, the transformer preset where
    `transformer`; "weights": nncf.compress_weights, int8 weights only)."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple, threads: int, quantize: Optional[str] = None,
                 calibration: Sequence[tuple] = (), transformer: bool = False) -> None:
        import openvino as ov

        inputs = _tensors(example_inputs)
        converted = ov.convert_model(model, example_input=tuple(inputs))
        if quantize == "static":
            import nncf
            dataset = nncf.Dataset([tuple(x.numpy() for x in _tensors(c)) for c in calibration])
            converted = nncf.quantize(converted, dataset, subset_size=len(calibration),
                                      model_type=nncf.ModelType.TRANSFORMER if transformer else None)
        elif quantize == "weights":
            import nncf
            converted = nncf.compress_weights(converted)
        compiled = ov.Core().compile_model(converted, "CPU", {
            "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1,
            "INFERENCE_PRECISION_HINT": "f32"})
        if len(compiled.inputs) != len(inputs):
            raise RuntimeError(f"the converted model takes {len(compiled.inputs)} inputs, the model {len(inputs)}")
        self.compiled = compiled  # the request needs its compiled model alive
        self.keeps_state = bool(converted.get_variables())  # state between calls: ReadValue/Assign pairs
        self.request = compiled.create_infer_request()
        self.inputs = [x.clone() for x in inputs]
        for i, x in enumerate(self.inputs):
            self.request.set_input_tensor(i, ov.Tensor(x.numpy(), shared_memory=True))
        self.request.infer()
        self.outputs = [torch.from_numpy(self.request.get_output_tensor(i).data.copy())
                        for i in range(len(compiled.outputs))]
        for i, o in enumerate(self.outputs):
            self.request.set_output_tensor(i, ov.Tensor(o.numpy(), shared_memory=True))

    def __call__(self, *args: Any) -> List[torch.Tensor]:
        for dst, src in zip(self.inputs, args):
            dst.copy_(src)
        self.request.infer()
        return self.outputs


def _flatc() -> None:
    """ExecuTorch's XNNPACK serializer runs `flatc`: the one its wheel ships, unless set."""
    if "FLATC_EXECUTABLE" not in os.environ:
        for root in importlib.util.find_spec("executorch").submodule_search_locations or []:
            path = os.path.join(root, "data", "bin", "flatc")
            if os.path.exists(path):
                os.environ["FLATC_EXECUTABLE"] = path
                break


def executorch_threads(threads: int) -> None:
    """ExecuTorch's thread pool (XNNPACK's threads) set to `threads`, where the package is there."""
    if importlib.util.find_spec("executorch") is None:
        return
    from executorch.extension.pybindings import portable_lib
    if portable_lib._threadpool_get_thread_count() != threads:
        portable_lib._unsafe_reset_threadpool(threads)


class ExecuTorch:
    """torch.export, to_edge_transform_and_lower with the XnnpackPartitioner, to_executorch, then
    the program's forward loaded and executed through executorch.runtime (its thread pool set to
    `threads` by executorch_threads). `quantize`: the exported fp32 model through PT2E with
    ExecuTorch's XNNPACKQuantizer first (per-channel symmetric int8 weights; "static": int8
    activations calibrated on `calibration`, "dynamic": activations quantized per call), XNNPACK's
    int8 path."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple, threads: int, quantize: Optional[str] = None,
                 calibration: Sequence[tuple] = ()) -> None:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime

        _flatc()
        executorch_threads(threads)
        inputs = _tensors(example_inputs)
        if quantize is not None:
            from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
                XNNPACKQuantizer, get_symmetric_quantization_config)
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
            quantizer = XNNPACKQuantizer().set_global(
                get_symmetric_quantization_config(is_per_channel=True, is_dynamic=quantize == "dynamic"))
            prepared = prepare_pt2e(torch.export.export(model, tuple(inputs), strict=True).module(), quantizer)
            for c in calibration if quantize == "static" else [tuple(inputs)]:
                prepared(*c)
            model = convert_pt2e(prepared)
        ep = torch.export.export(model, tuple(inputs))
        program = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
        self.program = Runtime.get().load_program(program.buffer)
        self.method = self.program.load_method("forward")

    def __call__(self, *args: Any) -> List[torch.Tensor]:
        return list(self.method.execute(list(args)))


PEER_CLASSES = {"onnxruntime": OnnxRuntime, "openvino": OpenVino, "executorch": ExecuTorch}
