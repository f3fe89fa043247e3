// The plan entries of overlap_comm: see overlapped_plan.h.
#include "overlapped_plan.h"

#include <c10/util/StringUtil.h>
#include <c10/util/Type.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "block_math.h"
#include "dtensor/core/api.h"
#include "dtensor/core/distribute_module.h"
#include "dtensor/models/transformer.h"
#include "dtensor/tp/forward_wrapper.h"
#include "dtensor/tp/overlap.h"

namespace dtensor::models::detail {
namespace {

// Without overlap, autograd sums the input gradients of wq, wk and wv as (v + k) + q: the value
// path's backward finishes first (its nodes were created last), then the key's. The overlapped
// projections sum in the same order so that their results are bitwise the same.
const std::vector<int64_t> kQkvGradSumOrder{2, 1, 0};

// A style that only installs a forward wrapper on modules of type `M`.
template <class M>
class OverlappedModule : public tp::ParallelStyle {
 public:
  using Body = std::function<at::Tensor(M& module, const tp::ModuleCall& call,
                                        const DeviceMesh& mesh, int64_t chunks)>;
  OverlappedModule(std::string name, int64_t chunks, Body body)
      : name_(std::move(name)), chunks_(chunks), body_(std::move(body)) {}

  std::string repr() const override { return c10::str(name_, "(chunks=", chunks_, ")"); }

  void validate(torch::nn::Module& module, const std::string& fqn,
                const DeviceMesh&) const override {
    TORCH_CHECK(dynamic_cast<M*>(&module) != nullptr, repr(), " at '", fqn, "' needs a ",
                c10::demangle_type<M>(), ", got ", module.name());
  }

  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override {
    validate(module, fqn, mesh);
    tp::set_forward_wrapper(
        module,
        [mesh, chunks = chunks_, body = body_](torch::nn::Module& m, const tp::ModuleCall& call,
                                               const tp::ForwardBody&) -> c10::IValue {
          return body(dynamic_cast<M&>(m), call, mesh, chunks);
        });
  }

 protected:
  std::string name_;
  int64_t chunks_;
  Body body_;
};

// The head: its weight sharded as ColwiseParallel shards it (unless it is the embedding's), then
// the wrapper.
class OverlappedHead : public OverlappedModule<dtensor::nn::LinearImpl> {
 public:
  OverlappedHead(int64_t chunks, bool loss_parallel, bool shares_embedding)
      : OverlappedModule("OverlappedHead", chunks,
                         [loss_parallel](dtensor::nn::LinearImpl& head, const tp::ModuleCall& call,
                                         const DeviceMesh& mesh, int64_t chunks) {
                           // The local matmul ColwiseParallel (or a tied head's conversions)
                           // would run: bitwise the same logits.
                           const at::Tensor local = tp::all_gather_matmul(
                               call.args.at(0).toTensor(), {head.weight}, mesh, chunks)[0];
                           const at::Tensor logits =
                               from_local(local, mesh, {Shard(local.dim() - 1)});
                           if (loss_parallel) return logits;
                           return to_local(redistribute(logits, {Replicate()}));
                         }),
        shares_embedding_(shares_embedding) {}

  bool uses_distribute_module() const override { return !shares_embedding_; }

  void apply(torch::nn::Module& module, const std::string& fqn,
             const DeviceMesh& mesh) const override {
    validate(module, fqn, mesh);
    if (!shares_embedding_) {
      auto& head = dynamic_cast<dtensor::nn::LinearImpl&>(module);
      replace_parameter(head, "weight",
                        distribute_tensor(head.weight.detach(), mesh, {Shard(0)}, src_data_rank));
    }
    OverlappedModule::apply(module, fqn, mesh);
  }

 private:
  bool shares_embedding_;
};

}  // namespace

tp::Style overlapped_attention(int64_t chunks) {
  return OverlappedModule<AttentionImpl>(
      "OverlappedAttention", chunks,
      [](AttentionImpl& a, const tp::ModuleCall& call, const DeviceMesh& mesh, int64_t chunks) {
        const auto qkv = tp::all_gather_matmul(call.args.at(0).toTensor(),
                                               {a.wq->weight, a.wk->weight, a.wv->weight}, mesh,
                                               chunks, kQkvGradSumOrder);
        const at::Tensor out = a.attend(qkv[0], qkv[1], qkv[2], call.args.at(1).toTensor());
        return tp::matmul_reduce_scatter(out, a.wo->weight, mesh, chunks);
      });
}

tp::Style overlapped_feed_forward(int64_t chunks) {
  return OverlappedModule<FeedForwardImpl>(
      "OverlappedFeedForward", chunks,
      [](FeedForwardImpl& f, const tp::ModuleCall& call, const DeviceMesh& mesh, int64_t chunks) {
        const auto h = tp::all_gather_matmul(call.args.at(0).toTensor(),
                                             {f.w1->weight, f.w3->weight}, mesh, chunks);
        return tp::matmul_reduce_scatter(gated_activation(h[0], h[1], f.activation), f.w2->weight,
                                         mesh, chunks);
      });
}

tp::Style overlapped_head(int64_t chunks, bool loss_parallel, bool shares_embedding) {
  return OverlappedHead(chunks, loss_parallel, shares_embedding);
}

}  // namespace dtensor::models::detail
