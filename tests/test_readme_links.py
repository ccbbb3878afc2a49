"""The README's links stay inside the repository and resolve (files and heading anchors); the
other Markdown files' relative links resolve too."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKDOWN = sorted([README, ROOT / "benchmarks" / "README.md", ROOT / "notebooks" / "README.md",
                   *(ROOT / "docs").glob("*.md")])


def _prose(text: str) -> str:
  """``text`` without fenced code blocks and code spans (their brackets are not links)."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
  """The targets of the Markdown links and images in ``text``, and its ``<...>`` autolinks.

  >>> links("[a](docs/x.md#y) ![b](img.png) `[c](code.md)` <https://example.org>")
  ['docs/x.md#y', 'img.png', 'https://example.org']
  """
  prose = _prose(text)
  found = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)
  return found + re.findall(r"<([a-z][a-z0-9+.-]*:[^>\s]+)>", prose)


def anchor(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.

  >>> anchor("Presets and micro-batches")
  'presets-and-micro-batches'
  >>> anchor("The library in `four` snippets!")
  'the-library-in-four-snippets'
  """
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
  headings = re.findall(r"^#+\s+(.*)$", re.sub(r"^```.*?^```", "", path.read_text(),
                                                 flags=re.S | re.M), re.M)
  return {anchor(h) for h in headings}


def broken_links(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
  """Relative links of ``path`` whose file (or heading anchor) does not exist in ``root``."""
  broken = []
  for target in links(path.read_text()):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # a URL: checked for the README only
      continue
    file, _, fragment = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    if root not in resolved.parents:
      broken.append(f"{target} (outside the repository)")
    elif not resolved.exists():
      broken.append(f"{target} (no such file)")
    elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
      broken.append(f"{target} (no heading #{fragment} in {resolved.relative_to(root)})")
  return broken


def test_readme_links_only_to_files_in_the_repository():
  targets = links(README.read_text())
  assert len(targets) >= 10, targets  # the parser still finds the README's links
  outside = [t for t in targets if re.match(r"[a-z][a-z0-9+.-]*:|/|\.\./", t)]
  assert outside == [], f"README.md links outside the repository: {outside}"
  assert not re.search(r"https?://", _prose(README.read_text())), "a bare URL in README.md"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
  assert broken_links(path) == []


def test_broken_links_are_found(tmp_path):
  (tmp_path / "a.md").write_text("# Title\n\n## Part two\n")
  doc = tmp_path / "doc.md"
  doc.write_text("[ok](a.md#part-two) [file](missing.md) [heading](a.md#nope) [up](../x.md) "
                 "`[code](skipped.md)`\n```\n[block](skipped.md)\n```\n")
  assert broken_links(doc, tmp_path) == ["missing.md (no such file)",
                               "a.md#nope (no heading #nope in a.md)",
                               "../x.md (outside the repository)"]
