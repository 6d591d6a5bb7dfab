"""Every code block of the README and docs/ runs.

- `python` blocks run, in the order they appear, as one program per file
  (a fresh process, in an empty working directory, on 2 virtual CPU devices
  where a block asks for them);
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
                        if language == "python")
  done = subprocess.run(
      [sys.executable, "-c", program], cwd=tmp_path, capture_output=True,
      text=True, timeout=900,
      env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=str(REPOSITORY)))
  assert done.returncode == 0, done.stderr[-3000:]


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
