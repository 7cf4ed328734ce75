"""MkDocs hooks, registered under `hooks:` in mkdocs.yml."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
REPO_LINK = "](../../benchmarks/results/"  # how docs/results/*.md link a curve (renders on GitHub)
SITE_LINK = "](img/"  # where the site serves it: results/img/<name>.png

# The curves live in benchmarks/results/, where the benchmark scripts write them, and MkDocs
# serves only docs/. Rather than commit a second copy of each PNG (or symlinks, which not
# every checkout keeps), the build adds them as generated files under results/img/, where
# strict link checks find them, and points the results pages' links there.


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/img/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("results/"):
        markdown = markdown.replace(REPO_LINK, SITE_LINK)
    return markdown
