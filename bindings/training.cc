// Training calls: forward and backward engines joined by a C++ autograd node (Note [Training
// calls] in training.h).
#include "bindings/training.h"

#include <pybind11/stl.h>
#include <ATen/ops/empty_strided.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "bindings/call.h"
#include "bindings/convert.h"

namespace torchreplay {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The grad_fn of gradients computed with create_graph=True: as AOTAutograd's, a backward through
// them (double backward) raises.
class DoubleBackward final : public Node {
 public:
  std::string name() const override { return "TorchreplayDoubleBackward"; }
  variable_list apply(variable_list&& /*grads*/) override {
    TORCH_CHECK(false, "torch.compile with aot_autograd does not currently support double backward");
  }
};

void ConnectToDoubleBackward(const variable_list& from, variable_list& grads) {
  std::shared_ptr<DoubleBackward> node(new DoubleBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(from));
  for (at::Tensor& g : grads) {
    if (!g.defined()) continue;
    if (g.is_view()) g = g.detach();  // a view made with grad mode off takes no history
    torch::autograd::set_history(g, node);
  }
}

class ReplayBackward final : public Node {
 public:
  ReplayBackward(std::shared_ptr<replay::Engine> backward, std::shared_ptr<const TrainingSpec> spec)
      : backward_(std::move(backward)), spec_(std::move(spec)) {}

  std::string name() const override { return "TorchreplayBackward"; }

  void Save(const std::vector<c10::IValue>& returns, const std::vector<const c10::TensorImpl*>& outputs) {
    const TrainingSpec& s = *spec_;
    for (int k = s.saved_begin; k < s.saved_end; ++k) {
      // As AOTAutograd saves them (Note [Detaching saved tensors in AOTAutograd]): a view made
      // with grad mode off is saved detached (its storage, which the pool's handout tracks, is
      // the same).
      const at::Tensor& r = returns[k].toTensor();
      const at::Tensor t = r.is_view() ? r.detach() : r;
      // A view of a forward input that requires grad (a parameter's transpose): AOTAutograd saves
      // the input itself, so that a backward with create_graph=True builds the gradients' graph
      // from it; here its view is saved detached, and the input is kept for that graph.
      if (r.is_view() && r._base().requires_grad()) graph_roots_.emplace_back(at::Tensor(r._base()));
      if (k < s.saved_vc_end) {
        const bool is_output = std::find(outputs.begin(), outputs.end(), t.unsafeGetTensorImpl()) != outputs.end();
        saved_.emplace_back(t, is_output);
      } else {
        saved_no_vc_.push_back(t);
      }
    }
  }

  variable_list apply(variable_list&& grads) override {
    const TrainingSpec& s = *spec_;
    TORCH_CHECK(!released_, "Trying to backward through the graph a second time (or directly access saved tensors "
                "after they have already been freed). Saved intermediate values of the graph are freed when you call "
                ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the graph "
                "a second time or if you need to access saved tensors after calling backward.");
    std::vector<c10::IValue> args;
    args.reserve(saved_.size() + saved_no_vc_.size() + s.tangent_sizes.size());
    bool needs_graph = false;  // create_graph=True: the gradients would need a graph of their own
    for (SavedVariable& v : saved_) {
      args.emplace_back(v.unpack(shared_from_this()));
      needs_graph = needs_graph || args.back().toTensor().requires_grad();
    }
    for (const at::Tensor& t : saved_no_vc_) {
      args.emplace_back(t);
      needs_graph = needs_graph || t.requires_grad();
    }
    size_t k = 0;
    for (int i = 0; i < s.num_outputs; ++i) {
      if (!s.output_requires_grad[i]) continue;
      at::Tensor g = grads[i];
      if (!g.defined()) g = input_metadata(i).zeros_like();  // as autograd.Function materializes it
      needs_graph = needs_graph || g.requires_grad();
      const std::vector<int64_t>& sizes = s.tangent_sizes[k];
      const std::vector<int64_t>& strides = s.tangent_strides[k++];
      if (sizes.empty()) {
        if (!g.is_contiguous()) g = g.contiguous();
      } else if (g.sizes() != c10::IntArrayRef(sizes) || g.strides() != c10::IntArrayRef(strides)) {
        at::Tensor restrided = at::empty_strided(sizes, strides, g.options());
        restrided.copy_(g);
        g = std::move(restrided);
      }
      args.emplace_back(std::move(g));
    }
    variable_list from;  // create_graph=True: what the gradients' graph hangs from
    if ((needs_graph || !graph_roots_.empty()) && torch::autograd::GradMode::is_enabled()) {
      for (const c10::IValue& a : args) from.push_back(a.toTensor());
      from.insert(from.end(), graph_roots_.begin(), graph_roots_.end());
    }
    absl::StatusOr<std::vector<c10::IValue>> out;
    {
      torch::autograd::AutoGradMode no_grad(false);
      out = backward_->Run(std::move(args));
    }
    TORCH_CHECK(out.ok(), "torchreplay: graph '", backward_->options().name, "' failed: ", out.status().message());
    variable_list result;
    result.reserve(s.num_inputs);
    for (int j = 0; j < s.num_inputs && j < static_cast<int>(out->size()); ++j) {
      const c10::IValue& v = (*out)[j];
      result.push_back(v.isTensor() ? v.toTensor() : at::Tensor());
    }
    result.resize(s.num_inputs);
    if (!from.empty()) ConnectToDoubleBackward(from, result);
    return result;
  }

  void release_variables() override {
    for (SavedVariable& v : saved_) v.reset_data();
    saved_no_vc_.clear();
    graph_roots_.clear();
    released_ = true;
  }

 private:
  std::shared_ptr<replay::Engine> backward_;
  std::shared_ptr<const TrainingSpec> spec_;
  std::vector<SavedVariable> saved_;
  std::vector<at::Tensor> saved_no_vc_;
  std::vector<at::Tensor> graph_roots_;  // inputs requiring grad whose views were saved detached
  bool released_ = false;
};

}  // namespace

py::object TrainingCall::operator()(const py::args& args) const {
  const TrainingSpec& s = *spec;
  if (static_cast<int>(args.size()) != s.num_inputs) {
    throw py::type_error(absl::StrCat("torchreplay: graph '", forward->options().name, "' takes ", s.num_inputs,
                                      " arguments, got ", args.size()));
  }
  std::vector<c10::IValue> inputs;
  inputs.reserve(args.size());
  for (const py::handle a : args) inputs.push_back(ToIValue(a));
  std::vector<at::Tensor> tensors;
  tensors.reserve(inputs.size());
  for (const c10::IValue& v : inputs) tensors.push_back(v.isTensor() ? v.toTensor() : at::Tensor());
  const bool track = torch::autograd::compute_requires_grad(tensors);
  if (track && !s.compiled_requires_grad.empty()) {
    for (int i = 0; i < s.num_inputs; ++i) {
      if (!s.compiled_requires_grad[i] && tensors[i].defined() && tensors[i].requires_grad()) {
        throw std::runtime_error(RequiresGradSinceCompiled(
            forward->options().name, i, i < static_cast<int>(s.input_names.size()) ? s.input_names[i] : "?"));
      }
    }
  }
  absl::StatusOr<std::vector<c10::IValue>> out;
  {
    py::gil_scoped_release no_gil;
    torch::autograd::AutoGradMode no_grad(false);
    out = forward->Run(std::move(inputs));
  }
  if (!out.ok()) Throw(out.status());
  for (int i : s.mutated) tensors[i].unsafeGetTensorImpl()->bump_version();
  std::vector<c10::IValue>& returns = *out;
  if (static_cast<int>(returns.size()) < s.saved_end) {
    throw py::value_error(absl::StrCat("torchreplay: graph '", forward->options().name, "' returned ",
                                       returns.size(), " values, not ", s.saved_end));
  }
  // As autograd.Function wraps its outputs (views, non-differentiable outputs, input metadata).
  std::shared_ptr<ReplayBackward> node;
  if (track) {
    node = std::shared_ptr<ReplayBackward>(new ReplayBackward(backward, spec), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(tensors));
  }
  std::vector<std::optional<at::Tensor>> raw;
  std::unordered_set<at::TensorImpl*> non_differentiable;
  for (int i = 0; i < s.num_outputs; ++i) {
    raw.emplace_back(returns[i].toTensor());
    if (!s.output_requires_grad[i]) non_differentiable.insert(raw.back()->unsafeGetTensorImpl());
  }
  const auto no_jvp = [](const variable_list&, const variable_list&) -> variable_list {
    TORCH_CHECK(false, "torchreplay: forward-mode AD through a replayed training graph is not supported");
  };
  const auto view_as_self = [](const at::Tensor& x) { return x.view_as(x); };
  std::vector<std::optional<at::Tensor>> wrapped = torch::autograd::_wrap_outputs(
      tensors, non_differentiable, {}, raw, node, no_jvp, {}, view_as_self, /*pure_view=*/false);
  std::vector<const c10::TensorImpl*> differentiable;
  for (int i = 0; i < s.num_outputs; ++i) {
    returns[i] = *wrapped[i];
    if (s.output_requires_grad[i]) differentiable.push_back(wrapped[i]->unsafeGetTensorImpl());
  }
  if (node != nullptr) node->Save(returns, differentiable);
  return FromIValues<py::list>(returns, s.num_outputs);
}

void BindTraining(py::module_& m) {
  py::class_<TrainingSpec, std::shared_ptr<TrainingSpec>>(m, "TrainingSpec",
                                                           "How a training graph's engines meet autograd.")
      .def(py::init([](int num_inputs, std::vector<int> mutated, std::vector<bool> output_requires_grad,
                       int saved_begin, int saved_vc_end, int saved_end,
                       std::vector<std::vector<int64_t>> tangent_sizes,
                       std::vector<std::vector<int64_t>> tangent_strides, std::vector<bool> compiled_requires_grad,
                       std::vector<std::string> input_names) {
             auto s = std::make_shared<TrainingSpec>();
             s->num_inputs = num_inputs;
             s->mutated = std::move(mutated);
             for (int i : s->mutated) {
               if (i < 0 || i >= num_inputs) throw py::value_error("torchreplay: mutated input out of range");
             }
             s->num_outputs = static_cast<int>(output_requires_grad.size());
             s->output_requires_grad = std::move(output_requires_grad);
             s->saved_begin = saved_begin, s->saved_vc_end = saved_vc_end, s->saved_end = saved_end;
             s->tangent_sizes = std::move(tangent_sizes);
             s->tangent_strides = std::move(tangent_strides);
             s->compiled_requires_grad = std::move(compiled_requires_grad);
             s->input_names = std::move(input_names);
             if (!s->compiled_requires_grad.empty() &&
                 static_cast<int>(s->compiled_requires_grad.size()) != num_inputs) {
               throw py::value_error("torchreplay: compiled_requires_grad needs one flag per input");
             }
             int tangents = 0;
             for (bool r : s->output_requires_grad) tangents += r;
             if (s->saved_begin < s->num_outputs || s->saved_vc_end < s->saved_begin ||
                 s->saved_end < s->saved_vc_end || static_cast<int>(s->tangent_sizes.size()) != tangents ||
                 s->tangent_strides.size() != s->tangent_sizes.size()) {
               throw py::value_error("torchreplay: inconsistent TrainingSpec");
             }
             return s;
           }),
           py::arg("num_inputs"), py::arg("mutated"), py::arg("output_requires_grad"), py::arg("saved_begin"), py::arg("saved_vc_end"),
           py::arg("saved_end"), py::arg("tangent_sizes"), py::arg("tangent_strides"),
           py::arg("compiled_requires_grad") = std::vector<bool>(), py::arg("input_names") = std::vector<std::string>());
  py::class_<TrainingCall>(m, "TrainingCall",
                           "A training graph's forward and backward engines joined by a C++ autograd node "
                           "(Note [Training calls]).")
      .def(py::init([](std::shared_ptr<replay::Engine> forward, std::shared_ptr<replay::Engine> backward,
                       std::shared_ptr<TrainingSpec> spec) {
             return TrainingCall{std::move(forward), std::move(backward), std::move(spec)};
           }),
           py::arg("forward"), py::arg("backward"), py::arg("spec"))
      .def("__call__", &TrainingCall::operator());
}

}  // namespace torchreplay
