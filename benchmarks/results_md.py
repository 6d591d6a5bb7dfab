"""benchmarks/RESULTS.md: its sections and their figures, and the plots.

A recorded section ends with its run's figures in an HTML comment
(`read_data`), so that it and its plot can be redrawn without running
anything; `publish_section` writes a section and draws its plot beside
the file; `two_panels` starts every two-panel plot the same way.
"""

import json
import os
import re

def read_data(text, prefix):
  """The figures a recorded section holds, or None (`prefix`: the CTR
  section's, for its own)."""
  start = text.find(prefix)
  if start < 0:
    return None
  end = text.index(" -->", start)
  return json.loads(text[start + len(prefix):end])


def kept_section(text, heading):
  """The `## Across workers` section of `text` (to its end or the next
  `## ` heading), or "" if it has none; `heading`: another section's."""
  start = section_start(text, heading)
  if start < 0:
    return ""
  following = re.search(r"^## ", text[start + len(heading):], re.MULTILINE)
  end = len(text) if not following else (start + len(heading) +
                                         following.start())
  return text[start:end]


def replace_section(text, new, heading):
  """`text` with its `## Across workers` section (or `heading`'s) replaced
  by `new` (or `new` appended, after a blank line)."""
  old = kept_section(text, heading)
  if old:  # keeping the blank line before a section that follows
    return text.replace(old, new.rstrip("\n") + (
        "\n\n" if old.endswith("\n\n") else "\n"), 1)
  return text.rstrip("\n") + "\n\n" + new.rstrip("\n") + "\n"


def section_start(text, heading):
  match = re.search(r"^" + re.escape(heading) + r"\s*$", text, re.MULTILINE)
  return match.start() if match else -1


def read(path):
  try:
    with open(path) as f:
      return f.read()
  except FileNotFoundError:
    return ""


def publish_section(path, text, heading, plot_suffix, draw_plot, what):
  """Writes `text` as `heading`'s section of `path`, and its plot beside
  it (`<stem><plot_suffix>`, by `draw_plot(plot_path)`: False without
  matplotlib); says which, naming the section `what`."""
  whole = read(path)
  with open(path, "w") as f:
    f.write(replace_section(whole, text, heading))
  plot_path = os.path.splitext(path)[0] + plot_suffix
  if draw_plot(plot_path):
    print("Wrote {} of {} and {}.".format(what, path, plot_path))
  else:
    print("Wrote {} of {}; no plot (matplotlib is not installed).".format(
        what, path))


def two_panels(path, title, fill):
  """Draws a 13 x 5.2 inch figure of two panels into `path`: `fill(left,
  right)` draws them, `title` above. False without matplotlib (the plot is
  then left out)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
  figure, (left, right) = pyplot.subplots(1, 2, figsize=(13, 5.2),
                                          layout="constrained")
  fill(left, right)
  figure.suptitle(title, fontsize=11)
  figure.savefig(path, dpi=100)
  pyplot.close(figure)
  return True
