"""benchmarks/ kept as the library is (tests/test_layout.py): no import
cycle, modules under ~300 lines but the named ones, and every command's
`--help` answered before TensorFlow is imported.

Imports are read from the sources (module level and inside functions), so
a cycle behind a function-level import is found too.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent


def _modules():
  """{module name: path} of benchmarks/'s modules, tests left out."""
  return {path.stem: path for path in sorted(BENCHMARKS.glob("*.py"))
          if not path.stem.startswith("test_")}


def _imports(path, names):
  """The benchmarks modules `path` imports, anywhere in it (`from
  benchmarks import x`, `import benchmarks.x`, or, in a script run from
  benchmarks/, `import x`)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "benchmarks":
        found.update(alias.name for alias in node.names)
      elif node.module.startswith("benchmarks."):
        found.add(node.module.split(".")[1])
    elif isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split(".")
        found.add(parts[1] if parts[0] == "benchmarks" and len(parts) > 1
                  else parts[0])
  return found & set(names)


def import_graph():
  """{module: the benchmarks modules it imports}."""
  modules = _modules()
  return {name: _imports(path, modules) - {name}
          for name, path in modules.items()}


def find_cycle(graph):
  """One import cycle as a list of modules (first repeated last), or []."""
  state = {}

  def visit(name, trail):
    state[name] = "open"
    for other in sorted(graph[name]):
      if state.get(other) == "open":
        return trail[trail.index(other):] + [other]
      if other not in state:
        cycle = visit(other, trail + [other])
        if cycle:
          return cycle
    state[name] = "done"
    return []

  for name in sorted(graph):
    if name not in state:
      cycle = visit(name, [name])
      if cycle:
        return cycle
  return []


def test_no_module_imports_itself_back():
  assert find_cycle(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) == []


# Modules are kept under ~300 lines, one concern each; these are over it,
# each for its reason. Any other over MAX_LINES fails, and so does one
# listed here that is no longer over it.
MAX_LINES = 300
LONG_MODULES = {
    # The cost model of a synchronous step: one formula, its docstring the
    # model's statement, and the shapes of the models it is applied to.
    "step_cost_model": "one model with its derivation",
    # The plots of `python -m benchmarks`: two figures of the grid.
    "plot": "the grid's two figures",
}


def test_the_long_modules_are_exactly_those_over_the_line_count():
  counts = {name: len(path.read_text().splitlines())
            for name, path in _modules().items()}
  assert sorted(name for name, lines in counts.items()
                if lines > MAX_LINES) == sorted(LONG_MODULES)


# Every command of benchmarks/ and examples/, as the docs give them.
COMMANDS = [
    ["-m", "benchmarks"], ["-m", "benchmarks.across_workers"],
    ["-m", "benchmarks.allreduce_cost"], ["-m", "benchmarks.cluster"],
    ["-m", "benchmarks.ctr_cost"], ["-m", "benchmarks.plot"],
    ["-m", "benchmarks.profile"], ["-m", "benchmarks.readme"],
    ["-m", "benchmarks.split_cost"], ["-m", "benchmarks.step_trace"],
    ["-m", "benchmarks.touched_gradients_timing"], ["-m", "benchmarks.build_time"],
    ["benchmarks/across_workers_job.py"], ["examples/digits_demo.py"],
    ["examples/cluster_demo.py"], ["-m", "replicate.launch"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=[c[-1] for c in COMMANDS])
def test_help_answers_before_tensorflow_is_imported(command):
  """`--help` parses the command line first: it imports no TensorFlow
  (which takes seconds), as `-X importtime` shows."""
  done = subprocess.run(
      [sys.executable, "-X", "importtime"] + command + ["--help"],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=str(ROOT)))
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.startswith("usage: "), done.stdout[:200]
  imported = [line.rsplit("|", 1)[-1].strip()
              for line in done.stderr.splitlines()
              if line.startswith("import time:")]
  assert [name for name in imported
          if name.split(".")[0] in ("tensorflow", "keras")] == []


def test_every_command_of_the_docs_is_listed():
  """A command a doc gives (`python -m benchmarks...`, `python
  benchmarks/...`, `python examples/...`) is in COMMANDS."""
  listed = {" ".join(command) for command in COMMANDS}
  documents = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + (
      sorted(BENCHMARKS.glob("*.md")))
  missing = set()
  for path in documents:
    for word in path.read_text().split("python ")[1:]:
      parts = word.split()
      command = " ".join(parts[:2]) if parts[:1] == ["-m"] else (
          parts[0] if parts else "")
      command = command.rstrip(".,;:)`'\"")
      if command.startswith(("-m benchmarks", "benchmarks/", "examples/")) \
          and command not in listed:
        missing.add((path.name, command))
  assert sorted(missing) == []


def test_the_command_lines_name_the_models_there_are():
  """configs.MODEL_NAMES (read before TensorFlow is imported) are
  models.MODELS's names, and the hand ring's arguments its configuration's."""
  from benchmarks import configs, hand_ring, models  # pylint: disable=import-outside-toplevel
  assert configs.MODEL_NAMES == tuple(models.MODELS)
  assert set(configs.DEFAULT_MODELS) <= set(configs.MODEL_NAMES)
  assert hand_ring.ARGUMENTS == {"variable_strategy": "replicated",
                                 "all_reduce": "gather"}
