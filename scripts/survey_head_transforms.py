"""What every causal-LM class of the installed transformers does around its output layer: a survey of the source.

For each class in transformers' causal-LM and image-text-to-text auto mappings, its ``forward`` is read (Python's
``ast``, no model built) for the statements that touch the hidden states between the backbone and the head, and
the logits between the head and the loss: a soft-cap, a scale, a mask, a slice. Those are what a fused lm_head
must apply (``grpo_kernels.heads.head_transform`` reads the ones it can; the probe refuses the rest). Prints a
Markdown table, one row per class that does something, and a count of those that do nothing:

    python scripts/survey_head_transforms.py            # the table in the README
    python scripts/survey_head_transforms.py --all      # every class, the plain ones too
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re

import transformers
from transformers.models.auto import modeling_auto

HEAD_CALL = re.compile(r"self\.(lm_head|output_layer|embed_out|get_output_embeddings\(\))\(")
# a statement that reads the backbone's output or keeps its last positions (nothing done to the values)
PLAIN_HIDDEN = re.compile(
    r"^hidden_states = (\w+(\.last_hidden_state|\[0\])?( if return_dict else \w+\[0\])?"
    r"|slice_logits_to_keep\(.*\))$"
)
# the head applied, or applied and cast to another dtype (nothing to apply: the fused kernels compute in fp32)
PLAIN_HEAD = re.compile(
    r"^(lm_)?logits = self\.(lm_head|embed_out)\((hidden_states|last_hidden_state)"
    r"(\.to\(self\.lm_head\.weight\.dtype\))?\)(\.float\(\))?$"
)
CASTS = re.compile(r"^logits = logits\.(float\(\)|to\(torch\.float32\))$")


def causal_lm_classes() -> dict[str, str]:
    """{class name: model type} of the causal-LM and image-text-to-text auto mappings."""
    names = {}
    for mapping in (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    ):
        for model_type, classes in mapping.items():
            for name in classes if isinstance(classes, (list, tuple)) else (classes,):
                names.setdefault(name, model_type)
    return names


def _statements(source: str) -> list[str]:
    return [" ".join(line.split("#")[0].split()) for line in source.splitlines()]


def around_the_head(forward_source: str) -> tuple[str | None, list[str], list[str]]:
    """(the head's call, statements on the hidden states just before it, statements on the logits after it)."""
    lines = [s for s in _statements(forward_source) if s]
    calls = [i for i, s in enumerate(lines) if HEAD_CALL.search(s)]
    if not calls:
        return None, [], []
    i = calls[0]
    before = []
    for s in reversed(lines[:i]):
        if not s.startswith("hidden_states"):
            break
        if not PLAIN_HIDDEN.match(s):
            before.insert(0, s)
    after = []
    for s in lines[i + 1 :]:
        if s.startswith(("loss", "if labels", "return", "aux_loss", "if not return_dict", "output")):
            break
        if not CASTS.match(s):
            after.append(s)
    return lines[i], before, after


def survey() -> list[dict[str, object]]:
    wanted = causal_lm_classes()
    root = pathlib.Path(transformers.__file__).parent / "models"
    rows = []
    for path in sorted(root.glob("*/modeling_*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if not isinstance(node, ast.ClassDef) or node.name not in wanted:
                continue
            forward = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
            if forward is None:
                continue
            call, before, after = around_the_head(ast.get_source_segment(source, forward))
            rows.append(
                {
                    "class": node.name,
                    "model_type": wanted[node.name],
                    "head_call": call,
                    "before": before,
                    "after": after,
                }
            )
    return rows


def does_something(row) -> bool:
    call = row["head_call"]
    return call is None or bool(row["before"] or row["after"]) or not PLAIN_HEAD.match(call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="list every class, the plain ones too")
    args = parser.parse_args()
    rows = survey()
    shown = rows if args.all else [r for r in rows if does_something(r)]
    print(
        f"transformers {transformers.__version__}: {len(rows)} causal-LM classes, "
        f"{len(rows) - len([r for r in rows if does_something(r)])} apply the head and nothing else\n"
    )
    print("| class | what its forward does around the head |")
    print("|---|---|")
    for r in sorted(shown, key=lambda r: r["class"].lower()):
        if r["head_call"] is None:
            what = "no `self.lm_head(...)` call (another head layout)"
        else:
            what = "; ".join(f"`{s}`" for s in r["before"] + [r["head_call"]] + r["after"])
        print(f"| {r['class']} | {what.replace('|', '/')} |")


if __name__ == "__main__":
    main()
