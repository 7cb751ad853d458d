"""README's relative links resolve: the front page sends readers into docs/, and a page renamed or moved there
would otherwise leave a dead link that nothing builds (mkdocs --strict checks the links between the pages of
docs/, not README's)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# [text](target) and [text](target "title"), outside code spans and blocks
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def relative_links(markdown: str) -> list[str]:
    prose = CODE_SPAN.sub("", FENCE.sub("", markdown))
    targets = [m.group(1) for m in LINK.finditer(prose)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_link_finder_reads_markdown_as_written():
    text = ('See [the install](docs/install.md#gpu) and [site](https://example.org), [top](#top), '
            '[titled](docs/views.md "Views").\n```\n[in a block](docs/nowhere.md)\n```\n`[in a span](docs/x.md)`')
    assert relative_links(text) == ["docs/install.md#gpu", "docs/views.md"]


def test_readme_links_point_at_files_that_exist():
    links = relative_links((REPO / "README.md").read_text())
    into_docs = [link for link in links if link.startswith("docs/")]
    assert into_docs, "README links to no page of docs/"
    missing = [link for link in links if not (REPO / link.split("#", 1)[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    # a page of the docs that is not in mkdocs.yml's nav would not be reachable on the built site
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {link.split("#", 1)[0].removeprefix("docs/") for link in into_docs}
    unlisted = sorted(page for page in pages if page.endswith(".md") and page not in nav)
    assert not unlisted, f"README links to pages that mkdocs.yml's nav leaves out: {unlisted}"
