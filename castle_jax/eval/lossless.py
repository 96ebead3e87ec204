"""Is speculative sampling lossless? Chi-square tests of LongSpec speculative sampling against
the target's own autoregressive sampling.

At a sampling temperature, `speculative_generate` must emit every token with exactly the
target's distribution (`castle_jax.inference.speculative`: the multi-candidate acceptance
rule). This command draws `--samples` continuations of `--new_tokens` tokens of one prompt
with each sampler (the speculative draws as the rows of a batch, `--batch_size` rows per
call) and tests, for every generated position, that the two samplers' token counts come
from one distribution (chi-square test of homogeneity), and the joint of the first two
tokens the same way. The exact distribution of the first token is one target forward away,
so both samplers' first-token counts are also tested against it (goodness of fit).

Categories whose expected count is below 5 are merged into one "other" bin, as the
chi-square approximation asks; the test is Pearson's, without continuity correction. Each
row also reports the total-variation distance (TV) between the two empirical distributions
(or the sample's and the exact one) next to the TV two samples of the same sizes drawn from
one distribution show (its 95th percentile over 200 draws: the sampling noise), and for the
speculative sampler how often the token at that position was an accepted draft token, with
tau (tokens per row verification): the test means something only where drafts were accepted.

The verdict: no test rejects at --alpha after Bonferroni's correction over the tests of
every prompt. `--control_temperature=T'` adds a control that must be rejected: autoregressive
samples at T' tested against those at the sampling temperature (the test's power at this
--samples).

    python -m castle_jax.eval.lossless --target_workdir=runs/longspec_target_tiny \\
        --draft_workdir=runs/longspec_draft_tiny_long --samples=4000 --new_tokens=3 \\
        [--prompt="def main(" | --prompt_length=128 --prompts=1 --data_dir=DIR] [--temperature=1 \\
        --top_k=0 --top_p=1 --tree=4,16,16,16,16 --seed=0 --batch_size=500 --alpha=0.05 \\
        --control_temperature=0.8 --target_step=N --draft_step=N --output=DIR_OR_NEW_FILE.json]

Prompts: `--prompt` text (after a BOS token), or `--prompts` pieces of `--prompt_length`
tokens of the target's validation split (consecutive `[BOS] file [EOS]` text). Writes the
JSON (settings, every test, the verdict) to a new file, `--output` or
`<draft_workdir>/eval/lossless_step<N>.json` (never over an earlier one), and prints a
markdown table.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from castle_jax import command_line, outputs
from castle_jax.checkpoints import CheckpointError
from castle_jax.eval import cli
from castle_jax.inference import generate, speculative_generate
from castle_jax.inference.sampling import filtered_logits, validate_sampling
from castle_jax.inference.speculative import DEFAULT_TREE, TreeShape
from castle_jax.models import family_of
from castle_jax.workdir import load_draft, load_trained_model, read_config

# The chi-square approximation needs expected counts of at least this per category.
MIN_EXPECTED = 5.0
# Draws of the sampling-noise reference of the TV distance.
NOISE_DRAWS = 200


class SpeculativeDraws(NamedTuple):
  """What `draw_speculative` returns.

  Attributes:
    tokens: int32 [samples, new_tokens], the continuations.
    row_tokens_per_round: int32 [samples, rounds], the tokens each row's verifications
      emitted (`SpeculativeResult.row_tokens_per_round`, cut at new_tokens; 0 once done).
  """

  tokens: np.ndarray
  row_tokens_per_round: np.ndarray

  @property
  def mean_accepted(self) -> float:
    """tau: tokens per row verification, over every sample (`SpeculativeResult.mean_accepted`;
    with few new tokens, each row's last round, cut at new_tokens, keeps it low)."""
    return float(self.row_tokens_per_round.sum() / max(np.count_nonzero(self.row_tokens_per_round), 1))

  def drafted_share(self) -> np.ndarray:
    """float [new_tokens - 1]: for positions 1 .. new_tokens - 1, the share of samples whose
    token there was an accepted draft token, not the target's own draw after the accepted
    ones (a round's last token, the bonus). The last position is left out: the round that
    reaches it is cut at new_tokens, so whether its token was drafted is not recorded."""
    counts = self.row_tokens_per_round
    new_tokens = self.tokens.shape[1]
    ends = np.cumsum(counts, axis=1)  # [samples, rounds], one past each round's last token
    bonus = np.zeros((counts.shape[0], new_tokens + 1), bool)
    rows = np.broadcast_to(np.arange(counts.shape[0])[:, None], counts.shape)
    # A finished row's empty rounds point past the end.
    np.logical_or.at(bonus, (rows, np.where(counts > 0, ends - 1, new_tokens)), True)
    return 1.0 - bonus[:, : new_tokens - 1].mean(axis=0)


def _chunks(samples: int, batch_size: int) -> int:
  return -(-samples // batch_size)


def draw_speculative(
  target_model,
  target_params,
  draft_model,
  draft_params,
  prompt: np.ndarray,
  *,
  samples: int,
  new_tokens: int,
  rng: jax.Array,
  tree: Sequence[int] = DEFAULT_TREE,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  batch_size: int = 500,
) -> SpeculativeDraws:
  """`samples` independent speculative continuations of one prompt.

  Args:
    target_model, target_params, draft_model, draft_params: a target and its LongSpec draft.
    prompt: int [prompt_len].
    samples, new_tokens: how many continuations, of how many tokens.
    rng: PRNG key; batch i draws from fold_in(rng, i), and `speculative_generate` gives every
      row its own key, so the rows are independent.
    tree, temperature, top_k, top_p: as `speculative_generate` takes them.
    batch_size: rows per call; every call has this many (the last one's extra rows are
      dropped, which keeps one compiled shape and leaves the kept rows i.i.d.).

  Returns:
    SpeculativeDraws (tokens int32 [samples, new_tokens], tokens per round per row).
  """
  batch = min(batch_size, samples)
  prompts = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32)[None], (batch, len(prompt)))
  tokens, per_round = [], []
  for chunk in range(_chunks(samples, batch)):
    result = speculative_generate(
      target_model,
      target_params,
      draft_model,
      draft_params,
      prompts,
      max_new_tokens=new_tokens,
      tree=tuple(tree),
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      rng=jax.random.fold_in(rng, chunk),
    )
    tokens.append(np.asarray(result.tokens[:, len(prompt) :]))
    per_round.append(result.row_tokens_per_round)
  rounds = max(counts.shape[1] for counts in per_round)
  per_round = [np.pad(counts, ((0, 0), (0, rounds - counts.shape[1]))) for counts in per_round]
  return SpeculativeDraws(
    np.concatenate(tokens)[:samples].astype(np.int32), np.concatenate(per_round)[:samples].astype(np.int32)
  )


def draw_autoregressive(
  model,
  params,
  prompt: np.ndarray,
  *,
  samples: int,
  new_tokens: int,
  rng: jax.Array,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  batch_size: int = 500,
) -> np.ndarray:
  """int32 [samples, new_tokens]: independent continuations of prompt int [prompt_len] by the
  model alone (`generate`), `batch_size` rows per call as `draw_speculative` draws them."""
  batch = min(batch_size, samples)
  prompts = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32)[None], (batch, len(prompt)))
  tokens = [
    np.asarray(
      generate(
        model,
        params,
        prompts,
        max_new_tokens=new_tokens,
        rng=jax.random.fold_in(rng, chunk),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
      )[:, len(prompt) :]
    )
    for chunk in range(_chunks(samples, batch))
  ]
  return np.concatenate(tokens)[:samples].astype(np.int32)


def first_token_probabilities(
  model, params, prompt: np.ndarray, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
  """float64 [vocab]: the exact sampling distribution of the token after prompt int
  [prompt_len] (one forward of the model; the samplers' own temperature and filters)."""
  logits = family_of(model).last_logits(model, params, jnp.asarray(prompt, jnp.int32)[None], 1)[0, -1]
  # float64 on the host, so that the expected counts of rare tokens are not rounded to 0.
  logits = np.asarray(filtered_logits(logits, temperature, top_k, top_p), np.float64)
  p = np.exp(logits - logits.max())
  return p / p.sum()


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
  """Half the L1 distance between two distributions (float [K] each, summing to 1)."""
  return 0.5 * float(np.abs(a - b).sum())


def _quantile_95(values: np.ndarray) -> float:
  return float(np.quantile(values, 0.95))


def homogeneity_test(
  a: np.ndarray, b: np.ndarray, *, min_expected: float = MIN_EXPECTED, rng: np.random.Generator | None = None
) -> dict[str, Any]:
  """Chi-square test that two samples of categories come from one distribution.

  Args:
    a, b: int [n_a], int [n_b] (n_a, n_b >= 1): the category of each draw (any integer codes).
    min_expected: categories whose smaller expected count under one shared distribution,
      min(n_a, n_b) * (their pooled count) / (n_a + n_b), is below this are merged into one
      "other" bin; when "other" is still below it, it joins the least frequent kept category.
    rng: for the sampling-noise reference of the TV (default: a fixed seed).

  Returns:
    {"chi2", "dof", "p" (Pearson's test of the merged 2 x K table, no continuity
    correction; one category left: chi2 0, dof 0, p 1), "categories" (observed), "bins"
    (tested), "tv" (between the two empirical distributions, unmerged), "tv_noise_95" (the
    95th percentile of the TV between two samples of sizes n_a and n_b drawn from the
    pooled distribution)}.
  """
  a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
  if a.size < 1 or b.size < 1:
    raise ValueError(f"both samples need at least one draw, got {a.size} and {b.size}")
  categories, codes = np.unique(np.concatenate([a, b]), return_inverse=True)
  table = np.stack(
    [np.bincount(codes[: a.size], minlength=categories.size), np.bincount(codes[a.size :], minlength=categories.size)]
  )
  sizes = table.sum(axis=1)
  pooled = table.sum(axis=0)
  smallest_expected = sizes.min() * pooled / sizes.sum()
  keep = smallest_expected >= min_expected
  if not keep.all():
    other = table[:, ~keep].sum(axis=1)
    table = table[:, keep]
    if sizes.min() * other.sum() / sizes.sum() >= min_expected or not keep.any():
      table = np.concatenate([table, other[:, None]], axis=1)
    else:
      rarest = np.argmin(table.sum(axis=0))
      table[:, rarest] += other
  if table.shape[1] < 2:
    chi2, p, dof = 0.0, 1.0, 0
  else:
    chi2, p, dof, _ = stats.chi2_contingency(table, correction=False)
  share_a = np.bincount(codes[: a.size], minlength=categories.size) / a.size
  share_b = np.bincount(codes[a.size :], minlength=categories.size) / b.size
  rng = np.random.default_rng(0) if rng is None else rng
  noise_a = rng.multinomial(a.size, pooled / pooled.sum(), size=NOISE_DRAWS) / a.size
  noise_b = rng.multinomial(b.size, pooled / pooled.sum(), size=NOISE_DRAWS) / b.size
  return {
    "chi2": float(chi2),
    "dof": int(dof),
    "p": float(p),
    "categories": int(categories.size),
    "bins": int(table.shape[1]),
    "tv": total_variation(share_a, share_b),
    "tv_noise_95": _quantile_95(0.5 * np.abs(noise_a - noise_b).sum(axis=1)),
  }


def goodness_of_fit(
  sample: np.ndarray,
  probabilities: np.ndarray,
  *,
  min_expected: float = MIN_EXPECTED,
  rng: np.random.Generator | None = None,
) -> dict[str, Any]:
  """Chi-square test that a sample of tokens follows a known distribution.

  Args:
    sample: int [n] (n >= 1): token ids in [0, vocab).
    probabilities: float [vocab], summing to 1.
    min_expected: tokens whose expected count n * p is below this are merged into "other"
      (which, when still below it, joins the kept token of the smallest expected count).
    rng: for the sampling-noise reference of the TV (default: a fixed seed).

  Returns:
    {"chi2", "dof", "p", "bins", "outside_support" (draws of tokens of probability 0: any
    rejects outright, chi2 inf and p 0), "tv" (between the sample's distribution and
    `probabilities`), "tv_noise_95" (its 95th percentile over samples of size n drawn from
    `probabilities`)}.
  """
  sample = np.asarray(sample).reshape(-1)
  probabilities = np.asarray(probabilities, np.float64)
  if sample.size < 1:
    raise ValueError("the sample needs at least one draw")
  if sample.min() < 0 or sample.max() >= probabilities.size:
    raise ValueError(f"tokens must lie in [0, {probabilities.size}), got {sample.min()} .. {sample.max()}")
  probabilities = probabilities / probabilities.sum()
  observed = np.bincount(sample, minlength=probabilities.size)
  expected = sample.size * probabilities
  outside = int(observed[probabilities == 0].sum())
  keep = expected >= min_expected
  kept_observed, kept_expected = observed[keep], expected[keep]
  other_observed, other_expected = observed[~keep].sum(), expected[~keep].sum()
  if other_expected >= min_expected or (not keep.any() and other_expected > 0):
    kept_observed = np.append(kept_observed, other_observed)
    kept_expected = np.append(kept_expected, other_expected)
  elif other_expected > 0:
    rarest = np.argmin(kept_expected)
    kept_observed[rarest] += other_observed
    kept_expected[rarest] += other_expected
  if outside:
    chi2, p, dof = float("inf"), 0.0, max(kept_observed.size - 1, 0)
  elif kept_observed.size < 2:
    chi2, p, dof = 0.0, 1.0, 0
  else:
    chi2, p = stats.chisquare(kept_observed, kept_expected)
    dof = kept_observed.size - 1
  rng = np.random.default_rng(0) if rng is None else rng
  noise = rng.multinomial(sample.size, probabilities, size=NOISE_DRAWS) / sample.size
  return {
    "chi2": float(chi2),
    "dof": int(dof),
    "p": float(p),
    "bins": int(kept_observed.size),
    "outside_support": outside,
    "tv": total_variation(observed / sample.size, probabilities),
    "tv_noise_95": _quantile_95(0.5 * np.abs(noise - probabilities).sum(axis=1)),
  }


def compare_samplers(
  tested: np.ndarray,
  reference: np.ndarray,
  first_probabilities: np.ndarray,
  *,
  tested_name: str = "speculative",
  reference_name: str = "autoregressive",
  seed: int = 0,
) -> list[dict[str, Any]]:
  """Every test of one prompt's samples.

  Args:
    tested, reference: int [n_tested, new_tokens], int [n_reference, new_tokens]: the two
      samplers' continuations of one prompt.
    first_probabilities: float [vocab], the exact distribution of the first token.
    tested_name, reference_name: how the rows name the samplers.
    seed: for the TV noise references.

  Returns:
    One record per test ({"test", "position", ...`homogeneity_test` or `goodness_of_fit`}):
    the marginal of each position (1-based), the joint of positions 1-2 (from 2 new tokens
    on), and each sampler's first token against `first_probabilities`.
  """
  if tested.ndim != 2 or reference.ndim != 2 or tested.shape[1] != reference.shape[1]:
    raise ValueError(
      f"samples must be int [n, new_tokens] with equal new_tokens, got shapes {tested.shape} and {reference.shape}"
    )
  rng = np.random.default_rng(seed)
  vocab = first_probabilities.size
  rows = []
  for position in range(tested.shape[1]):
    rows.append(
      {
        "test": f"{tested_name} vs {reference_name}",
        "position": str(position + 1),
        **homogeneity_test(tested[:, position], reference[:, position], rng=rng),
      }
    )
  if tested.shape[1] >= 2:
    joint = lambda x: x[:, 0].astype(np.int64) * vocab + x[:, 1]  # one code per (first, second) pair
    rows.append(
      {
        "test": f"{tested_name} vs {reference_name}",
        "position": "1-2 joint",
        **homogeneity_test(joint(tested), joint(reference), rng=rng),
      }
    )
  for name, sample in ((tested_name, tested), (reference_name, reference)):
    rows.append(
      {"test": f"{name} vs exact", "position": "1", **goodness_of_fit(sample[:, 0], first_probabilities, rng=rng)}
    )
  return rows


def lossless_test(
  target_model,
  target_params,
  draft_model,
  draft_params,
  prompt: np.ndarray,
  *,
  samples: int = 4000,
  new_tokens: int = 3,
  tree: Sequence[int] = DEFAULT_TREE,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  batch_size: int = 500,
  control_temperature: float | None = None,
) -> dict[str, Any]:
  """The tests of one prompt: speculative sampling against the target's own sampling.

  Args:
    target_model, target_params, draft_model, draft_params: a target and its LongSpec draft.
    prompt: int [prompt_len] (>= 1 token).
    samples: continuations per sampler (>= 1); new_tokens: their length (>= 1).
    tree, temperature (> 0), top_k, top_p: the sampling (`speculative_generate`).
    seed: the speculative, autoregressive and control draws use independent keys of it.
    batch_size: rows per sampler call.
    control_temperature: when set, as many autoregressive samples at this temperature,
      tested against the ones at `temperature` (a difference the test should find).

  Returns:
    {"tests": `compare_samplers` rows, "control": rows of the control or None,
    "control_first_token_tv" (the exact TV between the first token's distributions at the
    two temperatures, or None),
    "drafted_share" (float [new_tokens]: per tested position, the share of speculative
    samples whose token there was an accepted draft token), "mean_accepted" (tau, tokens
    per row verification) and "rounds" (verifications per sample) of the speculative
    draws, which run one token past new_tokens so that the last tested position's round is
    complete, "first_token_probabilities" (the 20 likeliest tokens: [[token, p], ...])}.
  """
  if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
    raise ValueError(f"samples must be an int >= 1, got {samples!r}")
  if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
    raise ValueError(f"new_tokens must be an int >= 1, got {new_tokens!r}")
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0 (at 0 sampling is greedy: nothing to test), got {temperature}")
  if control_temperature is not None and not control_temperature > 0:
    raise ValueError(f"control_temperature must be > 0, got {control_temperature}")
  validate_sampling(temperature, top_k, top_p)
  prompt = np.asarray(prompt, np.int32).reshape(-1)
  if prompt.size < 1:
    raise ValueError("the prompt needs at least one token")
  keys = jax.random.split(jax.random.key(seed), 3)  # speculative, autoregressive, control
  sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
  draws = dict(samples=samples, new_tokens=new_tokens, batch_size=batch_size)
  # One token more than tested, so that every tested position's round is complete and
  # whether its token was drafted is known (`SpeculativeDraws.drafted_share`).
  speculative = draw_speculative(
    target_model,
    target_params,
    draft_model,
    draft_params,
    prompt,
    rng=keys[0],
    tree=tree,
    samples=samples,
    new_tokens=new_tokens + 1,
    batch_size=batch_size,
    **sampling,
  )
  autoregressive = draw_autoregressive(target_model, target_params, prompt, rng=keys[1], **sampling, **draws)
  exact = first_token_probabilities(target_model, target_params, prompt, **sampling)
  control, control_tv = None, None
  if control_temperature is not None:
    other = draw_autoregressive(
      target_model,
      target_params,
      prompt,
      rng=keys[2],
      temperature=control_temperature,
      top_k=top_k,
      top_p=top_p,
      **draws,
    )
    control = compare_samplers(
      other, autoregressive, exact, tested_name=f"autoregressive T={control_temperature:g}", seed=seed + 1
    )[:-1]  # the last row tests the reference against the exact distribution again
    # How far apart the control and the reference are: the size of difference tested for.
    control_exact = first_token_probabilities(
      target_model, target_params, prompt, temperature=control_temperature, top_k=top_k, top_p=top_p
    )
    control_tv = total_variation(exact, control_exact)
  likeliest = np.argsort(-exact)[:20]
  return {
    "tests": compare_samplers(speculative.tokens[:, :new_tokens], autoregressive, exact, seed=seed),
    "control": control,
    "control_first_token_tv": control_tv,
    "mean_accepted": speculative.mean_accepted,
    "drafted_share": speculative.drafted_share().tolist(),
    "rounds": float(np.count_nonzero(speculative.row_tokens_per_round) / samples),
    "first_token_probabilities": [[int(t), float(exact[t])] for t in likeliest],
  }


def verdict(tests: Sequence[dict[str, Any]], alpha: float) -> dict[str, Any]:
  """Bonferroni over `tests` (records with "p"): {"tests", "alpha", "threshold" (alpha /
  tests), "min_p", "rejected" (whether some p < threshold), "rejected_uncorrected" (how many
  p < alpha)}."""
  ps = [t["p"] for t in tests]
  threshold = alpha / len(ps)
  return {
    "tests": len(ps),
    "alpha": alpha,
    "threshold": threshold,
    "min_p": min(ps),
    "rejected": min(ps) < threshold,
    "rejected_uncorrected": sum(p < alpha for p in ps),
  }


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
  """The tests of every prompt (`lossless_test` results with a "prompt" index) as a markdown table."""
  header = "| prompt | test | position | chi2 | dof | p | TV | TV noise 95% | drafted | tau |"
  lines = [header, "|" + " --- |" * (header.count("|") - 1)]
  for result in results:
    for row in result["tests"] + (result["control"] or []):
      position = row["position"]
      drafted = ""
      if row["test"].startswith("speculative vs autoregressive") and position.isdigit():
        drafted = f"{result['drafted_share'][int(position) - 1]:.3f}"
      tau = f"{result['mean_accepted']:.3f}" if row["test"].startswith("speculative") else ""
      lines.append(
        f"| {result['prompt']} | {row['test']} | {position} | {row['chi2']:.2f} | {row['dof']} | {row['p']:.4g} | "
        f"{row['tv']:.4f} | {row['tv_noise_95']:.4f} | {drafted} | {tau} |"
      )
  return "\n".join(lines)


# --- the command ---------------------------------------------------------------------------------


def _parse(argv: Sequence[str]):
  parser = command_line.ArgumentParser(prog="python -m castle_jax.eval.lossless", description=__doc__)
  parser.add_argument(
    "--target_workdir", required=True, help="the target's training workdir (or Hugging Face directory)"
  )
  parser.add_argument("--draft_workdir", required=True, help="the workdir of a LongSpec draft trained for the target")
  parser.add_argument("--target_step", type=command_line.nonnegative_int, default=None, help="default: the newest good")
  parser.add_argument("--draft_step", type=command_line.nonnegative_int, default=None, help="default: the newest good")
  parser.add_argument("--prompt", default=None, help="prompt text (after a BOS token); default: the validation split")
  parser.add_argument(
    "--prompt_length", type=command_line.positive_int, default=None, help="tokens per split prompt (default 128)"
  )
  parser.add_argument(
    "--prompts", type=command_line.positive_int, default=None, help="prompts from the validation split (default 1)"
  )
  parser.add_argument(
    "--data_dir", default=None, help="TFDS data dir of the split (default: the target's data.data_dir)"
  )
  parser.add_argument("--samples", type=command_line.positive_int, default=4000, help="continuations per sampler")
  parser.add_argument("--new_tokens", type=command_line.positive_int, default=3, help="tokens per continuation")
  parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
  parser.add_argument("--top_k", type=command_line.nonnegative_int, default=0, help="0: off")
  parser.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1] (1: off)")
  parser.add_argument(
    "--tree",
    type=command_line.positive_int_list,
    default=list(DEFAULT_TREE),
    help="draft nodes per level (a chain: 1,1,1,1)",
  )
  parser.add_argument("--seed", type=command_line.nonnegative_int, default=0, help="sampling seed")
  parser.add_argument("--batch_size", type=command_line.positive_int, default=500, help="rows per sampler call")
  parser.add_argument("--alpha", type=float, default=0.05, help="significance level, Bonferroni-corrected")
  parser.add_argument(
    "--control_temperature",
    type=float,
    default=None,
    help="also test autoregressive samples at this temperature (a difference the test must find)",
  )
  parser.add_argument(
    "--output",
    default=None,
    help="a directory (lossless_step<N>.json, then -2, ...) or a new .json file; default <draft_workdir>/eval/",
  )
  args = parser.parse_args(argv)
  cli.require(args.temperature > 0, "--temperature", "> 0 (0 is greedy sampling: nothing to test)", args.temperature)
  cli.require(0 < args.top_p <= 1, "--top_p", "in (0, 1] (1 turns nucleus sampling off)", args.top_p)
  cli.require(0 < args.alpha < 1, "--alpha", "in (0, 1)", args.alpha)
  if args.control_temperature is not None:
    cli.require(args.control_temperature > 0, "--control_temperature", "> 0", args.control_temperature)
    cli.require(
      args.control_temperature != args.temperature,
      "--control_temperature",
      f"another temperature than --temperature={args.temperature:g}",
      args.control_temperature,
    )
  try:
    TreeShape(tuple(args.tree))
  except ValueError as e:
    cli.fail(f"--tree: {e}")
  if args.prompt is not None:
    if args.prompts is not None or args.prompt_length is not None:
      cli.fail("--prompt takes the place of --prompts/--prompt_length (prompts of the validation split): pass one")
    if not args.prompt:
      cli.fail("--prompt is empty: pass some text, or leave it out for prompts of the validation split")
  else:
    args.prompts = 1 if args.prompts is None else args.prompts
    args.prompt_length = 128 if args.prompt_length is None else args.prompt_length
  if args.output and args.output.endswith(".json"):
    outputs.refuse_existing(f"--output={args.output}", args.output)
  for flag in ("target_workdir", "draft_workdir"):
    path = getattr(args, flag)
    if not os.path.isdir(path):
      cli.fail(f"--{flag}={path}: no such directory")
  return args


def _prompts(args, target, config) -> list[np.ndarray]:
  tokenizer = target.tokenizer
  if args.prompt is not None:
    return [np.concatenate([[tokenizer.bos_id], tokenizer.encode(args.prompt)]).astype(np.int32)]
  needed = args.prompt_length * args.prompts
  stream = cli.validation_tokens(config, tokenizer, needed, args.data_dir)
  if stream.size < needed:
    cli.fail(
      f"the validation split has {stream.size} tokens, fewer than --prompts={args.prompts} x "
      f"--prompt_length={args.prompt_length}: ask for fewer or shorter prompts"
    )
  return [stream[i * args.prompt_length : (i + 1) * args.prompt_length] for i in range(args.prompts)]


def _main(argv: Sequence[str]) -> None:
  args = _parse(argv)
  try:
    target = load_trained_model(args.target_workdir, args.target_step)
    config = read_config(args.target_workdir)
    draft = load_draft(args.draft_workdir, target, step=args.draft_step)
  except (FileNotFoundError, ValueError, CheckpointError) as e:
    cli.fail(str(e))
  prompts = _prompts(args, target, config)
  start = time.perf_counter()
  results = []
  for index, prompt in enumerate(prompts):
    try:
      result = lossless_test(
        target.model,
        target.params,
        draft.model,
        draft.params,
        prompt,
        samples=args.samples,
        new_tokens=args.new_tokens,
        tree=tuple(args.tree),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed + index,
        batch_size=args.batch_size,
        control_temperature=args.control_temperature,
      )
    except ValueError as e:  # a tree too deep for the draft's window, a draft for another target, ...
      cli.fail(str(e))
    results.append({"prompt": index, "prompt_tokens": prompt.tolist(), **result})
  seconds = time.perf_counter() - start
  overall = verdict([row for result in results for row in result["tests"]], args.alpha)
  controls = [row for result in results for row in result["control"] or []]
  print(markdown_table(results))
  print()
  print(
    f"{overall['tests']} tests over {len(prompts)} prompt(s), {args.samples} samples per sampler, tau "
    f"{np.mean([r['mean_accepted'] for r in results]):.3f}: smallest p {overall['min_p']:.4g} against "
    f"{args.alpha:g}/{overall['tests']} = {overall['threshold']:.4g}: "
    + ("REJECTED: the samplers differ" if overall["rejected"] else "not rejected (consistent with lossless sampling)")
  )
  if controls:
    control = verdict(controls, args.alpha)
    distance = ", ".join(f"{r['control_first_token_tv']:.4f}" for r in results)
    print(
      f"control (autoregressive at T={args.control_temperature:g}, exact first-token TV {distance} from "
      f"T={args.temperature:g}): smallest p {control['min_p']:.4g}: "
      + ("rejected, as it must be" if control["rejected"] else "NOT rejected: the test lacks power at this --samples")
    )
  record = {
    "eval": "lossless",
    "target_workdir": os.path.abspath(args.target_workdir),
    "target_step": target.step,
    "draft_workdir": os.path.abspath(args.draft_workdir),
    "draft_step": draft.step,
    "settings": {
      name: getattr(args, name)
      for name in (
        "prompt",
        "prompt_length",
        "prompts",
        "samples",
        "new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "tree",
        "seed",
        "batch_size",
        "alpha",
        "control_temperature",
      )
    },
    "verdict": overall,
    "control_verdict": verdict(controls, args.alpha) if controls else None,
    "results": results,
    "seconds": seconds,
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }
  stem = outputs.publish(
    lambda path: cli.write_json(path, record),
    cli.output_stem(args.output, os.path.join(args.draft_workdir, "eval"), "lossless", draft.step),
    ".json",
  )
  print(f"wrote {stem}.json")


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m castle_jax.eval.lossless ...` (argv without the program name); 0, or 1 after one ERROR line."""
  return cli.run_main(_main, argv)


if __name__ == "__main__":
  sys.exit(main())
