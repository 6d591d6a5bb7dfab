"""Every code block of the README and docs/ runs.

- `python` blocks run, in the order they appear, as one program per file
  (a fresh process, in an empty working directory, on 2 virtual CPU devices
  where a block asks for them);
- but a `python` block whose first line is `# train.py: ...` is a cluster's
  program: the file's first `python` block (its imports and definitions)
  and that block run as `train.py` under the launcher, as a user runs it
  (`python -m replicate.launch --workers 2 -- python train.py`), and the
  launcher must exit 0 with every line the block's text says the chief
  prints;
- `sh` blocks are commands: `make X` must be a target (`make -n X`), and
  `python -m module ...` / `python path.py ...` must answer `--help`;
- `json` blocks parse;
- `text` blocks are output or layouts, not code.
A block in any other language, or none, fails the test: say what it is.
"""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [REPOSITORY / "README.md"] + sorted(
    (REPOSITORY / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
_LANGUAGES = {"python", "sh", "json", "text"}


def blocks(path):
  """[(language, code)] of `path`'s fenced code blocks, in order."""
  return [(match.group(1).strip(), match.group(2))
          for match in _BLOCK.finditer(path.read_text())]


def _ids(paths):
  return [str(path.relative_to(REPOSITORY)) for path in paths]


@pytest.mark.parametrize("path", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_every_block_says_what_it_is(path):
  assert [language for language, _ in blocks(path)
          if language not in _LANGUAGES] == []


@pytest.mark.parametrize(
    "path", [p for p in DOCUMENTS if any(
        language == "python" for language, _ in blocks(p))],
    ids=_ids([p for p in DOCUMENTS if any(
        language == "python" for language, _ in blocks(p))]))
def test_python_blocks_run(path, tmp_path):
  program = "\n\n".join(code for language, code in blocks(path)
                        if language == "python" and not _is_cluster(code))
  done = subprocess.run(
      [sys.executable, "-c", program], cwd=tmp_path, capture_output=True,
      text=True, timeout=900, env=_ENV)
  assert done.returncode == 0, done.stderr[-3000:]


_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3",
            PYTHONPATH=str(REPOSITORY))
_CLUSTER_MARK = "# train.py: "


def _is_cluster(code):
  return code.startswith(_CLUSTER_MARK)


def _clusters():
  """[(path, definitions, program)]: each cluster block and its file's first."""
  found = []
  for path in DOCUMENTS:
    python = [code for language, code in blocks(path) if language == "python"]
    found += [(path, python[0], code) for code in python if _is_cluster(code)]
  return found


def test_the_readme_has_a_cluster_program():
  assert [path.name for path, _, _ in _clusters()].count("README.md") == 1


@pytest.mark.parametrize("path, definitions, program", _clusters(),
                         ids=_ids([path for path, _, _ in _clusters()]))
def test_cluster_programs_run_under_the_launcher(path, definitions, program,
                                                 tmp_path):
  (tmp_path / "train.py").write_text(definitions + "\n\n" + program)
  done = subprocess.run(
      [sys.executable, "-m", "replicate.launch", "--workers", "2", "--",
       sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
      text=True, timeout=300, env=_ENV)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  lines = done.stdout.splitlines()
  # What the text after the block says the chief prints, as `... prints `X``.
  text = " ".join(path.read_text().split(program, 1)[1].split())
  promised = re.findall(r"the chief prints `([^`]+)`", text)
  assert promised
  for line in promised:
    assert "[chief:0] " + line in lines, (line, lines[-20:])
  # One shared model_dir: only the chief's checkpoints, at the last step.
  [model_dir] = [folder for folder in tmp_path.iterdir() if folder.is_dir()]
  assert (model_dir / "checkpoint").is_file()


def _commands():
  found = []
  for path in DOCUMENTS:
    for language, code in blocks(path):
      if language != "sh":
        continue
      for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
          found.append((str(path.relative_to(REPOSITORY)), line))
  return found


@pytest.mark.parametrize("where, command", _commands(),
                         ids=[c for _, c in _commands()])
def test_commands_exist(where, command):
  words = shlex.split(command)
  while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
    words = words[1:]  # VARIABLE=value prefixes
  if words[0] == "make":
    checks = [["make", "-n"] + words[1:]]
  elif words[0].startswith("python"):
    checks = []
    while words:  # the launcher's command follows "--": checked too
      inner = words.index("--") if "--" in words else len(words)
      arguments = words[1:inner]
      target = arguments[:2] if arguments[0] == "-m" else arguments[:1]
      checks.append([sys.executable] + target + ["--help"])
      words = words[inner + 1:]
  else:
    raise AssertionError("{}: no check for {!r}".format(where, command))
  for check in checks:
    done = subprocess.run(check, cwd=REPOSITORY, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                                   PYTHONPATH=str(REPOSITORY)))
    assert done.returncode == 0, (where, check, done.stderr[-2000:])


@pytest.mark.parametrize("path", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_json_blocks_parse(path):
  for language, code in blocks(path):
    if language == "json":
      json.loads(code)


# The README is a guide: reference goes to docs/.
README_MAX_LINES = 250


def test_the_readme_stays_a_guide():
  assert len((REPOSITORY / "README.md").read_text().splitlines()) <= (
      README_MAX_LINES)


def test_testing_md_counts_the_oracle_as_its_harness_does(monkeypatch):
  monkeypatch.syspath_prepend(str(REPOSITORY / "tests" / "oracle"))
  import oracle_harness  # pylint: disable=import-outside-toplevel
  text = " ".join((REPOSITORY / "docs" / "testing.md").read_text().split())
  full = "{:,}".format(len(oracle_harness.cells(full=True)))
  assert "a zoo of {} `model_fn`s".format(len(oracle_harness.ZOO)) in text
  assert ": {} cells".format(full) in text
  assert "{} of the {} cells".format(len(oracle_harness.ci_cells()),
                                     full) in text
  assert "sample of the cross, {} cells".format(
      len(oracle_harness.cells(full=False))) in text


# Times are quoted once, in docs/testing.md, as the one recorded run; the
# README and the Makefile point there instead of quoting their own.
_TIME = re.compile(r"\b\d+(\.\d+)?\s*(minutes?|min)\b|~\s*\d+\s*min")


def test_times_are_quoted_in_testing_md_alone():
  for path in (REPOSITORY / "README.md", REPOSITORY / "Makefile"):
    assert _TIME.findall(path.read_text()) == [], path.name


def test_the_demo_prints_the_readme_summary(tmp_path):
  """`make demo`'s run: the summary's lines as the README shows them (the
  seeded figures exactly), its folders outside the checkout."""
  readme = (REPOSITORY / "README.md").read_text()
  sample = readme.split("```text\nSummary\n", 1)[1].split("```", 1)[0]
  before = sorted(path for path in (REPOSITORY / "examples").rglob("*")
                  if "__pycache__" not in path.parts)
  done = subprocess.run(
      [sys.executable, "examples/digits_demo.py", "--towers", "2"],
      cwd=REPOSITORY, capture_output=True, text=True, timeout=900,
      env=dict(_ENV, TMPDIR=str(tmp_path)))
  assert done.returncode == 0, done.stderr[-3000:]
  summary = done.stdout.split("\nSummary\n", 1)[1]
  labels = [line[:21] for line in sample.splitlines()]
  assert [line[:21] for line in summary.splitlines()] == labels
  for label in ("test accuracy", "test loss", "predicted classes", "towers"):
    [line] = [line for line in sample.splitlines() if label in line[:21]]
    assert line in summary.splitlines()
  [model_dir] = [line[21:] for line in summary.splitlines()
                 if line.startswith("  model_dir")]
  assert pathlib.Path(model_dir).parent == tmp_path
  assert sorted(path for path in (REPOSITORY / "examples").rglob("*")
                if "__pycache__" not in path.parts) == before
