#pragma once
/// \file batch_loss.hpp
/// The loss of a batch of sequences: the multi-token loss of each sequence
/// (its heads' targets run past its end, see Batch), averaged over the
/// sequences, with head statistics pooled over every token. CharModel::loss
/// applies it to the model's heads; it depends on the batch layout
/// (text_data.hpp) and the heads, not on the trunk, so it lives apart.

#include <apex/ffn/layers/cross_entropy.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>

#include <cstddef>
#include <vector>

#include "text_data.hpp"

namespace apex::demo {

/// Loss of a batch, summed over its sequences before averaging.
struct BatchLoss {
  double total = 0;                    ///< L = L_main + λ·Σ_k L_k (mean over chunks)
  CrossEntropyStats main;              ///< main head: mean CE (nats) and accuracy
  std::vector<CrossEntropyStats> heads;  ///< head i predicts token t+2+i
};

/// The multi-token loss of `logits` (N × V) and `head_logits` (N × N_heads·V)
/// on `batch`: each chunk is one sequence (its heads' targets run
/// `lookahead` tokens past it), and the batch loss is the mean over chunks.
/// With `dlogits`/`dheads`, writes ∂L/∂logits.
template <class T>
BatchLoss batch_loss(const MultiTokenHeads<T>& mtp, const Matrix<T>& logits, const Matrix<T>& head_logits,
                     const Batch& batch, Matrix<T>* dlogits = nullptr, Matrix<T>* dheads = nullptr) {
  const Index L = batch.chunk_len, chunks = batch.chunks();
  BatchLoss r;
  r.heads.resize(std::size_t(mtp.num_heads()));
  if (dlogits) dlogits->resize(logits.rows(), logits.cols());
  if (dheads) dheads->resize(head_logits.rows(), head_logits.cols());
  Matrix<T> dm, dh;
  double main_sum = 0;
  std::vector<double> head_sum(r.heads.size(), 0.0);
  for (Index b = 0; b < chunks; ++b) {
    const MultiTokenLoss l = mtp.loss(logits.middleRows(b * L, L), head_logits.middleRows(b * L, L),
                                      batch.labels[std::size_t(b)], dlogits ? &dm : nullptr, dheads ? &dh : nullptr);
    // multi_token_loss averages within one sequence; the batch averages the
    // sequences, so each chunk's gradient is scaled by 1/chunks.
    const T s = T(1.0 / double(chunks));
    if (dlogits) dlogits->middleRows(b * L, L) = s * dm;
    if (dheads) dheads->middleRows(b * L, L) = s * dh;
    r.total += l.total / double(chunks);
    main_sum += l.main.loss * double(l.main.count);
    r.main.count += l.main.count;
    r.main.correct += l.main.correct;
    for (std::size_t i = 0; i < r.heads.size(); ++i) {
      head_sum[i] += l.heads[i].loss * double(l.heads[i].count);
      r.heads[i].count += l.heads[i].count;
      r.heads[i].correct += l.heads[i].correct;
    }
  }
  r.main.loss = r.main.count > 0 ? main_sum / double(r.main.count) : 0.0;
  for (std::size_t i = 0; i < r.heads.size(); ++i)
    r.heads[i].loss = r.heads[i].count > 0 ? head_sum[i] / double(r.heads[i].count) : 0.0;
  return r;
}

}  // namespace apex::demo
