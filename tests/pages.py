"""Commands read out of the docs pages, so that the tests run them as the pages write them."""

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def page_line(page: str, startswith: str) -> str:
    """The page's command line that starts with `startswith`, without its comment."""
    for line in (DOCS / page).read_text().splitlines():
        if line.strip().startswith(startswith):
            return line.split("  #")[0].strip()
    raise AssertionError(f"docs/{page} has no line starting with {startswith!r}")


def code_blocks(path: Path) -> list[str]:
    """The Markdown file's indented code blocks, each as the text a user pastes."""
    blocks = path.read_text().split("\n\n")
    return ["\n".join(line[4:] for line in b.splitlines()) for b in blocks if b.startswith("    ")]


def page_block(page: str, containing: str) -> str:
    """The page's indented code block holding `containing`, as a shell script."""
    return next(b for b in code_blocks(DOCS / page) if containing in b)
