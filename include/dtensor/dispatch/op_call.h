#pragma once
// What a sharding rule sees and returns. A rule looks at the global specs of an op's tensor
// inputs (and its non-tensor arguments) and decides the placements every input must have,
// the placements of every output, and any arguments to rewrite for the local call.
// Rules run only on a cache miss; the result is cached by (op, input specs, static args).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/core/dtensor_spec.h"

namespace dtensor::dispatch {

/// One tensor input: a DTensor, or a plain tensor treated as Replicate.
struct InputSpec {
  SpecPtr spec;         // null for an undefined optional tensor
  int arg = 0;          // index in the schema's arguments
  int list_index = -1;  // position inside a Tensor[] argument, else -1
};

/// The op call a sharding rule decides: the operator, its arguments and its inputs' specs.
/// A view: it refers to the caller's objects and lives only during the rule.
class OpCall {
 public:
  /// Refers to (does not copy) `op`, `args`, `inputs` and `mesh`.
  OpCall(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
         const std::vector<InputSpec>& inputs, const DeviceMesh& mesh)
      : op_(op), args_(args), inputs_(inputs), mesh_(mesh) {}

  const c10::OperatorHandle& op() const { return op_; }               ///< The operator.
  const c10::FunctionSchema& schema() const { return op_.schema(); }  ///< Its schema.
  std::string name() const;                                           // "aten::add.Tensor"
  c10::ArrayRef<c10::IValue> args() const { return args_; }    ///< All arguments, in schema order.
  const c10::IValue& arg(size_t i) const { return args_[i]; }  ///< Argument `i` (unchecked).
  size_t num_args() const { return args_.size(); }             ///< Number of arguments.
  /// The tensor inputs, in order.
  const std::vector<InputSpec>& inputs() const { return inputs_; }
  size_t num_inputs() const { return inputs_.size(); }  ///< Number of tensor inputs.
  /// Spec of tensor input `i` (must not be an undefined optional).
  const DTensorSpec& input(size_t i) const { return *inputs_.at(i).spec; }
  const DeviceMesh& mesh() const { return mesh_; }    ///< The mesh of the DTensor inputs.
  int64_t mesh_ndim() const { return mesh_.ndim(); }  ///< Number of mesh dims.

  /// Typed argument access (by schema position), with defaults for None.
  int64_t int_arg(size_t i, int64_t dflt = 0) const;
  /// Argument `i` as a bool, `dflt` when None.
  bool bool_arg(size_t i, bool dflt = false) const;
  /// Argument `i` as an int list.
  std::vector<int64_t> int_list_arg(size_t i) const;  // empty for None
  /// Argument `i` as an int list, nullopt when None.
  std::optional<std::vector<int64_t>> opt_int_list_arg(size_t i) const;
  /// Number of values the op returns.
  int64_t num_returns() const { return static_cast<int64_t>(schema().returns().size()); }
  std::string placements_str() const;  // "(S(0)), (R)" for error messages

 private:
  const c10::OperatorHandle& op_;
  c10::ArrayRef<c10::IValue> args_;
  const std::vector<InputSpec>& inputs_;
  const DeviceMesh& mesh_;
};

/// What a local kernel knows besides the stack: the specs of the inputs as they arrive at the
/// local call (after redistribution) and of the outputs (null for non-tensor returns).
struct LocalContext {
  c10::ArrayRef<SpecPtr> inputs;   ///< Specs of the inputs at the local call.
  c10::ArrayRef<SpecPtr> outputs;  ///< Specs of the outputs; null for non-tensor returns.
};
/// Replaces `op.callBoxed` when an op's local computation differs from the plain op (a masked
/// embedding lookup, a random op drawing from DTensor's stream). It gets the stack exactly as
/// the op would (local tensors, rewritten arguments) and must leave the returns on it.
using LocalKernel = std::function<void(const c10::OperatorHandle& op, torch::jit::Stack& stack,
                                       const LocalContext&)>;

/// A rule's answer for one op call: input placements, output placements and local rewrites.
struct Decision {
  /// Placements each input must have for the local call (one entry per OpCall input; an
  /// empty Placements means "as it is").
  std::vector<Placements> inputs;
  /// Placements of each return; nullopt for non-tensor returns. A Tensor[] return uses the
  /// same placements for every element.
  std::vector<std::optional<Placements>> outputs;
  /// Arguments rewritten for the local call (global sizes -> local sizes and the like).
  std::vector<std::pair<int, c10::IValue>> local_args;
  /// Global metadata of each return when the op cannot run on meta tensors.
  std::vector<std::optional<TensorMeta>> output_meta;
  /// Custom local computation (rarely needed).
  LocalKernel local_kernel;
};

/// One candidate for strategy selection.
struct Strategy {
  std::vector<Placements> outputs;  // per return (tensor returns only; nullopt handled by rule)
  std::vector<Placements> inputs;   // per OpCall input
};

/// A sharding rule: from an op call to the Decision (throws when no sharding applies).
using Rule = std::function<Decision(const OpCall&)>;

/// Registers `rule` for a qualified op name with overload ("aten::add.Tensor", or "aten::mm"
/// for the default overload). Later registrations replace earlier ones. Scalar/float
/// arguments are left out of the decision cache's key (their values change from step to step);
/// list in `static_args` the positions of those whose value does change the decision (a
/// norm's order).
void register_rule(const std::string& qualified_name, Rule rule, std::vector<int> static_args = {});
/// Registers `rule` under each of `names` (see above).
void register_rule(std::initializer_list<const char*> names, const Rule& rule,
                   std::vector<int> static_args = {});
/// Registers `rule` to decide `qualified_name` instead of its ordinary rule while
/// decision_context() has any bit of `context_mask` set. A guard that changes how a family of
/// ops is sharded (tp::LossParallel: vocab-parallel log_softmax and nll_loss) registers its
/// rules this way from its own layer, and the ordinary rules never need to know about it. The
/// first registered rule whose mask matches wins.
void register_context_rule(const std::string& qualified_name, int64_t context_mask, Rule rule);
/// Registers `rule` as a context rule under each of `names` (see above).
void register_context_rule(std::initializer_list<const char*> names, int64_t context_mask,
                           const Rule& rule);
/// A DTensor-aware decomposition of a CompositeImplicitAutograd op: given the boxed arguments on
/// `stack`, it pops them and pushes the results. It runs above autograd, in place of LibTorch's
/// decomposition, when a DTensor is among the arguments (PyTorch registers the same with
/// `py_impl(CompositeImplicitAutograd)`); for composites whose LibTorch decomposition reads an
/// argument's memory, which a DTensor does not have.
using Decomposition = std::function<void(std::vector<c10::IValue>& stack)>;
/// Registers `decomposition` for a CompositeImplicitAutograd op ("aten::tensor_split.
/// tensor_indices_or_sections"). Later registrations replace earlier ones.
void register_decomposition(const std::string& qualified_name, Decomposition decomposition);
/// Whether an ordinary rule (register_rule) is registered for `qualified_name`.
bool has_rule(const std::string& qualified_name);
/// Every name a rule was registered for, sorted (a misspelt name registers a rule that no
/// operator ever reaches: tests check each against the dispatcher).
std::vector<std::string> registered_rule_names();

/// Thread-local state that changes sharding decisions (a guard such as loss_parallel sets bits
/// here while active). It is part of every decision-cache key, so decisions made inside and
/// outside the guard never mix. Rules read it through decision_context().
int64_t decision_context();
/// Sets bits `mask` for the life of the guard (restores the previous value on destruction).
class DecisionContextGuard {
 public:
  /// Sets bits `mask` in decision_context() on this thread.
  explicit DecisionContextGuard(int64_t mask);
  /// Restores the previous decision_context().
  ~DecisionContextGuard();
  DecisionContextGuard(const DecisionContextGuard&) = delete;
  DecisionContextGuard& operator=(const DecisionContextGuard&) = delete;

 private:
  int64_t prev_;
};

/// Picks the cheapest candidate by the redistribution cost model, with PyTorch's tie-break order,
/// and turns it into a Decision (docs/ARCHITECTURE.md, "Strategy choice").
Decision choose(const OpCall& call, const std::vector<Strategy>& candidates);

/// Estimated cost (µs) of moving `src` to `dst` placements
/// (docs/ARCHITECTURE.md, "Strategy choice").
double redistribute_cost(const DTensorSpec& src, c10::ArrayRef<Placement> dst);

// Registers rules from a static initializer: DTENSOR_RULES(pointwise) { register_rule(...); }
#define DTENSOR_RULES(family)                                \
  static void dtensor_register_rules_##family();             \
  static const bool dtensor_rules_registered_##family = [] { \
    dtensor_register_rules_##family();                       \
    return true;                                             \
  }();                                                       \
  static void dtensor_register_rules_##family()

}  // namespace dtensor::dispatch
