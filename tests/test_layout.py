"""The package's layout: floors, no import cycle; TensorFlow's private parts
in _tf.py.

Imports are read from the source (module level and inside functions), so a
cycle hidden behind a function-level import is found too.
"""

import ast
import pathlib
import re

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


# The floors, lowest first: a module may import its own floor's and the
# floors below, never one above. The bottom holds what every step uses (the
# call's bookkeeping, the strategy Protocol); the top runs the steps.
FLOORS = (
    # TensorFlow's private parts, walks, what op types mean (graph/).
    ("_tf", "graph_walk", "_identity", "graph"),
    ("call",),  # one call's context, layout, progress, devices, names
    ("shard",),  # step 1: the batch split, the rule of rows
    ("communication",),  # all-reduce, collectives
    ("cluster",),  # TF_CONFIG clusters, the launcher's processes
    ("gradients",),  # steps 3-4: weighting, combining, applying once
    ("variables",),  # where variables live, what a tower sees
    ("batch_norm",),  # sync_batch_norm
    ("towers",),  # step 2: building the model_fn once per tower
    ("state",),  # step 5: other state changes
    ("outputs",),  # step 6: the EstimatorSpec
    ("model_fn", "arguments", "canned", "launch", "check",
     ""),  # the wrapping, the API, the check against one device
)


def _floor_of(module):
  """The floor of `module` (a dotted name), from its first part below
  `replicate` ("" for the package itself)."""
  part = (module.split(".") + [""])[1]
  for level, names in enumerate(FLOORS):
    if part in names:
      return level
  raise AssertionError(
      "{} is on no floor: add its sub-package to FLOORS".format(module))


def sub_package_graph(graph):
  """{floor name: the other floor names its modules import}."""
  found = {}
  for module, imported in graph.items():
    part = (module.split(".") + [""])[1]
    found.setdefault(part, set()).update(
        (other.split(".") + [""])[1] for other in imported)
    found[part].discard(part)
  return found


def test_no_sub_package_imports_one_above_it():
  upward = sorted(
      (module, other) for module, imported in import_graph().items()
      for other in imported if _floor_of(other) > _floor_of(module))
  assert upward == []


def test_no_cycle_between_sub_packages():
  assert find_cycle(sub_package_graph(import_graph())) == []


def test_the_floors_hold_every_sub_package():
  parts = {(name.split(".") + [""])[1] for name in _modules()}
  assert parts == {name for names in FLOORS for name in names}


# Modules are kept under ~300 lines, one concern each; these are over it
# (`_tf.py` is the one room for TensorFlow's private parts). Any other over
# MAX_LINES fails; one brought under it leaves the list.
MAX_LINES = 300
LONG_MODULES = frozenset([
    "replicate._tf", "replicate.launch", "replicate.state.train_op",
    "replicate.state.rule", "replicate.gradients.weighting",
    "replicate.gradients.apply_once", "replicate.communication.allreduce",
    "replicate.outputs.batch_inputs", "replicate.shard.batch_reductions",
    "replicate.towers.all_rows",
])


def test_no_module_but_the_long_ones_is_over_the_line_count():
  counts = {name: len(path.read_text().splitlines())
            for name, path in _modules().items()}
  assert LONG_MODULES <= set(counts)
  assert sorted(name for name, lines in counts.items()
                if lines > MAX_LINES and name not in LONG_MODULES) == []


def test_the_cycle_finder_finds_a_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [
      "a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) == []


# What reaching into TensorFlow looks like in a source: its private modules,
# Keras's, and the pylint switch for a private attribute.
_PRIVATE_TF = re.compile(r"tensorflow\.python|keras\.src|protected-access")
# The public API of namedtuples, spelled with an underscore.
_NAMEDTUPLE_API = frozenset(["_replace", "_asdict", "_fields", "_make"])
# Public names of the standard library that start with an underscore.
_STDLIB_API = frozenset(["_exit"])  # os._exit


def _private_names_defined(trees):
  """Every single-underscore name the package defines itself (functions,
  classes, attributes it assigns)."""
  names = set()
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        names.add(node.name)
      elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        names.add(node.attr)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        names.add(node.id)
  return {name for name in names if name.startswith("_")}


def _private_reads(tree):
  """(line, name) of each `x._name` (x not self or cls) and each
  getattr/hasattr/setattr of a "_name" in `tree`, dunders left out."""
  found = []
  for node in ast.walk(tree):
    name = None
    if isinstance(node, ast.Attribute) and not (
        isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
      name = node.attr
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id in ("getattr", "hasattr", "setattr") and
          len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and
          isinstance(node.args[1].value, str)):
      name = node.args[1].value
    if name and name.startswith("_") and not name.startswith("__"):
      found.append((node.lineno, name))
  return found


def test_tensorflow_private_parts_are_reached_from_tf_py_only():
  sources = {name: path.read_text() for name, path in _modules().items()}
  reaching = sorted(name for name, text in sources.items()
                    if _PRIVATE_TF.search(text))
  assert reaching == ["replicate._tf"]
  trees = {name: ast.parse(text) for name, text in sources.items()}
  own = (_private_names_defined(trees.values()) | _NAMEDTUPLE_API |
         _STDLIB_API)
  foreign = {name: [(line, attr) for line, attr in _private_reads(tree)
                    if attr not in own]
             for name, tree in trees.items() if name != "replicate._tf"}
  assert {name: reads for name, reads in foreign.items() if reads} == {}


def test_the_private_read_finder_finds_them():
  tree = ast.parse("op._update_input(0, x)\nself._mine = 1\n"
                   "getattr(head, '_weight_column', None)\nx.__class__\n")
  assert sorted(_private_reads(tree)) == [(1, "_update_input"),
                                  (3, "_weight_column")]
  assert _private_names_defined([tree]) == {"_mine"}
