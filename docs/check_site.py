"""A built site's search finds each option's reference: ``python docs/check_site.py SITE_DIR`` (CI, after
``mkdocs build --strict``). Every option name must be found on the options page and in the API reference."""

from __future__ import annotations

import json
import pathlib
import sys


def main(site: str) -> None:
    from grpo_kernels.option_docs import option_names

    docs = json.loads((pathlib.Path(site) / "search" / "search_index.json").read_text())["docs"]
    text_of: dict = {}
    for doc in docs:
        page = doc["location"].split("#")[0]
        text_of[page] = text_of.get(page, "") + " " + doc["title"] + " " + doc["text"]
    missing = [
        (option, page)
        for option in option_names()
        for page in ("options/", "api/")
        if option not in text_of.get(page, "")
    ]
    if missing:
        raise SystemExit(f"the site's search does not find these options on these pages: {missing}")
    print(f"the site's search finds all {len(option_names())} options on the options page and in the API reference")


if __name__ == "__main__":
    main(sys.argv[1])
