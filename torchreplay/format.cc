// The .trp writer and reader (Note [The .trp format] in format.h): each section described once and
// walked both ways (Note [One description per section]); the bytes of plain fields, the tensor
// table and the two directions are format_io.h's, packed quantized weights format_packed.h's. The
// sections stay in this one file (over 600 lines on purpose): each is a description the writer and
// reader share, read together.
#include "torchreplay/format.h"

#include <torch/headeronly/version.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "torchreplay/format_io.h"
#include "torchreplay/format_packed.h"

namespace torchreplay::format {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the .trp format is little-endian");

constexpr char kMagic[8] = {'T', 'O', 'R', 'C', 'H', 'R', 'P', 'L'};
constexpr int kMaxDepth = 16;    // nesting of lists in arguments and values

enum class Tag : uint8_t {
  kNone, kBool, kInt, kDouble, kComplex, kString, kDevice, kWrappedNumber, kTensor,
  kIntList, kDoubleList, kBoolList, kTensorList, kPackedLinear, kPackedCells,  // format_packed.h
};
enum class ArgKind : uint8_t { kConstant, kValue, kList };

// Note [Ops a file may call]
// A .trp's graph computes with ATen ops, each checking its own arguments; a handful do not check
// that what they make stays within a tensor's memory (_reshape_alias, the _unsafe_ indexing ops,
// _index_put_impl_ with unsafe=True, set_ onto another storage) or reach the file system
// (from_file). A graph a capture makes holds none of them (export's decompositions do not emit
// them), and a hostile file could read or write outside its tensors through them: the reader
// refuses them, and every op outside aten, prims and torchreplay (custom ops, collectives).
// The library rule alone (the writer's too: a capture's custom ops are refused at the save).
std::string OtherLibrary(const std::string& op) {
  const std::string ns = op.substr(0, op.find("::"));
  // quantize_dynamic's Linears (Note [Packed quantized Linears] in python/torchreplay/packed.py):
  // their packed weights are made by the reader, from checked tensors.
  if (op == "quantized::linear_dynamic" || op == "quantized::linear_dynamic_fp16") return "";
  if (ns != "aten" && ns != "prims" && ns != "torchreplay") {
    return "ops outside aten, prims and torchreplay are not loaded";
  }
  return "";
}

std::string Refused(const std::string& op) {
  if (std::string why = OtherLibrary(op); !why.empty()) return why;
  const std::string name = op.substr(op.find("::") + 2, op.find('.') == std::string::npos ? std::string::npos
                                                                                             : op.find('.') - op.find("::") - 2);
  for (const char* unchecked : {"_reshape_alias", "_reshape_alias_copy", "set_", "from_file", "_unsafe_index",
                                "_unsafe_index_put", "_unsafe_masked_index", "_unsafe_masked_index_put_accumulate",
                                "_nested_view_from_buffer", "_nested_view_from_buffer_copy", "_nested_view_from_jagged"}) {
    if (name == unchecked) return "it does not check that it stays within its tensors' memory, or it reads files";
  }
  return "";
}

// ------------------------------------------------------------------------------------ the sections

// Note [One description per section]
// Each section of the payload is described once, by a function template over the direction: Out
// appends the fields of a program being saved, In reads them back, each checked as it comes
// (Reader's bounds, then the description's own Check calls, which Out skips). The writer and the
// reader walk the same description, so they cannot drift apart. What only one side does is
// outside the descriptions: turning a graph into records (RecordOf) and records back into a graph
// through GraphBuilder (GraphBuild), with the refusals of Note [Ops a file may call]. Out and In
// are in format_io.h.

// A value's tag (Note [The .trp format]); Unsupported for a kind a file cannot hold.
Tag TagOf(const c10::IValue& v) {
  if (v.isNone()) return Tag::kNone;
  if (v.isBool()) return Tag::kBool;
  if (v.isInt()) return Tag::kInt;
  if (v.isDouble()) return Tag::kDouble;
  if (v.isComplexDouble()) return Tag::kComplex;
  if (v.isString()) return Tag::kString;
  if (v.isDevice()) return Tag::kDevice;
  if (v.isTensor()) return v.toTensor().unsafeGetTensorImpl()->is_wrapped_number() ? Tag::kWrappedNumber : Tag::kTensor;
  if (v.isIntList()) return Tag::kIntList;
  if (v.isDoubleList()) return Tag::kDoubleList;
  if (v.isBoolList()) return Tag::kBoolList;
  if (v.isTensorList()) return Tag::kTensorList;
  if (IsPackedLinear(v)) return Tag::kPackedLinear;
  if (IsPackedCells(v)) return Tag::kPackedCells;
  throw Unsupported{absl::StrCat("a constant of kind ", v.tagKind())};
}

// A list of numbers: its count, then each.
template <class T, class IO>
std::vector<T> NumberList(IO& io, std::vector<T> l, const char* what) {
  io.Count(l, what, sizeof(T));
  for (T& x : l) io.template Num<T>(x, what);
  return l;
}

// A value: its tag, then its fields. `v` is the value written (Out) or read (In). Over 80 lines:
// one case per tag, each that tag's fields in the file's order.
template <class IO>
void ValueFields(IO& io, c10::IValue& v, int depth = 0) {
  io.Check(depth <= kMaxDepth, "values nested too deep");
  uint8_t tag = IO::kWriting ? static_cast<uint8_t>(TagOf(v)) : 0;
  io.template Num<uint8_t>(tag, "value tag");
  switch (static_cast<Tag>(tag)) {
    case Tag::kNone:
      v = c10::IValue();
      return;
    case Tag::kBool: {
      uint8_t b = IO::kWriting && v.toBool();
      io.template Num<uint8_t>(b, "bool");
      v = c10::IValue(b != 0);
      return;
    }
    case Tag::kInt: {
      int64_t x = IO::kWriting ? v.toInt() : 0;
      io.template Num<int64_t>(x, "int");
      v = c10::IValue(x);
      return;
    }
    case Tag::kDouble: {
      double x = IO::kWriting ? v.toDouble() : 0;
      io.template Num<double>(x, "float");
      v = c10::IValue(x);
      return;
    }
    case Tag::kComplex: {
      const c10::complex<double> c = IO::kWriting ? v.toComplexDouble() : c10::complex<double>();
      double re = c.real(), im = c.imag();
      io.template Num<double>(re, "complex");
      io.template Num<double>(im, "complex");
      v = c10::IValue(c10::complex<double>(re, im));
      return;
    }
    case Tag::kString: {
      std::string s = IO::kWriting ? v.toStringRef() : "";
      io.Str(s, "string");
      v = c10::IValue(std::move(s));
      return;
    }
    case Tag::kDevice: {
      const c10::Device d = IO::kWriting ? v.toDevice() : c10::Device(c10::kCPU);
      int8_t type = static_cast<int8_t>(d.type()), index = d.index();
      io.template Num<int8_t>(type, "device");
      io.template Num<int8_t>(index, "device index");
      const auto t = static_cast<c10::DeviceType>(type);
      io.Check((t == c10::DeviceType::CPU || t == c10::DeviceType::CUDA || t == c10::DeviceType::Meta) && index >= -1,
               "unknown device");
      v = c10::IValue(c10::Device(t, index));
      return;
    }
    case Tag::kWrappedNumber: {  // the number, wrapped again by the builder where a Tensor goes
      c10::IValue number = IO::kWriting ? c10::IValue(v.toTensor().item()) : c10::IValue();
      ValueFields(io, number, depth + 1);
      io.Check(number.isInt() || number.isDouble() || number.isBool() || number.isComplexDouble(),
               "a wrapped number that is none");
      v = number;
      return;
    }
    case Tag::kTensor: {
      at::Tensor t = IO::kWriting ? v.toTensor() : at::Tensor();
      io.Tensor(t);
      v = c10::IValue(t);
      return;
    }
    case Tag::kIntList:
      v = c10::IValue(NumberList<int64_t>(io, IO::kWriting ? v.toIntVector() : std::vector<int64_t>(), "int list"));
      return;
    case Tag::kDoubleList:
      v = c10::IValue(NumberList<double>(io, IO::kWriting ? v.toDoubleVector() : std::vector<double>(), "float list"));
      return;
    case Tag::kBoolList: {
      std::vector<uint8_t> l;
      if (IO::kWriting) {
        for (bool b : v.toBoolList()) l.push_back(b);
      }
      io.Count(l, "bool list");
      c10::List<bool> out;
      for (uint8_t& b : l) {
        io.template Num<uint8_t>(b, "bool list");
        out.push_back(b != 0);
      }
      v = c10::IValue(out);
      return;
    }
    case Tag::kTensorList: {
      std::vector<at::Tensor> l = IO::kWriting ? v.toTensorVector() : std::vector<at::Tensor>();
      io.Count(l, "tensor list", sizeof(uint32_t));
      for (at::Tensor& t : l) io.Tensor(t);
      v = c10::IValue(l);
      return;
    }
    case Tag::kPackedLinear:
      PackedLinearFields(io, v);
      return;
    case Tag::kPackedCells:
      PackedCellsFields(io, v);
      return;
  }
  io.Check(false, "unknown value tag");
}

// An argument: its kind, then a constant, a value id (the file's), or the elements of a list.
template <class IO>
void ArgFields(IO& io, capture::Arg& a, int depth = 0) {
  io.Check(depth <= kMaxDepth, "arguments nested too deep");
  uint8_t kind = static_cast<uint8_t>(a.kind);
  io.template Num<uint8_t>(kind, "argument kind");
  switch (static_cast<ArgKind>(kind)) {
    case ArgKind::kConstant:
      a.kind = capture::Arg::Kind::kConstant;
      ValueFields(io, a.constant);
      return;
    case ArgKind::kValue:
      a.kind = capture::Arg::Kind::kValue;
      io.template Num<int32_t>(a.value, "value id");
      return;
    case ArgKind::kList:
      a.kind = capture::Arg::Kind::kList;
      io.Count(a.elems, "list argument");
      for (capture::Arg& e : a.elems) ArgFields(io, e, depth + 1);
      return;
  }
  io.Check(false, "unknown argument kind");
}

// The graph section's records, with the file's value ids.
struct InputRecord {
  int32_t id = 0;
  std::string name;
  uint8_t type = 0;
  std::optional<capture::TensorSpec> spec;
};
struct NodeRecord {
  uint8_t kind = 0;
  std::string name;
  std::vector<int32_t> outputs;
  std::string op;                                           // kOp
  std::vector<std::pair<std::string, capture::Arg>> args;   // kOp: by schema name; kSymArith: unnamed
  int32_t list = 0;                                         // kGetItem
  int64_t index = 0;
  uint8_t sym_op = 0;                                       // kSymArith
};
struct GraphRecord {
  uint32_t num_values = 0;
  std::vector<InputRecord> inputs;
  std::vector<NodeRecord> nodes;
  std::vector<capture::Arg> outputs;
  std::vector<int32_t> static_inputs;
};

template <class IO>
void InputFields(IO& io, InputRecord& in) {
  io.template Num<int32_t>(in.id, "input id");
  io.Str(in.name, "input name");
  io.template Num<uint8_t>(in.type, "input type");
  io.Check(in.type <= static_cast<uint8_t>(capture::ValueType::kNone), "unknown input type");
  uint8_t has_spec = in.spec.has_value();
  io.template Num<uint8_t>(has_spec, "input spec");
  if (has_spec == 0) return;
  if (!in.spec.has_value()) in.spec.emplace();
  io.Dtype(in.spec->dtype, "an input");
  int8_t device = static_cast<int8_t>(in.spec->device);
  io.template Num<int8_t>(device, "input device");
  in.spec->device = static_cast<c10::DeviceType>(device);
  io.template Num<int64_t>(in.spec->dim, "input rank");
  io.Check((in.spec->device == c10::DeviceType::CPU || in.spec->device == c10::DeviceType::CUDA) &&
               in.spec->dim >= 0 && in.spec->dim <= kMaxRank,
           "an input's device or rank");
}

template <class IO>
void NodeFields(IO& io, NodeRecord& n) {
  io.template Num<uint8_t>(n.kind, "node kind");
  io.Str(n.name, "node name");
  io.Count(n.outputs, "node outputs", sizeof(int32_t));
  for (int32_t& o : n.outputs) io.template Num<int32_t>(o, "node output");
  switch (static_cast<capture::NodeKind>(n.kind)) {
    case capture::NodeKind::kOp:
      io.Str(n.op, "op");
      io.Count(n.args, "op arguments");
      for (auto& [key, arg] : n.args) {
        io.Str(key, "argument name");
        ArgFields(io, arg);
      }
      return;
    case capture::NodeKind::kGetItem:
      io.template Num<int32_t>(n.list, "getitem list");
      io.template Num<int64_t>(n.index, "getitem index");
      return;
    case capture::NodeKind::kSymArith:
      io.template Num<uint8_t>(n.sym_op, "arithmetic op");
      io.Check(n.sym_op <= static_cast<uint8_t>(capture::SymOp::kSqrt), "unknown arithmetic op");
      io.Count(n.args, "operands");
      for (auto& [unnamed, arg] : n.args) ArgFields(io, arg);
      return;
  }
  io.Check(false, "unknown node kind");
}

template <class IO>
void GraphFields(IO& io, GraphRecord& g) {
  io.Bound(g.num_values, "values");
  io.Count(g.inputs, "inputs");
  for (InputRecord& in : g.inputs) InputFields(io, in);
  io.Count(g.nodes, "nodes");
  for (NodeRecord& n : g.nodes) NodeFields(io, n);
  io.Count(g.outputs, "outputs");
  for (capture::Arg& a : g.outputs) ArgFields(io, a);
  io.Count(g.static_inputs, "static inputs", sizeof(int32_t));
  for (int32_t& s : g.static_inputs) io.template Num<int32_t>(s, "static input");
}

// The sections after the graph: the bound tensors, then what the trace assumed of the arguments.
template <class IO>
void ArgumentFields(IO& io, SavedProgram& p) {
  io.Count(p.bound, "bound tensors", 12);
  for (BoundTensor& b : p.bound) {
    io.Tensor(b.tensor);
    io.Str(b.kind, "bound kind");
    io.Str(b.name, "bound name");
  }
  const size_t inputs = p.graph->inputs().size();
  io.Check(p.bound.size() <= inputs, "more bound tensors than graph inputs");
  const int64_t last_arg = static_cast<int64_t>(inputs - std::min(p.bound.size(), inputs)) - 1;
  const char* out_of_range = "an argument index is out of range";
  io.Count(p.fixed, "fixed numbers", 5);
  for (auto& [arg, value] : p.fixed) {
    io.template Num<int32_t>(arg, "fixed argument", 0, last_arg, out_of_range);
    ValueFields(io, value);
    io.Check(value.isInt() || value.isDouble() || value.isBool(), "a fixed argument that is no number");
  }
  io.Count(p.sizes, "size checks", 7 * sizeof(int64_t));
  for (replay::SizeCheck& c : p.sizes) {
    io.template Num<int64_t>(c.arg, "size check", 0, last_arg, out_of_range);
    io.template Num<int64_t>(c.dim, "size check", 0, kMaxRank - 1, "a size check's dim is out of range");
    io.template Num<int64_t>(c.lo, "size check");
    io.template Num<int64_t>(c.hi, "size check");
    io.template Num<int64_t>(c.group, "size check", -1, kMaxRank * 1024, "a size check's group is out of range");
    io.template Num<int64_t>(c.coef, "size check");
    io.template Num<int64_t>(c.offset, "size check");
    if (!IO::kWriting) {
      const auto& spec = p.graph->values()[p.graph->inputs()[p.bound.size() + c.arg]].spec;
      io.Check(!spec.has_value() || c.dim < spec->dim, "a size check's dim is beyond its argument's rank");
    }
  }
  io.Count(p.strides, "stride checks", sizeof(int64_t) + sizeof(uint32_t));  // arg, an empty list
  for (replay::StrideCheck& c : p.strides) {
    io.template Num<int64_t>(c.arg, "stride check", 0, last_arg, out_of_range);
    c.strides = NumberList<int64_t>(io, std::move(c.strides), "stride check");
    io.Check(c.strides.size() <= static_cast<size_t>(kMaxRank), "a stride check's rank is out of range");
  }
  io.Count(p.written, "written arguments", sizeof(int32_t));
  for (int& i : p.written) io.template Num<int32_t>(i, "written argument", 0, last_arg, out_of_range);
  io.template Num<int32_t>(p.num_outputs, "outputs", -1, static_cast<int64_t>(p.graph->outputs().size()),
                           "the number of outputs is out of range");
}

// The writer's side: a graph as the graph section's records.
GraphRecord RecordOf(const capture::Graph& g) {
  GraphRecord rec;
  rec.num_values = static_cast<uint32_t>(g.values().size());
  for (capture::ValueId id : g.inputs()) {
    const capture::ValueInfo& v = g.values()[id];
    rec.inputs.push_back({id, v.name, static_cast<uint8_t>(v.type), v.spec});
  }
  for (const capture::Node& n : g.nodes()) {
    NodeRecord r;
    r.kind = static_cast<uint8_t>(n.kind);
    r.name = n.name;
    r.outputs.assign(n.outputs.begin(), n.outputs.end());
    switch (n.kind) {
      case capture::NodeKind::kOp: {
        r.op = capture::OperatorName(*n.op);
        // A capture's check that its folded weights were not written since (Note [PT2E's weights
        // dequantized once]): a loaded program's weights are the file's, which nothing else writes.
        if (r.op == "torchreplay::check_frozen") continue;
        // (ATen's unchecked ops never come from a capture: only the reader refuses them, what a
        // hostile file meets and format_test writes.)
        if (const std::string why = OtherLibrary(r.op); !why.empty()) {
          throw Unsupported{absl::StrCat("node '", n.name, "' calling ", r.op, " (", why,
                                         ": Note [Ops a file may call] in torchreplay/format.cc)")};
        }
        const auto& formals = n.op->schema().arguments();
        for (size_t i = 0; i < n.args.size(); ++i) r.args.emplace_back(formals[i].name(), n.args[i]);
        break;
      }
      case capture::NodeKind::kGetItem:
        r.list = n.args[0].value;
        r.index = n.index;
        break;
      case capture::NodeKind::kSymArith:
        r.sym_op = static_cast<uint8_t>(n.sym_op);
        for (const capture::Arg& a : n.args) r.args.emplace_back("", a);
        break;
    }
    rec.nodes.push_back(std::move(r));
  }
  rec.outputs = g.outputs();
  rec.static_inputs.assign(g.static_inputs().begin(), g.static_inputs().end());
  return rec;
}

// The reader's side: the graph rebuilt from its records through GraphBuilder, the file's value
// ids mapped to the builder's, every op resolved and checked in this LibTorch.
class GraphBuild {
 public:
  std::shared_ptr<const capture::Graph> Build(GraphRecord& g) {
    ids_.assign(g.num_values, -1);
    for (InputRecord& in : g.inputs) {
      Define(in.id, b_.AddInput(std::move(in.name), static_cast<capture::ValueType>(in.type), in.spec));
    }
    for (NodeRecord& n : g.nodes) Node(n);
    for (capture::Arg& a : g.outputs) Resolve(a);
    Check(b_.SetOutputs(std::move(g.outputs)));
    Check(b_.SetStaticInputs(std::vector<int>(g.static_inputs.begin(), g.static_inputs.end())));
    return Check(b_.Build());
  }

 private:
  void Node(NodeRecord& n) {
    std::vector<capture::ValueId> made;
    switch (static_cast<capture::NodeKind>(n.kind)) {
      case capture::NodeKind::kOp: {
        if (const std::string why = Refused(n.op); !why.empty()) {
          throw Bad{absl::StatusCode::kFailedPrecondition,
                    absl::StrCat("node '", n.name, "' calls ", n.op, ", which a loaded program may not: ", why,
                                 " (Note [Ops a file may call] in torchreplay/format.cc)")};
        }
        for (auto& [key, arg] : n.args) {
          if (n.op.rfind("aten::_index_put_impl_", 0) == 0 && key == "unsafe" &&
              arg.kind == capture::Arg::Kind::kConstant && arg.constant.isBool() && arg.constant.toBool()) {
            throw Bad{absl::StatusCode::kFailedPrecondition,
                      absl::StrCat("node '", n.name, "' calls ", n.op, " with unsafe=True (no bounds checks), which a "
                                   "loaded program may not (Note [Ops a file may call] in torchreplay/format.cc)")};
          }
          Resolve(arg);
        }
        made = Check(b_.AddOp(n.op, {}, std::move(n.args), n.name));
        break;
      }
      case capture::NodeKind::kGetItem:
        made = {Check(b_.AddGetItem(Id(n.list), n.index, n.name))};
        break;
      case capture::NodeKind::kSymArith: {
        std::vector<capture::Arg> operands;
        for (auto& [unnamed, arg] : n.args) {
          Resolve(arg);
          operands.push_back(std::move(arg));
        }
        made = {Check(b_.AddSymArith(static_cast<capture::SymOp>(n.sym_op), std::move(operands), n.name))};
        break;
      }
    }
    if (made.size() != n.outputs.size()) {
      throw Bad{absl::StatusCode::kFailedPrecondition,
                absl::StrCat("node '", n.name, "' has ", made.size(), " outputs in this LibTorch, ", n.outputs.size(),
                             " in the file (the op's schema changed)")};
    }
    for (size_t i = 0; i < made.size(); ++i) Define(n.outputs[i], made[i]);
  }

  void Resolve(capture::Arg& a) {
    if (a.kind == capture::Arg::Kind::kValue) a.value = Id(a.value);
    for (capture::Arg& e : a.elems) Resolve(e);
  }
  void Define(int32_t file_id, capture::ValueId id) {
    if (file_id < 0 || static_cast<size_t>(file_id) >= ids_.size() || ids_[file_id] >= 0) {
      Corrupt("a value id is out of range or defined twice");
    }
    ids_[file_id] = id;
  }
  capture::ValueId Id(int32_t file_id) {
    if (file_id < 0 || static_cast<size_t>(file_id) >= ids_.size() || ids_[file_id] < 0) {
      Corrupt("a value is used before it is defined");
    }
    return ids_[file_id];
  }
  template <typename T>
  T Check(absl::StatusOr<T> s) {
    if (!s.ok()) Check(s.status());
    return *std::move(s);
  }
  void Check(const absl::Status& s) {
    if (!s.ok()) {
      throw Bad{absl::StatusCode::kFailedPrecondition,
                absl::StrCat("the graph does not build in this LibTorch (torch ", TORCH_VERSION, "): ", s.message())};
    }
  }

  capture::GraphBuilder b_;
  std::vector<capture::ValueId> ids_;
};

// The payload of a .trp file after its header (magic, version, length, checksum), each checked.
absl::StatusOr<std::string_view> Payload(std::string_view bytes) {
  Reader header(bytes);
  if (bytes.size() < kHeaderBytes || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::FailedPreconditionError("not a torchreplay program (.trp) file: its first bytes are not TORCHRPL");
  }
  header.Bytes(sizeof(kMagic), "magic");
  const uint32_t version = header.Get<uint32_t>("format version");
  if (version != kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the file is in .trp format version ", version, "; this torchreplay reads version ", kFormatVersion,
        " (save the model again with this torchreplay)"));
  }
  header.Get<uint32_t>("reserved");
  const uint64_t length = header.Get<uint64_t>("payload length");
  const uint64_t checksum = header.Get<uint64_t>("checksum");
  if (length != bytes.size() - kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("the file is truncated or has trailing bytes: its header says ", length,
                                            " bytes follow, ", bytes.size() - kHeaderBytes, " do"));
  }
  const std::string_view payload = bytes.substr(kHeaderBytes);
  if (Checksum(payload) != checksum) {
    return absl::DataLossError("the file is corrupted: its checksum does not match its contents");
  }
  return payload;
}

}  // namespace

uint64_t Checksum(std::string_view payload) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a 64
  for (unsigned char c : payload) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

// The file's sections in the order Note [The .trp format] lists them.
absl::StatusOr<std::string> Serialize(const SavedProgram& program) {
  try {
    SavedProgram p = program;  // (the descriptions take fields by reference; Out only reads them)
    TensorTable tensors;
    for (const BoundTensor& b : p.bound) tensors.Add(b.tensor);
    Writer graph;  // written after the tensor table its constants enter
    Out graph_out(graph, tensors);
    GraphRecord g = RecordOf(*p.graph);
    GraphFields(graph_out, g);

    Writer w;
    Out out(w, tensors);
    std::string torch = TORCH_VERSION;
    out.Str(torch, "torch version");
    out.Str(p.name, "name");
    tensors.Write(w);
    out.Seal(tensors.size());
    w.bytes() += graph.bytes();
    ArgumentFields(out, p);

    Writer file;
    file.bytes().append(kMagic, sizeof(kMagic));
    file.Put<uint32_t>(kFormatVersion);
    file.Put<uint32_t>(0);
    file.Put<uint64_t>(w.bytes().size());
    file.Put<uint64_t>(Checksum(w.bytes()));
    file.bytes() += w.bytes();
    return std::move(file.bytes());
  } catch (const Unsupported& u) {
    return absl::InvalidArgumentError(absl::StrCat("torchreplay.save: the program holds ", u.what,
                                                   ", which a .trp file cannot"));
  }
}

// The sections read back through the same descriptions, each field checked.
absl::StatusOr<SavedProgram> Deserialize(std::string_view bytes) {
  try {
    const absl::StatusOr<std::string_view> payload = Payload(bytes);
    if (!payload.ok()) return payload.status();
    Reader r(*payload);
    const std::string torch = r.Str("torch version");
    if (torch != TORCH_VERSION) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the file was saved with torch ", torch, " and this LibTorch is ", TORCH_VERSION,
          "; ops and their numerics may differ: save it again with torch ", TORCH_VERSION));
    }
    SavedProgram p;
    p.name = r.Str("name");
    const std::vector<at::Tensor> tensors = ReadTensors(r);
    In in(r, tensors);
    GraphRecord g;
    GraphFields(in, g);
    p.graph = GraphBuild().Build(g);
    ArgumentFields(in, p);
    if (!r.done()) Corrupt("bytes after the last section");
    return p;
  } catch (const Bad& b) {
    return absl::Status(b.code, b.what);
  } catch (const c10::Error& e) {
    return absl::DataLossError(absl::StrCat("the file is corrupted: ", e.what_without_backtrace()));
  }
}

absl::Status WriteFile(const SavedProgram& program, const std::string& path) {
  absl::StatusOr<std::string> bytes = Serialize(program);
  if (!bytes.ok()) return bytes.status();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
  f.close();
  if (!f) return absl::UnavailableError(absl::StrCat("torchreplay.save: cannot write '", path, "'"));
  return absl::OkStatus();
}

absl::StatusOr<SavedProgram> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("torchreplay::Load: cannot open '", path, "'"));
  std::stringstream buffer;
  buffer << f.rdbuf();
  const std::string bytes = buffer.str();
  absl::StatusOr<SavedProgram> p = Deserialize(bytes);
  if (!p.ok()) return absl::Status(p.status().code(), absl::StrCat("torchreplay::Load('", path, "'): ", p.status().message()));
  return p;
}

}  // namespace torchreplay::format
