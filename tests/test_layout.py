"""The package's layout: every module imports cleanly, and no import cycle.

Imports are read from the source (module level and inside functions), so a
cycle hidden behind a function-level import is found too.
"""

import ast
import pathlib

import replicate

PACKAGE = pathlib.Path(replicate.__file__).parent


def _modules():
  """{dotted name: path} of every module of the package."""
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    found[".".join(parts)] = path
  return found


def _imports(path, modules):
  """The package's modules that `path` imports, anywhere in it."""
  imported = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      # `from package import module` imports the module; `from module
      # import name` the module.
      names = [node.module + "." + alias.name for alias in node.names]
      if not any(name in modules for name in names):
        names = [node.module]
    else:
      continue
    imported.update(name for name in names if name in modules)
  return imported


def import_graph():
  """{module: the package's modules it imports}, leaving out its own
  packages (importing a module always imports those first)."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    ancestors = {".".join(name.split(".")[:end])
                 for end in range(1, name.count(".") + 1)}
    graph[name] = _imports(path, modules) - {name} - ancestors
  return graph


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
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [
      "a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) == []
