// Speculative decoding (layers/speculative.hpp): greedy verification and
// drafts, greedy speculative decoding against greedy decoding of the main
// model, a seeded statistical test (chi-square) that speculative sampling
// reproduces the main model's distribution for first tokens and whole
// sequences, full acceptance when q equals p, float probabilities, and the
// error sweep and regression tests of drafting and verification.
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
using apex::test::random_matrix;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

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

// ---- error handling (sweeps) ----
using namespace apex::test;  // the sweep machinery of support/sweep.hpp

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
