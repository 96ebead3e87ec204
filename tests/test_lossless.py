"""The losslessness test of speculative sampling (`castle_jax.eval.lossless`): its statistics
on known distributions, that it passes LongSpec's sampler and rejects wrong ones (the
target at another temperature, an acceptance rule that forgets to renormalize), and the
command on target and draft workdirs."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from castle_jax.checkpoints import Checkpointer
from castle_jax.config import ModelConfig
from castle_jax.eval import lossless
from castle_jax.inference import speculative
from castle_jax.inference.sampling import filtered_logits
from castle_jax.models import build_model, longspec_draft
from castle_jax.workdir import CONFIG_NAME, FROZEN_NAME, params_fingerprint
from helpers import random_longspec_pair

# Its module-scoped fixtures are costly (trained models, compiled steps): one worker runs the
# whole module under `--dist loadgroup`, so they are built once.
pytestmark = pytest.mark.xdist_group("test_lossless")

VOCAB = 12
TREE = (4, 8)
SAMPLES = 1500


def _pair(vocab):
  """A random target and draft. A large init makes the target's distributions far from
  uniform (85% of the first token's mass on two tokens after PROMPT); with TREE, the target
  accepts drafts at both tested positions (the tests check it: a random draft whose
  candidates missed the target's likely tokens would make the test vacuous)."""
  return random_longspec_pair(
    ModelConfig(vocab_size=vocab, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, dtype="float32", init_std=0.3)
  )


@pytest.fixture(scope="module")
def pair():
  return _pair(VOCAB)


PROMPT = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], np.int32)


@pytest.fixture(scope="module")
def report(pair):
  """One run of the whole test on the random pair, with a control at temperature 0.5."""
  return lossless.lossless_test(
    *pair, PROMPT, samples=SAMPLES, new_tokens=2, tree=TREE, seed=0, batch_size=SAMPLES, control_temperature=0.5
  )


# --- the statistics --------------------------------------------------------------------------------


def test_homogeneity_matches_scipy_on_a_table_without_rare_categories():
  a = np.repeat([0, 1, 2], [30, 50, 20])
  b = np.repeat([0, 1, 2], [45, 35, 40])
  result = lossless.homogeneity_test(a, b)
  chi2, p, dof, _ = stats.chi2_contingency(np.array([[30, 50, 20], [45, 35, 40]]), correction=False)
  assert (result["chi2"], result["p"], result["dof"]) == pytest.approx((chi2, p, dof))
  assert result["categories"] == result["bins"] == 3
  assert result["tv"] == pytest.approx(0.5 * (abs(0.30 - 45 / 120) + abs(0.50 - 35 / 120) + abs(0.20 - 40 / 120)))


def test_rare_categories_are_merged_into_one_bin():
  # Categories 7, 8 and 9 are rare (expected < 5 in either sample); together they are not.
  a = np.repeat([0, 1, 7, 8, 9], [40, 40, 2, 2, 2])
  b = np.repeat([0, 1, 7, 8, 9], [40, 40, 3, 1, 2])
  result = lossless.homogeneity_test(a, b)
  assert result["categories"] == 5 and result["bins"] == 3 and result["dof"] == 2
  table = np.array([[40, 40, 6], [40, 40, 6]])
  assert result["chi2"] == pytest.approx(stats.chi2_contingency(table, correction=False)[0])
  # A rare remainder too small for a bin of its own joins the least frequent kept category.
  a = np.repeat([0, 1, 7], [40, 20, 2])
  b = np.repeat([0, 1, 7], [40, 20, 1])
  result = lossless.homogeneity_test(a, b)
  assert result["bins"] == 2
  chi2 = stats.chi2_contingency(np.array([[40, 22], [40, 21]]), correction=False)[0]
  assert result["chi2"] == pytest.approx(chi2)
  # One category left: nothing to test.
  result = lossless.homogeneity_test(np.zeros(10, int), np.zeros(20, int))
  assert (result["chi2"], result["dof"], result["p"], result["tv"]) == (0.0, 0, 1.0, 0.0)


def test_goodness_of_fit_merges_rare_tokens_and_rejects_tokens_outside_the_support():
  p = np.array([0.5, 0.3, 0.15, 0.03, 0.02, 0.0])
  sample = np.repeat([0, 1, 2, 3, 4], [52, 28, 14, 4, 2])
  result = lossless.goodness_of_fit(sample, p)
  # Tokens 3 and 4 (expected 3 and 2) make one bin of 5; token 5 has probability 0.
  expected = stats.chisquare([52, 28, 14, 6], [50, 30, 15, 5])
  assert (result["chi2"], result["p"], result["dof"], result["bins"]) == pytest.approx(
    (expected.statistic, expected.pvalue, 3, 4)
  )
  assert result["outside_support"] == 0
  assert result["tv"] == pytest.approx(0.5 * (0.02 + 0.02 + 0.01 + 0.01 + 0.0))
  outside = lossless.goodness_of_fit(np.append(sample[:-1], 5), p)
  assert outside["outside_support"] == 1 and outside["p"] == 0.0 and outside["chi2"] == float("inf")
  with pytest.raises(ValueError, match=r"tokens must lie in \[0, 6\)"):
    lossless.goodness_of_fit(np.array([6]), p)


def test_p_values_are_calibrated_and_a_small_shift_is_found():
  """Under the null the tests reject at 5% about 5% of the time; a shift of TV 0.1 is
  found at these sizes nearly always."""
  rng = np.random.default_rng(1)
  p = rng.dirichlet(np.ones(20) * 0.5)
  shifted = 0.9 * p + 0.1 * np.eye(20)[np.argmin(p)]
  null_h, null_g, power = [], [], []
  for _ in range(300):
    a, b = rng.choice(20, 500, p=p), rng.choice(20, 500, p=p)
    null_h.append(lossless.homogeneity_test(a, b, rng=rng)["p"])
    null_g.append(lossless.goodness_of_fit(a, p, rng=rng)["p"])
  for _ in range(20):
    power.append(lossless.homogeneity_test(rng.choice(20, 1000, p=p), rng.choice(20, 1000, p=shifted), rng=rng)["p"])
  for ps in (null_h, null_g):
    assert 0.02 <= np.mean(np.array(ps) < 0.05) <= 0.09
    assert stats.kstest(ps, "uniform").pvalue > 1e-3
  assert np.mean(np.array(power) < 0.001) >= 0.9


def test_drafted_share_reads_the_rounds():
  # Row 0: rounds of 3 and 2 tokens (bonuses at 2 and 4), then done; row 1: rounds of 1, 1
  # and 3 (bonuses at 0, 1 and 4). Position 4 ends both rows: left out.
  draws = lossless.SpeculativeDraws(np.zeros((2, 5), np.int32), np.array([[3, 2, 0], [1, 1, 3]], np.int32))
  np.testing.assert_allclose(draws.drafted_share(), [0.5, 0.5, 0.5, 1.0])
  assert draws.mean_accepted == pytest.approx(10 / 5)


# --- the samplers ----------------------------------------------------------------------------------


def test_speculative_sampling_passes_and_its_drafts_were_accepted(report):
  tests = report["tests"]
  assert [(t["test"], t["position"]) for t in tests] == [
    ("speculative vs autoregressive", "1"),
    ("speculative vs autoregressive", "2"),
    ("speculative vs autoregressive", "1-2 joint"),
    ("speculative vs exact", "1"),
    ("autoregressive vs exact", "1"),
  ]
  assert not lossless.verdict(tests, 0.05)["rejected"], tests
  assert min(t["p"] for t in tests) > 0.01, tests
  for t in tests:
    assert t["dof"] >= 5 and t["tv"] < t["tv_noise_95"] * 1.5, t
  # Not vacuous: at both positions, a good share of the speculative tokens were drafted
  # tokens that the target accepted, not its own draws.
  assert report["drafted_share"][0] > 0.5 and report["drafted_share"][1] > 0.25, report
  assert report["mean_accepted"] > 1.2, report


def test_the_target_at_another_temperature_is_rejected(report):
  control = report["control"]
  assert [t["position"] for t in control] == ["1", "2", "1-2 joint", "1"]
  assert all(t["p"] < 1e-6 and t["tv"] > 2 * t["tv_noise_95"] for t in control), control
  assert report["control_first_token_tv"] > 0.1


def _accept_without_renormalizing(shape, tokens, parents, logits, rng, temperature, top_k, top_p):
  """A broken acceptance rule (level 1 only): the root's children are tried in order, each
  accepted with its target probability, but a rejected child is never removed from the
  distribution that the later children and the bonus are drawn from."""
  del parents  # level 1's parent is the root
  probabilities = jax.nn.softmax(filtered_logits(logits, temperature, top_k, top_p), axis=-1)
  children = 1 + jnp.arange(shape.widths[0])
  uniform_rng, bonus_rng = jax.random.split(rng)
  accepted = jax.random.uniform(uniform_rng, children.shape) < probabilities[0, tokens[children]]
  chosen = jnp.where(accepted.any(), children[jnp.argmax(accepted)], 0)
  path = jnp.zeros((shape.depth + 1,), jnp.int32).at[1].set(chosen)
  bonus = jax.random.categorical(bonus_rng, jnp.log(probabilities[chosen]))
  return path, (1 + accepted.any()).astype(jnp.int32), bonus.astype(jnp.int32)


@pytest.fixture
def broken_acceptance(monkeypatch):
  # The compiled decoding loop is cached by its static arguments, which the patch does not
  # change: compile afresh with the broken rule, and drop that program afterwards.
  jax.clear_caches()
  monkeypatch.setattr(speculative, "_accept_sampling", _accept_without_renormalizing)
  yield
  monkeypatch.undo()
  jax.clear_caches()


def test_a_speculative_sampler_that_does_not_renormalize_is_rejected(pair, broken_acceptance):
  draws = lossless.draw_speculative(
    *pair, PROMPT, samples=SAMPLES, new_tokens=2, rng=jax.random.key(5), tree=TREE, batch_size=SAMPLES
  )
  exact = lossless.first_token_probabilities(pair[0], pair[1], PROMPT)
  autoregressive = lossless.draw_autoregressive(
    pair[0], pair[1], PROMPT, samples=SAMPLES, new_tokens=2, rng=jax.random.key(6), batch_size=SAMPLES
  )
  tests = lossless.compare_samplers(draws.tokens, autoregressive, exact)
  assert lossless.verdict(tests, 0.05)["rejected"]
  by_name = {(t["test"], t["position"]): t for t in tests}
  assert by_name["speculative vs exact", "1"]["p"] < 1e-6
  assert by_name["speculative vs autoregressive", "1"]["p"] < 1e-6
  assert by_name["autoregressive vs exact", "1"]["p"] > 1e-3  # the reference itself is fine


def test_bad_arguments_are_named(pair):
  call = lambda **kw: lossless.lossless_test(*pair, kw.pop("prompt", PROMPT), **{"samples": 10, **kw})
  for kw, message in (
    (dict(samples=0), "samples must be an int >= 1, got 0"),
    (dict(new_tokens=0), "new_tokens must be an int >= 1, got 0"),
    (dict(batch_size=0), "batch_size must be an int >= 1, got 0"),
    (dict(temperature=0.0), r"temperature must be > 0 \(at 0 sampling is greedy"),
    (dict(control_temperature=-1.0), "control_temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(prompt=np.zeros(0, np.int32)), "the prompt needs at least one token"),
  ):
    with pytest.raises(ValueError, match=message):
      call(**kw)
  with pytest.raises(ValueError, match="both samples need at least one draw"):
    lossless.homogeneity_test(np.zeros(0, int), np.zeros(3, int))
  with pytest.raises(ValueError, match="equal new_tokens"):
    lossless.compare_samplers(np.zeros((4, 2), int), np.zeros((4, 3), int), np.ones(VOCAB) / VOCAB)


# --- the command -----------------------------------------------------------------------------------


def _write_workdir(workdir, config, params, step):
  """A workdir as training leaves it: config.json and a checked checkpoint of the params."""
  os.makedirs(workdir)
  with open(os.path.join(workdir, CONFIG_NAME), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
  checkpointer.save(step, {"params": params})
  checkpointer.close()


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory, stdlib_data_dir):
  """A random target (byte tokens) and its random draft as training workdirs."""
  from configs import longspec_draft_tiny, longspec_target_tiny
  from helpers import tiny_run

  root = tmp_path_factory.mktemp("lossless")
  settings = {"model.n_kv_heads": 1, "model.init_std": 0.3, "data.seq_len": 32}
  target_config = tiny_run(longspec_target_tiny, str(root / "target"), stdlib_data_dir, **settings)
  target = build_model(ModelConfig.from_mapping(target_config.model))
  target_params = nn.unbox(target.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  _write_workdir(target_config.workdir, target_config, target_params, 8)
  draft_config = tiny_run(longspec_draft_tiny, str(root / "draft"), stdlib_data_dir, **settings)
  with draft_config.unlocked():
    draft_config.model.family_kwargs.target_workdir = target_config.workdir
    draft_config.model.family_kwargs.window = 8
  draft = build_model(ModelConfig.from_mapping(draft_config.model))
  draft_params = nn.unbox(longspec_draft.init_variables(draft, jax.random.key(1), 8)["params"])
  _write_workdir(draft_config.workdir, draft_config, draft_params, 4)
  fingerprint = params_fingerprint({longspec_draft.TARGET: target_params})
  with open(os.path.join(draft_config.workdir, FROZEN_NAME), "w") as f:
    json.dump({"workdir": target_config.workdir, "step": 8, "fingerprint": fingerprint}, f)
  return target_config.workdir, draft_config.workdir


def test_the_command_writes_the_tests_of_split_prompts(workdirs, tmp_path, capsys):
  target_dir, draft_dir = workdirs
  flags = [f"--target_workdir={target_dir}", f"--draft_workdir={draft_dir}", "--samples=64", "--new_tokens=2"]
  flags += ["--prompts=2", "--prompt_length=12", "--tree=2,2", "--batch_size=40"]
  assert lossless.main(flags) == 0
  out = capsys.readouterr().out
  assert out.startswith("| prompt | test | position | chi2 | dof | p | TV | TV noise 95% | drafted | tau |")
  assert "10 tests over 2 prompt(s), 64 samples per sampler" in out
  record = json.load(open(os.path.join(draft_dir, "eval", "lossless_step4.json")))
  assert (record["target_step"], record["draft_step"], record["settings"]["samples"]) == (8, 4, 64)
  assert [len(r["prompt_tokens"]) for r in record["results"]] == [12, 12]
  assert record["results"][0]["prompt_tokens"][0] == 256  # the split's first [BOS]
  assert len(record["results"][1]["tests"]) == 5 and record["verdict"]["tests"] == 10
  assert record["control_verdict"] is None and record["jax"] == jax.__version__
  # A text prompt and a control (the prompt and batch shapes as above: nothing recompiles
  # but the control's sampler); the named file is written once, then refused.
  output = str(tmp_path / "text.json")
  flags = [f"--target_workdir={target_dir}", f"--draft_workdir={draft_dir}", "--samples=40", "--new_tokens=2"]
  flags += ["--prompt=def main(x)", "--tree=2,2", "--control_temperature=0.5", f"--output={output}"]
  assert lossless.main(flags) == 0
  record = json.load(open(output))
  assert record["results"][0]["prompt_tokens"] == [256, *b"def main(x)"]
  assert len(record["results"][0]["tests"]) == 5 and len(record["results"][0]["control"]) == 4
  assert len(record["results"][0]["drafted_share"]) == 2 and record["control_verdict"]["tests"] == 4
  capsys.readouterr()
  assert lossless.main(flags) == 1
  assert f"--output={output}: {output} exists" in capsys.readouterr().err


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--samples=0"], "argument --samples: '0' must be an integer >= 1"),
    (["--new_tokens=0"], "argument --new_tokens: '0' must be an integer >= 1"),
    (["--temperature=0"], "--temperature must be > 0 (0 is greedy sampling: nothing to test), got 0.0"),
    (["--top_p=1.5"], "--top_p must be in (0, 1]"),
    (["--alpha=1"], "--alpha must be in (0, 1), got 1.0"),
    (["--seed=-1"], "argument --seed: '-1' must be an integer >= 0"),
    (["--tree=4,x"], "argument --tree: '4,x' is not a comma-separated list of integers"),
    (["--control_temperature=1"], "--control_temperature must be another temperature than --temperature=1"),
    (["--prompt=def", "--prompts=2"], "--prompt takes the place of --prompts/--prompt_length"),
    (["--prompt="], "--prompt is empty"),
    (["--target_workdir={missing}"], "--target_workdir={missing}: no such directory"),
    (["--draft_workdir={missing}"], "--draft_workdir={missing}: no such directory"),
    (["--draft_workdir={target}"], "holds a 'transformer' model, not a 'longspec_draft' draft"),
    (["--draft_step=3"], "No checkpoint for step 3 in"),
    (["--tree=1,1,1,1,1,1,1,1"], "tree depth 8 must be below the draft's window (8)"),
    (["--prompts=100000", "--prompt_length=1000"], "fewer than --prompts=100000 x --prompt_length=1000"),
  ],
)
def test_bad_input_is_one_error_line(flags, message, workdirs, tmp_path, capsys):
  target_dir, draft_dir = workdirs
  paths = dict(missing=str(tmp_path / "nowhere"), target=target_dir)
  defaults = {"--target_workdir": target_dir, "--draft_workdir": draft_dir, "--samples": "4"}
  flags = [f.format(**paths) for f in flags]
  given = {f.split("=")[0] for f in flags}
  argv = [f"{k}={v}" for k, v in defaults.items() if k not in given] + flags + [f"--output={tmp_path}/out.json"]
  assert lossless.main(argv) == 1
  out, err = capsys.readouterr()
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("ERROR: ") and message.format(**paths) in lines[0], err
  assert out == "" and not os.path.exists(tmp_path / "out.json")
