"""Every command ends a bad argument in one line `ERROR: ...` naming the argument, the bad
value and the fix, with exit status 1; `--traceback` shows the full traceback instead.

The cases run as the user runs them, a command line each: `python -m train`,
`train.generate`, the evaluation commands, `colabs/execute.py` and every benchmark's CLI,
each in its own process forked, two at a time, from one that has imported the large
third-party packages (tests/forked_commands.py) rather than a fresh interpreter that
would import them again. `--traceback` cases run as plain subprocesses.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

import forked_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable

# A config file with a misspelled key (the config is locked by tiny.get_config()).
MISSPELLED_CONFIG = """from configs import tiny


def get_config():
  c = tiny.get_config()
  c.train.stpes = 3
  return c
"""


def _command(args: tuple[str, ...], paths: dict[str, str]) -> list[str]:
  return [PYTHON, *(a.format(**paths) for a in args)]


def _run(command: list[str]) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)


def _run_all(cases, paths) -> list[str]:
  """Runs every (args, expected text) case, each in a process forked from one that has
  imported the third-party packages they share (tests/forked_commands.py); returns what
  went wrong."""
  commands = [_command(args, paths)[1:] for args, _ in cases]
  results, import_stderr = forked_commands.run(commands, ROOT, dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  # What importing those packages printed, which every command would print too.
  assert not import_stderr.strip(), import_stderr[-3000:]
  problems = []
  for (args, expected), done in zip(cases, results):
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    expected = expected.format(**paths)
    ok = (
      done.returncode == 1
      and len(lines) == 1
      and lines[0].startswith("ERROR: ")
      and expected in lines[0]
      and not done.stdout.strip()
    )
    if not ok:
      problems.append(
        f"{' '.join(args)}: exit {done.returncode}, expected one line with {expected!r}; "
        f"stderr:\n{done.stderr[-1500:]}\nstdout:\n{done.stdout[-500:]}"
      )
  return problems


@pytest.fixture()
def paths(tmp_path):
  (tmp_path / "a_file").write_text("not a directory\n")
  (tmp_path / "misspelled.py").write_text(MISSPELLED_CONFIG)
  (tmp_path / "broken.py").write_text("def get_config(:\n")
  (tmp_path / "earlier").mkdir()
  (tmp_path / "earlier" / "results.json").write_text("{}")
  (tmp_path / "curve.csv").write_text("")
  (tmp_path / "odd").mkdir()
  (tmp_path / "odd" / "config.json").write_text('{"hidden_size": 8}')
  # Hugging Face model directories: one without weights, one of an unsupported model_type.
  llama2 = os.path.join(ROOT, "tests", "fixtures", "hf", "llama2")
  for name in ("hf_no_weights", "hf_mistral"):
    (tmp_path / name).mkdir()
    for file in ("config.json", "tokenizer.json"):
      shutil.copyfile(os.path.join(llama2, file), tmp_path / name / file)
  config = json.loads((tmp_path / "hf_mistral" / "config.json").read_text())
  config.update(model_type="mistral", architectures=["MistralForCausalLM"])
  (tmp_path / "hf_mistral" / "config.json").write_text(json.dumps(config))
  return {
    "odd": str(tmp_path / "odd"),
    "hf_no_weights": str(tmp_path / "hf_no_weights"),
    "hf_mistral": str(tmp_path / "hf_mistral"),
    "hf": os.path.join(ROOT, "tests", "fixtures", "hf", "llama3"),
    "earlier": str(tmp_path / "earlier"),
    "tmp": str(tmp_path),
    "file": str(tmp_path / "a_file"),
    "misspelled": str(tmp_path / "misspelled.py"),
    "broken": str(tmp_path / "broken.py"),
    "nowhere": str(tmp_path / "nowhere"),
  }


TRAIN = ("-m", "train")
TINY = ("-m", "train", "--config=configs/tiny.py", "--workdir={tmp}/run")
TRAIN_CASES = [
  (TRAIN, "--config is required: pass --config=FILE"),
  ((*TRAIN, "--workdir={tmp}/run"), "--config is required"),
  ((*TRAIN, "--config=configs/tinyy.py", "--workdir={tmp}/run"), "did you mean --config=configs/tiny.py?"),
  ((*TRAIN, "--config=configs/tiny.py", "--workdir={file}"), "--workdir={file} is a file; pass a directory"),
  ((*TRAIN, "--config=configs/tiny.py", "--workdir={file}/run"), "cannot be created: {file} is a file"),
  ((*TRAIN, "--config=configs/tiny.py"), "--workdir is required: pass --workdir=DIR"),
  ((*TINY, "--config.train.stepz=5"), "--config.train.stepz=5: section 'train' has no key 'stepz'; did you mean"),
  ((*TINY, "--config.trian.steps=5"), "--config.trian.steps=5: the config has no key 'trian'; did you mean"),
  ((*TINY, "--config.train.steps=abc"), "--config.train.steps='abc': invalid literal for int()"),
  (
    (*TRAIN, "--config={misspelled}", "--workdir={tmp}/run"),
    "--config={misspelled}: {misspelled}, line 6 (`c.train.stpes = 3`): unknown config key 'stpes'; did you mean 'steps'?",
  ),
  ((*TRAIN, "--config={broken}", "--workdir={tmp}/run"), "{broken}, line 1: SyntaxError"),
  ((*TINY, "--bogus"), "unknown flag --bogus"),
  ((*TINY, "--num_processes=0"), "--num_processes=0: 0 is not a positive integer"),
  ((*TINY, "extra"), "unexpected argument(s) 'extra'"),
  ((*TINY, "--config.train.log_every=0"), "train.log_every must be >= 1, got 0"),
  ((*TINY, "--seeds=4"), "--seeds=4: the number of seeds is a config key: pass --config.train.seeds=4"),
  ((*TINY, "--config.train.seeds=0"), "train.seeds must be an integer >= 1 (or None: one run in the workdir), got 0"),
  (
    (
      *TRAIN,
      "--config=configs/longspec_draft_tiny.py",
      "--workdir={tmp}/draft",
      "--config.model.family_kwargs.target_workdir={nowhere}",
    ),
    "{nowhere}/config.json not found: model.family_kwargs.target_workdir must be a training workdir",
  ),
  (
    (
      *TRAIN,
      "--config=configs/longspec_draft_tiny.py",
      "--workdir={tmp}/draft",
      "--config.model.family_kwargs.target_workdir={hf_mistral}",
    ),
    "model_type 'mistral' with architectures ['MistralForCausalLM'] is not supported",
  ),
  (
    (*TINY, "--config.train.init_from={hf}"),
    "train.init_from={hf} is a Hugging Face model with another model config (",
  ),
  (
    (*TRAIN, "--config=configs/hf_finetune.py", "--workdir={tmp}/run"),
    "ValueError: no model directory: pass it after the file's name, --config=configs/hf_finetune.py:path/to/model_dir",
  ),
  (
    (*TRAIN, "--config=configs/hf_finetune.py:{hf}", "--workdir={tmp}/run", "--config.data.tokenizer=byte"),
    "data.tokenizer byte differs from the tokenizer of train.init_from={hf} ({hf}); pass --config.data.tokenizer={hf}",
  ),
  (
    (*TRAIN, "--config=configs/drt_tiny.py", "--workdir={nowhere}", "--config.model.family_kwargs.retriever=random"),
    "model.family_kwargs holds only the keys its config file sets",
  ),
]

GENERATE = ("-m", "train.generate", "--workdir={nowhere}")
EVAL_AND_NOTEBOOK_CASES = [
  (("-m", "train.generate"), "--workdir is required"),
  ((*GENERATE, "--max_new_tokens=0"), "--max_new_tokens=0: 0 is not a positive integer"),
  ((*GENERATE, "--temperature=-1"), "--temperature=-1: -1.0 is not a non-negative number"),
  ((*GENERATE, "--top_p=2"), "--top_p=2.0: must be in (0, 1]"),
  ((*GENERATE, "--tree=4,x"), "--tree=4,x: must list positive integers"),
  (
    GENERATE,
    "{nowhere}/config.json not found: --workdir must be a training workdir (written by `python -m train`: "
    "config.json, checkpoints/) or a Hugging Face model directory (config.json with a model_type",
  ),
  (
    ("-m", "train.generate", "--workdir={odd}"),
    "{odd}/config.json has neither a training run's model section nor a Hugging Face model_type",
  ),
  (
    ("-m", "train.generate", "--workdir={hf}", "--step=1"),
    "--step=1: {hf} is a Hugging Face model directory, whose weights have no checkpoint steps; leave --step out",
  ),
  (
    ("-m", "train.generate", "--workdir={hf_no_weights}"),
    "no weights in {hf_no_weights}: expected model.safetensors, or model.safetensors.index.json and its shards",
  ),
  (
    ("-m", "train.generate", "--workdir={hf_mistral}"),
    "model_type 'mistral' with architectures ['MistralForCausalLM'] is not supported; supported: llama",
  ),
  (("-m", "train.generate", "--workdir={hf}", "--draft_workdir={hf}"), "holds a 'transformer' model, not a"),
  (("-m", "castle_jax.eval.perplexity", "--workdir={hf}", "--step=1"), "--step=1: {hf} is a Hugging Face model"),
  (("-m", "castle_jax.eval.passkey"), "one of the arguments --workdir --pretrained is required"),
  (("-m", "castle_jax.eval.passkey", "--workdir={nowhere}", "--examples=0"), "--examples must be an integer >= 1"),
  (("-m", "castle_jax.eval.perplexity", "--workdir={nowhere}", "--lengths=2k"), "--lengths='2k' must be"),
  (("-m", "castle_jax.eval.perplexity", "--workdir={nowhere}"), "{nowhere}/config.json not found"),
  (("-m", "castle_jax.eval.compare", "{nowhere}"), "{nowhere}: no such directory"),
  (
    ("-m", "castle_jax.eval.lossless", "--target_workdir={nowhere}", "--draft_workdir={nowhere}"),
    "--target_workdir={nowhere}: no such directory",
  ),
  (("-m", "castle_jax.eval.compare", "{tmp}", "--at_tokens=0"), "--at_tokens: '0' must be an integer >= 1"),
  (("colabs/execute.py", "colabs/nope.ipynb"), "'colabs/nope.ipynb': no such file"),
  (("colabs/execute.py", "README.md"), "'README.md' is not a notebook (.ipynb)"),
  (("colabs/execute.py", "--timeout=0"), "argument --timeout: '0' must be an integer >= 1"),
  (("colabs/execute.py", "--in_place", "--output_dir={tmp}"), "--output_dir: not allowed with argument --in_place"),
  (
    ("-m", "castle_jax.models.export_pretrained", "--workdir={nowhere}", "--name=x"),
    "--workdir='{nowhere}' is not a directory",
  ),
  (("-m", "castle_jax.data.train_tokenizer"), "--output is required"),
  (("-m", "castle_jax.data.train_tokenizer", "--output={file}"), "--output={file}: exists: pass a new file name"),
  (("-m", "castle_jax.data.train_tokenizer", "--output={nowhere}", "--vocab_size=0"), "--vocab_size=0: 0 is not"),
]

BENCHMARK_CASES = [
  (("-m", f"benchmarks.{name}", *args), expected)
  for name, args, expected in [
    ("castle_attention", ["--seq_lens=2k"], "--seq_lens: '2k' is not a comma-separated list of integers"),
    ("castle_decode", ["--dtype=fp8"], "--dtype: invalid choice: 'fp8'"),
    ("drt_decoding", ["--lengths="], "--lengths: '' lists no integer"),
    ("gca_attention", ["--kernel_configs=mosaic:bogus=1"], "--kernel_configs: 'mosaic:bogus=1' is not"),
    ("castle_attention", ["--impls=pallas"], "--impls: unknown 'pallas'; choose from reference, xla, triton, mosaic"),
    ("icl_curve", [], "--workdirs is required"),
    ("longspec", ["--target_workdir={nowhere}", "--draft={nowhere}"], "{nowhere}/config.json not found"),
    ("longspec_speed", ["--taus=3.28,0.5"], "--taus: [0.5] below 1: a round emits at least one token"),
    ("longspec_speed", ["--smoke", "--tensor=64"], "--tensor=64 must divide the"),
    ("multi_gpu", ["--parts=everything"], "--parts: unknown 'everything'"),
    ("power_attention", ["--impls=flash"], "--impls: unknown 'flash'"),
    ("power_decode", ["--bogus=1"], "unrecognized arguments: --bogus=1"),
    ("power_decode", ["--json={file}"], "argument --json: '{file}' exists (results of an earlier run are never"),
    ("multi_gpu", ["--out={earlier}"], "--out={earlier}: {earlier}/results.json exists"),
    ("icl_curve", ["--workdirs={nowhere}", "--output={tmp}/curve"], "--output={tmp}/curve: {tmp}/curve.csv exists"),
    ("train_throughput", ["--config=configs/tiny.py", "--json={file}"], "--json={file}: exists"),
    ("train_loop", ["--config=configs/tiny.py", "--steps=0"], "--steps=0: 0 is not a positive integer"),
    ("train_throughput", ["--config=configs/tinyy.py"], "did you mean --config=configs/tiny.py?"),
    ("tree_attention", ["--heads=6", "--kv_heads=4"], "--heads=6 must be a multiple of --kv_heads=4"),
    ("gradient_agreement", ["--workdir={nowhere}"], "{nowhere}"),
  ]
]


@pytest.mark.parametrize(
  "cases",
  [
    pytest.param(TRAIN_CASES, id="train"),
    pytest.param(EVAL_AND_NOTEBOOK_CASES, id="generate-eval-notebooks"),
    pytest.param(BENCHMARK_CASES, id="benchmarks"),
  ],
)
def test_every_bad_argument_is_one_error_line(cases, paths):
  problems = _run_all(cases, paths)
  assert not problems, "\n\n".join(problems)


def test_every_benchmark_command_is_in_the_table():
  commands = {
    name[: -len(".py")]
    for name in os.listdir(os.path.join(ROOT, "benchmarks"))
    if name.endswith(".py") and "__main__" in open(os.path.join(ROOT, "benchmarks", name)).read()
  }
  assert commands == {args[1].split(".", 1)[1] for args, _ in BENCHMARK_CASES}


@pytest.mark.parametrize(
  "args, last_line",
  [
    (TRAIN, "castle_jax.command_line.UsageError: --config is required"),
    (("-m", "castle_jax.eval.perplexity", "--workdir={nowhere}"), "castle_jax.eval.cli.EvalError: {nowhere}"),
    (("-m", "benchmarks.power_decode", "--iters=0"), "castle_jax.command_line.UsageError: argument --iters"),
  ],
)
def test_traceback_shows_the_whole_trace(args, last_line, paths):
  done = _run(_command((*args, "--traceback"), paths))
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 1 and lines[0] == "Traceback (most recent call last):", done.stderr[-2000:]
  assert lines[-1].startswith(last_line.format(**paths)), done.stderr[-2000:]
