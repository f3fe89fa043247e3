#include "health_state.h"

#include <sstream>

namespace dtensor::comm::detail {

Health& health() {
  static Health* h = new Health;
  return *h;
}

std::string to_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

std::vector<std::string> split(const std::string& s, char sep, size_t max_parts) {
  std::vector<std::string> out;
  size_t start = 0;
  while (out.size() + 1 < max_parts) {
    size_t p = s.find(sep, start);
    if (p == std::string::npos) break;
    out.push_back(s.substr(start, p - start));
    start = p + 1;
  }
  out.push_back(s.substr(start));
  return out;
}

std::string serialize(const History& h) {
  std::ostringstream o;
  o << (h.left ? "left" : "at") << "\t" << h.seq << "\n";
  for (const auto& f : h.ring)
    o << f.seq << "\t" << f.op << "\t" << f.sig << "\t" << f.module << "\n";
  for (const auto& w : h.waits) {
    o << "waits\t" << w.group << "\t" << w.label << "\t";
    for (size_t i = 0; i < w.members.size(); ++i) o << (i ? "," : "") << w.members[i];
    const auto& f = w.fingerprint;
    o << "\t" << f.seq << "\t" << f.op << "\t" << f.sig << "\t" << f.module << "\n";
  }
  return o.str();
}

History deserialize(const std::string& text) {
  History h;
  std::istringstream in(text);
  std::string line;
  if (std::getline(in, line)) {
    auto p = split(line, '\t', 2);
    h.left = p[0] == "left";
    if (p.size() == 2) h.seq = std::stoll(p[1]);
  }
  while (std::getline(in, line)) {
    if (line.rfind("waits\t", 0) == 0) {
      auto p = split(line, '\t', 8);
      if (p.size() != 8) continue;
      Wait w{p[1], p[2], {}, {std::stoll(p[4]), p[5], p[6], p[7]}};
      for (const auto& r : split(p[3], ',', SIZE_MAX)) {
        if (!r.empty()) w.members.push_back(std::stoi(r));
      }
      h.waits.push_back(std::move(w));
      continue;
    }
    auto p = split(line, '\t', 4);
    if (p.size() != 4) continue;
    h.ring.push_back({std::stoll(p[0]), p[1], p[2], p[3]});
  }
  return h;
}

std::string history_key(const std::string& prefix, const std::string& group, int rank) {
  return prefix + "hist/" + group + "/" + std::to_string(rank);
}

// What this rank's threads wait in now (collectives, MPI calls). Call with health().mu held.
std::vector<Wait> current_waits_locked() {
  auto& h = health();
  std::vector<WorkContext> contexts;
  for (const auto& [work, c] : h.waiting) contexts.push_back(c);
  for (const auto& [id, b] : h.blocked) contexts.push_back(b.context);
  std::vector<Wait> out;
  for (const auto& c : contexts) {
    auto it = h.groups.find(c.group);
    if (it == h.groups.end()) continue;
    const Fingerprint* f = it->second.history.at(c.seq);
    out.push_back({c.group, it->second.label, it->second.members,
                   f ? *f : Fingerprint{c.seq, "collective", "", ""}});
  }
  return out;
}

}  // namespace dtensor::comm::detail
