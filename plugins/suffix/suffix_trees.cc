// The suffix proposer's trees, compiled: the same suffix trie as plugins/suffix/tree.py (its
// reference twin: tests compare the drafts, token for token and probability for probability),
// and batch calls that catch every running request's own tree and its match in a tree of
// earlier responses up with its new tokens, then draft for it.
//
// A plain C ABI loaded with ctypes (plugins/suffix/compiled.py), no paddle types. tree.py's
// docstring explains the structure; the names here follow it (Node/Leaf, best, STALE, the
// active suffix nodes, Matcher). Every choice that decides a draft is tree.py's, ties
// included: a node's children keep Python's dict order (insertion order; a replaced child
// keeps its place, a deleted one leaves it), so a stale best child is recomputed as the first
// child of the highest count, as Python's max() finds it.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace {

constexpr int32_t kNone = -1;   // no child
constexpr int32_t kStale = -2;  // the best child lost count: recompute when read
constexpr int32_t kRoot = 0;

// Unique across every tree of the process: a matcher made on one tree can never take another
// tree (one made later at the same address) for the tree it matched against. Atomic: ctypes
// lets go of the GIL, and two engines in one process may each run their proposer at once.
std::atomic<uint64_t> g_version{0};

struct Node {
  int32_t token = 0;     // inner nodes: the path's last token (a leaf's first is seqs[seq][pos])
  int32_t count = 0;     // a leaf's is 1
  int32_t best = kNone;  // inner nodes (not kept for the root)
  bool leaf = false;
  int32_t seq = -1;  // leaf: tokens seqs[seq][pos : min(limit, len)]
  int32_t pos = 0;
  int32_t limit = 0;
  std::vector<int32_t> children;  // inner nodes but the root: child ids in insertion order
};

// (parent, token) -> child: open addressing with linear probing and backward-shift deletion,
// one cache miss a lookup in the common case where std::unordered_map pays two (bucket, then
// node); an append looks up one edge per active suffix, up to max_depth.
class EdgeTable {
 public:
  EdgeTable() : slots_(16) {}

  static uint64_t key_of(int32_t node, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(node)) << 32) | static_cast<uint32_t>(token);
  }

  int32_t find(uint64_t key) const {
    for (size_t i = home(key);; i = (i + 1) & mask()) {
      const Slot& slot = slots_[i];
      if (slot.value == kNone) return kNone;
      if (slot.key == key) return slot.value;
    }
  }

  void put(uint64_t key, int32_t value) {
    if (2 * (count_ + 1) > slots_.size()) grow();
    size_t i = home(key);
    while (slots_[i].value != kNone && slots_[i].key != key) i = (i + 1) & mask();
    if (slots_[i].value == kNone) ++count_;
    slots_[i] = {key, value};
  }

  void erase(uint64_t key) {
    size_t i = home(key);
    while (slots_[i].key != key || slots_[i].value == kNone) {
      if (slots_[i].value == kNone) return;
      i = (i + 1) & mask();
    }
    slots_[i].value = kNone;
    --count_;
    // Pull back every entry after the hole that may not sit beyond it (its home is not in (i, j]).
    for (size_t j = (i + 1) & mask(); slots_[j].value != kNone; j = (j + 1) & mask()) {
      const size_t k = home(slots_[j].key);
      const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      slots_[j].value = kNone;
      i = j;
    }
  }

 private:
  struct Slot {
    uint64_t key = 0;
    int32_t value = kNone;
  };

  size_t mask() const { return slots_.size() - 1; }
  size_t home(uint64_t key) const {
    key ^= key >> 31;
    key *= 0xbf58476d1ce4e5b9ULL;
    key ^= key >> 29;
    return static_cast<size_t>(key) & mask();
  }

  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    count_ = 0;
    for (const Slot& slot : old)
      if (slot.value != kNone) put(slot.key, slot.value);
  }

  std::vector<Slot> slots_;
  size_t count_ = 0;
};

struct Draft {
  std::vector<int64_t> tokens;
  std::vector<double> probs;
  double score = 0.0;
  int64_t match_len = 0;
};

class Tree {
 public:
  explicit Tree(int32_t depth) : depth_(depth), version_(++g_version) { nodes_.emplace_back(); }

  int32_t depth() const { return depth_; }
  uint64_t version() const { return version_; }
  int64_t num_seqs() const { return static_cast<int64_t>(slot_of_.size()); }
  const std::vector<int32_t>& active() const { return active_; }

  // Append tokens to sequence `key` (a new one if unknown); false if `key` is closed.
  bool extend(int64_t key, const int64_t* tokens, int64_t count) {
    if (!(has_growing_ && key == growing_key_)) {
      if (slot_of_.count(key)) return false;
      int32_t slot;
      if (!free_seqs_.empty()) {
        slot = free_seqs_.back();
        free_seqs_.pop_back();
      } else {
        slot = static_cast<int32_t>(seqs_.size());
        seqs_.emplace_back();
      }
      slot_of_[key] = slot;
      has_growing_ = true;
      growing_key_ = key;
      growing_slot_ = slot;
      active_.clear();
    }
    for (int64_t i = 0; i < count; ++i) extend_suffixes(static_cast<int32_t>(tokens[i]));
    version_ = ++g_version;
    return true;
  }

  // Remove sequence `key`; false if absent.
  bool remove(int64_t key) {
    auto found = slot_of_.find(key);
    if (found == slot_of_.end()) return false;
    const int32_t slot = found->second;
    slot_of_.erase(found);
    if (has_growing_ && key == growing_key_) {
      has_growing_ = false;
      active_.clear();
    }
    std::vector<int32_t>& seq = seqs_[slot];
    const int64_t length = static_cast<int64_t>(seq.size());
    for (int64_t start = 0; start < length; ++start) {
      nodes_[kRoot].count -= 1;
      int32_t node = kRoot;
      const int64_t stop = std::min<int64_t>(start + depth_, length);
      for (int64_t i = start; i < stop; ++i) {
        const int32_t token = seq[i];
        const int32_t child = find(node, token);
        if (!nodes_[child].leaf) {
          nodes_[child].count -= 1;
          if (nodes_[child].count) {
            if (child == nodes_[node].best) nodes_[node].best = kStale;
            node = child;
            continue;
          }
        }
        // A leaf, or a node only this suffix used: it goes, with all below it.
        erase_child(node, token, child);
        if (child == nodes_[node].best) nodes_[node].best = nodes_[node].children.empty() ? kNone : kStale;
        free_subtree(child);
        break;
      }
    }
    seq.clear();
    seq.shrink_to_fit();
    free_seqs_.push_back(slot);
    version_ = ++g_version;
    return true;
  }

  const std::vector<int32_t>* sequence(int64_t key) const {
    auto found = slot_of_.find(key);
    return found == slot_of_.end() ? nullptr : &seqs_[found->second];
  }

  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size() - free_nodes_.size()) - 1; }

  // -- reading (the matcher's and the drafts' primitives) --

  int32_t find(int32_t node, int32_t token) const { return edges_.find(EdgeTable::key_of(node, token)); }
  const Node& at(int32_t id) const { return nodes_[id]; }
  const std::vector<int32_t>& seq_tokens(int32_t slot) const { return seqs_[slot]; }
  int32_t leaf_end(const Node& leaf) const {
    return std::min<int32_t>(leaf.limit, static_cast<int32_t>(seqs_[leaf.seq].size()));
  }

  // node.best, recomputed first if a removal left it stale.
  int32_t best_child(int32_t node) {
    Node& n = nodes_[node];
    if (n.best == kStale) {
      int32_t best = kNone;
      for (int32_t child : n.children)
        if (best == kNone || nodes_[child].count > nodes_[best].count) best = child;
      n.best = best;
    }
    return n.best;
  }

 private:
  // A node in a free slot (or a new one) holding `fields`.
  int32_t new_node(Node fields) {
    if (free_nodes_.empty()) {
      nodes_.push_back(std::move(fields));
      return static_cast<int32_t>(nodes_.size() - 1);
    }
    const int32_t id = free_nodes_.back();
    free_nodes_.pop_back();
    nodes_[id] = std::move(fields);
    return id;
  }

  int32_t new_leaf(int32_t seq, int32_t pos, int32_t limit) {
    Node leaf;
    leaf.count = 1;
    leaf.leaf = true;
    leaf.seq = seq;
    leaf.pos = pos;
    leaf.limit = limit;
    return new_node(std::move(leaf));
  }

  int32_t new_inner(int32_t token, int32_t count) {
    Node inner;
    inner.token = token;
    inner.count = count;
    return new_node(std::move(inner));
  }

  void add_child(int32_t parent, int32_t token, int32_t child) {
    edges_.put(EdgeTable::key_of(parent, token), child);
    if (parent != kRoot) nodes_[parent].children.push_back(child);
  }

  void replace_child(int32_t parent, int32_t token, int32_t old_child, int32_t new_child) {
    edges_.put(EdgeTable::key_of(parent, token), new_child);
    if (parent == kRoot) return;
    for (int32_t& child : nodes_[parent].children)
      if (child == old_child) {
        child = new_child;
        return;
      }
  }

  void erase_child(int32_t parent, int32_t token, int32_t child) {
    edges_.erase(EdgeTable::key_of(parent, token));
    if (parent == kRoot) return;
    std::vector<int32_t>& children = nodes_[parent].children;
    children.erase(std::find(children.begin(), children.end(), child));
  }

  void free_subtree(int32_t id) {
    std::vector<int32_t> stack{id};
    while (!stack.empty()) {
      const int32_t node = stack.back();
      stack.pop_back();
      Node& n = nodes_[node];
      if (!n.leaf) {
        for (int32_t child : n.children) {
          const Node& c = nodes_[child];
          edges_.erase(EdgeTable::key_of(node, c.leaf ? seqs_[c.seq][c.pos] : c.token));
          stack.push_back(child);
        }
        n.children.clear();
        n.children.shrink_to_fit();
      }
      free_nodes_.push_back(node);
    }
  }

  // A second suffix enters `leaf`: its first token becomes an inner node of count 2.
  int32_t split(int32_t parent, int32_t token, int32_t leaf) {
    const int32_t node = new_inner(token, 2);
    Node& l = nodes_[leaf];
    l.pos += 1;
    bool keep = l.pos < leaf_end(l);
    if (keep) {
      nodes_[node].children.push_back(leaf);
      edges_.put(EdgeTable::key_of(node, seqs_[l.seq][l.pos]), leaf);
      nodes_[node].best = leaf;
    }
    replace_child(parent, token, leaf, node);
    const int32_t best = nodes_[parent].best;
    if (best == leaf || (best >= 0 && nodes_[best].count < 2)) nodes_[parent].best = node;
    if (!keep) free_nodes_.push_back(leaf);
    return node;
  }

  // Extend every suffix of the growing sequence that ends at an inner node by `token`.
  void extend_suffixes(int32_t token) {
    std::vector<int32_t>& seq = seqs_[growing_slot_];
    seq.push_back(token);
    const int32_t pos = static_cast<int32_t>(seq.size()) - 1;
    nodes_[kRoot].count += 1;
    next_active_.clear();
    int32_t child = find(kRoot, token);
    if (child == kNone) {
      add_child(kRoot, token, new_leaf(growing_slot_, pos, pos + depth_));
    } else {
      if (nodes_[child].leaf)
        child = split(kRoot, token, child);
      else
        nodes_[child].count += 1;
      next_active_.push_back(child);
    }
    int32_t depth = 0;
    for (int32_t node : active_) {
      depth += 1;
      if (depth >= depth_) break;  // cut at max_depth: this suffix is complete
      child = find(node, token);
      if (child == kNone) {
        const int32_t leaf = new_leaf(growing_slot_, pos, pos - depth + depth_);
        add_child(node, token, leaf);
        if (nodes_[node].best == kNone) nodes_[node].best = leaf;
        continue;
      }
      if (nodes_[child].leaf) {
        child = split(node, token, child);
      } else {
        nodes_[child].count += 1;
        const int32_t best = nodes_[node].best;
        if (child != best && best >= 0 && nodes_[child].count > nodes_[best].count) nodes_[node].best = child;
      }
      next_active_.push_back(child);
    }
    active_.swap(next_active_);
  }

  int32_t depth_;
  uint64_t version_;
  std::vector<Node> nodes_;  // nodes_[0] is the root
  std::vector<int32_t> free_nodes_;
  EdgeTable edges_;  // (parent, token) -> child
  std::vector<std::vector<int32_t>> seqs_;
  std::vector<int32_t> free_seqs_;
  std::unordered_map<int64_t, int32_t> slot_of_;  // sequence key -> slot in seqs_
  bool has_growing_ = false;
  int64_t growing_key_ = 0;
  int32_t growing_slot_ = -1;
  std::vector<int32_t> active_, next_active_;
};

// Follow the most frequent children from `node` (tree.py: draft_from).
Draft draft_from(Tree& tree, int32_t node, int64_t max_tokens, double min_token_prob) {
  Draft draft;
  const double total = tree.at(node).count;
  while (static_cast<int64_t>(draft.tokens.size()) < max_tokens) {
    const int32_t child = tree.best_child(node);
    if (child == kNone) break;
    const Node& c = tree.at(child);
    const double prob = c.count / total;
    if (prob < min_token_prob) break;
    if (c.leaf) {
      const int64_t length = std::min<int64_t>(max_tokens - draft.tokens.size(), tree.leaf_end(c) - c.pos);
      const std::vector<int32_t>& seq = tree.seq_tokens(c.seq);
      for (int64_t i = 0; i < length; ++i) {
        draft.tokens.push_back(seq[c.pos + i]);
        draft.probs.push_back(prob);
      }
      draft.score += prob * length;
      break;
    }
    draft.tokens.push_back(c.token);
    draft.probs.push_back(prob);
    draft.score += prob;
    node = child;
  }
  return draft;
}

inline int64_t length_limit(int64_t m, double max_spec_factor) {
  return static_cast<int64_t>(m * max_spec_factor + 1e-9);
}

// The highest-scoring draft over match lengths 1 .. nodes.size() (tree.py: best_node_draft).
Draft best_node_draft(Tree& tree, const std::vector<int32_t>& nodes, int64_t max_tokens, double max_spec_factor,
                      double min_token_prob, double beat) {
  Draft best;
  double best_score = beat;
  for (int64_t m = static_cast<int64_t>(nodes.size()); m > 0; --m) {
    const int64_t limit = std::min(max_tokens, length_limit(m, max_spec_factor));
    if (limit <= best_score) break;
    const int32_t node = nodes[m - 1];
    const int32_t child = tree.best_child(node);
    if (child == kNone) continue;
    const double first = static_cast<double>(tree.at(child).count) / tree.at(node).count;
    if (first < min_token_prob || first * limit <= best_score) continue;
    Draft draft = draft_from(tree, node, limit, min_token_prob);
    if (draft.score > best_score) {
      best = std::move(draft);
      best.match_len = m;
      best_score = best.score;
    }
  }
  return best;
}

// Where each suffix of a growing context ends in a tree (tree.py: Matcher).
struct Matcher {
  uint64_t version = 0;  // the tree's version it matched against; 0: never
  std::vector<int32_t> nodes, next_nodes;
  int32_t seq = -1;
  int64_t index = 0;
  int64_t top = 0;

  void reset(const Tree& tree, const std::vector<int32_t>& context) {
    nodes.clear();
    seq = -1;
    index = 0;
    top = 0;
    version = tree.version();
    const size_t start = context.size() > static_cast<size_t>(tree.depth()) ? context.size() - tree.depth() : 0;
    for (size_t i = start; i < context.size(); ++i) push(tree, context[i]);
  }

  void push(const Tree& tree, int32_t token) {
    next_nodes.clear();
    int32_t new_seq = -1;
    int64_t new_index = 0, new_top = 0;
    const int32_t first = tree.find(kRoot, token);
    if (first != kNone) {
      new_top = 1;
      if (tree.at(first).leaf) {
        new_seq = tree.at(first).seq;
        new_index = tree.at(first).pos + 1;
      } else {
        next_nodes.push_back(first);
      }
      bool every_node_grew = true;
      for (int32_t node : nodes) {  // the suffix of length m grows to m + 1
        const int32_t child = tree.find(node, token);
        if (child == kNone) {
          every_node_grew = false;
          break;
        }
        new_top += 1;
        if (new_seq < 0) {
          if (tree.at(child).leaf) {
            new_seq = tree.at(child).seq;
            new_index = tree.at(child).pos + 1;
          } else {
            next_nodes.push_back(child);
          }
        }
      }
      if (every_node_grew && top > static_cast<int64_t>(nodes.size())) {
        // The unique matches grow too if their one occurrence goes on with `token`.
        const std::vector<int32_t>& old = tree.seq_tokens(seq);
        if (index < static_cast<int64_t>(old.size()) && old[index] == token) {
          new_top = std::min<int64_t>(top + 1, tree.depth());
          if (new_top > static_cast<int64_t>(next_nodes.size())) {
            new_seq = seq;
            new_index = index + 1;
          }
        }
      }
    }
    nodes.swap(next_nodes);
    seq = new_seq;
    index = new_index;
    top = new_top;
  }

  Draft best_draft(Tree& tree, int64_t max_tokens, double max_spec_factor, double min_token_prob, double beat) {
    int64_t best_len = 0, best_m = 0;
    const int64_t inner = static_cast<int64_t>(nodes.size());
    if (top > inner) {
      // Unique matches: their next tokens each have probability 1, up to the depth cut.
      const int64_t left = static_cast<int64_t>(tree.seq_tokens(seq).size()) - index;
      const int64_t depth = tree.depth();
      const int64_t cap = max_tokens < left ? max_tokens : left;
      for (int64_t m = std::min(top, depth - 1); m > inner; --m) {
        int64_t limit = length_limit(m, max_spec_factor);
        if (limit > cap) limit = cap;
        if (limit <= best_len || limit <= beat) break;
        const int64_t length = limit < depth - m ? limit : depth - m;
        if (length > best_len && length > beat) {
          best_len = length;
          best_m = m;
        }
      }
    }
    if (best_len) beat = static_cast<double>(best_len);
    Draft draft = best_node_draft(tree, nodes, max_tokens, max_spec_factor, min_token_prob, beat);
    if (draft.score > beat || !best_len) return draft;
    Draft unique;
    const std::vector<int32_t>& tokens = tree.seq_tokens(seq);
    for (int64_t i = 0; i < best_len; ++i) {
      unique.tokens.push_back(tokens[index + i]);
      unique.probs.push_back(1.0);
    }
    unique.score = static_cast<double>(best_len);
    unique.match_len = best_m;
    return unique;
  }
};

// A running request: its own tree (one growing sequence, key 0) and its match in a tree of
// earlier responses.
struct RequestState {
  explicit RequestState(int32_t depth) : own(depth) { own.extend(0, nullptr, 0); }
  Tree own;
  Matcher matcher;

  const std::vector<int32_t>& tokens() const { return *own.sequence(0); }

  // The request grew by `tokens`; `responses` is the tree its matcher follows (may be null).
  void append(const int64_t* tokens, int64_t count, const Tree* responses) {
    own.extend(0, tokens, count);
    if (responses != nullptr && matcher.version == responses->version())
      for (int64_t i = 0; i < count; ++i) matcher.push(*responses, static_cast<int32_t>(tokens[i]));
  }

  // tree.py's SuffixProposer.speculate: the best draft over both trees, ties to its own.
  Draft speculate(Tree* responses, bool own_only, int64_t max_tokens, double max_spec_factor,
                  double min_token_prob) {
    Draft own_draft = best_node_draft(own, own.active(), max_tokens, max_spec_factor, min_token_prob, 0.0);
    if (own_only || responses == nullptr || responses->num_seqs() == 0) return own_draft;
    if (matcher.version != responses->version()) matcher.reset(*responses, tokens());
    Draft cached = matcher.best_draft(*responses, max_tokens, max_spec_factor, min_token_prob, own_draft.score);
    return cached.score > own_draft.score ? cached : own_draft;
  }
};

}  // namespace

extern "C" {

void* specdec_suffix_tree_new(int64_t depth) { return depth >= 1 ? new Tree(static_cast<int32_t>(depth)) : nullptr; }

void specdec_suffix_tree_free(void* tree) { delete static_cast<Tree*>(tree); }

// 0, or -1 when `key` is closed (only the sequence appended to last can grow).
int64_t specdec_suffix_tree_extend(void* tree, int64_t key, const int64_t* tokens, int64_t count) {
  return static_cast<Tree*>(tree)->extend(key, tokens, count) ? 0 : -1;
}

// 0, or -1 when `key` is absent.
int64_t specdec_suffix_tree_remove(void* tree, int64_t key) { return static_cast<Tree*>(tree)->remove(key) ? 0 : -1; }

int64_t specdec_suffix_tree_num_nodes(void* tree) { return static_cast<Tree*>(tree)->num_nodes(); }

// The length of sequence `key` (-1 if absent); its tokens into `out` when not null.
int64_t specdec_suffix_tree_sequence(void* tree, int64_t key, int64_t* out) {
  const std::vector<int32_t>* seq = static_cast<Tree*>(tree)->sequence(key);
  if (seq == nullptr) return -1;
  if (out != nullptr) std::copy(seq->begin(), seq->end(), out);
  return static_cast<int64_t>(seq->size());
}

// The best draft for `context` from this tree alone (tree.py: SuffixTree.speculate); writes
// up to max_tokens tokens and probabilities, the score and the match length; returns the length.
int64_t specdec_suffix_tree_speculate(void* tree, const int64_t* context, int64_t count, int64_t max_tokens,
                                      double max_spec_factor, double min_token_prob, int64_t* out_tokens,
                                      double* out_probs, double* out_score, int64_t* out_match_len) {
  Tree& t = *static_cast<Tree*>(tree);
  std::vector<int32_t> tokens(context, context + count);
  Matcher matcher;
  matcher.reset(t, tokens);
  Draft draft = matcher.best_draft(t, max_tokens, max_spec_factor, min_token_prob, 0.0);
  std::copy(draft.tokens.begin(), draft.tokens.end(), out_tokens);
  std::copy(draft.probs.begin(), draft.probs.end(), out_probs);
  *out_score = draft.score;
  *out_match_len = draft.match_len;
  return static_cast<int64_t>(draft.tokens.size());
}

void* specdec_suffix_request_new(int64_t depth) {
  return depth >= 1 ? new RequestState(static_cast<int32_t>(depth)) : nullptr;
}

void specdec_suffix_request_free(void* state) { delete static_cast<RequestState*>(state); }

// The request's token count; its tokens from `start` on into `out` when not null.
int64_t specdec_suffix_request_tokens(void* state, int64_t start, int64_t* out) {
  const std::vector<int32_t>& tokens = static_cast<RequestState*>(state)->tokens();
  if (out != nullptr && start < static_cast<int64_t>(tokens.size())) std::copy(tokens.begin() + start, tokens.end(), out);
  return static_cast<int64_t>(tokens.size());
}

// A batch call's table: int64 columns of `count` rows each, one after the other.
//   extend:  states, response trees, new token counts
//   propose: the same, then max draft lengths, own-only flags, and what it writes: draft
//            lengths, match lengths
// A state or tree is an address from specdec_suffix_request_new / specdec_suffix_tree_new
// (a tree of 0: none). One array crosses over where seven would each cost a conversion.
enum Column { kStates = 0, kTrees, kCounts, kMaxLens, kOwnOnly, kLengths, kMatchLens };

// Append to each request its counts[i] tokens (all of them in one flat array, in order).
void specdec_suffix_extend_batch(int64_t count, int64_t* table, const int64_t* flat) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tokens = table[kCounts * count + i];
    auto* state = reinterpret_cast<RequestState*>(table[kStates * count + i]);
    state->append(flat, tokens, reinterpret_cast<const Tree*>(table[kTrees * count + i]));
    flat += tokens;
  }
}

// extend_batch, then each request's best draft of at most max_lens[i] tokens (own_only[i]:
// from its own tree alone) into row i of out [count, width], padding left as it is.
void specdec_suffix_propose_batch(int64_t count, int64_t* table, const int64_t* flat, double max_spec_factor,
                                  double min_token_prob, int64_t width, int64_t* out) {
  specdec_suffix_extend_batch(count, table, flat);
  for (int64_t i = 0; i < count; ++i) {
    int64_t& length = table[kLengths * count + i];
    int64_t& match_len = table[kMatchLens * count + i];
    length = match_len = 0;
    const int64_t max_tokens = std::min(table[kMaxLens * count + i], width);
    if (max_tokens <= 0) continue;
    auto* state = reinterpret_cast<RequestState*>(table[kStates * count + i]);
    Draft draft = state->speculate(reinterpret_cast<Tree*>(table[kTrees * count + i]),
                                   table[kOwnOnly * count + i] != 0, max_tokens, max_spec_factor, min_token_prob);
    std::copy(draft.tokens.begin(), draft.tokens.end(), out + i * width);
    length = static_cast<int64_t>(draft.tokens.size());
    match_len = draft.tokens.empty() ? 0 : draft.match_len;
  }
}

}  // extern "C"
