// Multi-token prediction: fused cross-entropy, the heads and their loss
// (values against a plain log-softmax, gradients by finite differences,
// stability, head offsets, options), and speculative verification (greedy
// cases, a seeded statistical test that sampling reproduces the main model's
// distribution, and that the biased scheme fails the same test), and the error
// sweeps and regression tests of all three.
#include <apex/ffn/layers/cross_entropy.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/speculative.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "gradcheck.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

namespace {

TokenIds ids(std::initializer_list<Index> v) {
  TokenIds t(Index(v.size()));
  Index i = 0;
  for (Index x : v) t(i++) = x;
  return t;
}

TokenIds random_labels(Index n, Index vocab, std::uint64_t seed) {
  Rng rng(seed);
  TokenIds t(n);
  for (Index i = 0; i < n; ++i) t(i) = Index(rng.index(std::uint64_t(vocab)));
  return t;
}

// −log softmax(z)_y written the plain way: log Σ exp(z) − z_y (fine for the
// small logits it is used with).
double plain_ce(const Matrix<double>& z, Index row, Index y) {
  double s = 0;
  for (Index j = 0; j < z.cols(); ++j) s += std::exp(z(row, j));
  return std::log(s) - z(row, y);
}

bool plain_correct(const Matrix<double>& z, Index row, Index y) {
  Index best = 0;
  for (Index j = 1; j < z.cols(); ++j)
    if (z(row, j) > z(row, best)) best = j;
  return best == y;
}

// The loss of docs/math.md#multi-token-prediction, position by position: main
// target labels[t]; head k's target labels[t + k] (the token t+1+k) when it exists.
struct PlainLoss {
  double total = 0, main = 0;
  std::vector<double> heads, acc;
  std::vector<Index> counts;
};

PlainLoss plain_mtp_loss(const Matrix<double>& zm, const Matrix<double>& zh, const TokenIds& labels, Index heads,
                         double lambda, bool average, Index ignore = kIgnoreIndex) {
  const Index n = zm.rows(), vocab = zm.cols();
  PlainLoss out;
  double sum = 0;
  Index count = 0;
  for (Index t = 0; t < n; ++t)
    if (labels(t) != ignore) {
      sum += plain_ce(zm, t, labels(t));
      ++count;
    }
  out.main = count ? sum / double(count) : 0;
  out.total = out.main;
  for (Index k = 1; k <= heads; ++k) {
    const Matrix<double> block = zh.middleCols((k - 1) * vocab, vocab);
    double s = 0;
    Index c = 0, right = 0;
    for (Index t = 0; t < n; ++t) {
      if (t + k >= labels.size() || labels(t + k) == ignore) continue;
      s += plain_ce(block, t, labels(t + k));
      right += plain_correct(block, t, labels(t + k)) ? 1 : 0;
      ++c;
    }
    out.heads.push_back(c ? s / double(c) : 0);
    out.acc.push_back(c ? double(right) / double(c) : 0);
    out.counts.push_back(c);
    out.total += (average ? lambda / double(heads) : lambda) * out.heads.back();
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// Fused cross-entropy

TEST_CASE("cross_entropy matches a plain log-softmax computation", "[mtp][cross_entropy]") {
  const Matrix<double> z = random_matrix(7, 9, 1, 3.0);
  TokenIds y = random_labels(7, 9, 2);
  y(3) = kIgnoreIndex;
  Matrix<double> dz;
  const CrossEntropyStats s = cross_entropy(z, y, &dz, {kIgnoreIndex, 2.5});

  double sum = 0;
  Index right = 0;
  Matrix<double> want = Matrix<double>::Zero(7, 9);
  for (Index t = 0; t < 7; ++t) {
    if (t == 3) continue;
    sum += plain_ce(z, t, y(t));
    right += plain_correct(z, t, y(t)) ? 1 : 0;
    // ∂CE/∂z = softmax − onehot, scaled by grad_scale / count.
    const double norm = z.row(t).array().exp().sum();
    want.row(t) = z.row(t).array().exp() / norm;
    want(t, y(t)) -= 1;
  }
  want *= 2.5 / 6;
  CHECK(s.count == 6);
  CHECK(s.correct == right);
  CHECK_THAT(s.loss, WithinRel(sum / 6, 1e-13));
  CHECK_THAT(s.accuracy(), WithinAbs(double(right) / 6, 1e-15));
  CHECK((dz - want).norm() <= 1e-14);
  CHECK(dz.row(3).isZero());
}

TEST_CASE("cross_entropy gradient matches central differences", "[mtp][cross_entropy][gradcheck]") {
  Matrix<double> z = random_matrix(5, 6, 3, 2.0);
  TokenIds y = random_labels(5, 6, 4);
  y(1) = kIgnoreIndex;
  Matrix<double> dz;
  cross_entropy(z, y, &dz, {kIgnoreIndex, 0.7});
  auto loss = [&] { return 0.7 * cross_entropy(z, y).loss; };
  APEX_CHECK_GRADS(std::vector{check_values("logits", z.data(), dz.data(), z.size(), loss)}, 1e-6);
}

TEST_CASE("cross_entropy may write its gradient over the logits", "[mtp][cross_entropy]") {
  Matrix<double> z = random_matrix(6, 11, 5, 4.0);
  const TokenIds y = random_labels(6, 11, 6);
  Matrix<double> dz;
  const CrossEntropyStats a = cross_entropy(z, y, &dz);
  const CrossEntropyStats b = cross_entropy(z, y, &z);  // in place
  CHECK(a.loss == b.loss);
  CHECK(a.correct == b.correct);
  CHECK(z == dz);
}

TEMPLATE_TEST_CASE("fused cross-entropy is finite for logits of magnitude 1e4", "[mtp][cross_entropy][stability]",
                   float, double) {
  using T = TestType;
  // A naive softmax overflows on these logits: exp(1e4) is inf in float and double.
  REQUIRE(std::isinf(std::exp(T(1e4))));
  Matrix<T> z(3, 4);
  z << T(1e4), T(-1e4), T(9999.5), T(0),  //
      T(-1e4), T(-1e4), T(-1e4), T(-1e4),  //
      T(-5e3), T(1e4), T(3e3), T(-9999);
  const TokenIds y = ids({1, 2, 1});
  Matrix<T> dz;
  const CrossEntropyStats s = cross_entropy(z, y, &dz);
  // Exact: row 0: 2e4 + log(1 + e^{−0.5}); row 1: log 4; row 2: 0 (to 1e-3043).
  const double row0 = 2e4 + std::log1p(std::exp(-0.5)), row1 = std::log(4.0);
  CHECK(std::isfinite(s.loss));
  CHECK_THAT(s.loss, WithinRel((row0 + row1) / 3, 1e-6));
  REQUIRE(dz.allFinite());
  // Each gradient row sums to 0 (softmax sums to 1), entries bounded by 1/count.
  for (Index t = 0; t < 3; ++t) CHECK(std::abs(double(dz.row(t).sum())) <= 1e-6);
  CHECK(dz.cwiseAbs().maxCoeff() <= T(1.0 / 3 + 1e-6));
  CHECK_THAT(double(dz(0, 1)), WithinAbs(-1.0 / 3, 1e-6));
  CHECK_THAT(double(dz(1, 0)), WithinAbs(0.25 / 3, 1e-6));

  // The same logits through the multi-token loss (one head).
  MultiTokenOptions opt;
  opt.num_heads = 1;
  Matrix<T> dmain, dheads;
  const TokenIds labels = ids({1, 2, 1, 3});
  const MultiTokenLoss l = multi_token_loss(z, z, labels, opt, &dmain, &dheads);
  CHECK(std::isfinite(l.total));
  CHECK(dmain.allFinite());
  CHECK(dheads.allFinite());
}

// ---------------------------------------------------------------------------
// The heads and their loss

TEST_CASE("heads compute h times each head's weight and name their parameters", "[mtp][heads]") {
  MultiTokenOptions opt;
  opt.num_heads = 3;
  MultiTokenHeads<double> heads(5, 7, opt, 42);
  const Matrix<double> h = random_matrix(11, 5, 7);
  MultiTokenHeads<double>::Cache cache;
  const Matrix<double> y = heads.forward(h, &cache);
  REQUIRE(y.rows() == 11);
  REQUIRE(y.cols() == 21);
  for (Index i = 0; i < 3; ++i) {
    const Matrix<double> want = h * heads.weight(i).transpose();  // head_k(h) = h·W_k, W_k = weight(k−1)ᵀ
    CHECK((y.middleCols(i * 7, 7) - want).norm() <= 1e-13 * want.norm());
  }
  // A decode-sized batch takes the matrix–vector path: same values.
  const Matrix<double> y2 = heads.forward(h.topRows(2));
  CHECK((y2 - y.topRows(2)).norm() <= 1e-13 * y2.norm());
  Matrix<double> buf(11, 21);
  heads.forward_into(h, buf);
  CHECK(buf == y);
  const auto draft = heads.draft_logits(y, 4);  // 3 × 7
  for (Index i = 0; i < 3; ++i) CHECK(draft.row(i) == y.row(4).segment(i * 7, 7));

  const auto ps = heads.params();
  REQUIRE(ps.size() == 3);
  CHECK(ps[0].name == "heads.0.weight");
  CHECK(ps[2].name == "heads.2.weight");
  CHECK(ps[1].rows == 7);  // PyTorch layout V × d
  CHECK(ps[1].cols == 5);
  CHECK(parameter_count(ps) == 3 * 7 * 5);
  // nn.Linear's default init: U(−1/√d, 1/√d).
  CHECK(heads.weights().cwiseAbs().maxCoeff() <= 1 / std::sqrt(5.0));

  // backward adds (+=) and zero_grad clears.
  const Matrix<double> r = random_matrix(11, 21, 8);
  heads.backward(r, cache);
  const Matrix<double> once = heads.weight_grad(1);
  CHECK(once.norm() > 0);
  heads.backward(r, cache);
  CHECK((heads.weight_grad(1) - 2 * once).norm() <= 1e-12 * once.norm());
  heads.zero_grad();
  for (const auto& p : heads.params()) CHECK(p.grad().isZero());
}

TEST_CASE("multi-token loss matches a plain log-softmax computation", "[mtp][loss]") {
  for (bool average : {false, true}) {
    INFO("average_heads = " << average);
    MultiTokenOptions opt;
    opt.num_heads = 3;
    opt.lambda = 0.1;
    opt.average_heads = average;
    MultiTokenHeads<double> heads(6, 8, opt, 3);
    const Matrix<double> h = random_matrix(9, 6, 9, 3.0);
    const Matrix<double> wm = random_matrix(8, 6, 10);
    TokenIds labels = random_labels(9, 8, 11);
    labels(4) = kIgnoreIndex;
    const Matrix<double> zm = h * wm.transpose(), zh = heads.forward(h);
    const MultiTokenLoss l = heads.loss(zm, zh, labels);
    const PlainLoss want = plain_mtp_loss(zm, zh, labels, 3, 0.1, average);
    CHECK_THAT(l.total, WithinRel(want.total, 1e-13));
    CHECK_THAT(l.main.loss, WithinRel(want.main, 1e-13));
    CHECK(l.main.count == 8);
    CHECK_THAT(l.head_weight, WithinRel(average ? 0.1 / 3 : 0.1, 1e-15));
    REQUIRE(l.heads.size() == 3);
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK_THAT(l.heads[i].loss, WithinRel(want.heads[i], 1e-13));
      CHECK(l.heads[i].count == want.counts[i]);
      CHECK_THAT(l.heads[i].accuracy(), WithinAbs(want.acc[i], 1e-15));
    }
    // Head k has 9 − k labels ahead of it, one of them (labels[4]) ignored.
    CHECK(l.heads[0].count == 7);
    CHECK(l.heads[2].count == 5);
  }
}

TEST_CASE("multi-token gradients match central differences", "[mtp][loss][gradcheck]") {
  struct Case {
    bool average;
    Index labels;  // number of labels: n, or n + look-ahead
    Index heads;
  };
  for (const Case c : {Case{false, 6, 3}, Case{true, 6, 3}, Case{false, 8, 4}, Case{false, 6, 0}}) {
    INFO("average " << c.average << ", labels " << c.labels << ", heads " << c.heads);
    const Index n = 6, d = 5, vocab = 7;
    MultiTokenOptions opt;
    opt.num_heads = c.heads;
    opt.average_heads = c.average;
    opt.lambda = 0.3;  // larger than the default so the heads' terms weigh in the check
    MultiTokenHeads<double> heads(d, vocab, opt, 21);
    Matrix<double> h = random_matrix(n, d, 22, 1.5);
    Matrix<double> wm = random_matrix(vocab, d, 23, 0.8);  // the caller's main head, V × d
    TokenIds labels = random_labels(c.labels, vocab, 24);
    labels(2) = kIgnoreIndex;

    auto loss = [&] {
      const Matrix<double> zm = h * wm.transpose();
      return heads.loss(zm, heads.forward(h), labels).total;
    };
    MultiTokenHeads<double>::Cache cache;
    const Matrix<double> zh = heads.forward(h, &cache);
    const Matrix<double> zm = h * wm.transpose();
    Matrix<double> dmain, dheads;
    heads.loss(zm, zh, labels, &dmain, &dheads);
    // dH = dheads·W_all (the layer) + dmain·W_main (the caller's main head).
    Matrix<double> dh = heads.backward(dheads, cache);
    dh.noalias() += dmain * wm;
    Matrix<double> dwm = dmain.transpose() * h;  // V × d

    APEX_CHECK_GRADS(check_params(heads.params(), loss), 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("h", h.data(), dh.data(), h.size(), loss)}, 1e-6);
    APEX_CHECK_GRADS(std::vector{check_values("w_main", wm.data(), dwm.data(), wm.size(), loss)}, 1e-6);
    for (const auto& p : heads.params()) CHECK(p.grad().norm() > 0);

    // The logits' gradients themselves.
    Matrix<double> zm_v = zm, zh_v = zh;
    auto loss_logits = [&] { return heads.loss(zm_v, zh_v, labels).total; };
    APEX_CHECK_GRADS(std::vector{check_values("main_logits", zm_v.data(), dmain.data(), zm_v.size(), loss_logits)},
                     1e-6);
    if (c.heads > 0)
      APEX_CHECK_GRADS(
          std::vector{check_values("head_logits", zh_v.data(), dheads.data(), zh_v.size(), loss_logits)}, 1e-6);
  }
}

TEST_CASE("head k's target at position t is the token t+1+k", "[mtp][loss][reference]") {
  // Sequence x_0..x_9 of distinct tokens; hidden state h_t sits on x_t, so the
  // labels (next tokens) are x_1..x_9 and the main head's target at t is x_{t+1}.
  const Index n = 9, vocab = 16, heads = 3;
  const TokenIds x = ids({3, 14, 1, 5, 9, 2, 6, 12, 8, 7});
  const TokenIds labels = x.tail(n);
  // Logits that put 20 on the token at offset `off` from t.
  auto peaked = [&](Index off) {
    Matrix<double> z = Matrix<double>::Zero(n, vocab);
    for (Index t = 0; t < n; ++t)
      if (t + off < x.size()) z(t, x(t + off)) = 20;
    return z;
  };
  const Matrix<double> zm = peaked(1);
  Matrix<double> zh(n, heads * vocab);
  for (Index k = 1; k <= heads; ++k) zh.middleCols((k - 1) * vocab, vocab) = peaked(1 + k);  // head k predicts t+1+k

  MultiTokenOptions opt;
  opt.num_heads = heads;
  const MultiTokenLoss l = multi_token_loss(zm, zh, labels, opt);
  CHECK(l.main.count == n);
  CHECK(l.main.accuracy() == 1.0);
  for (Index k = 1; k <= heads; ++k) {
    INFO("head k = " << k);
    // Token t+1+k exists for t + 1 + k ≤ 9, i.e. for n − k positions.
    CHECK(l.heads[std::size_t(k - 1)].count == n - k);
    CHECK(l.heads[std::size_t(k - 1)].accuracy() == 1.0);
    CHECK(l.heads[std::size_t(k - 1)].loss < 1e-6);
  }

  // Erratum (docs/math.md#errata; the reference document's §16.2 writes
  // CE(head_k(h_t), token_{t+k})): under that
  // reading head 1 targets token t+1, the main head's own target, so head 1
  // would be trained into a copy of the main head and draft nothing new. Heads
  // built that way score 0 here, because the loss uses t+1+k.
  Matrix<double> zh_erratum(n, heads * vocab);
  for (Index k = 1; k <= heads; ++k) zh_erratum.middleCols((k - 1) * vocab, vocab) = peaked(k);
  CHECK(zh_erratum.leftCols(vocab) == zm);  // head 1 is literally the main head
  const MultiTokenLoss e = multi_token_loss(zm, zh_erratum, labels, opt);
  for (const auto& s : e.heads) {
    CHECK(s.accuracy() == 0.0);
    CHECK(s.loss > 19);
  }
}

TEST_CASE("averaging the heads divides their weight by N", "[mtp][loss]") {
  MultiTokenOptions sum_opt;
  sum_opt.lambda = 0.1;  // N = 4 (default)
  MultiTokenOptions mean_opt = sum_opt;
  mean_opt.average_heads = true;
  const Matrix<double> zm = random_matrix(10, 6, 30, 2.0), zh = random_matrix(10, 24, 31, 2.0);
  const TokenIds labels = random_labels(10, 6, 32);
  Matrix<double> dm_s, dh_s, dm_m, dh_m;
  const MultiTokenLoss s = multi_token_loss(zm, zh, labels, sum_opt, &dm_s, &dh_s);
  const MultiTokenLoss m = multi_token_loss(zm, zh, labels, mean_opt, &dm_m, &dh_m);
  double heads_sum = 0;
  for (const auto& hs : s.heads) heads_sum += hs.loss;
  CHECK_THAT(s.total, WithinRel(s.main.loss + 0.1 * heads_sum, 1e-14));
  CHECK_THAT(m.total, WithinRel(m.main.loss + 0.1 / 4 * heads_sum, 1e-14));
  CHECK(s.total > m.total);
  CHECK(dm_s == dm_m);                                   // the main term is unchanged
  CHECK((dh_m - dh_s / 4).norm() <= 1e-15 * dh_s.norm());  // every head gradient / N
  // λ = 0: the heads get no gradient; N = 0: the loss is L_main.
  MultiTokenOptions zero = sum_opt;
  zero.lambda = 0;
  Matrix<double> dm_z, dh_z;
  const MultiTokenLoss z = multi_token_loss(zm, zh, labels, zero, &dm_z, &dh_z);
  CHECK(z.total == z.main.loss);
  CHECK(dh_z.isZero());
  MultiTokenOptions none = sum_opt;
  none.num_heads = 0;
  const MultiTokenLoss nh = multi_token_loss(zm, Matrix<double>(10, 0), labels, none);
  CHECK(nh.total == s.main.loss);
  CHECK(nh.heads.empty());
}

TEST_CASE("the ignore index removes targets from every term", "[mtp][loss]") {
  const Index n = 8, vocab = 5;
  MultiTokenOptions opt;
  opt.num_heads = 2;
  const Matrix<double> zm = random_matrix(n, vocab, 40, 2.0), zh = random_matrix(n, 2 * vocab, 41, 2.0);
  TokenIds labels = random_labels(n, vocab, 42);
  labels(5) = kIgnoreIndex;
  Matrix<double> dm, dh;
  const MultiTokenLoss l = multi_token_loss(zm, zh, labels, opt, &dm, &dh);
  CHECK(l.main.count == 7);
  CHECK(dm.row(5).isZero());
  CHECK(!dm.row(4).isZero());
  // labels[5] is head k's target at t = 5 − k: that row of head k is empty.
  CHECK(dh.block(4, 0, 1, vocab).isZero());      // head 1 at t = 4
  CHECK(dh.block(3, vocab, 1, vocab).isZero());  // head 2 at t = 3
  CHECK(dh.row(7).isZero());                     // no token 7+1+k at all
  CHECK(l.heads[0].count == 6);                  // 7 positions with a token ahead, one ignored
  CHECK(l.heads[1].count == 5);
  // Equal to the loss with the ignored rows dropped.
  TokenIds kept(7);
  Matrix<double> zm_kept(7, vocab);
  for (Index t = 0, r = 0; t < n; ++t)
    if (t != 5) {
      kept(r) = labels(t);
      zm_kept.row(r++) = zm.row(t);
    }
  CHECK_THAT(l.main.loss, WithinRel(cross_entropy(zm_kept, kept).loss, 1e-14));

  // A custom ignore index, and a batch with no target at all.
  opt.ignore_index = 99;
  TokenIds none = TokenIds::Constant(n, 99);
  Matrix<double> dm0, dh0;
  const MultiTokenLoss z = multi_token_loss(zm, zh, none, opt, &dm0, &dh0);
  CHECK(z.total == 0);
  CHECK(z.main.count == 0);
  CHECK(z.heads[0].accuracy() == 0);
  CHECK(dm0.isZero());
  CHECK(dh0.isZero());
}

TEST_CASE("heads and loss agree between float and double", "[mtp][heads][loss]") {
  MultiTokenOptions opt;
  opt.num_heads = 2;
  MultiTokenHeads<double> hd(16, 12, opt, 5);
  MultiTokenHeads<float> hf(16, 12, opt, 5);
  const Matrix<double> h = random_matrix(20, 16, 50, 2.0), wm = random_matrix(12, 16, 51);
  const TokenIds labels = random_labels(20, 12, 52);
  MultiTokenHeads<double>::Cache cd;
  MultiTokenHeads<float>::Cache cf;
  const Matrix<double> zhd = hd.forward(h, &cd);
  const Matrix<float> zhf = hf.forward(h.cast<float>(), &cf);
  CHECK((zhf.cast<double>() - zhd).norm() <= 1e-5 * zhd.norm());
  Matrix<double> dmd, dhd;
  Matrix<float> dmf, dhf;
  const MultiTokenLoss ld = hd.loss(h * wm.transpose(), zhd, labels, &dmd, &dhd);
  const Matrix<float> zmf = (h * wm.transpose()).cast<float>();
  const MultiTokenLoss lf = hf.loss(zmf, zhf, labels, &dmf, &dhf);
  CHECK_THAT(lf.total, WithinRel(ld.total, 1e-5));
  const Matrix<double> dxd = hd.backward(dhd, cd);
  const Matrix<float> dxf = hf.backward(dhf, cf);
  CHECK((dxf.cast<double>() - dxd).norm() <= 1e-5 * dxd.norm());
  CHECK((hf.weight_grad(1).cast<double>() - hd.weight_grad(1)).norm() <= 1e-5 * hd.weight_grad(1).norm());
}

// ---------------------------------------------------------------------------
// Speculative verification: greedy

TEST_CASE("greedy verification accepts the longest prefix equal to the argmax", "[mtp][speculative]") {
  // Main-model argmax per drafted position: 2, 4, 1 and (after the last draft) 3.
  Matrix<double> p(4, 5);
  p << 0.1, 0.2, 0.9, 0.0, 0.3,  //
      0.0, 0.1, 0.2, 0.3, 0.4,   //
      0.5, 0.6, 0.2, 0.1, 0.0,   //
      0.0, 0.0, 0.0, 7.0, 0.0;
  SpeculativeStats stats;

  SECTION("all accepted: the bonus token follows") {
    const VerifyResult r = verify_greedy({2, 4, 1}, p);
    CHECK(r.tokens == std::vector<Index>{2, 4, 1, 3});
    CHECK(r.accepted == 3);
    CHECK(r.drafted == 3);
    CHECK(r.emitted() == 4);
    CHECK(r.all_accepted());
  }
  SECTION("first rejected: the main model's own token only") {
    const VerifyResult r = verify_greedy({0, 4, 1}, p);
    CHECK(r.tokens == std::vector<Index>{2});
    CHECK(r.accepted == 0);
    CHECK(r.emitted() == 1);
    CHECK_FALSE(r.all_accepted());
  }
  SECTION("middle rejected: the accepted prefix then the correction") {
    const VerifyResult r = verify_greedy({2, 0, 1}, p);  // draft 3 matches but comes after a mismatch
    CHECK(r.tokens == std::vector<Index>{2, 4});
    CHECK(r.accepted == 1);
  }
  SECTION("last rejected") {
    const VerifyResult r = verify_greedy({2, 4, 0}, p);
    CHECK(r.tokens == std::vector<Index>{2, 4, 1});
    CHECK(r.accepted == 2);
  }
  SECTION("no drafts: one main-model token") {
    const VerifyResult r = verify_greedy({}, p.topRows(1));
    CHECK(r.tokens == std::vector<Index>{2});
  }
  SECTION("statistics") {
    stats.add(verify_greedy({2, 4, 1}, p));
    stats.add(verify_greedy({0, 4, 1}, p));
    stats.add(verify_greedy({2, 0, 1}, p));
    CHECK(stats.steps == 3);
    CHECK(stats.drafted == 9);
    CHECK(stats.accepted == 4);
    CHECK(stats.emitted == 7);
    CHECK_THAT(stats.acceptance_rate(), WithinAbs(4.0 / 9, 1e-15));
    CHECK_THAT(stats.tokens_per_step(), WithinAbs(7.0 / 3, 1e-15));
    CHECK(stats.accepted_histogram == std::vector<Index>{1, 1, 0, 1});
  }
}

TEST_CASE("greedy drafts take each head's argmax with ties to the lower id", "[mtp][speculative]") {
  Matrix<float> z(3, 4);
  z << 0, 5, 5, 1,  //
      -1, -2, -3, -0.5f,  //
      2, 2, 2, 2;
  const SpeculativeDraft<float> d = draft_greedy(z);
  CHECK(d.tokens == std::vector<Index>{1, 3, 0});
  CHECK(d.probs.size() == 0);
}

TEST_CASE("greedy speculative decoding reproduces greedy decoding of the main model", "[mtp][speculative]") {
  // A synthetic main model: next-token logits depend on the last token
  // (row V is the start state). The heads draft from unrelated logits.
  const Index vocab = 6, heads = 3, length = 40;
  const Matrix<double> table = random_matrix(vocab + 1, vocab, 60, 2.0);
  auto main_argmax = [&](Index last) { return detail::argmax(table.row(last)); };
  std::vector<Index> plain;
  for (Index last = vocab; Index(plain.size()) < length; last = plain.back()) plain.push_back(main_argmax(last));

  Rng rng(61);
  std::vector<Index> spec;
  SpeculativeStats stats;
  Matrix<double> head_logits(heads, vocab), p(heads + 1, vocab);
  while (Index(spec.size()) < length) {
    // Half the time the heads happen to draft the right continuation.
    head_logits = random_matrix(heads, vocab, rng.index(1000), 1.0);
    Index last = spec.empty() ? vocab : spec.back();
    if (rng.uniform() < 0.5)
      for (Index i = 0, l = last; i < heads; ++i) {
        l = main_argmax(l);
        head_logits(i, l) += 10;
      }
    const SpeculativeDraft<double> d = draft_greedy(head_logits);
    for (Index i = 0; i <= heads; ++i) {
      p.row(i) = table.row(last);  // p_i conditions on the token before the drafted position
      if (i < heads) last = d.tokens[std::size_t(i)];
    }
    const VerifyResult r = verify_greedy(d.tokens, p);
    stats.add(r);
    spec.insert(spec.end(), r.tokens.begin(), r.tokens.end());
  }
  spec.resize(std::size_t(length));
  CHECK(spec == plain);
  CHECK(stats.tokens_per_step() > 1.5);  // the good drafts were accepted
  CHECK(stats.accepted < stats.drafted);  // and the bad ones rejected
}

// ---------------------------------------------------------------------------
// Speculative verification: sampling

namespace {

// Regularised upper incomplete gamma Q(a, x) (series for x < a + 1, Lentz
// continued fraction otherwise); the chi-square survival function is
// Q(dof/2, χ²/2).
double gamma_q(double a, double x) {
  if (x <= 0) return 1;
  const double log_front = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1) {
    double ap = a, del = 1 / a, sum = del;
    for (int i = 0; i < 10000 && std::abs(del) > std::abs(sum) * 1e-16; ++i) {
      ap += 1;
      del *= x / ap;
      sum += del;
    }
    return 1 - sum * std::exp(log_front);
  }
  const double tiny = 1e-300;
  double b = x + 1 - a, c = 1 / tiny, d = 1 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::abs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::abs(c) < tiny) c = tiny;
    d = 1 / d;
    const double del = d * c;
    h *= del;
    if (std::abs(del - 1) < 1e-16) break;
  }
  return std::exp(log_front) * h;
}

// p-value of Pearson's χ² test of `counts` against probabilities `prob`.
// A cell with probability 0 that was hit makes the p-value 0.
double chi_square_p(const std::vector<Index>& counts, const std::vector<double>& prob) {
  Index total = 0;
  for (Index c : counts) total += c;
  double chi2 = 0;
  int cells = 0;
  for (std::size_t j = 0; j < counts.size(); ++j) {
    if (prob[j] <= 0) {
      if (counts[j] > 0) return 0;
      continue;
    }
    const double e = prob[j] * double(total);
    chi2 += (double(counts[j]) - e) * (double(counts[j]) - e) / e;
    ++cells;
  }
  return gamma_q((cells - 1) / 2.0, chi2 / 2);
}

// The APEX-1 code's scheme: accept with min(1, p(x)/(1/V)) (a uniform q) and
// resample from p itself. Biased whenever the real q is not uniform.
VerifyResult verify_uniform_q(const std::vector<Index>& draft, const Matrix<double>& p, Rng& rng) {
  VerifyResult out;
  out.drafted = Index(draft.size());
  auto sample_p = [&](Index row) {
    return detail::sample_weighted(p.cols(), [&](Index j) { return p(row, j); }, p.row(row).sum(), rng);
  };
  for (std::size_t i = 0; i < draft.size(); ++i) {
    if (rng.uniform() < std::min(1.0, p(Index(i), draft[i]) * double(p.cols()))) {
      out.tokens.push_back(draft[i]);
      ++out.accepted;
      continue;
    }
    out.tokens.push_back(sample_p(Index(i)));
    return out;
  }
  out.tokens.push_back(sample_p(out.drafted));
  return out;
}

constexpr double kAlpha = 1e-3;  // a correct sampler fails with this probability per test (fixed seed)

}  // namespace

TEST_CASE("the chi-square p-value is right", "[mtp][speculative][statistics]") {
  // dof 2: Q(1, x/2) = exp(−x/2); dof 1 at χ² = 3.841: p = 0.05; dof 10 at 23.209: p = 0.01.
  CHECK_THAT(gamma_q(1, 3.0), WithinRel(std::exp(-3.0), 1e-12));
  CHECK_THAT(gamma_q(0.5, 3.841458820694124 / 2), WithinRel(0.05, 1e-9));
  CHECK_THAT(gamma_q(5, 23.20925115681376 / 2), WithinRel(0.01, 1e-9));
  // Integer a: Q(a, x) = e^{−x} Σ_{k<a} x^k/k!, through both branches (x < a + 1 and beyond).
  for (double x : {2.0, 8.0, 15.0, 50.0}) {
    double term = 1, sum = 0;
    for (int k = 0; k < 13; ++k) {
      sum += term;
      term *= x / (k + 1);
    }
    CHECK_THAT(gamma_q(13, x), WithinRel(std::exp(-x) * sum, 1e-10));
  }
}

TEST_CASE("speculative sampling emits first tokens distributed as p", "[mtp][speculative][statistics]") {
  // The heads' q is far from p: it puts 0.8 on token 3, which p never emits.
  const Index vocab = 4, heads = 2, trials = 20000;
  const std::vector<double> p0 = {0.5, 0.3, 0.2, 0.0};
  const std::vector<double> q0 = {0.05, 0.05, 0.1, 0.8};
  Matrix<double> head_logits(heads, vocab), p(heads + 1, vocab);
  for (Index j = 0; j < vocab; ++j) {
    head_logits(0, j) = std::log(q0[std::size_t(j)]);
    head_logits(1, j) = std::log(0.25);
    for (Index i = 0; i <= heads; ++i) p(i, j) = p0[std::size_t(j)];
  }

  Rng rng(2024);
  std::vector<Index> good(vocab, 0), biased(vocab, 0);
  SpeculativeStats stats;
  Index first_accepted = 0;
  for (Index n = 0; n < trials; ++n) {
    const SpeculativeDraft<double> d = draft_sample(head_logits, rng);
    const VerifyResult r = verify_sampling(d.tokens, d.probs, p, rng);
    ++good[std::size_t(r.tokens.front())];
    first_accepted += r.accepted > 0 ? 1 : 0;
    stats.add(r);
    ++biased[std::size_t(verify_uniform_q(d.tokens, p, rng).tokens.front())];
  }
  INFO("speculative counts " << good[0] << " " << good[1] << " " << good[2] << " " << good[3]);
  INFO("biased counts " << biased[0] << " " << biased[1] << " " << biased[2] << " " << biased[3]);
  CHECK(good[3] == 0);  // p(3) = 0 is never emitted, though q proposes it 80 % of the time
  CHECK(chi_square_p(good, p0) > kAlpha);
  // The same test rejects the uniform-q scheme. Its ratio p(x)·V ignores how
  // often q proposes x, so it emits P = q·min(1, V·p) + (rejected mass)·p
  // = [0.46, 0.296, 0.244, 0] instead of [0.5, 0.3, 0.2, 0].
  CHECK(chi_square_p(biased, p0) < 1e-9);

  // The first draft is accepted with probability Σ_x min(p(x), q(x)) = 0.2.
  const double rate = double(first_accepted) / double(trials), sigma = std::sqrt(0.2 * 0.8 / double(trials));
  CHECK(std::abs(rate - 0.2) < 5 * sigma);
  CHECK(stats.steps == trials);
  CHECK(stats.drafted == 2 * trials);
  CHECK_THAT(stats.tokens_per_step(), WithinAbs(1 + double(stats.accepted) / double(trials), 1e-12));
}

TEST_CASE("speculative sampling emits whole sequences distributed as the main model", "[mtp][speculative][statistics]") {
  // A synthetic main model over V = 3 tokens whose next-token distribution
  // depends on the previous token (row 3 = start). The heads' q ignores the
  // context and prefers token 0, which the model rarely follows with itself.
  const Index vocab = 3, heads = 3, length = 3, trials = 30000;
  Matrix<double> model(vocab + 1, vocab);
  model << 0.1, 0.3, 0.6,  //
      0.5, 0.2, 0.3,       //
      0.3, 0.6, 0.1,       //
      0.2, 0.5, 0.3;  // start
  Matrix<double> head_logits(heads, vocab);
  head_logits << 3, 0, -1,  //
      2, 0, 1,              //
      0, -2, 2;

  // P(x_1 x_2 x_3) = model(start, x_1)·model(x_1, x_2)·model(x_2, x_3).
  std::vector<double> want;
  for (Index a = 0; a < vocab; ++a)
    for (Index b = 0; b < vocab; ++b)
      for (Index c = 0; c < vocab; ++c) want.push_back(model(vocab, a) * model(a, b) * model(b, c));

  // Runs decode steps until `length` tokens are out; returns the cell of the
  // first `length` tokens.
  Matrix<double> p(heads + 1, vocab);
  auto run = [&](Rng& rng, bool biased) {
    std::vector<Index> seq;
    while (Index(seq.size()) < length) {
      const SpeculativeDraft<double> d = draft_sample(head_logits, rng);
      Index last = seq.empty() ? vocab : seq.back();
      for (Index i = 0; i <= heads; ++i) {
        p.row(i) = model.row(last);
        if (i < heads) last = d.tokens[std::size_t(i)];
      }
      const VerifyResult r = biased ? verify_uniform_q(d.tokens, p, rng) : verify_sampling(d.tokens, d.probs, p, rng);
      seq.insert(seq.end(), r.tokens.begin(), r.tokens.end());
    }
    return std::size_t((seq[0] * vocab + seq[1]) * vocab + seq[2]);
  };

  Rng rng(7);
  std::vector<Index> good(want.size(), 0), bad(want.size(), 0);
  for (Index n = 0; n < trials; ++n) {
    ++good[run(rng, false)];
    ++bad[run(rng, true)];
  }
  const double p_good = chi_square_p(good, want), p_bad = chi_square_p(bad, want);
  INFO("p-values: speculative " << p_good << ", uniform-q scheme " << p_bad);
  CHECK(p_good > kAlpha);
  CHECK(p_bad < 1e-9);
}

TEST_CASE("speculative sampling accepts every draft when q equals p", "[mtp][speculative]") {
  Matrix<double> logits = random_matrix(4, 6, 70, 2.0);
  Rng rng(71);
  for (int n = 0; n < 200; ++n) {
    const SpeculativeDraft<double> d = draft_sample(logits.topRows(3), rng);
    Matrix<double> p(4, 6);
    p.topRows(3) = d.probs;
    p.row(3) = softmax_rows(logits.bottomRows(1));
    const VerifyResult r = verify_sampling(d.tokens, d.probs, p, rng);
    REQUIRE(r.accepted == 3);
    CHECK(std::vector<Index>(r.tokens.begin(), r.tokens.begin() + 3) == d.tokens);
  }
  // One-hot p and q on different tokens: the draft is always rejected and
  // the correction is p's token.
  Matrix<double> q1 = Matrix<double>::Zero(1, 3), p1 = Matrix<double>::Zero(2, 3);
  q1(0, 0) = 1;
  p1(0, 2) = 1;
  p1(1, 1) = 1;
  const VerifyResult r = verify_sampling({0}, q1, p1, rng);
  CHECK(r.tokens == std::vector<Index>{2});
  CHECK(r.accepted == 0);
}

TEST_CASE("float speculative sampling works on float probabilities", "[mtp][speculative]") {
  Matrix<float> logits(3, 5);
  logits << 1, 2, 3, 4, 5,  //
      0, 0, 0, 0, 0,        //
      5, 4, 3, 2, 1;
  Rng rng(3);
  const SpeculativeDraft<float> d = draft_sample(logits.topRows(2), rng);
  const Matrix<float> p = softmax_rows(logits);
  const VerifyResult r = verify_sampling(d.tokens, d.probs, p, rng);
  CHECK(r.emitted() == r.accepted + 1);
  CHECK(r.emitted() >= 1);
  CHECK(r.emitted() <= 3);
}

// ---------------------------------------------------------------------------
// Validation

TEST_CASE("bad configurations and inputs raise typed exceptions", "[mtp][errors]") {
  MultiTokenOptions bad;
  bad.num_heads = -1;
  CHECK_THROWS_AS(MultiTokenHeads<double>(4, 6, bad), ConfigError);
  bad = {};
  bad.lambda = -0.1;
  CHECK_THROWS_AS(MultiTokenHeads<double>(4, 6, bad), ConfigError);
  bad.lambda = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(MultiTokenHeads<double>(4, 6, bad), ConfigError);
  bad = {};
  bad.ignore_index = 2;  // a real token
  CHECK_THROWS_AS(MultiTokenHeads<double>(4, 6, bad), ConfigError);
  CHECK_THROWS_AS(MultiTokenHeads<double>(0, 6), ConfigError);
  CHECK_THROWS_AS(MultiTokenHeads<double>(4, 0), ConfigError);
  MultiTokenOptions none;
  none.num_heads = 0;
  CHECK_NOTHROW(MultiTokenHeads<double>(4, 6, none));

  MultiTokenOptions opt;
  opt.num_heads = 2;
  MultiTokenHeads<double> heads(4, 6, opt, 1);
  CHECK_THROWS_AS(heads.set_lambda(-1), ConfigError);
  CHECK_THROWS_WITH(heads.forward(Matrix<double>::Zero(3, 5)),
                    "MultiTokenHeads::forward: argument 'h' has shape [3 x 5], expected [* x 4]");
  MultiTokenHeads<double>::Cache cache;
  const Matrix<double> y = heads.forward(Matrix<double>::Ones(3, 4), &cache);
  CHECK_THROWS_AS(heads.backward(Matrix<double>::Zero(3, 6), cache), ShapeError);
  CHECK_THROWS_AS(heads.backward(Matrix<double>::Zero(2, 12), cache), ShapeError);
  CHECK_THROWS_AS(heads.draft_logits(y, 3), ValueError);
  CHECK_THROWS_AS(heads.weight(2), ValueError);

  const Matrix<double> zm = Matrix<double>::Zero(3, 6);
  CHECK_NOTHROW(heads.loss(zm, y, ids({0, 5, kIgnoreIndex})));
  CHECK_THROWS_AS(heads.loss(zm, y, ids({0, 6, 1})), ValueError);   // id = V
  CHECK_THROWS_AS(heads.loss(zm, y, ids({0, -1, 1})), ValueError);  // negative, not the ignore index
  CHECK_THROWS_WITH(heads.loss(zm, y, ids({0, 1, 7})),
                    "multi_token_loss: argument 'labels' has token id 7 at position 2, expected a value in [0, 6) "
                    "or the ignore index -100");
  CHECK_THROWS_AS(heads.loss(zm, y, ids({0, 1})), ShapeError);                       // fewer labels than rows
  CHECK_THROWS_AS(heads.loss(zm, y.leftCols(6), ids({0, 1, 2})), ShapeError);         // one head's logits
  CHECK_THROWS_AS(heads.loss(Matrix<double>::Zero(2, 6), y, ids({0, 1, 2})), ShapeError);
  CHECK_THROWS_AS(heads.loss(Matrix<double>::Zero(3, 5), y, ids({0, 1, 2})), ShapeError);
  Matrix<double> nan_logits = zm;
  nan_logits(1, 2) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(heads.loss(nan_logits, y, ids({0, 1, 2})), ValueError);

  CHECK_THROWS_AS(cross_entropy(zm, ids({0, 1})), ShapeError);
  CHECK_THROWS_AS(cross_entropy(zm, ids({0, 1, 9})), ValueError);

  // Speculative verification.
  Rng rng(1);
  Matrix<double> q(2, 3), p(3, 3);
  q << 0.2, 0.3, 0.5, 0.1, 0.1, 0.8;
  p << 0.3, 0.3, 0.4, 0.5, 0.5, 0.0, 1.0, 0.0, 0.0;
  CHECK_NOTHROW(verify_sampling({2, 2}, q, p, rng));
  CHECK_THROWS_AS(verify_sampling({2}, q, p, rng), ShapeError);          // 1 draft, 2 q rows
  CHECK_THROWS_AS(verify_sampling({2, 2}, q, p.topRows(2), rng), ShapeError);
  CHECK_THROWS_AS(verify_sampling({2, 3}, q, p, rng), ValueError);       // id = V
  CHECK_THROWS_AS(verify_sampling({-1, 2}, q, p, rng), ValueError);
  Matrix<double> neg = q;
  neg(0, 0) = -0.2;
  neg(0, 1) = 0.7;  // still sums to 1
  CHECK_THROWS_AS(verify_sampling({2, 2}, neg, p, rng), ValueError);
  Matrix<double> unnorm = p;
  unnorm(1, 0) = 0.6;
  CHECK_THROWS_WITH(verify_sampling({2, 2}, q, unnorm, rng),
                    "verify_sampling: argument 'target_probs' row 1 sums to 1.100000, not 1 (expected a probability "
                    "distribution)");
  Matrix<double> zero_q = q;
  zero_q.row(1) << 0.5, 0.5, 0.0;
  CHECK_THROWS_AS(verify_sampling({2, 2}, zero_q, p, rng), ValueError);  // draft 2 has q = 0
  CHECK_THROWS_AS(verify_greedy({1, 1}, p.topRows(2)), ShapeError);
  CHECK_THROWS_AS(verify_greedy({1, 5}, p), ValueError);
  CHECK_THROWS_AS(verify_greedy({}, Matrix<double>(1, 0)), ShapeError);
  CHECK_THROWS_AS(draft_greedy(Matrix<double>(2, 0)), ShapeError);
  CHECK_THROWS_AS(draft_sample(nan_logits, rng), ValueError);
}

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

TEMPLATE_TEST_CASE("cross_entropy and softmax_rows sweep", "[sweeps][cross_entropy]", float, double) {
  using T = TestType;
  const Index n = 4, v = 5;
  const Matrix<T> logits = rnd<T>(n, v, 1);
  TokenIds targets(n);
  targets << 0, 4, kIgnoreIndex, 2;
  std::vector<Case> cases;
  for (Index len : {n - 1, n + 1, Index(0)})
    cases.push_back({"cross_entropy with " + std::to_string(len) + " targets",
                     [=] { cross_entropy(logits, TokenIds::Zero(len)); }, "ShapeError",
                     {"cross_entropy", "'targets'", shape(len, 1)}});
  for (Index id : {v, Index(-1), kIgnoreIndex - 1, Index(1) << 40})
    cases.push_back({"cross_entropy with target " + std::to_string(id),
                     [=] {
                       TokenIds t = targets;
                       t(1) = id;
                       cross_entropy(logits, t);
                     },
                     "ValueError", {"cross_entropy", "'targets'", std::to_string(id), "position 1"}});
  for (double s : {kNaN, kInf})
    cases.push_back({"cross_entropy with grad_scale " + std::to_string(s),
                     [=] {
                       CrossEntropyOptions o;
                       o.grad_scale = s;
                       Matrix<T> g;
                       cross_entropy(logits, targets, &g, o);
                     },
                     "ConfigError", {"cross_entropy", "grad_scale"}});
  for (double bad : {kNaN, kInf, -kInf})
    for (bool with_grad : {false, true})
      cases.push_back({"cross_entropy with " + std::to_string(bad) + " in a row with a target",
                       [=] {
                         Matrix<T> z = logits;
                         z(3, 1) = T(bad);
                         Matrix<T> g;
                         cross_entropy(z, targets, with_grad ? &g : nullptr);
                       },
                       "ValueError", {"cross_entropy", "logits", "row 3", "NaN or Inf"}});
  cases.push_back({"softmax_rows with NaN", [=] {
                     Matrix<T> z = logits;
                     z(0, 0) = T(kNaN);
                     softmax_rows(z);
                   },
                   "ValueError", {"softmax_rows", "'logits'"}});
  run_sweep(cases);

  // A row without a target is never read: NaN there is harmless.
  Matrix<T> z = logits;
  z(2, 0) = T(kNaN);
  Matrix<T> g;
  const CrossEntropyStats s = cross_entropy(z, targets, &g);
  CHECK(s.count == 3);
  CHECK(std::isfinite(s.loss));
  CHECK(g.allFinite());
  CHECK(g.row(2).isZero(0));
}

TEMPLATE_TEST_CASE("multi-token loss and MultiTokenHeads sweep", "[sweeps][mtp]", float, double) {
  using T = TestType;
  const Index d = 6, v = 5, heads_n = 3, n = 4;
  MultiTokenOptions opt;
  opt.num_heads = heads_n;
  MultiTokenHeads<T> heads(d, v, opt, 1);
  const Matrix<T> h = rnd<T>(n, d, 2);
  typename MultiTokenHeads<T>::Cache cache, other;
  const Matrix<T> y = heads.forward(h, &cache);
  heads.forward(rnd<T>(n + 2, d, 3), &other);
  const Matrix<T> main = rnd<T>(n, v, 4);
  TokenIds labels(n);
  labels << 1, 0, 4, 2;
  std::vector<Case> cases;

  struct Option {
    const char* field;
    std::function<void(MultiTokenOptions&)> spoil;
  };
  const std::vector<Option> options = {
      {"num_heads", [](MultiTokenOptions& o) { o.num_heads = -1; }},
      {"lambda", [](MultiTokenOptions& o) { o.lambda = -0.1; }},
      {"lambda", [](MultiTokenOptions& o) { o.lambda = kNaN; }},
      {"lambda", [](MultiTokenOptions& o) { o.lambda = kInf; }},
      {"ignore_index", [](MultiTokenOptions& o) { o.ignore_index = 0; }},
      {"ignore_index", [v](MultiTokenOptions& o) { o.ignore_index = v - 1; }},
  };
  for (const Option& op : options) {
    MultiTokenOptions bad = opt;
    op.spoil(bad);
    cases.push_back({std::string("multi_token_loss with a bad ") + op.field,
                     [=] { multi_token_loss(main, y, labels, bad); }, "ConfigError", {"multi_token_loss", op.field}});
    cases.push_back({std::string("MultiTokenHeads with a bad ") + op.field, [=] { (void)MultiTokenHeads<T>(d, v, bad); },
                     "ConfigError", {"MultiTokenHeads", op.field}});
  }
  cases.push_back({"MultiTokenHeads(0, v)", [=] { (void)MultiTokenHeads<T>(0, v); }, "ConfigError", {"MultiTokenHeads", "d_model"}});
  cases.push_back({"MultiTokenHeads(d, 0)", [=] { (void)MultiTokenHeads<T>(d, 0); }, "ConfigError", {"MultiTokenHeads", "vocab"}});
  for (double lambda : {-1.0, kNaN, kInf})
    cases.push_back({"MultiTokenHeads::set_lambda(" + std::to_string(lambda) + ")", [=, &heads] { heads.set_lambda(lambda); },
                     "ConfigError", {"MultiTokenHeads::set_lambda", "lambda"}});

  const std::pair<Index, Index> head_shapes[] = {{n, heads_n * v - 1}, {n, heads_n * v + 1}, {n - 1, heads_n * v}, {n + 1, heads_n * v}, {n, 0}};
  for (const auto& [r, c] : head_shapes)
    cases.push_back({"multi_token_loss with head_logits " + shape(r, c),
                     [=] { multi_token_loss(main, Matrix<T>::Zero(r, c), labels, opt); }, "ShapeError",
                     {"multi_token_loss", "'head_logits'", shape(r, c)}});
  cases.push_back({"multi_token_loss with fewer labels than positions",
                   [=] { multi_token_loss(main, y, TokenIds(labels.head(n - 1)), opt); }, "ShapeError",
                   {"multi_token_loss", "'labels'"}});
  for (Index id : {v, Index(-1)})
    cases.push_back({"multi_token_loss with label " + std::to_string(id),
                     [=] {
                       TokenIds l = labels;
                       l(2) = id;
                       multi_token_loss(main, y, l, opt);
                     },
                     "ValueError", {"multi_token_loss", "'labels'", std::to_string(id)}});
  for (bool in_main : {true, false})
    for (double bad : {kNaN, kInf})
      cases.push_back({std::string("multi_token_loss with ") + std::to_string(bad) + (in_main ? " in main" : " in a head"),
                       [=] {
                         Matrix<T> zm = main, zh = y;
                         (in_main ? zm(0, 1) : zh(0, v + 1)) = T(bad);
                         Matrix<T> gm, gh;
                         multi_token_loss(zm, zh, labels, opt, &gm, &gh);
                       },
                       "ValueError", {"multi_token_loss", "logits", "row 0", "NaN or Inf"}});

  add_width_cases<T>(cases, "MultiTokenHeads::forward", "h", n, d, [&](const Matrix<T>& x) { heads.forward(x); });
  const std::pair<Index, Index> out_shapes[] = {{n, heads_n * v - 1}, {n + 1, heads_n * v}, {n, 0}};
  for (const auto& [r, c] : out_shapes)
    cases.push_back({"MultiTokenHeads::forward_into a buffer " + shape(r, c),
                     [=, &heads] {
                       Matrix<T> out(r, c);
                       heads.forward_into(h, out);
                     },
                     "ShapeError", {"MultiTokenHeads::forward", "'y'", shape(r, c)}});
  add_grad_cases<T>(cases, "MultiTokenHeads::backward", "dy", n, heads_n * v,
                    [&](const Matrix<T>& dy) { heads.backward(dy, cache); });
  cases.push_back({"MultiTokenHeads::backward with the cache of a 6-row batch",
                   [&] { heads.backward(Matrix<T>::Ones(n, heads_n * v), other); }, "ShapeError",
                   {"MultiTokenHeads::backward", "'dy'"}});
  for (Index c : {v - 1, v + 1, Index(0)})
    cases.push_back({"MultiTokenHeads::loss with main_logits of " + std::to_string(c) + " columns",
                     [=, &heads] { heads.loss(Matrix<T>::Zero(n, c), y, labels); }, "ShapeError",
                     {"MultiTokenHeads::loss", "'main_logits'"}});
  for (Index c : {heads_n * v - 1, heads_n * v + 1, Index(0)})
    cases.push_back({"MultiTokenHeads::draft_logits of an output with " + std::to_string(c) + " columns",
                     [=, &heads] {
                       const Matrix<T> out = Matrix<T>::Zero(n, c);
                       heads.draft_logits(out, 0);
                     },
                     "ShapeError", {"MultiTokenHeads::draft_logits", "'y'"}});
  for (Index t : {Index(-1), n})
    cases.push_back({"MultiTokenHeads::draft_logits at position " + std::to_string(t), [=, &heads, &y] { heads.draft_logits(y, t); },
                     "ValueError", {"MultiTokenHeads::draft_logits", "position", std::to_string(t)}});
  for (Index i : {Index(-1), heads_n})
    cases.push_back({"MultiTokenHeads::weight(" + std::to_string(i) + ")", [=, &heads] { (void)heads.weight(i); },
                     "ValueError", {"MultiTokenHeads::weight", "head", std::to_string(i)}});
  run_sweep(cases);
  CHECK(heads.options().lambda == 0.1);  // rejected set_lambda changed nothing
}

TEMPLATE_TEST_CASE("speculative drafting and verification sweep", "[sweeps][speculative]", float, double) {
  using T = TestType;
  const Index n = 3, v = 5;
  const Matrix<T> head_logits = rnd<T>(n, v, 1);
  const Matrix<T> q = softmax_rows(head_logits);
  const Matrix<T> p = softmax_rows(rnd<T>(n + 1, v, 2));
  const std::vector<Index> draft = {1, 4, 0};
  Rng rng(3);
  std::vector<Case> cases;

  cases.push_back({"draft_greedy with no columns", [] { draft_greedy(Matrix<T>(3, 0)); }, "ShapeError",
                   {"draft_greedy", "'head_logits'", "0 columns"}});
  cases.push_back({"draft_sample with no columns", [&] { draft_sample(Matrix<T>(3, 0), rng); }, "ShapeError",
                   {"draft_sample", "'head_logits'", "0 columns"}});
  for (double bad : {kNaN, kInf, -kInf}) {
    Matrix<T> z = head_logits;
    z(1, 2) = T(bad);
    cases.push_back({"draft_greedy with " + std::to_string(bad), [=] { draft_greedy(z); }, "ValueError",
                     {"draft_greedy", "'head_logits'", "NaN or Inf"}});
    cases.push_back({"draft_sample with " + std::to_string(bad), [=, &rng] { draft_sample(z, rng); }, "ValueError",
                     {"logits", "NaN or Inf"}});
  }

  for (Index rows : {n, n + 2})
    cases.push_back({"verify_greedy with " + std::to_string(rows) + " target rows for 3 drafts",
                     [=] { verify_greedy(draft, Matrix<T>::Zero(rows, v)); }, "ShapeError",
                     {"verify_greedy", "'target_scores'", shape(rows, v)}});
  cases.push_back({"verify_greedy with no columns", [=] { verify_greedy(draft, Matrix<T>(n + 1, 0)); }, "ShapeError",
                   {"verify_greedy", "'target_scores'", "0 columns"}});
  cases.push_back({"verify_greedy with NaN", [=] {
                     Matrix<T> s = p;
                     s(3, 3) = T(kNaN);
                     verify_greedy(draft, s);
                   },
                   "ValueError", {"verify_greedy", "'target_scores'", "NaN or Inf"}});
  for (Index id : {v, Index(-1), kIgnoreIndex})
    cases.push_back({"verify_greedy with draft token " + std::to_string(id),
                     [=] {
                       std::vector<Index> dr = draft;
                       dr[2] = id;
                       verify_greedy(dr, p);
                     },
                     "ValueError", {"verify_greedy", "'draft'", std::to_string(id), "position 2"}});

  for (Index rows : {n, n + 2})
    cases.push_back({"verify_sampling with " + std::to_string(rows) + " target rows",
                     [=, &rng] { verify_sampling(draft, q, Matrix<T>::Constant(rows, v, T(0.2)), rng); }, "ShapeError",
                     {"verify_sampling", "'target_probs'", shape(rows, v)}});
  cases.push_back({"verify_sampling with target_probs of no columns",
                   [=, &rng] { verify_sampling(draft, q, Matrix<T>(n + 1, 0), rng); }, "ShapeError",
                   {"verify_sampling", "'target_probs'", "0 columns"}});
  const std::pair<Index, Index> q_shapes[] = {{n - 1, v}, {n + 1, v}, {n, v - 1}, {n, v + 1}};
  for (const auto& [r, c] : q_shapes)
    cases.push_back({"verify_sampling with draft_probs " + shape(r, c),
                     [=, &rng] { verify_sampling(draft, Matrix<T>::Constant(r, c, T(1) / T(c)), p, rng); }, "ShapeError",
                     {"verify_sampling", "'draft_probs'", shape(r, c)}});
  struct Spoil {
    const char* what;
    bool in_q;
    std::function<void(Matrix<T>&)> spoil;
    const char* says;
  };
  const std::vector<Spoil> spoils = {
      {"NaN", true, [](Matrix<T>& m) { m(1, 1) = T(kNaN); }, "NaN or Inf"},
      {"Inf", false, [](Matrix<T>& m) { m(3, 0) = T(kInf); }, "NaN or Inf"},
      {"a negative entry", true, [](Matrix<T>& m) { m(0, 2) -= T(0.5), m(0, 3) += T(0.5); }, "negative"},
      {"a negative entry", false, [](Matrix<T>& m) { m(2, 2) -= T(0.5), m(2, 3) += T(0.5); }, "negative"},
      {"a row summing to 0.9", false, [](Matrix<T>& m) { m.row(1) *= T(0.9); }, "sums to"},
      {"a row summing to 1.1", true, [](Matrix<T>& m) { m.row(2) *= T(1.1); }, "sums to"},
  };
  for (const Spoil& s : spoils) {
    Matrix<T> qq = q, pp = p;
    s.spoil(s.in_q ? qq : pp);
    cases.push_back({std::string("verify_sampling with ") + s.what + (s.in_q ? " in q" : " in p"),
                     [=, &rng] { verify_sampling(draft, qq, pp, rng); }, "ValueError",
                     {"verify_sampling", s.in_q ? "'draft_probs'" : "'target_probs'", s.says}});
  }
  for (Index id : {v, Index(-1)})
    cases.push_back({"verify_sampling with draft token " + std::to_string(id),
                     [=, &rng] {
                       std::vector<Index> dr = draft;
                       dr[0] = id;
                       verify_sampling(dr, q, p, rng);
                     },
                     "ValueError", {"verify_sampling", "'draft'", std::to_string(id)}});
  cases.push_back({"verify_sampling with a draft q could not produce", [=, &rng] {
                     Matrix<T> qq = q;
                     qq.row(0).setConstant(T(0.25));
                     qq(0, 1) = T(0);  // draft[0] = 1 has q = 0
                     verify_sampling(draft, qq, p, rng);
                   },
                   "ValueError", {"verify_sampling", "draft probability 0"}});
  run_sweep(cases);
}

TEST_CASE("multi_token_loss reports logits without columns as a ShapeError", "[sweeps][regression][mtp]") {
  // layers/multi_token_heads.hpp, multi_token_loss: `main_logits` with 0 columns
  // raised ConfigError ("main_logits must have at least one column"). It is
  // an argument of the wrong shape, and draft_greedy/draft_sample/
  // verify_* raise ShapeError for the same input. Fixed: it uses
  // detail::check_vocab as they do.
  const Matrix<double> none(3, 0);
  TokenIds labels = TokenIds::Constant(3, kIgnoreIndex);
  expect(outcome([&] { multi_token_loss(none, none, labels, MultiTokenOptions{}); }), "ShapeError",
         {"multi_token_loss", "'main_logits'"});
}

TEST_CASE("cross_entropy drops targets equal to an in-vocabulary ignore index as PyTorch does",
          "[sweeps][regression][cross_entropy]") {
  // layers/cross_entropy.hpp: CrossEntropyOptions::ignore_index may be a real token
  // id (PyTorch allows it, e.g. a padding id), while multi_token_loss rejects
  // one (ConfigError). The difference is documented on both option structs
  // and in docs/error_model.md; this test pins what cross_entropy does with
  // it: targets equal to the ignore index contribute neither loss nor
  // gradient, the mean divides by the number of other targets, and the id
  // stays a class of the softmax of the other rows.
  const Index v = 5;
  const Matrix<double> z = random_matrix(4, v, 21);
  CrossEntropyOptions o;
  o.ignore_index = 3;
  o.grad_scale = 0.5;
  TokenIds t(4);
  t << 3, 1, 3, 0;
  Matrix<double> g;
  const CrossEntropyStats got = cross_entropy(z, t, &g, o);

  // Reference: the same loss over rows 1 and 3 alone, with the default ignore index.
  Matrix<double> z_kept(2, v);
  z_kept << z.row(1), z.row(3);
  TokenIds t_kept(2);
  t_kept << 1, 0;
  CrossEntropyOptions o_ref;
  o_ref.grad_scale = 0.5;
  Matrix<double> g_ref;
  const CrossEntropyStats ref = cross_entropy(z_kept, t_kept, &g_ref, o_ref);
  CHECK(got.count == 2);
  CHECK(got.loss == ref.loss);  // same rows in the same order: bitwise equal
  CHECK(got.correct == ref.correct);
  REQUIRE(g.rows() == 4);
  CHECK(g.row(0).isZero(0));
  CHECK(g.row(2).isZero(0));
  CHECK(g.row(1) == g_ref.row(0));
  CHECK(g.row(3) == g_ref.row(1));
  CHECK(g(1, 3) > 0);  // token 3 is still a class: softmax mass, positive gradient
  // The loss of the kept rows, by hand: mean of lse(z) − z_y over the two rows.
  const auto lse = [&](Index r) { return std::log(z.row(r).array().exp().sum()); };
  CHECK_THAT(got.loss, Catch::Matchers::WithinRel(0.5 * ((lse(1) - z(1, 1)) + (lse(3) - z(3, 0))), 1e-12));

  // Every target ignored: no loss, no gradient, no division by zero.
  const CrossEntropyStats none = cross_entropy(z, TokenIds::Constant(4, 3), &g, o);
  CHECK(none.count == 0);
  CHECK(none.loss == 0);
  CHECK(g.isZero(0));

  // multi_token_loss keeps its stricter contract for the same option.
  MultiTokenOptions mo;
  mo.num_heads = 0;
  mo.ignore_index = 3;
  expect(outcome([&] { multi_token_loss(z, Matrix<double>(4, 0), t, mo); }), "ConfigError",
         {"multi_token_loss", "ignore_index"});
}

namespace {
template <class H, class = void>
struct draft_logits_takes_temporary : std::false_type {};
template <class H>
struct draft_logits_takes_temporary<
    H, std::void_t<decltype(std::declval<const H&>().draft_logits(std::declval<Matrix<typename H::Scalar>>(), Index(0)))>>
    : std::true_type {};
template <class H, class = void>
struct draft_logits_takes_lvalue : std::false_type {};
template <class H>
struct draft_logits_takes_lvalue<
    H, std::void_t<decltype(std::declval<const H&>().draft_logits(std::declval<const Matrix<typename H::Scalar>&>(), Index(0)))>>
    : std::true_type {};
}  // namespace

TEST_CASE("MultiTokenHeads::draft_logits refuses a temporary", "[sweeps][regression][mtp]") {
  // layers/multi_token_heads.hpp, draft_logits(const Matrix<T>& y, Index t) returns
  // a Map into y, and a const reference binds to a temporary, so
  // `auto z = heads.draft_logits(heads.forward(h), t);` compiled and z
  // dangled as soon as the statement ended (use after free). Fixed: the
  // rvalue overloads are deleted; a named matrix still works.
  CHECK_FALSE(draft_logits_takes_temporary<MultiTokenHeads<double>>::value);
  CHECK_FALSE(draft_logits_takes_temporary<MultiTokenHeads<float>>::value);
  CHECK(draft_logits_takes_lvalue<MultiTokenHeads<double>>::value);
}

TEST_CASE("draft_sample names itself and head_logits when the logits are not finite",
          "[sweeps][regression][speculative]") {
  // layers/speculative.hpp, draft_sample: the finiteness check happened inside
  // softmax_rows, so the message read "softmax_rows: argument 'logits'
  // contains NaN or Inf" — a function and an argument the caller never
  // used. Fixed: draft_sample checks head_logits itself, as draft_greedy does.
  Matrix<double> z = Matrix<double>::Zero(2, 3);
  z(1, 1) = kNaN;
  Rng rng(0);
  expect(outcome([&] { draft_sample(z, rng); }), "ValueError", {"draft_sample", "'head_logits'"});
}
