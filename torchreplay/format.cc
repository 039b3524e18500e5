// The .trp writer and reader (Note [The .trp format] in format.h): each section's write
// (Serialize, WriteGraph, PutValue, PutArg) and read (Deserialize, GraphReader, ValueReader) in
// one file, so that a change to one is seen next to the other; the bytes of plain fields and the
// tensor table, both ways, are format_io.h's.
#include "torchreplay/format.h"

#include <torch/headeronly/version.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "torchreplay/format_io.h"

namespace torchreplay::format {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the .trp format is little-endian");

constexpr char kMagic[8] = {'T', 'O', 'R', 'C', 'H', 'R', 'P', 'L'};
constexpr int kMaxDepth = 16;    // nesting of lists in arguments and values

enum class Tag : uint8_t {
  kNone, kBool, kInt, kDouble, kComplex, kString, kDevice, kWrappedNumber, kTensor,
  kIntList, kDoubleList, kBoolList, kTensorList,
};
enum class ArgKind : uint8_t { kConstant, kValue, kList };

// Note [Ops a file may call]
// A .trp's graph computes with ATen ops, each checking its own arguments; a handful do not check
// that what they make stays within a tensor's memory (_reshape_alias, the _unsafe_ indexing ops,
// _index_put_impl_ with unsafe=True, set_ onto another storage) or reach the file system
// (from_file). A graph a capture makes holds none of them (export's decompositions do not emit
// them), and a hostile file could read or write outside its tensors through them: the reader
// refuses them, and every op outside aten, prims and torchreplay (custom ops, collectives).
std::string Refused(const std::string& op) {
  const std::string ns = op.substr(0, op.find("::"));
  if (ns != "aten" && ns != "prims" && ns != "torchreplay") {
    return "ops outside aten, prims and torchreplay are not loaded";
  }
  const std::string name = op.substr(op.find("::") + 2, op.find('.') == std::string::npos ? std::string::npos
                                                                                             : op.find('.') - op.find("::") - 2);
  for (const char* unchecked : {"_reshape_alias", "_reshape_alias_copy", "set_", "from_file", "_unsafe_index",
                                "_unsafe_index_put", "_unsafe_masked_index", "_unsafe_masked_index_put_accumulate",
                                "_nested_view_from_buffer", "_nested_view_from_buffer_copy", "_nested_view_from_jagged"}) {
    if (name == unchecked) return "it does not check that it stays within its tensors' memory, or it reads files";
  }
  return "";
}

// ------------------------------------------------------------------------------------ writing

void PutValue(Writer& w, TensorTable& tensors, const c10::IValue& v) {
  if (v.isNone()) {
    w.Put(Tag::kNone);
  } else if (v.isBool()) {
    w.Put(Tag::kBool);
    w.Put<uint8_t>(v.toBool());
  } else if (v.isInt()) {
    w.Put(Tag::kInt);
    w.Put<int64_t>(v.toInt());
  } else if (v.isDouble()) {
    w.Put(Tag::kDouble);
    w.Put<double>(v.toDouble());
  } else if (v.isComplexDouble()) {
    w.Put(Tag::kComplex);
    const c10::complex<double> c = v.toComplexDouble();
    w.Put<double>(c.real());
    w.Put<double>(c.imag());
  } else if (v.isString()) {
    w.Put(Tag::kString);
    w.Str(v.toStringRef());
  } else if (v.isDevice()) {
    w.Put(Tag::kDevice);
    w.Put<int8_t>(static_cast<int8_t>(v.toDevice().type()));
    w.Put<int8_t>(v.toDevice().index());
  } else if (v.isTensor() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) {
    w.Put(Tag::kWrappedNumber);  // the number, wrapped again by the builder as eager wraps it
    PutValue(w, tensors, c10::IValue(v.toTensor().item()));
  } else if (v.isTensor()) {
    w.Put(Tag::kTensor);
    w.Put<uint32_t>(tensors.Add(v.toTensor()));
  } else if (v.isIntList()) {
    w.Put(Tag::kIntList);
    w.Ints(v.toIntVector());
  } else if (v.isDoubleList()) {
    w.Put(Tag::kDoubleList);
    const auto l = v.toDoubleVector();
    w.Put<uint32_t>(static_cast<uint32_t>(l.size()));
    for (double d : l) w.Put<double>(d);
  } else if (v.isBoolList()) {
    w.Put(Tag::kBoolList);
    const auto l = v.toBoolList();
    w.Put<uint32_t>(static_cast<uint32_t>(l.size()));
    for (bool b : l) w.Put<uint8_t>(b);
  } else if (v.isTensorList()) {
    w.Put(Tag::kTensorList);
    const auto l = v.toTensorVector();
    w.Put<uint32_t>(static_cast<uint32_t>(l.size()));
    for (const at::Tensor& t : l) w.Put<uint32_t>(tensors.Add(t));
  } else {
    throw Unsupported{absl::StrCat("a constant of kind ", v.tagKind())};
  }
}

void PutArg(Writer& w, TensorTable& tensors, const capture::Arg& a) {
  switch (a.kind) {
    case capture::Arg::Kind::kConstant:
      w.Put(ArgKind::kConstant);
      PutValue(w, tensors, a.constant);
      break;
    case capture::Arg::Kind::kValue:
      w.Put(ArgKind::kValue);
      w.Put<int32_t>(a.value);
      break;
    case capture::Arg::Kind::kList:
      w.Put(ArgKind::kList);
      w.Put<uint32_t>(static_cast<uint32_t>(a.elems.size()));
      for (const capture::Arg& e : a.elems) PutArg(w, tensors, e);
      break;
  }
}

// ------------------------------------------------------------------------------------ reading

class ValueReader {
 public:
  ValueReader(Reader& r, const std::vector<at::Tensor>& tensors) : r_(r), tensors_(tensors) {}

  c10::IValue Value(int depth = 0) {
    if (depth > kMaxDepth) Corrupt("values nested too deep");
    switch (static_cast<Tag>(r_.Get<uint8_t>("value tag"))) {
      case Tag::kNone: return c10::IValue();
      case Tag::kBool: return c10::IValue(r_.Get<uint8_t>("bool") != 0);
      case Tag::kInt: return c10::IValue(r_.Get<int64_t>("int"));
      case Tag::kDouble: return c10::IValue(r_.Get<double>("float"));
      case Tag::kComplex: {
        const double re = r_.Get<double>("complex"), im = r_.Get<double>("complex");
        return c10::IValue(c10::complex<double>(re, im));
      }
      case Tag::kString: return c10::IValue(r_.Str("string"));
      case Tag::kDevice: {
        const auto type = static_cast<c10::DeviceType>(r_.Get<int8_t>("device"));
        const int8_t index = r_.Get<int8_t>("device index");
        if ((type != c10::DeviceType::CPU && type != c10::DeviceType::CUDA && type != c10::DeviceType::Meta) ||
            index < -1) {
          Corrupt("unknown device");
        }
        return c10::IValue(c10::Device(type, index));
      }
      case Tag::kWrappedNumber: {
        c10::IValue v = Value(depth + 1);
        if (!(v.isInt() || v.isDouble() || v.isBool() || v.isComplexDouble())) Corrupt("a wrapped number that is none");
        return v;  // the builder wraps it where a Tensor goes
      }
      case Tag::kTensor: return c10::IValue(Tensor());
      case Tag::kIntList: return c10::IValue(r_.Ints("int list"));
      case Tag::kDoubleList: {
        std::vector<double> l(r_.Count("float list", sizeof(double)));
        for (double& d : l) d = r_.Get<double>("float list");
        return c10::IValue(l);
      }
      case Tag::kBoolList: {
        c10::List<bool> l;
        for (uint32_t n = r_.Count("bool list"); n > 0; --n) l.push_back(r_.Get<uint8_t>("bool list") != 0);
        return c10::IValue(l);
      }
      case Tag::kTensorList: {
        std::vector<at::Tensor> l(r_.Count("tensor list", sizeof(uint32_t)));
        for (at::Tensor& t : l) t = Tensor();
        return c10::IValue(l);
      }
    }
    Corrupt("unknown value tag");
  }

  at::Tensor Tensor() {
    const uint32_t i = r_.Get<uint32_t>("tensor index");
    if (i >= tensors_.size()) Corrupt("a tensor index is out of range");
    return tensors_[i];
  }

 private:
  Reader& r_;
  const std::vector<at::Tensor>& tensors_;
};

// The graph, rebuilt through GraphBuilder: value ids in the file are mapped to the builder's.
class GraphReader {
 public:
  GraphReader(Reader& r, ValueReader& values) : r_(r), values_(values) {}

  std::shared_ptr<const capture::Graph> Read() {
    const uint32_t num_values = r_.Count("values");
    ids_.assign(num_values, -1);
    for (uint32_t n = r_.Count("inputs"); n > 0; --n) {
      const int32_t id = r_.Get<int32_t>("input id");
      std::string name = r_.Str("input name");
      const uint8_t type = r_.Get<uint8_t>("input type");
      if (type > static_cast<uint8_t>(capture::ValueType::kNone)) Corrupt("unknown input type");
      std::optional<capture::TensorSpec> spec;
      if (r_.Get<uint8_t>("input spec") != 0) {
        spec = capture::TensorSpec{ReadDtype(r_), static_cast<c10::DeviceType>(r_.Get<int8_t>("input device")),
                                   r_.Get<int64_t>("input rank")};
        if ((spec->device != c10::DeviceType::CPU && spec->device != c10::DeviceType::CUDA) || spec->dim < 0 ||
            spec->dim > kMaxRank) {
          Corrupt("an input's device or rank");
        }
      }
      Define(id, b_.AddInput(std::move(name), static_cast<capture::ValueType>(type), spec));
    }
    for (uint32_t n = r_.Count("nodes"); n > 0; --n) Node();
    std::vector<capture::Arg> outputs(r_.Count("outputs"));
    for (capture::Arg& a : outputs) a = Arg();
    Check(b_.SetOutputs(std::move(outputs)));
    std::vector<int> statics(r_.Count("static inputs", sizeof(int32_t)));
    for (int& s : statics) s = r_.Get<int32_t>("static input");
    Check(b_.SetStaticInputs(std::move(statics)));
    return Check(b_.Build());
  }

 private:
  void Node() {
    const uint8_t kind = r_.Get<uint8_t>("node kind");
    std::string name = r_.Str("node name");
    std::vector<int32_t> outs(r_.Count("node outputs", sizeof(int32_t)));
    for (int32_t& o : outs) o = r_.Get<int32_t>("node output");
    std::vector<capture::ValueId> made;
    switch (static_cast<capture::NodeKind>(kind)) {
      case capture::NodeKind::kOp: {
        const std::string op = r_.Str("op");
        if (const std::string why = Refused(op); !why.empty()) {
          throw Bad{absl::StatusCode::kFailedPrecondition,
                    absl::StrCat("node '", name, "' calls ", op, ", which a loaded program may not: ", why,
                                 " (Note [Ops a file may call] in torchreplay/format.cc)")};
        }
        std::vector<std::pair<std::string, capture::Arg>> kwargs(r_.Count("op arguments"));
        for (auto& [key, arg] : kwargs) {
          key = r_.Str("argument name");
          arg = Arg();
          if (op.rfind("aten::_index_put_impl_", 0) == 0 && key == "unsafe" && arg.kind == capture::Arg::Kind::kConstant &&
              arg.constant.isBool() && arg.constant.toBool()) {
            throw Bad{absl::StatusCode::kFailedPrecondition,
                      absl::StrCat("node '", name, "' calls ", op, " with unsafe=True (no bounds checks), which a "
                                   "loaded program may not (Note [Ops a file may call] in torchreplay/format.cc)")};
          }
        }
        made = Check(b_.AddOp(op, {}, std::move(kwargs), name));
        break;
      }
      case capture::NodeKind::kGetItem: {
        const capture::ValueId list = Id(r_.Get<int32_t>("getitem list"));
        made = {Check(b_.AddGetItem(list, r_.Get<int64_t>("getitem index"), name))};
        break;
      }
      case capture::NodeKind::kSymArith: {
        const uint8_t op = r_.Get<uint8_t>("arithmetic op");
        if (op > static_cast<uint8_t>(capture::SymOp::kSqrt)) Corrupt("unknown arithmetic op");
        std::vector<capture::Arg> operands(r_.Count("operands"));
        for (capture::Arg& a : operands) a = Arg();
        made = {Check(b_.AddSymArith(static_cast<capture::SymOp>(op), std::move(operands), name))};
        break;
      }
      default:
        Corrupt("unknown node kind");
    }
    if (made.size() != outs.size()) {
      throw Bad{absl::StatusCode::kFailedPrecondition,
                absl::StrCat("node '", name, "' has ", made.size(), " outputs in this LibTorch, ", outs.size(),
                             " in the file (the op's schema changed)")};
    }
    for (size_t i = 0; i < outs.size(); ++i) Define(outs[i], made[i]);
  }

  capture::Arg Arg(int depth = 0) {
    if (depth > kMaxDepth) Corrupt("arguments nested too deep");
    switch (static_cast<ArgKind>(r_.Get<uint8_t>("argument kind"))) {
      case ArgKind::kConstant: return capture::Arg::Const(values_.Value());
      case ArgKind::kValue: return capture::Arg::Ref(Id(r_.Get<int32_t>("value id")));
      case ArgKind::kList: {
        std::vector<capture::Arg> elems(r_.Count("list argument"));
        for (capture::Arg& e : elems) e = Arg(depth + 1);
        return capture::Arg::List(std::move(elems));
      }
    }
    Corrupt("unknown argument kind");
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

  Reader& r_;
  ValueReader& values_;
  capture::GraphBuilder b_;
  std::vector<capture::ValueId> ids_;
};

// The graph section (Note [The .trp format]): inputs, nodes, outputs, static inputs; the tensors
// its constants hold go into `tensors`.
Writer WriteGraph(const capture::Graph& g, TensorTable& tensors) {
  Writer graph;
  graph.Put<uint32_t>(static_cast<uint32_t>(g.values().size()));
  graph.Put<uint32_t>(static_cast<uint32_t>(g.inputs().size()));
  for (capture::ValueId id : g.inputs()) {
    const capture::ValueInfo& v = g.values()[id];
    graph.Put<int32_t>(id);
    graph.Str(v.name);
    graph.Put<uint8_t>(static_cast<uint8_t>(v.type));
    graph.Put<uint8_t>(v.spec.has_value());
    if (v.spec.has_value()) {
      if (!Storable(v.spec->dtype)) throw Unsupported{absl::StrCat("an input of dtype ", c10::toString(v.spec->dtype))};
      graph.Put<int8_t>(static_cast<int8_t>(v.spec->dtype));
      graph.Put<int8_t>(static_cast<int8_t>(v.spec->device));
      graph.Put<int64_t>(v.spec->dim);
    }
  }
  graph.Put<uint32_t>(static_cast<uint32_t>(g.nodes().size()));
  for (const capture::Node& n : g.nodes()) {
    graph.Put<uint8_t>(static_cast<uint8_t>(n.kind));
    graph.Str(n.name);
    graph.Put<uint32_t>(static_cast<uint32_t>(n.outputs.size()));
    for (capture::ValueId o : n.outputs) graph.Put<int32_t>(o);
    switch (n.kind) {
      case capture::NodeKind::kOp: {
        graph.Str(capture::OperatorName(*n.op));
        const auto& formals = n.op->schema().arguments();
        graph.Put<uint32_t>(static_cast<uint32_t>(n.args.size()));
        for (size_t i = 0; i < n.args.size(); ++i) {
          graph.Str(formals[i].name());
          PutArg(graph, tensors, n.args[i]);
        }
        break;
      }
      case capture::NodeKind::kGetItem:
        graph.Put<int32_t>(n.args[0].value);
        graph.Put<int64_t>(n.index);
        break;
      case capture::NodeKind::kSymArith:
        graph.Put<uint8_t>(static_cast<uint8_t>(n.sym_op));
        graph.Put<uint32_t>(static_cast<uint32_t>(n.args.size()));
        for (const capture::Arg& a : n.args) PutArg(graph, tensors, a);
        break;
    }
  }
  graph.Put<uint32_t>(static_cast<uint32_t>(g.outputs().size()));
  for (const capture::Arg& a : g.outputs()) PutArg(graph, tensors, a);
  graph.Put<uint32_t>(static_cast<uint32_t>(g.static_inputs().size()));
  for (int s : g.static_inputs()) graph.Put<int32_t>(s);
  return graph;
}

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
absl::StatusOr<std::string> Serialize(const SavedProgram& p) {
  try {
    const capture::Graph& g = *p.graph;
    Writer w;
    TensorTable tensors;
    Writer graph = WriteGraph(g, tensors);  // written after the tensor table it refers to

    std::vector<uint32_t> bound;
    for (const BoundTensor& b : p.bound) bound.push_back(tensors.Add(b.tensor));

    w.Str(TORCH_VERSION);
    w.Str(p.name);
    tensors.Write(w);
    w.bytes() += graph.bytes();
    w.Put<uint32_t>(static_cast<uint32_t>(p.bound.size()));
    for (size_t i = 0; i < p.bound.size(); ++i) {
      w.Put<uint32_t>(bound[i]);
      w.Str(p.bound[i].kind);
      w.Str(p.bound[i].name);
    }
    w.Put<uint32_t>(static_cast<uint32_t>(p.fixed.size()));
    for (const auto& [arg, value] : p.fixed) {
      w.Put<int32_t>(arg);
      PutValue(w, tensors, value);  // numbers only (no tensor enters the table this late)
    }
    w.Put<uint32_t>(static_cast<uint32_t>(p.sizes.size()));
    for (const replay::SizeCheck& c : p.sizes) {
      for (int64_t v : {int64_t{c.arg}, int64_t{c.dim}, c.lo, c.hi, int64_t{c.group}, c.coef, c.offset}) w.Put<int64_t>(v);
    }
    w.Put<uint32_t>(static_cast<uint32_t>(p.written.size()));
    for (int i : p.written) w.Put<int32_t>(i);
    w.Put<int32_t>(p.num_outputs);

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

// The sections read back in the order Serialize writes them, each checked.
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
    ValueReader values(r, tensors);
    p.graph = GraphReader(r, values).Read();
    p.bound.resize(r.Count("bound tensors", 12));
    for (BoundTensor& b : p.bound) {
      b.tensor = values.Tensor();
      b.kind = r.Str("bound kind");
      b.name = r.Str("bound name");
    }
    const size_t args = p.graph->inputs().size() - std::min(p.bound.size(), p.graph->inputs().size());
    if (p.bound.size() > p.graph->inputs().size()) Corrupt("more bound tensors than graph inputs");
    auto arg_index = [&](int64_t i) {
      if (i < 0 || static_cast<size_t>(i) >= args) Corrupt("an argument index is out of range");
      return static_cast<int>(i);
    };
    p.fixed.resize(r.Count("fixed numbers", 5));
    for (auto& [arg, value] : p.fixed) {
      arg = arg_index(r.Get<int32_t>("fixed argument"));
      value = values.Value();
      if (!(value.isInt() || value.isDouble() || value.isBool())) Corrupt("a fixed argument that is no number");
    }
    p.sizes.resize(r.Count("size checks", 7 * sizeof(int64_t)));
    for (replay::SizeCheck& c : p.sizes) {
      c.arg = arg_index(r.Get<int64_t>("size check"));
      const int64_t dim = r.Get<int64_t>("size check");
      if (dim < 0 || dim >= kMaxRank) Corrupt("a size check's dim is out of range");
      c.dim = static_cast<int>(dim);
      c.lo = r.Get<int64_t>("size check");
      c.hi = r.Get<int64_t>("size check");
      const int64_t group = r.Get<int64_t>("size check");
      if (group < -1 || group > kMaxRank * 1024) Corrupt("a size check's group is out of range");
      c.group = static_cast<int>(group);
      c.coef = r.Get<int64_t>("size check");
      c.offset = r.Get<int64_t>("size check");
      const auto& spec = p.graph->values()[p.graph->inputs()[p.bound.size() + c.arg]].spec;
      if (spec.has_value() && c.dim >= spec->dim) Corrupt("a size check's dim is beyond its argument's rank");
    }
    p.written.resize(r.Count("written arguments", sizeof(int32_t)));
    for (int& i : p.written) i = arg_index(r.Get<int32_t>("written argument"));
    p.num_outputs = r.Get<int32_t>("outputs");
    if (p.num_outputs < -1 || p.num_outputs > static_cast<int>(p.graph->outputs().size())) {
      Corrupt("the number of outputs is out of range");
    }
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
