"""The examples: command lines (help with defaults, bad values refused) and
the cluster demo's output (progress, no deprecation notices) with ps tasks
and without (a synchronous cluster, trained in lockstep).

examples/ is not a package: a script finds its neighbours by its own folder
on sys.path (cluster_demo.py imports digits_demo), so the tests put it there.
"""

import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 120


@pytest.fixture
def examples(monkeypatch):
  """{name: module} of the two example scripts, imported as modules."""
  monkeypatch.syspath_prepend(str(EXAMPLES))
  return {name: importlib.import_module(name)
          for name in ("digits_demo", "cluster_demo")}


@pytest.mark.parametrize("name, argv, flag, received", [
    ("digits_demo", ["--towers", "two"], "--towers", "'two'"),
    ("digits_demo", ["--towers", "0"], "--towers", "'0'"),
    ("digits_demo", ["--steps", "1.5"], "--steps", "'1.5'"),
    ("digits_demo", ["--batch-size", "-128"], "--batch-size", "'-128'"),
    ("cluster_demo", ["--model-dir", "m", "--steps", "-5"], "--steps",
     "'-5'"),
    ("cluster_demo", ["--model-dir", "m", "--batch-size", "x"],
     "--batch-size", "'x'"),
])
def test_a_bad_value_is_a_usage_error_naming_its_flag(examples, name, argv,
                                                       flag, received,
                                                       capsys):
  with pytest.raises(SystemExit) as exit_info:
    examples[name].make_parser().parse_args(argv)
  assert exit_info.value.code == 2
  error = capsys.readouterr().err
  assert error.startswith("usage: ")
  assert ("error: argument {}: must be a whole number of at least 1; "
          "received {}".format(flag, received)) in error


@pytest.mark.parametrize("name, expected", [
    ("digits_demo", ["--towers N towers on a machine without GPUs: this many "
                     "virtual CPU devices (default: 2)",
                     "--steps N training steps (default: 600)",
                     "--batch-size ROWS global batch size, split across "
                     "towers (default: 128)",
                     "--model-dir DIR where checkpoints and the SavedModel "
                     "go (default: a new temporary folder, named in the "
                     "summary)"]),
    ("cluster_demo", ["--model-dir DIR shared by every task: checkpoints go "
                      "here (required)",
                      "--steps N global steps to train (default: 3000)",
                      "--batch-size ROWS each worker's batch (default: 128)",
                      "--progress-every STEPS global steps between the "
                      "chief's progress lines (default: 500)"]),
])
def test_every_flag_has_help_that_gives_its_default(examples, name,
                                                     expected):
  parser = examples[name].make_parser()
  options = [action for action in parser._actions  # pylint: disable=protected-access
             if action.dest != "help"]
  assert len(options) == len(expected)
  assert all(action.help for action in options)
  text = " ".join(parser.format_help().split())
  for line in expected:
    assert line in text


def test_the_cluster_demo_script_refuses_negative_steps_before_training(
    tmp_path):
  # As run by hand: the script, not the module, and no model dir made.
  result = subprocess.run(
      [sys.executable, str(EXAMPLES / "cluster_demo.py"), "--model-dir",
       str(tmp_path / "model"), "--steps", "-5"], capture_output=True,
      text=True, timeout=TIMEOUT, cwd=tmp_path)
  assert result.returncode == 2
  assert result.stderr.splitlines()[-1] == (
      "cluster_demo.py: error: argument --steps: must be a whole number of "
      "at least 1; received '-5'")
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "model").exists()


def test_the_cluster_demo_prints_progress_and_no_deprecation_notices(
    tmp_path):
  # The chief alone with one ps task: the smallest cluster, a few seconds.
  lines = _launched_demo(tmp_path, ["--ps", "1", "--workers", "1"], 200, 50)

  assert lines[0].startswith("[launch] Starting 1 chief and 1 ps on ")
  chief = [line[len("[chief:0] "):] for line in lines
           if line.startswith("[chief:0] ")]
  assert chief[0] == (
      "Training 200 global steps of 128 rows on 1 worker (the chief "
      "included) and 1 ps task; checkpoints in {}".format(tmp_path / "model"))
  progress = [line for line in chief if line.startswith("global step")]
  assert len(progress) >= 2
  for line in progress:
    assert re.fullmatch(r"global step +\d+/200  loss [0-9.e-]+ +[0-9,]+ "
                        r"examples/sec \(\d+ global steps/sec\)", line), line
  assert re.fullmatch(r"test accuracy 0\.\d{4} at global step 20\d",
                      chief[-1])
  # Everything else: the JSON rate line and the launcher's two lines.
  assert len(lines) == len(chief) + 2
  assert not [line for line in lines
              if "deprecat" in line.lower() or "WARNING" in line]


def test_the_cluster_demo_trains_a_synchronous_cluster_without_ps(tmp_path):
  # The launcher's default: the chief and 1 worker, no ps, 2 towers each.
  lines = _launched_demo(tmp_path, ["--workers", "2"], 50, 20)

  assert lines[0].startswith("[launch] Starting 1 chief and 1 worker on ")
  # The worker may still print after the chief has exited: not lines[-1].
  assert ("[launch] chief:0 exited with code 0; waiting up to 30.0 s for the "
          "workers and evaluator.") in lines
  assert not [line for line in lines if "cannot go on" in line]
  task_lines = {task: [line[len(task) + 3:] for line in lines
                       if line.startswith("[{}] ".format(task))]
                for task in ("chief:0", "worker:0")}
  chief, worker = task_lines["chief:0"], task_lines["worker:0"]
  assert chief[0] == (
      "Training 50 global steps of 128 rows on 2 workers (the chief "
      "included), synchronously: 256 rows a step, 2 towers a worker; "
      "checkpoints in {}".format(tmp_path / "model"))
  progress = [line for line in chief if line.startswith("global step")]
  assert [line.split()[2] for line in progress] == ["20/50", "40/50"]
  for line in progress:
    assert re.fullmatch(r"global step \d+/50  loss [0-9.e-]+ +[0-9,]+ "
                        r"examples/sec \(\d+ global steps/sec\)", line), line
  # In lockstep: each task ran every one of the 50 global steps, one each.
  records = [json.loads(line) for line in chief + worker
             if line.startswith("{")]
  assert [(r["task"], r["steps"], r["last_global_step"])
          for r in records] == [("chief:0", 50, 50), ("worker:0", 50, 50)]
  assert len(worker) == 1  # its JSON line: nothing else to say
  match = re.fullmatch(r"test accuracy (0\.\d{4}) at global step 50",
                       chief[-1])
  assert match and float(match.group(1)) > 0.8, chief[-1]
  # Everything else: the launcher's two lines.
  assert len([line for line in lines if line.startswith("[launch] ")]) == 2
  assert [line for line in lines if not line.startswith(
      ("[launch] ", "[chief:0] ", "[worker:0] "))] == []
  assert not [line for line in lines
              if "deprecat" in line.lower() or "WARNING" in line]


def test_the_cluster_demo_run_again_on_its_model_dir_says_it_is_done(
    tmp_path):
  # The chief alone with one ps task, twice into the same model dir.
  first = _launched_demo(tmp_path, ["--ps", "1", "--workers", "1"], 20, 10)
  again = _launched_demo(tmp_path, ["--ps", "1", "--workers", "1"], 20, 10)

  def records(lines):
    return [json.loads(line[len("[chief:0] "):],
                       parse_constant=_no_constant)
            for line in lines if line.startswith("[chief:0] {")]

  [record] = records(first)
  assert (record["steps"], record["last_global_step"]) == (20, 20)
  assert record["global_steps_per_second"] > 0
  chief = [line[len("[chief:0] "):] for line in again
           if line.startswith("[chief:0] ")]
  assert chief[0] == (
      "Nothing to train: the checkpoint in {} is at global step 20 "
      "already, and --steps is 20. Evaluating it; to train again, give a "
      "new --model-dir or more --steps.".format(tmp_path / "model"))
  assert records(again) == [{"task": "chief:0", "steps": 0,
                             "last_global_step": 20,
                             "global_steps_per_second": None}]
  assert re.fullmatch(r"test accuracy 0\.\d{4} at global step 20",
                      chief[-1])


def _no_constant(name):
  raise AssertionError("not JSON: {}".format(name))


def _launched_demo(tmp_path, launcher_args, steps, every):
  """The cluster demo's output lines under the launcher; it must exit 0."""
  result = subprocess.run(
      [sys.executable, "-m", "replicate.launch"] + launcher_args + [
          "--", sys.executable, str(EXAMPLES / "cluster_demo.py"),
          "--model-dir", str(tmp_path / "model"), "--steps", str(steps),
          "--progress-every", str(every)],
      capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": str(EXAMPLES.parent)})
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result.stdout.splitlines()
