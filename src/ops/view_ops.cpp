// View and shape ops as dimension maps. A shard survives a reshape when it sits on the leftmost
// (non-singleton) input dim of a merged/split group and both ends divide evenly; otherwise that
// mesh dim is replicated first.
#include "dtensor/ops/rule_utils.h"

namespace dtensor::ops {
namespace {

struct Group {
  std::vector<int64_t> in, out;  // tensor dims
};

std::vector<Group> group_dims(c10::IntArrayRef in, c10::IntArrayRef out) {
  std::vector<Group> groups;
  size_t i = 0, j = 0;
  while (i < in.size() || j < out.size()) {
    Group g;
    int64_t pi = 1, po = 1;
    // Always take at least one dim from each side that still has dims.
    if (i < in.size()) pi *= in[i], g.in.push_back(static_cast<int64_t>(i++));
    if (j < out.size()) po *= out[j], g.out.push_back(static_cast<int64_t>(j++));
    while (pi != po) {
      if (pi < po && i < in.size()) {
        pi *= in[i];
        g.in.push_back(static_cast<int64_t>(i++));
      } else if (j < out.size()) {
        po *= out[j];
        g.out.push_back(static_cast<int64_t>(j++));
      } else if (i < in.size()) {
        pi *= in[i];
        g.in.push_back(static_cast<int64_t>(i++));
      } else {
        break;
      }
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

int64_t first_non_singleton(const std::vector<int64_t>& dims, c10::IntArrayRef shape) {
  for (auto d : dims) {
    if (shape[d] != 1) return d;
  }
  return dims.empty() ? -1 : dims.front();
}

// Input target and output placements for reshaping `in` to `out_shape`.
std::pair<Placements, Placements> reshape_placements(const OpCall& call, const DTensorSpec& in,
                                                     c10::IntArrayRef out_shape) {
  auto groups = group_dims(in.shape(), out_shape);
  Placements tgt, outp;
  for (size_t i = 0; i < in.placements().size(); ++i) {
    const Placement& p = in.placements()[i];
    if (!p.is_shard()) {
      tgt.push_back(p);
      outp.push_back(p);
      continue;
    }
    const int64_t k = shards_of_dim(call.mesh(), in.placements(), p.dim());
    std::optional<int64_t> od;
    for (const auto& g : groups) {
      if (std::find(g.in.begin(), g.in.end(), p.dim()) == g.in.end()) continue;
      if (g.out.empty()) break;
      const int64_t lead_in = first_non_singleton(g.in, in.shape());
      const int64_t lead_out = first_non_singleton(g.out, out_shape);
      if (lead_in != p.dim()) break;
      auto non_singleton = [](const std::vector<int64_t>& dims, c10::IntArrayRef shape) {
        int64_t n = 0;
        for (auto d : dims) n += shape[d] != 1 ? 1 : 0;
        return n;
      };
      if (non_singleton(g.in, in.shape()) <= 1 && non_singleton(g.out, out_shape) <= 1) {
        od = lead_out;  // the same dim with size-1 dims added or dropped: uneven is fine
      } else if (in.shape()[p.dim()] % k == 0 && out_shape[lead_out] % k == 0) {
        od = lead_out;
      }
      break;
    }
    tgt.push_back(od ? p : Replicate());
    outp.push_back(od ? Shard(*od) : Replicate());
  }
  return {tgt, outp};
}

Decision view_like(const OpCall& call, bool with_stride) {
  const DTensorSpec& in = call.input(0);
  int64_t numel = 1;
  for (auto s : in.shape()) numel *= s;
  std::vector<int64_t> out_shape = at::infer_size(call.int_list_arg(1), numel);
  auto [tgt, outp] = reshape_placements(call, in, out_shape);
  Decision d = all_outputs(call, {tgt}, outp);
  auto local = local_shape_of(call.mesh(), out_shape, outp);
  d.local_args.push_back({1, c10::IValue(local)});
  if (with_stride) {
    // The global strides say nothing about the local tensor's layout (it may be expanded):
    // view it with its own strides instead of rewriting the stride argument.
    d.local_kernel = [](const c10::OperatorHandle&, torch::jit::Stack& st,
                        const dispatch::LocalContext&) {
      st.pop_back();  // stride
      auto size = st.back().toIntVector();
      st.pop_back();
      at::Tensor self = st.back().toTensor();
      st.pop_back();
      st.push_back(self.view(size));
    };
  }
  return d;
}

Decision expand(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  std::vector<int64_t> size = call.int_list_arg(1);
  const int64_t off = static_cast<int64_t>(size.size()) - in.ndim();
  for (int64_t d = 0; d < in.ndim(); ++d) {
    if (size[d + off] == -1) size[d + off] = in.shape()[d];
  }
  Placements tgt, outp;
  for (const auto& p : in.placements()) {
    if (p.is_shard() && in.shape()[p.dim()] == 1 && size[p.dim() + off] != 1) {
      tgt.push_back(Replicate());
      outp.push_back(Replicate());
    } else {
      tgt.push_back(p);
      outp.push_back(p.is_shard() ? Shard(p.dim() + off) : p);
    }
  }
  Decision d = all_outputs(call, {tgt}, outp);
  d.local_args.push_back({1, c10::IValue(local_shape_of(call.mesh(), size, outp))});
  return d;
}

Decision permute_dims(const OpCall& call, const std::vector<int64_t>& perm) {
  const DTensorSpec& in = call.input(0);
  Placements outp = remap_shards(in.placements(), [&](int64_t d) -> std::optional<int64_t> {
    for (size_t i = 0; i < perm.size(); ++i) {
      if (perm[i] == d) return static_cast<int64_t>(i);
    }
    return std::nullopt;
  });
  return all_outputs(call, {in.placements()}, outp);
}

Decision transpose(const OpCall& call) {
  const int64_t nd = call.input(0).ndim();
  std::vector<int64_t> perm(nd);
  for (int64_t i = 0; i < nd; ++i) perm[i] = i;
  if (nd >= 2) {
    const int64_t a = call.num_args() > 1 ? wrap_dim(call.int_arg(1), nd) : 0;
    const int64_t b = call.num_args() > 2 ? wrap_dim(call.int_arg(2), nd) : 1;
    std::swap(perm[a], perm[b]);
  }
  return permute_dims(call, perm);
}

Decision permute(const OpCall& call) {
  const int64_t nd = call.input(0).ndim();
  auto perm = call.int_list_arg(1);
  for (auto& p : perm) p = wrap_dim(p, nd);
  return permute_dims(call, perm);
}

Decision unsqueeze(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const int64_t d = wrap_dim(call.int_arg(1), in.ndim() + 1);
  Placements outp = remap_shards(
      in.placements(), [&](int64_t s) -> std::optional<int64_t> { return s >= d ? s + 1 : s; });
  return all_outputs(call, {in.placements()}, outp);
}

Decision squeeze(const OpCall& call) {
  const DTensorSpec& in = call.input(0);
  const int64_t nd = in.ndim();
  std::vector<bool> removed(nd, false);
  if (call.num_args() == 1) {
    for (int64_t d = 0; d < nd; ++d) removed[d] = in.shape()[d] == 1;
  } else if (call.arg(1).isInt()) {
    const int64_t d = wrap_dim(call.int_arg(1), nd);
    removed[d] = nd > 0 && in.shape()[d] == 1;
  } else {
    for (auto d : call.int_list_arg(1)) {
      const int64_t w = wrap_dim(d, nd);
      removed[w] = nd > 0 && in.shape()[w] == 1;
    }
  }
  Placements tgt;
  for (const auto& p : in.placements())
    tgt.push_back(p.is_shard() && removed[p.dim()] ? Replicate() : p);
  Placements outp = remap_shards(tgt, [&](int64_t s) -> std::optional<int64_t> {
    int64_t shift = 0;
    for (int64_t d = 0; d < s; ++d) shift += removed[d] ? 1 : 0;
    return s - shift;
  });
  Decision dec = all_outputs(call, {tgt}, outp);
  // The local call squeezes exactly the dims of global size 1: a shard that happens to hold
  // one row (or none) of a longer dim keeps it, as every other rank does.
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < nd; ++d) {
    if (removed[d]) dims.push_back(d);
  }
  const bool inplace = call.schema().name().back() == '_';
  dec.local_kernel = [dims, inplace](const c10::OperatorHandle& op, torch::jit::Stack& stack,
                                     const dispatch::LocalContext&) {
    const size_t nargs = op.schema().arguments().size();
    at::Tensor self = stack[stack.size() - nargs].toTensor();
    torch::jit::drop(stack, nargs);
    stack.emplace_back(inplace ? self.squeeze_(dims) : self.squeeze(dims));
  };
  return dec;
}

}  // namespace

DTENSOR_RULES(view_ops) {
  using dispatch::register_rule;
  register_rule({"aten::view", "aten::_unsafe_view", "aten::reshape"},
                [](const OpCall& c) { return view_like(c, false); });
  register_rule("aten::_reshape_alias", [](const OpCall& c) { return view_like(c, true); });
  register_rule("aten::expand", expand);
  // The *_copy ops return the view's values in a fresh tensor: the same placements.
  register_rule({"aten::t", "aten::transpose.int", "aten::t_", "aten::transpose_", "aten::t_copy",
                 "aten::transpose_copy.int"},
                transpose);
  register_rule({"aten::permute", "aten::permute_copy"}, permute);
  register_rule({"aten::unsqueeze", "aten::unsqueeze_", "aten::unsqueeze_copy"}, unsqueeze);
  register_rule({"aten::squeeze", "aten::squeeze.dim", "aten::squeeze.dims", "aten::squeeze_",
                 "aten::squeeze_.dim"},
                squeeze);
}

}  // namespace dtensor::ops
