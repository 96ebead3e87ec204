"""benchmarks.gradient_agreement: a trained model's weight gradients per attention
implementation against the float32 XLA path, and its bad-input errors."""

import json

import numpy as np
import pytest

from benchmarks import gradient_agreement


def test_each_implementation_is_compared_with_the_float32_reference(finished_tiny_run, tmp_path, capsys):
  output = str(tmp_path / "agreement.json")
  workdir = finished_tiny_run.config.workdir
  gradient_agreement.main(
    [f"--workdir={workdir}", "--implementations=reference,xla", "--batch=1", "--dtype=bfloat16", f"--output={output}"]
  )
  record = json.load(open(output))
  assert record["step"] == 8 and record["reference"]["dtype"] == "float32"
  for name in ("reference", "xla"):
    errors = record["implementations"][name]["errors"]
    assert "block_0.attention.query" in errors and "embed.embedding" in errors
    # bf16 against float32: small, but not zero (the comparison sees the dtype).
    assert 1e-5 < np.median(list(errors.values())) < 5e-2, errors
  assert "reference: float32 on xla" in capsys.readouterr().out


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--implementations=mosaic"], "--implementations must be implementations of attention 'mha'"),
    (["--batch=0"], "--batch must be at least 1"),
    (["--batch=100000"], "--batch must be at most"),
  ],
)
def test_bad_input_is_one_line(finished_tiny_run, flags, message, capsys):
  status = gradient_agreement.cli.run_main(
    gradient_agreement.main, [f"--workdir={finished_tiny_run.config.workdir}", *flags]
  )
  assert status == 1
  assert message in capsys.readouterr().err
