"""mkdocs hook: the docs link to files outside docs/ (ARCHITECTURE.md, benchmarks/RESULTS.md,
examples/...) as a reader of the repository sees them, `../benchmarks/RESULTS.md`. Such a link
would leave the site, so the file (and, for a Markdown file, what it links to in turn) is added
to the site under `repo/`, and the link rewritten to it. A link to a file that does not exist
fails the build, as a broken link inside docs/ does under `mkdocs build --strict`."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "repo/"
# [text](target) and ![alt](target); a target with a scheme or an anchor only is left alone
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)(#[^)\s]*)?\)")


def _repo_path(page_dir: str, target: str) -> str | None:
    """The repository path ``target`` names from a file in ``page_dir`` (repository-relative),
    or None when it is an address, an absolute path or stays inside docs/."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None
    path = posixpath.normpath(posixpath.join(page_dir, target))
    if path.startswith("../"):
        raise PluginError(f"a link leaves the repository: {target!r} from {page_dir}/")
    return None if path == "docs" or path.startswith("docs/") else path


def _linked(source: Path) -> list[tuple[str, str]]:
    """(target, repository path) of each link in ``source`` that leaves docs/."""
    page_dir = posixpath.dirname(source.relative_to(ROOT).as_posix())
    text = source.read_text()
    out = []
    for match in LINK.finditer(text):
        path = _repo_path(page_dir, match[2])
        if path is not None:
            out.append((match[2], path))
    return out


def on_files(files, config):
    todo = [Path(f.abs_src_path) for f in files.documentation_pages()]
    added: set[str] = set()
    while todo:
        source = todo.pop()
        for target, path in _linked(source):
            if path in added:
                continue
            if not (ROOT / path).is_file():
                raise PluginError(f"{source.relative_to(ROOT)} links to {target!r}: there is no file {path}")
            added.add(path)
            file = File.generated(config, PREFIX + path, abs_src_path=str(ROOT / path))
            file.inclusion = InclusionLevel.NOT_IN_NAV  # reached by its links, not from the nav
            files.append(file)
            if path.endswith(".md"):
                todo.append(ROOT / path)
    return files


def on_page_markdown(markdown, page, config, files):
    source = Path(page.file.abs_src_path)
    in_repo = page.file.src_uri.startswith(PREFIX)
    page_dir = posixpath.dirname(source.relative_to(ROOT).as_posix())

    def rewrite(match: re.Match) -> str:
        path = _repo_path(page_dir, match[2])
        if path is None or in_repo:  # a repository file's own links already resolve under repo/
            return match[0]
        site_dir = posixpath.dirname(page.file.src_uri)
        target = posixpath.relpath(PREFIX + path, site_dir or ".")
        return f"{match[1]}{target}{match[3] or ''})"

    return LINK.sub(rewrite, markdown)
