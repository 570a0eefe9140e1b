"""MkDocs hooks: the pages whose one source lives outside docs/ (the README, the trainer integrations' guide, the
benchmarks' page, the changelog) and the command line's reference (from its argparse parser) are generated into the
build, never copied into docs/; links between those sources are rewritten to the site's pages. The options page's
tables come from ``grpo_kernels.option_docs`` (where docs/options.md says ``<!-- options_table -->``)."""

from __future__ import annotations

import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a source outside docs/ -> its page on the site
GENERATED = {
    "README.md": "index.md",
    "grpo_kernels/integration/README.md": "trainers.md",
    "benchmarks/README.md": "benchmarks.md",
    "CHANGELOG.md": "changelog.md",
}
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _site_links(text: str, source: str) -> str:
    """Markdown links of a generated page's source, relative to the repository, as links between the site's pages."""
    base = (ROOT / source).parent

    def rewrite(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        if "://" in target:
            return match.group(0)
        relative = (base / target).resolve().relative_to(ROOT).as_posix()
        if relative in GENERATED:
            return f"]({GENERATED[relative]}{anchor})"
        if relative.startswith("docs/"):
            return f"]({relative[len('docs/') :]}{anchor})"
        return match.group(0)

    return LINK.sub(rewrite, text)


def cli_reference() -> str:
    """Every subcommand's ``--help``, as the parser prints it."""
    from grpo_kernels.training.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    parts = [
        "# Command line\n",
        "`grpo-kernels` (also `python -m grpo_kernels`): each subcommand's `--help`, generated from its parser.\n",
    ]
    for name, command in sub.choices.items():
        parts.append(f"## `grpo-kernels {name}`\n\n```text\n{command.format_help()}```\n")
    return "\n".join(parts)


def on_files(files, config):
    for source, page in GENERATED.items():
        text = _site_links((ROOT / source).read_text(), source)
        files.append(File.generated(config, page, content=text))
    files.append(File.generated(config, "cli.md", content=cli_reference()))
    return files


OPTIONS_MARKER = "<!-- options_table -->"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "options.md":
        from grpo_kernels.option_docs import options_table

        if OPTIONS_MARKER not in markdown:
            raise ValueError(f"docs/options.md must hold {OPTIONS_MARKER} (where the options' tables go)")
        return markdown.replace(OPTIONS_MARKER, options_table())
    return markdown
