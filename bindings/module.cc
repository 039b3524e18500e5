// bindings/module.cc: the pybind11 module torchreplay._C: graphs and their builder, engines and
// their options, the log, and the Call (call.h).
// Over 500 lines: one PYBIND11_MODULE, each class bound beside the next; the Call's own binding
// lives in call.cc and the training call's in training.cc.
//
// Graph construction: the Python lowering hands each argument over as a tagged tuple,
// ("v", value_id) for a graph value, ("l", [tagged...]) for a list with values in it, or
// ("c", python_constant). Calls: Engine.run takes AOTAutograd's boxed argument list, clears it
// (so inputs are freed as early as eager would free them), and returns the outputs as a list.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bindings/call.h"
#include "bindings/convert.h"
#include "bindings/training.h"
#include "capture/ir/caller_grad.h"
#include "capture/ir/graph.h"
#include "capture/ir/interpreter.h"
#include "capture/ir/scopes.h"
#include "memory_pool/arena.h"
#include "replay/engine.h"
#include "torchreplay/format.h"
#include "torchreplay/torchreplay.h"

namespace torchreplay {
namespace {

capture::Arg ToArg(py::handle tagged) {
  auto t = tagged.cast<py::tuple>();
  const std::string tag = t[0].cast<std::string>();
  if (tag == "v") return capture::Arg::Ref(t[1].cast<int>());
  if (tag == "l") {
    std::vector<capture::Arg> elems;
    for (auto e : t[1]) elems.push_back(ToArg(e));
    return capture::Arg::List(std::move(elems));
  }
  return capture::Arg::Const(ToIValue(t[1]));
}

capture::ValueType ValueTypeFromName(const std::string& s) {
  if (s == "Tensor") return capture::ValueType::kTensor;
  if (s == "int") return capture::ValueType::kInt;
  if (s == "float") return capture::ValueType::kFloat;
  if (s == "bool") return capture::ValueType::kBool;
  throw py::value_error("torchreplay: unknown input type '" + s + "'");
}

// Note [One log]
// Every message of torchreplay goes to one logger, Python's "torchreplay": the package's own
// (lowering, capture sizes, capture) and the C++ engines' (captures, fallbacks, keys that keep
// changing), which this module hands over through replay::SetLogSink. The package registers the
// logger with torch._logging (python/torchreplay/__init__.py), so TORCH_LOGS="torchreplay"
// (info: every capture), TORCH_LOGS="+torchreplay" (debug) and torch._logging.set_logs(
// modules={"torchreplay": logging.INFO}) work as for torch's own logs; TORCHREPLAY_LOG_LEVEL and
// torchreplay.set_log_level set the logger's level. Engines made from Python pass every message
// on (their default level is debug) and the logger decides. Messages are rare (per capture, per
// fallback, once per graph), so taking the GIL for each costs nothing a call would see; once
// Python is finalizing they go to stderr.
void LogToPython(replay::LogLevel level, const std::string& message) {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  if (!Py_IsInitialized() || finalizing) {
    std::fprintf(stderr, "[torchreplay] %s\n", message.c_str());
    return;
  }
  py::gil_scoped_acquire gil;
  try {
    static constexpr int kLevels[] = {10, 20, 30, 40};  // logging.DEBUG ... logging.ERROR
    py::module_::import("logging").attr("getLogger")("torchreplay").attr("log")(
        kLevels[static_cast<int>(level)], message);
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("torchreplay's log");
  }
}

replay::LogLevel ToLogLevel(int level) {
  if (level < 0 || level > 3) {
    throw py::value_error("torchreplay: log level must be 0 (debug), 1 (info), 2 (warning) or 3 (error)");
  }
  return static_cast<replay::LogLevel>(level);
}

py::dict StatsToDict(const replay::EngineStats& s) {
  py::dict d;
  d["calls"] = s.calls;
  d["replays"] = s.replays;
  d["captures"] = s.captures;
  d["warmups"] = s.warmups;
  d["eager_fallbacks"] = s.eager_fallbacks;
  d["misses"] = s.misses;
  d["evictions"] = s.evictions;
  d["cache_entries"] = s.cache_entries;
  d["last_miss"] = s.last_miss;
  d["pool_bytes"] = s.pool_bytes;
  d["handed_out"] = s.handed_out;
  d["copied_out"] = s.copied_out;
  d["copied_out_bytes"] = s.copied_out_bytes;
  d["errors"] = s.errors;
  d["last_error"] = s.last_error;
  py::list log;
  for (const auto& c : s.capture_log) {
    py::dict r;
    r["key"] = c.key;
    r["reason"] = c.reason;
    r["milliseconds"] = c.milliseconds;
    const capture::CaptureInfo& i = c.info;
    r["nodes"] = i.nodes;
    r["steps"] = i.steps;
    r["out_variant_steps"] = i.out_variant_steps;
    r["typed_steps"] = i.typed_steps;
    r["prepared_steps"] = i.prepared_steps;
    r["fused_steps"] = i.fused_steps;
    r["collective_steps"] = i.collective_steps;
    r["fused_nodes"] = i.fused_nodes;
    r["functional_steps"] = i.functional_steps;
    r["precomputed"] = i.precomputed;
    r["arena_bytes"] = i.arena_bytes;
    r["tensor_bytes"] = i.tensor_bytes;
    r["functional_ops"] = i.functional_ops;
    log.append(r);
  }
  d["capture_log"] = log;
  d["fallback_reasons"] = s.fallback_reasons;
  return d;
}

// Graph and GraphBuilder: the lowering builds graphs through these.
void BindGraph(py::module_& m) {
  py::class_<capture::Graph, std::shared_ptr<capture::Graph>>(m, "Graph")
      .def("__str__", &capture::Graph::ToString)
      .def_property_readonly("num_nodes", [](const capture::Graph& g) { return g.nodes().size(); })
      .def_property_readonly("num_inputs", [](const capture::Graph& g) { return g.inputs().size(); })
      .def_property_readonly("static_inputs", &capture::Graph::static_inputs)
      .def_property_readonly("communicates", &capture::Graph::communicates,
                             "Whether a node is a collective (Note [Collectives] in replay/engine.h).");

  py::class_<capture::GraphBuilder>(m, "GraphBuilder")
      .def(py::init<>())
      .def("add_input",
           [](capture::GraphBuilder& b, const std::string& name, const std::string& type,
              py::object dtype, py::object device, py::object dim) {
             std::optional<capture::TensorSpec> spec;
             if (!dtype.is_none()) {
               spec = capture::TensorSpec{
                   reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type,
                   reinterpret_cast<THPDevice*>(device.ptr())->device.type(), dim.cast<int64_t>()};
             }
             return b.AddInput(name, ValueTypeFromName(type), spec);
           },
           py::arg("name"), py::arg("type"), py::arg("dtype") = py::none(),
           py::arg("device") = py::none(), py::arg("dim") = py::none())
      .def("add_op",
           [](capture::GraphBuilder& b, const std::string& op, py::list args, py::dict kwargs,
              const std::string& name) {
             std::vector<capture::Arg> a;
             for (auto x : args) a.push_back(ToArg(x));
             std::vector<std::pair<std::string, capture::Arg>> kw;
             for (auto [k, v] : kwargs) kw.emplace_back(k.cast<std::string>(), ToArg(v));
             return Unwrap(b.AddOp(op, std::move(a), std::move(kw), name));
           },
           py::arg("op"), py::arg("args"), py::arg("kwargs"), py::arg("name") = "")
      .def("add_getitem",
           [](capture::GraphBuilder& b, int list, int64_t index, const std::string& name) {
             return Unwrap(b.AddGetItem(list, index, name));
           })
      .def("add_sym",
           [](capture::GraphBuilder& b, const std::string& op, py::list operands,
              const std::string& name) {
             std::vector<capture::Arg> a;
             for (auto x : operands) a.push_back(ToArg(x));
             return Unwrap(b.AddSymArith(Unwrap(capture::SymOpFromName(op)), std::move(a), name));
           })
      .def("set_outputs",
           [](capture::GraphBuilder& b, py::list outs) {
             std::vector<capture::Arg> a;
             for (auto x : outs) a.push_back(ToArg(x));
             if (auto s = b.SetOutputs(std::move(a)); !s.ok()) Throw(s);
           })
      .def("set_static_inputs",
           [](capture::GraphBuilder& b, std::vector<int> idx) {
             if (auto s = b.SetStaticInputs(std::move(idx)); !s.ok()) Throw(s);
           })
      .def("build", [](capture::GraphBuilder& b) {
        return std::const_pointer_cast<capture::Graph>(Unwrap(b.Build()));
      });
}

// EngineOptions, every field by name (over 80 lines: one binding per field, nothing else).
void BindEngineOptions(py::module_& m) {
  py::class_<replay::EngineOptions> options(
      m, "EngineOptions",
      "Every setting of an engine, by name: EngineOptions(mode='reduce-overhead', warmup_iters=1, "
      "capture_limit=64, cache_limit=256, clone_outputs=False, preserve_outputs=False, name='graph', bound_inputs=0, "
      "dump_dir='', cuda_graphs=False, prepared_steps=True, fuse_elementwise=True, log_level=0, capture_sizes=[], "
      "batch_inputs=[], batch_size_inputs=[], batch_outputs=[]). Unset fields take the defaults, "
      "with the environment's switches (TORCHREPLAY_PREPARED_ITERATORS, TORCHREPLAY_FUSE) applied; "
      "log_level is log_level() (0: every message goes to the 'torchreplay' logger, which decides).");
  options
      .def(py::init([](py::kwargs fields) {
        py::object o = py::cast(replay::EngineOptions::Defaults());
        for (auto [key, value] : fields) {
          const std::string k = key.cast<std::string>();
          if (k.rfind("_", 0) == 0 || !py::hasattr(o, k.c_str())) {
            throw py::type_error("torchreplay: EngineOptions has no field '" + k + "'");
          }
          o.attr(k.c_str()) = value;
        }
        return o.cast<replay::EngineOptions>();
      }))
      .def_property(
          "mode",
          [](const replay::EngineOptions& o) {
            return o.mode == replay::Mode::kDefault ? "default" : "reduce-overhead";
          },
          [](replay::EngineOptions& o, const std::string& mode) {
            if (mode == "default") {
              o.mode = replay::Mode::kDefault;
            } else if (mode == "reduce-overhead") {
              o.mode = replay::Mode::kReduceOverhead;
            } else {
              throw py::value_error("torchreplay: unknown mode '" + mode + "'");
            }
          })
      .def_readwrite("clone_outputs", &replay::EngineOptions::clone_outputs)
      .def_readwrite("preserve_outputs", &replay::EngineOptions::preserve_outputs)
      .def_readwrite("name", &replay::EngineOptions::name)
      .def_readwrite("dump_dir", &replay::EngineOptions::dump_dir)
      .def_readwrite("cuda_graphs", &replay::EngineOptions::cuda_graphs)
      .def_readwrite("prepared_steps", &replay::EngineOptions::prepared_steps)
      .def_readwrite("fuse_elementwise", &replay::EngineOptions::fuse_elementwise)
      .def_property(
          "capture_sizes", [](const replay::EngineOptions& o) { return o.capture_sizes; },
          [](replay::EngineOptions& o, std::vector<int64_t> sizes) {
            for (int64_t n : sizes) {
              if (n < 1) throw py::value_error("torchreplay: capture_sizes must be >= 1");
            }
            std::sort(sizes.begin(), sizes.end());
            sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
            o.capture_sizes = std::move(sizes);
          })
      .def_readwrite("batch_inputs", &replay::EngineOptions::batch_inputs)
      .def_readwrite("batch_size_inputs", &replay::EngineOptions::batch_size_inputs)
      .def_readwrite("batch_outputs", &replay::EngineOptions::batch_outputs)
      .def_property(
          "log_level", [](const replay::EngineOptions& o) { return static_cast<int>(o.log_level); },
          [](replay::EngineOptions& o, int level) { o.log_level = ToLogLevel(level); })
      .def("__repr__", [](py::object o) {
        std::vector<std::string> parts;
        for (const char* f : {"mode", "warmup_iters", "capture_limit", "cache_limit", "clone_outputs",
                              "preserve_outputs", "name", "bound_inputs", "dump_dir", "cuda_graphs",
                              "prepared_steps", "fuse_elementwise", "log_level", "capture_sizes", "batch_inputs",
                              "batch_size_inputs", "batch_outputs"}) {
          parts.push_back(absl::StrCat(f, "=", py::repr(o.attr(f)).cast<std::string>()));
        }
        return absl::StrCat("EngineOptions(", absl::StrJoin(parts, ", "), ")");
      });
  for (const auto& [name, field, least] :
       {std::tuple{"warmup_iters", &replay::EngineOptions::warmup_iters, 0},
        std::tuple{"capture_limit", &replay::EngineOptions::capture_limit, 0},
        std::tuple{"cache_limit", &replay::EngineOptions::cache_limit, 1},
        std::tuple{"bound_inputs", &replay::EngineOptions::bound_inputs, 0}}) {
    options.def_property(
        name, [field = field](const replay::EngineOptions& o) { return o.*field; },
        [name = std::string(name), field = field, least = least](replay::EngineOptions& o, int n) {
          if (n < least) {
            throw py::value_error(absl::StrCat("torchreplay: ", name, " must be >= ", least));
          }
          o.*field = n;
        });
  }

}

// Engine: run (AOTAutograd's boxed convention), precapture, profile, stats.
void BindEngine(py::module_& m) {
  py::class_<replay::Engine, std::shared_ptr<replay::Engine>>(m, "Engine")
      .def(py::init([](std::shared_ptr<capture::Graph> g, std::optional<replay::EngineOptions> o) {
             return std::make_shared<replay::Engine>(std::move(g),
                                                     o.value_or(replay::EngineOptions::Defaults()));
           }),
           py::arg("graph"), py::arg("options") = py::none())
      .def("run",
           [](replay::Engine& e, py::list args) {
             std::vector<c10::IValue> inputs;
             inputs.reserve(args.size());
             for (auto a : args) inputs.push_back(ToIValue(a));
             PyList_SetSlice(args.ptr(), 0, PyList_GET_SIZE(args.ptr()), nullptr);  // boxed call
             absl::StatusOr<std::vector<c10::IValue>> out;
             {
               py::gil_scoped_release no_gil;
               out = e.Run(std::move(inputs));
             }
             if (!out.ok()) Throw(out.status());
             return FromIValues<py::list>(*out, out->size());
           })
      .def("precapture",
           [](replay::Engine& e, const std::vector<py::list>& input_sets) {
             std::vector<std::vector<c10::IValue>> sets;
             for (const auto& l : input_sets) {
               std::vector<c10::IValue> inputs;
               for (auto a : l) inputs.push_back(ToIValue(a));
               sets.push_back(std::move(inputs));
             }
             absl::Status s;
             {
               py::gil_scoped_release no_gil;
               s = e.Precapture(std::move(sets));
             }
             if (!s.ok()) Throw(s);
           },
           py::arg("input_sets"),
           "Warms up and captures these inputs' keys ahead of time, largest first.")
      .def("profile",
           [](replay::Engine& e, py::list args, int iterations) {
             std::vector<c10::IValue> inputs;
             for (auto a : args) inputs.push_back(ToIValue(a));
             absl::StatusOr<std::vector<capture::StepTime>> rows;
             {
               py::gil_scoped_release no_gil;
               CallerGradScope no_grad;  // Note [The caller's grad mode]
               rows = e.ProfileSteps(std::move(inputs), iterations);
             }
             if (!rows.ok()) Throw(rows.status());
             py::list out;
             for (const auto& r : *rows) {
               py::dict d;
               d["node"] = r.node;
               d["op"] = r.op;
               d["kind"] = r.kind;
               d["shapes"] = r.shapes;
               d["us"] = r.us;
               d["note"] = r.note;
               out.append(d);
             }
             return out;
           },
           py::arg("inputs"), py::arg("iterations") = 200,
           "Per step of the replay of these inputs' key (captured first if needed): node, op, kind, "
           "shapes and mean microseconds over `iterations` replays.")
      .def("stats", [](const replay::Engine& e) { return StatsToDict(e.stats()); })
      .def_property_readonly("name", [](const replay::Engine& e) { return e.options().name; })
      .def_property_readonly("options", [](const replay::Engine& e) { return e.options(); });
}

// Note [Watching the random generators]
// torchreplay.capture refuses a model that sets a generator's state while torch.export traces it
// (torch.manual_seed, Generator.set_state...: done once while traced, never in the replays). It
// watches with a profile function on the tracing thread, which sees every call of a C function
// made from Python. A Python one (sys.setprofile) runs Python code on every call and return of
// the whole trace and made the export of the tiny Llama step 2.4x slower (0.65 s against 0.27
// s); this one returns at once unless a C method named like a setter is called on a
// torch.Generator, so the trace costs only what any profile function costs CPython (0.44 s).
// Such a call counts when the first frame calling it that is not torch's own is not
// torchreplay's either (export's bookkeeping is not the model's). A profiler already on the
// thread (cProfile) keeps seeing every event, and is put back by Stop. What sys.getprofile()
// shows while watching is a builtin function that does the same when called from Python, so a
// model that saves and restores the profile function puts the watch back. Calls made from C
// (map(gen.manual_seed, ...)) raise no event: random_state.py also compares the CPU generator's
// initial seed before and after.
class GeneratorWatch {
 public:
  GeneratorWatch(py::object generator_type, std::vector<std::string> setters, std::string torch_dir,
                 std::string own_dir)
      : generator_type_(std::move(generator_type)),
        setters_(std::move(setters)),
        torch_dir_(std::move(torch_dir)),
        own_dir_(std::move(own_dir)) {}
  ~GeneratorWatch() { Stop(); }

  void Start() {
    if (self_) throw py::value_error("torchreplay: the generator watch is running already");
    PyThreadState* thread = PyThreadState_Get();
    previous_ = thread->c_profilefunc;
    previous_object_ = py::reinterpret_borrow<py::object>(thread->c_profileobj);
    static PyMethodDef def = {"torchreplay_generator_watch", reinterpret_cast<PyCFunction>(&FromPython),
                              METH_VARARGS, "torchreplay's generator watch, as a profile function"};
    self_ = py::reinterpret_steal<py::object>(PyCFunction_New(&def, py::capsule(this).ptr()));
    PyEval_SetProfile(&GeneratorWatch::Event, self_.ptr());
  }

  void Stop() {
    if (!self_) return;
    PyEval_SetProfile(previous_, previous_object_.ptr());
    previous_ = nullptr;
    previous_object_ = py::object();
    self_ = py::object();
  }

  // What the model called ("called Generator.manual_seed"), or "" if nothing.
  const std::string& touched() const { return touched_; }

 private:
  // An event: first to the profiler that was on the thread, then to Saw.
  int Handle(PyFrameObject* frame, int what, PyObject* arg) {
    if (previous_ != nullptr) {
      const int r = previous_(previous_object_.ptr(), frame, what, arg);
      if (r != 0) return r;
    }
    if (what == PyTrace_C_CALL && touched_.empty() && PyCFunction_Check(arg)) Saw(frame, arg);
    return 0;
  }

  static int Event(PyObject* function, PyFrameObject* frame, int what, PyObject* arg) {
    auto* self = static_cast<GeneratorWatch*>(PyCapsule_GetPointer(PyCFunction_GET_SELF(function), nullptr));
    return self->Handle(frame, what, arg);
  }

  // The watch called as a Python profile function, (frame, event, arg).
  static PyObject* FromPython(PyObject* capsule, PyObject* args) {
    PyObject *frame, *event, *arg;
    if (!PyArg_ParseTuple(args, "O!UO", &PyFrame_Type, &frame, &event, &arg)) return nullptr;
    static const std::pair<const char*, int> kEvents[] = {
        {"call", PyTrace_CALL},     {"return", PyTrace_RETURN},     {"exception", PyTrace_EXCEPTION},
        {"c_call", PyTrace_C_CALL}, {"c_return", PyTrace_C_RETURN}, {"c_exception", PyTrace_C_EXCEPTION}};
    const char* name = PyUnicode_AsUTF8(event);
    if (name == nullptr) return nullptr;
    auto* self = static_cast<GeneratorWatch*>(PyCapsule_GetPointer(capsule, nullptr));
    for (const auto& [e, what] : kEvents) {
      if (std::strcmp(name, e) == 0 && self->Handle(reinterpret_cast<PyFrameObject*>(frame), what, arg) != 0) {
        return nullptr;
      }
    }
    Py_RETURN_NONE;
  }

  void Saw(PyFrameObject* frame, PyObject* function) {
    const char* name = reinterpret_cast<PyCFunctionObject*>(function)->m_ml->ml_name;
    if (std::find(setters_.begin(), setters_.end(), name) == setters_.end()) return;
    PyObject* generator = PyCFunction_GET_SELF(function);
    if (generator == nullptr || PyObject_IsInstance(generator, generator_type_.ptr()) != 1) {
      PyErr_Clear();
      return;
    }
    py::object f = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(frame));
    while (f && !f.is_none()) {
      auto* code = PyFrame_GetCode(reinterpret_cast<PyFrameObject*>(f.ptr()));
      const char* file = PyUnicode_AsUTF8(code->co_filename);
      Py_DECREF(code);
      if (file == nullptr) {
        PyErr_Clear();
        return;
      }
      const std::string_view path(file);
      if (path.substr(0, torch_dir_.size()) != torch_dir_) {
        if (path.substr(0, own_dir_.size()) != own_dir_) {
          const std::string type = Py_TYPE(generator)->tp_name;  // "torch._C.Generator"
          touched_ = absl::StrCat("called ", type.substr(type.rfind('.') + 1), ".", name);
        }
        return;
      }
      f = py::reinterpret_steal<py::object>(
          reinterpret_cast<PyObject*>(PyFrame_GetBack(reinterpret_cast<PyFrameObject*>(f.ptr()))));
    }
  }

  py::object generator_type_;
  std::vector<std::string> setters_;
  std::string torch_dir_;
  std::string own_dir_;
  std::string touched_;
  py::object self_;  // the builtin function handed to the thread while watching
  Py_tracefunc previous_ = nullptr;
  py::object previous_object_;
};

void BindGeneratorWatch(py::module_& m) {
  py::class_<GeneratorWatch>(m, "GeneratorWatch", "Note [Watching the random generators] (module.cc)")
      .def(py::init<py::object, std::vector<std::string>, std::string, std::string>(), py::arg("generator_type"),
           py::arg("setters"), py::arg("torch_dir"), py::arg("own_dir"))
      .def("start", &GeneratorWatch::Start, "Watches this thread until stop().")
      .def("stop", &GeneratorWatch::Stop, "Puts back the profile function the thread had before start().")
      .def_property_readonly("touched", &GeneratorWatch::touched);
}

}  // namespace

// torchreplay.save and the C++ loader (torchreplay/torchreplay.h), for Python to write programs and
// to check them as a C++ program would run them.
void BindPrograms(py::module_& m) {
  m.def(
      "save_program",
      [](const Call& call, const std::string& path, std::vector<std::string> kinds, std::vector<std::string> names) {
        if (!call.checks.has_value() || kinds.size() != call.bound.size() || names.size() != call.bound.size()) {
          throw py::value_error("torchreplay.save: want a torchreplay.capture result and a kind and name per bound tensor");
        }
        format::SavedProgram p;
        p.name = call.engine->options().name;
        p.graph = call.engine->shared_graph();
        for (size_t i = 0; i < call.bound.size(); ++i) {
          p.bound.push_back({std::move(kinds[i]), std::move(names[i]), call.bound[i].toTensor()});
        }
        p.fixed = call.checks->fixed;
        p.sizes = call.checks->sizes;
        p.strides = call.checks->strides;
        p.written = call.mutated;
        p.num_outputs = call.num_outputs;
        if (absl::Status s = format::WriteFile(p, path); !s.ok()) Throw(s);
      },
      py::arg("call"), py::arg("path"), py::arg("kinds"), py::arg("names"));
  py::class_<Program>(m, "Program", "A program loaded from a .trp file by the C++ loader (torchreplay/torchreplay.h).")
      .def(
          "__call__",
          [](const Program& p, py::args args) {
            std::vector<c10::IValue> inputs;
            for (auto a : args) inputs.push_back(ToIValue(a));
            std::vector<c10::IValue> out;
            try {
              py::gil_scoped_release no_gil;
              out = p.Run(std::move(inputs));
            } catch (const c10::Error&) {  // as torch raises it: LinAlgError, IndexError, ValueError, ...
              torch::translate_exception_to_python(std::current_exception());
              throw py::error_already_set();
            }
            return FromIValues<py::list>(out, out.size());
          })
      .def("stats", [](const Program& p) { return StatsToDict(p.Stats()); })
      .def("state", [](const Program& p, const std::string& name) {
        at::Tensor t;
        try {
          t = p.State(name);
        } catch (const c10::Error& e) {
          throw py::key_error(e.what_without_backtrace());
        }
        return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
      })
      .def_property_readonly("state_names", &Program::StateNames)
      .def_property_readonly("argument_names", &Program::ArgumentNames);
  m.def(
      "load_program",
      [](const std::string& path, std::optional<replay::EngineOptions> options) {
        try {
          return Load(path, options.value_or(replay::EngineOptions::Defaults()));
        } catch (const c10::Error& e) {
          throw py::value_error(e.what_without_backtrace());
        }
      },
      py::arg("path"), py::arg("options") = py::none());
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchreplay C++ runtime: graph IR, interpreter and replay engine";

  BindGraph(m);
  BindEngineOptions(m);
  BindEngine(m);
  BindCall(m);
  BindTraining(m);
  BindGeneratorWatch(m);
  BindPrograms(m);

  m.def("built_with_cuda", &capture::BuiltWithCuda);
  m.def("_testing_fail_allocations", &memory_pool::FailAllocationsForTesting, py::arg("n"),
        "Test-only: the next n arena growths raise torch.OutOfMemoryError (0: off).");
  m.def("set_log_level", [](int level) { replay::SetLogLevel(ToLogLevel(level)); },
        "The level of the engines made from now on (0 debug ... 3 error): their messages below it "
        "are dropped before they reach the \"torchreplay\" logger.");
  m.def("log_level", [] { return static_cast<int>(replay::DefaultLogLevel()); });
  // Note [One log]: engines hand every message to the logger, which decides.
  replay::SetLogSink(&LogToPython);
  replay::SetLogLevel(replay::LogLevel::kDebug);
  py::module_::import("atexit").attr("register")(
      py::cpp_function([] { replay::SetLogSink(nullptr); }));
}

}  // namespace torchreplay
