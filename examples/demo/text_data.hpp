#pragma once
/// \file text_data.hpp
/// Character-level text for the demo: the vocabulary, the train/validation
/// split, batches of context windows with their next-token labels, and the
/// bigram baseline the model has to beat.

#include <apex/ffn/layers/cross_entropy.hpp>
#include <apex/ffn/core/errors.hpp>
#include <apex/ffn/core/init.hpp>
#include <apex/ffn/core/types.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "context_embedding.hpp"

namespace apex::demo {

/// The distinct bytes of a text, in byte order; a token id is a position in it.
class Vocabulary {
 public:
  Vocabulary() { id_.fill(-1); }
  explicit Vocabulary(const std::string& text) : Vocabulary() {
    std::array<bool, 256> seen{};
    for (unsigned char ch : text) seen[ch] = true;
    for (int b = 0; b < 256; ++b)
      if (seen[std::size_t(b)]) {
        id_[std::size_t(b)] = Index(chars_.size());
        chars_.push_back(char(b));
      }
  }

  Index size() const { return Index(chars_.size()); }
  const std::string& chars() const { return chars_; }
  bool contains(char ch) const { return id_[static_cast<unsigned char>(ch)] >= 0; }
  /// ValueError for a character outside the vocabulary.
  Index id(char ch) const {
    const Index i = id_[static_cast<unsigned char>(ch)];
    if (i < 0) throw ValueError("Vocabulary::id: character code " + std::to_string(int(static_cast<unsigned char>(ch))) +
                                " is not in the vocabulary");
    return i;
  }
  char ch(Index id) const {
    if (id < 0 || id >= size())
      throw ValueError("Vocabulary::ch: token id " + std::to_string(id) + " outside [0, " + std::to_string(size()) + ")");
    return chars_[std::size_t(id)];
  }
  std::vector<Index> encode(const std::string& s) const {
    std::vector<Index> out;
    out.reserve(s.size());
    for (char c : s) out.push_back(id(c));
    return out;
  }
  std::string decode(const std::vector<Index>& ids) const {
    std::string s;
    for (Index i : ids) s += ch(i);
    return s;
  }

 private:
  std::string chars_;
  std::array<Index, 256> id_;
};

/// A text split into a training part and a held-out validation tail.
struct Corpus {
  Vocabulary vocab;
  std::vector<Index> train;  ///< token ids of the first part
  std::vector<Index> val;    ///< token ids of the held-out tail

  /// Splits `text` after the first line break past `1 − val_fraction` of it
  /// (at exactly that point if no line break follows before the end);
  /// the vocabulary covers the whole text. ValueError if either part would be
  /// empty.
  static Corpus from_text(const std::string& text, double val_fraction = 0.1) {
    if (!(val_fraction > 0 && val_fraction < 1))
      throw ConfigError("Corpus::from_text: val_fraction must be in (0, 1), got " + std::to_string(val_fraction));
    std::size_t cut = std::size_t(double(text.size()) * (1.0 - val_fraction));
    const std::size_t nl = text.find('\n', cut);
    if (nl != std::string::npos && nl + 1 < text.size()) cut = nl + 1;
    if (cut == 0 || cut >= text.size())
      throw ValueError("Corpus::from_text: a text of " + std::to_string(text.size()) +
                       " bytes is too short to split into training and validation parts");
    Corpus c;
    c.vocab = Vocabulary(text);
    c.train = c.vocab.encode(text.substr(0, cut));
    c.val = c.vocab.encode(text.substr(cut));
    return c;
  }

  /// Reads `path` whole; FormatError if it cannot be read or is empty.
  static Corpus load(const std::string& path, double val_fraction = 0.1) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw FormatError("Corpus::load: cannot open '" + path + "'");
    std::ostringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    if (text.empty()) throw FormatError("Corpus::load: '" + path + "' is empty");
    return from_text(text, val_fraction);
  }
};

/// A batch of `chunks` runs of `chunk_len` consecutive positions.
///
/// Row `b·L + t` is position `p = start_b + t`: its context is the `c` tokens
/// before p (the pad token where that runs before the text), and its main
/// target is the token at p. `labels[b]` holds the tokens at
/// `start_b … start_b + L + lookahead − 1` (the ignore index past the end), so
/// multi-token head k (predicting p + k) finds its target `lookahead` tokens
/// past the chunk as well — the layout `multi_token_loss` expects.
struct Batch {
  ContextIds context;            ///< chunks·L × c
  std::vector<TokenIds> labels;  ///< per chunk: L + lookahead targets
  Index chunk_len = 0;           ///< L
  Index chunks() const { return Index(labels.size()); }
  Index rows() const { return context.rows(); }
};

/// Builds the batch of the chunks starting at `starts` (see Batch).
inline Batch make_batch(const std::vector<Index>& text, const std::vector<Index>& starts, Index chunk_len, Index context,
                        Index lookahead, Index pad) {
  Batch b;
  b.chunk_len = chunk_len;
  b.context.resize(Index(starts.size()) * chunk_len, context);
  for (std::size_t s = 0; s < starts.size(); ++s) {
    const Index p0 = starts[s];
    for (Index t = 0; t < chunk_len; ++t) {
      auto row = b.context.row(Index(s) * chunk_len + t);
      for (Index j = 0; j < context; ++j) {
        const Index q = p0 + t - context + j;
        row(j) = q >= 0 && q < Index(text.size()) ? text[std::size_t(q)] : pad;
      }
    }
    TokenIds lab(chunk_len + lookahead);
    for (Index j = 0; j < lab.size(); ++j) {
      const Index q = p0 + j;
      lab(j) = q < Index(text.size()) ? text[std::size_t(q)] : kIgnoreIndex;
    }
    b.labels.push_back(std::move(lab));
  }
  return b;
}

/// Draws training batches: `chunks` chunk starts uniform over the text.
class BatchSampler {
 public:
  BatchSampler(const std::vector<Index>& text, Index chunks, Index chunk_len, Index context, Index lookahead, Index pad,
               std::uint64_t seed)
      : text_(&text), chunks_(chunks), len_(chunk_len), context_(context), lookahead_(lookahead), pad_(pad), rng_(seed) {
    if (Index(text.size()) <= chunk_len)
      throw ConfigError("BatchSampler: the text (" + std::to_string(text.size()) +
                        " tokens) must be longer than one chunk (" + std::to_string(chunk_len) + ")");
  }

  Batch next() {
    std::vector<Index> starts(static_cast<std::size_t>(chunks_));
    const Index span = Index(text_->size()) - len_;
    for (auto& s : starts) s = Index(rng_.index(std::uint64_t(span)));
    return make_batch(*text_, starts, len_, context_, lookahead_, pad_);
  }

 private:
  const std::vector<Index>* text_;
  Index chunks_, len_, context_, lookahead_, pad_;
  Rng rng_;
};

/// Character bigram model with add-k smoothing, fitted on a text:
/// P(b | a) = (n(a, b) + k) / (n(a) + k·V).
class BigramBaseline {
 public:
  BigramBaseline(const std::vector<Index>& text, Index vocab, double k = 0.1)
      : v_(vocab), k_(k), pair_(std::size_t(vocab * vocab), 0.0), first_(std::size_t(vocab), 0.0) {
    for (std::size_t i = 1; i < text.size(); ++i) {
      pair_[std::size_t(text[i - 1] * v_ + text[i])] += 1;
      first_[std::size_t(text[i - 1])] += 1;
    }
  }

  /// −ln P(b | a).
  double nll(Index a, Index b) const {
    return -std::log((pair_[std::size_t(a * v_ + b)] + k_) / (first_[std::size_t(a)] + k_ * double(v_)));
  }

  /// Mean −ln P over positions `first … first + count − 1` of `text` (each
  /// predicted from the token before it), in nats.
  double mean_nll(const std::vector<Index>& text, Index first, Index count) const {
    double s = 0;
    Index n = 0;
    for (Index p = std::max<Index>(first, 1); p < first + count && p < Index(text.size()); ++p, ++n)
      s += nll(text[std::size_t(p - 1)], text[std::size_t(p)]);
    return n > 0 ? s / double(n) : 0.0;
  }

 private:
  Index v_;
  double k_;
  std::vector<double> pair_, first_;
};

}  // namespace apex::demo
