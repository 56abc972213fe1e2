// Multi-token prediction heads and their loss (layers/multi_token_heads.hpp):
// the heads' products and parameter names, the loss against a plain
// position-by-position computation, gradients by finite differences, head
// offsets, averaging and the ignore index, float against double, and the
// error sweeps and regression tests of the heads and the loss.
#include <apex/ffn/layers/cross_entropy.hpp>
#include <apex/ffn/layers/multi_token_heads.hpp>
#include <apex/ffn/layers/speculative.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "gradcheck.hpp"
#include "mtp_reference.hpp"
#include "sweep.hpp"

using namespace apex;
using apex::test::check_params;
using apex::test::check_values;
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using apex::test::ids;
using apex::test::random_labels;
using apex::test::PlainLoss;
using apex::test::plain_mtp_loss;

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
