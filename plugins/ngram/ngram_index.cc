// The ngram proposer's index, compiled: for each request, where each n-gram (min_n <= n <= max_n)
// of its tokens last ended, among the positions that have a follower; and a batch call that
// catches every request's index up with its new tokens and drafts for it.
//
// A plain C ABI (loaded with ctypes by specdec.kernels.cpu.ngram), no paddle types. The Python
// NgramIndex in plugins/ngram/proposer.py is the reference twin: tests compare the drafts.
// Tables hold 64-bit hashes of n-grams (open addressing, see FlatTable); a lookup compares the
// tokens themselves before it trusts a hit, so a hash collision can only cost a draft, never
// produce a wrong one.
#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

inline uint64_t mix(uint64_t hash, int64_t token) {
  uint64_t x = hash ^ (static_cast<uint64_t>(token) + 0x9e3779b97f4a7c15ULL + (hash << 6) + (hash >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ULL;
  return x ^ (x >> 29);
}

// hash -> position, open addressing with linear probing: one cache miss per insert or lookup
// in the common case (a node-based map pays two: the bucket, then the node), which is what a
// batch of 256 long contexts spends its time on. Hash 0 marks an empty slot.
class FlatTable {
 public:
  FlatTable() : slots_(16) {}

  void put(uint64_t hash, int64_t value) {
    if (2 * (count_ + 1) > slots_.size()) grow();
    Slot& slot = slots_[index_of(key_of(hash))];
    if (slot.key == 0) {
      slot.key = key_of(hash);
      ++count_;
    }
    slot.value = value;
  }

  // The value stored under hash, or -1.
  int64_t get(uint64_t hash) const {
    const Slot& slot = slots_[index_of(key_of(hash))];
    return slot.key == 0 ? -1 : slot.value;
  }

 private:
  struct Slot {
    uint64_t key = 0;
    int64_t value = 0;
  };

  static uint64_t key_of(uint64_t hash) { return hash == 0 ? 1 : hash; }

  // The slot holding key, or the empty slot where it would go (the table is at most half full,
  // so there is one).
  size_t index_of(uint64_t key) const {
    const size_t mask = slots_.size() - 1;
    size_t i = key & mask;
    while (slots_[i].key != key && slots_[i].key != 0) i = (i + 1) & mask;
    return i;
  }

  void grow() {
    std::vector<Slot> old(2 * slots_.size());
    old.swap(slots_);
    for (const Slot& slot : old)
      if (slot.key != 0) slots_[index_of(slot.key)] = slot;
  }

  std::vector<Slot> slots_;
  size_t count_ = 0;
};

struct NgramIndex {
  int64_t min_n, max_n;
  std::vector<int64_t> tokens;
  std::vector<FlatTable> tables;  // tables[n]: hash of an n-gram -> where it last ended

  NgramIndex(int64_t min_n_, int64_t max_n_) : min_n(min_n_), max_n(max_n_), tables(max_n_ + 1) {}

  void append(const int64_t* new_tokens, int64_t count) {
    const int64_t old = static_cast<int64_t>(tokens.size());
    const int64_t length = old + count;
    if (count <= 0) return;
    tokens.insert(tokens.end(), new_tokens, new_tokens + count);
    // An n-gram ending at j is indexed once position j + 1 exists; later ends overwrite.
    for (int64_t j = std::max<int64_t>(old - 1, 0); j < length - 1; ++j) {
      uint64_t hash = 0;
      for (int64_t n = 1; n <= std::min(max_n, j + 1); ++n) {
        hash = mix(hash, tokens[j - n + 1]);
        if (n >= min_n) tables[n].put(hash, j);
      }
    }
  }

  // Writes the draft to out and returns its length; *matched is the length of the matched
  // suffix (0 when nothing matched).
  int64_t draft(int64_t max_len, int64_t* out, int64_t* matched) const {
    *matched = 0;
    const int64_t length = static_cast<int64_t>(tokens.size());
    const int64_t longest = std::min(max_n, length - 1);
    if (max_len <= 0 || longest < min_n) return 0;
    uint64_t hashes[65];
    uint64_t hash = 0;
    for (int64_t n = 1; n <= longest; ++n) hashes[n] = hash = mix(hash, tokens[length - n]);
    for (int64_t n = longest; n >= min_n; --n) {
      const int64_t end = tables[n].get(hashes[n]);
      if (end < 0) continue;
      if (!std::equal(tokens.begin() + (end - n + 1), tokens.begin() + end + 1, tokens.begin() + (length - n)))
        continue;  // a hash collision
      const int64_t count = std::min(max_len, length - end - 1);
      std::copy_n(tokens.begin() + end + 1, count, out);
      *matched = n;
      return count;
    }
    return 0;
  }
};

}  // namespace

extern "C" {

void* specdec_ngram_new(int64_t min_n, int64_t max_n) {
  if (min_n < 1 || max_n < min_n || max_n > 64) return nullptr;
  return new NgramIndex(min_n, max_n);
}

void specdec_ngram_free(void* index) { delete static_cast<NgramIndex*>(index); }

// For request i of n: append its new_counts[i] new tokens (the next ones of the flat array
// new_tokens) to indexes[i], then write up to max_lens[i] (at most width) draft tokens to
// out[i * width ...], their count to out_lens[i] and the matched suffix length to matched[i].
void specdec_ngram_propose(int64_t n, void* const* indexes, const int64_t* new_tokens, const int64_t* new_counts,
                           const int64_t* max_lens, int64_t width, int64_t* out, int64_t* out_lens,
                           int64_t* matched) {
  for (int64_t i = 0; i < n; ++i) {
    NgramIndex* index = static_cast<NgramIndex*>(indexes[i]);
    index->append(new_tokens, new_counts[i]);
    new_tokens += new_counts[i];
    out_lens[i] = index->draft(std::min(max_lens[i], width), out + i * width, matched + i);
  }
}

}  // extern "C"
