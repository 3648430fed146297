// Suffix decoding's counting suffix tree (spec_decode/suffix.py's SuffixTree) in C++.
//
// Why: the Python tree costs one interpreted _step per suffix still growing for every token a
// sequence commits (max_tree_depth of them, 24 by default), and a lookup walks nodes one call
// at a time. At batch 32 on the 2-core Zen 3 that host work was ~2 % of every decode step,
// enough to make "[suffix]" slower than plain decoding there when the policy proposes nothing.
// This is the same algorithm, operation for operation: the same nodes, counts and folds, and
// the same choice among equally frequent children (the one that became a child of its parent
// first: the Python dict's insertion order), so both propose exactly the same tokens
// (tests/test_suffix.py compares them on random operations). suffix.py documents the tree.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using Token = int64_t;

struct Child {
  int32_t node;
  uint64_t stamp;  // when this key entered its parent's map: ties go to the oldest
};

struct Node {
  std::vector<Token> label;  // the tokens of the edge into this node
  int64_t count = 0;         // suffixes that pass through the whole edge
  int32_t parent = -1;
  std::unordered_map<Token, Child> children;  // first token of the child's edge -> child
};

// The growing end of one sequence: the nodes where its last max_depth suffixes end.
struct Cursor {
  std::vector<int32_t> active;  // oldest (longest) suffix first
};

class SuffixTree {
 public:
  explicit SuffixTree(int max_depth) : max_depth_(max_depth) {
    if (max_depth < 1) throw std::invalid_argument("max_depth must be >= 1");
    nodes_.emplace_back();  // the root, index 0
  }

  int max_depth() const { return max_depth_; }
  int64_t root_count() const { return nodes_[0].count; }
  int64_t num_nodes() const { return int64_t(nodes_.size() - free_.size()); }

  void extend(Cursor& cursor, const std::vector<Token>& tokens) {
    auto& active = cursor.active;
    for (Token token : tokens) {
      active.push_back(0);  // the suffix starting at this token
      nodes_[0].count += 1;
      if (int(active.size()) > max_depth_) active.erase(active.begin());
      for (auto& node : active) node = step(node, token);
    }
  }

  void insert(const std::vector<Token>& tokens, int64_t num_starts) {
    const int64_t n = int64_t(tokens.size());
    const int64_t starts = num_starts < 0 ? n : num_starts;  // (as suffix.py: unclamped)
    for (int64_t start = 0; start < starts; ++start) {
      int32_t node = 0;
      nodes_[0].count += 1;
      const int64_t end = std::min(start + max_depth_, n);
      for (int64_t i = start; i < end; ++i) node = step(node, tokens[i]);
    }
  }

  void remove(const std::vector<Token>& tokens) {
    const int64_t n = int64_t(tokens.size());
    for (int64_t start = 0; start < n; ++start) {
      const int64_t end = std::min(start + max_depth_, n);
      nodes_[0].count -= 1;
      int32_t node = 0;
      int64_t i = start;
      while (i < end) {
        auto it = nodes_[node].children.find(tokens[i]);
        if (it == nodes_[node].children.end())
          throw std::runtime_error("remove: a sequence that was never inserted");
        const int32_t child = it->second.node;
        if (--nodes_[child].count == 0) {  // only this suffix used the rest of the path
          nodes_[node].children.erase(it);
          release_subtree(child);
          break;
        }
        i += int64_t(nodes_[child].label.size());
        node = child;
      }
      if (i > end) throw std::runtime_error("remove: a suffix must end at a node boundary");
      fold(node);
    }
  }

  int64_t count(const std::vector<Token>& tokens) const {
    if (tokens.empty() || int(tokens.size()) > max_depth_) return 0;
    int32_t node;
    size_t offset;
    return match(tokens, 0, node, offset) ? nodes_[node].count : 0;
  }

  int64_t longest_match(const std::vector<Token>& context) const {
    const std::vector<Token> pattern = tail(context);
    return longest_in(pattern);
  }

  // (tokens, score, match length) of the best-scoring walk over all matching tails.
  std::tuple<std::vector<Token>, double, int64_t> speculate(
      const std::vector<Token>& context, int64_t max_tokens, double max_spec_factor,
      double min_token_prob, const Cursor* cursor) const {
    const std::vector<Token> pattern = tail(context);
    const int64_t plen = int64_t(pattern.size());
    std::vector<Token> best_tokens, tokens;
    double best_score = 0.0;
    int64_t best_m = 0;
    int64_t longest;
    if (cursor != nullptr)
      longest = std::min(int64_t(cursor->active.size()), plen);
    else
      longest = longest_in(pattern);
    for (int64_t m = longest; m > 0; --m) {  // longest match first: it wins ties
      const int64_t limit = std::min({max_tokens, int64_t(m * max_spec_factor + 1e-6),
                                      int64_t(max_depth_) - m});
      if (double(limit) <= best_score) continue;
      int32_t node;
      size_t offset;
      if (cursor != nullptr) {
        node = cursor->active[cursor->active.size() - size_t(m)];
        offset = nodes_[node].label.size();  // a suffix ends at its node's boundary
      } else if (!match(pattern, size_t(plen - m), node, offset)) {
        continue;  // (cannot happen: every tail up to the longest occurs)
      }
      tokens.clear();
      const double score = walk(node, offset, limit, min_token_prob, tokens);
      if (score > best_score) {
        best_score = score;
        best_tokens = tokens;
        best_m = m;
      }
    }
    return {best_tokens, best_score, best_m};
  }

 private:
  int max_depth_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;  // released node indices, reused by alloc
  uint64_t clock_ = 0;

  std::vector<Token> tail(const std::vector<Token>& context) const {
    const size_t n = std::min(context.size(), size_t(max_depth_));
    return std::vector<Token>(context.end() - n, context.end());
  }

  int32_t alloc(std::vector<Token> label, int64_t count, int32_t parent) {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      id = int32_t(nodes_.size());
      nodes_.emplace_back();
    }
    Node& node = nodes_[id];
    node.label = std::move(label);
    node.count = count;
    node.parent = parent;
    return id;
  }

  void release(int32_t id) {
    Node& node = nodes_[id];
    node.label.clear();
    node.label.shrink_to_fit();
    node.children = {};  // (frees its buckets)
    node.count = 0;
    node.parent = -1;
    free_.push_back(id);
  }

  void release_subtree(int32_t id) {
    std::vector<int32_t> stack{id};
    while (!stack.empty()) {
      const int32_t n = stack.back();
      stack.pop_back();
      for (const auto& kv : nodes_[n].children) stack.push_back(kv.second.node);
      release(n);
    }
  }

  // parent.children[token] = child: a new key is the newest; a replaced one keeps its place.
  void set_child(int32_t parent, Token token, int32_t child) {
    auto& children = nodes_[parent].children;
    auto it = children.find(token);
    if (it != children.end())
      it->second.node = child;
    else
      children.emplace(token, Child{child, ++clock_});
  }

  // Extend a suffix that ends at node's boundary by token; return its new end (suffix.py's
  // SuffixTree._step, case for case).
  int32_t step(int32_t node, Token token) {
    const bool is_root = node == 0;
    auto it = nodes_[node].children.find(token);
    if (it == nodes_[node].children.end()) {
      if (!is_root && nodes_[node].count == 1) {  // a leaf only this suffix uses: grow it
        nodes_[node].label.push_back(token);
        return node;
      }
      const int32_t leaf = alloc({token}, 1, node);
      set_child(node, token, leaf);
      return leaf;
    }
    const int32_t child = it->second.node;
    if (!is_root && nodes_[node].count == nodes_[child].count + 1) {
      // This suffix is the only one ending at node; all others continue into child.
      if (nodes_[child].label.size() == 1) {  // same count on both: merge node into child
        std::vector<Token> label = nodes_[node].label;
        label.push_back(nodes_[child].label[0]);
        const int32_t parent = nodes_[node].parent;
        nodes_[child].label = std::move(label);
        nodes_[child].count += 1;
        nodes_[child].parent = parent;
        set_child(parent, nodes_[child].label[0], child);
        nodes_[node].children.clear();  // (child only: it moved up)
        release(node);
        return child;
      }
      Node& n = nodes_[node];  // move the boundary one token into child's edge
      n.label.push_back(token);
      n.children.erase(it);
      auto& child_label = nodes_[child].label;
      child_label.erase(child_label.begin());
      set_child(node, child_label[0], child);
      return node;
    }
    if (nodes_[child].label.size() == 1) {
      nodes_[child].count += 1;
      return child;
    }
    // split child's edge after one token
    const int32_t mid = alloc({token}, nodes_[child].count + 1, node);
    auto& child_label = nodes_[child].label;
    child_label.erase(child_label.begin());
    nodes_[child].parent = mid;
    set_child(mid, child_label[0], child);
    set_child(node, token, mid);
    return mid;
  }

  // Merge node into its only child when no suffix ends at node any more.
  void fold(int32_t node) {
    if (node == 0 || nodes_[node].children.size() != 1) return;
    const int32_t child = nodes_[node].children.begin()->second.node;
    if (nodes_[child].count != nodes_[node].count) return;
    std::vector<Token> label = nodes_[node].label;
    label.insert(label.end(), nodes_[child].label.begin(), nodes_[child].label.end());
    const int32_t parent = nodes_[node].parent;
    nodes_[child].label = std::move(label);
    nodes_[child].parent = parent;
    set_child(parent, nodes_[child].label[0], child);
    nodes_[node].children.clear();
    release(node);
  }

  // Where pattern[start:] ends: (node, tokens of its edge consumed); false if absent.
  bool match(const std::vector<Token>& pattern, size_t start, int32_t& node,
             size_t& offset) const {
    node = 0;
    offset = 0;
    for (size_t i = start; i < pattern.size(); ++i) {
      const Token token = pattern[i];
      const Node& n = nodes_[node];
      if (offset == n.label.size()) {
        auto it = n.children.find(token);
        if (it == n.children.end()) return false;
        node = it->second.node;
        offset = 1;
      } else if (n.label[offset] == token) {
        ++offset;
      } else {
        return false;
      }
    }
    return true;
  }

  // The longest tail of pattern that occurs (a binary search: every shorter tail occurs too).
  int64_t longest_in(const std::vector<Token>& pattern) const {
    int64_t lo = 0, hi = int64_t(pattern.size());
    int32_t node;
    size_t offset;
    while (lo < hi) {
      const int64_t m = (lo + hi + 1) / 2;
      if (match(pattern, pattern.size() - size_t(m), node, offset))
        lo = m;
      else
        hi = m - 1;
    }
    return lo;
  }

  // Follow the most frequent continuation while its probability stays >= min_token_prob.
  double walk(int32_t node, size_t offset, int64_t max_tokens, double min_token_prob,
              std::vector<Token>& tokens) const {
    double prob = 1.0, score = 0.0;
    while (true) {
      const Node& n = nodes_[node];
      const int64_t take = std::min(int64_t(n.label.size()) - int64_t(offset),
                                    max_tokens - int64_t(tokens.size()));
      if (take > 0) {  // inside an edge every suffix continues the same way
        tokens.insert(tokens.end(), n.label.begin() + int64_t(offset),
                      n.label.begin() + int64_t(offset) + take);
        score += prob * double(take);
      }
      if (int64_t(tokens.size()) >= max_tokens || n.children.empty()) return score;
      const Child* best = nullptr;
      for (const auto& kv : n.children) {
        const Child& c = kv.second;
        if (best == nullptr || nodes_[c.node].count > nodes_[best->node].count ||
            (nodes_[c.node].count == nodes_[best->node].count && c.stamp < best->stamp))
          best = &c;
      }
      prob *= double(nodes_[best->node].count) / double(n.count);
      if (prob < min_token_prob) return score;
      node = best->node;
      offset = 0;
    }
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "suffix decoding's counting suffix tree (spec_decode/suffix.py) in C++";
  py::class_<Cursor>(m, "Cursor", "the growing end of one sequence in a tree")
      .def(py::init<>())
      .def_property_readonly("depth", [](const Cursor& c) { return c.active.size(); })
      .def("__deepcopy__", [](const Cursor& c, py::dict) { return Cursor(c); });
  py::class_<SuffixTree>(m, "SuffixTree")
      .def(py::init<int>(), py::arg("max_depth"))
      // (a copy keeps every node index, so copies of its cursors stay valid in it)
      .def("__deepcopy__", [](const SuffixTree& t, py::dict) { return SuffixTree(t); })
      .def_property_readonly("max_depth", &SuffixTree::max_depth)
      .def_property_readonly("root_count", &SuffixTree::root_count)
      .def("num_nodes", &SuffixTree::num_nodes)
      .def("extend", &SuffixTree::extend, py::arg("cursor"), py::arg("tokens"))
      .def("insert", &SuffixTree::insert, py::arg("tokens"), py::arg("num_starts") = -1)
      .def("remove", &SuffixTree::remove, py::arg("tokens"))
      .def("count", &SuffixTree::count, py::arg("tokens"))
      .def("longest_match", &SuffixTree::longest_match, py::arg("context"))
      .def("speculate", &SuffixTree::speculate, py::arg("context"), py::arg("max_tokens"),
           py::arg("max_spec_factor"), py::arg("min_token_prob"),
           py::arg("cursor") = static_cast<const Cursor*>(nullptr));
}
