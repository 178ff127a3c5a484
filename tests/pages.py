"""Commands read out of the docs pages, so that the tests run them as the pages write them."""

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def page_line(page: str, startswith: str) -> str:
    """The page's command line that starts with `startswith`, without its comment."""
    for line in (DOCS / page).read_text().splitlines():
        if line.strip().startswith(startswith):
            return line.split("  #")[0].strip()
    raise AssertionError(f"docs/{page} has no line starting with {startswith!r}")


def page_block(page: str, containing: str) -> str:
    """The page's indented code block holding `containing`, as a shell script."""
    blocks = (DOCS / page).read_text().split("\n\n")
    block = next(b for b in blocks if containing in b and b.startswith("    "))
    return "\n".join(line[4:] for line in block.splitlines())
