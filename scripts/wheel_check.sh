#!/usr/bin/env bash
# The package as a user installs it: build the sdist and the wheel (python -m build), install the wheel
# (not editable) into a fresh virtual environment with the CPU build of torch, and run there, outside
# the checkout: the README's example, `grpo-kernels --help`, the no-triton import, and a look inside the
# wheel for what a user needs (tuned.json, the integration guide). Run by .ci/run before the tests, beside the docs
# build and the device suite's smoke mode.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
quietly() { "$@" > "$WORK/step.log" 2>&1 || { cat "$WORK/step.log"; return 1; }; }  # the output on failure only

# the build runs in .venv (set up by scripts/setup.sh), into a fresh folder
source .venv/bin/activate
python -c "import build" 2>/dev/null || quietly python -m pip install build
quietly python -m build --outdir "$WORK/dist" "$ROOT"
WHEEL="$(ls "$WORK"/dist/*.whl)"
ls "$WORK"/dist/*.tar.gz > /dev/null
python - "$WHEEL" <<'EOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
wanted = ["grpo_kernels/kernels/tuned.json", "grpo_kernels/integration/README.md", "grpo_kernels/py.typed"]
missing = [n for n in wanted if n not in names]
assert not missing, f"the wheel lacks {missing}"
assert not any(n.startswith(("tests/", "benchmarks/")) for n in names), "the wheel ships tests or benchmarks"
print(f"wheel: {sys.argv[1].rsplit('/', 1)[-1]}, {len(names)} files")
EOF
deactivate

python3 -m venv "$WORK/env"
source "$WORK/env/bin/activate"
quietly python -m pip install --upgrade pip
quietly python -m pip install torch==2.13.0   # the CPU build first, as the README's install section says
quietly python -m pip install "$WHEEL"
cd "$WORK"  # away from the checkout: only the installed package can be imported
python - "$ROOT/README.md" <<'EOF'
import re, sys
import grpo_kernels
assert "site-packages" in grpo_kernels.__file__, f"imported from {grpo_kernels.__file__}, not the installed wheel"
readme = open(sys.argv[1]).read()
example = re.search(r"## From logits\n\n```python\n(.*?)```", readme, re.S).group(1)
exec(compile(example, "README example", "exec"), {})
from importlib.metadata import version
assert version("grpo-kernels") == grpo_kernels.__version__, (version("grpo-kernels"), grpo_kernels.__version__)
print(f"README example ran with the installed grpo-kernels {grpo_kernels.__version__}")
EOF
grpo-kernels --help > /dev/null
# the loss alone installs no trainer packages: the package and a loss call import neither tqdm nor matplotlib, and
# the trainer's commands name the extra to install
python - <<'EOF'
import importlib.metadata, sys
import torch  # (torch.hub imports tqdm where it is installed, as transformers' dependency installs it)
for name in ("tqdm", "tqdm.auto", "matplotlib", "matplotlib.figure"):
    sys.modules[name] = None  # from here on, an import of either raises
from grpo_kernels import GRPOLoss, token_logprobs
logits = torch.randn(2, 3, 11, requires_grad=True)
GRPOLoss()(logits, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.tensor([1.0, -1.0])).loss.backward()
token_logprobs(logits.detach(), torch.zeros(2, 3, dtype=torch.long))
try:
    importlib.metadata.distribution("matplotlib")
    raise AssertionError("matplotlib installed without the train extra")
except importlib.metadata.PackageNotFoundError:
    pass
print("without the train extra: the loss runs, importing neither tqdm nor matplotlib (matplotlib not installed)")
EOF
if grpo-kernels train --steps 1 > "$WORK/no_extra.log" 2>&1; then
  echo "grpo-kernels train ran without the train extra"; exit 1
fi
grep -q 'pip install "grpo-kernels\[train\]"' "$WORK/no_extra.log" || { cat "$WORK/no_extra.log"; exit 1; }
echo "without the train extra: grpo-kernels train names it"
quietly python -m pip install "$WHEEL[train]"
python -c "import tqdm, matplotlib; print('the train extra installs tqdm and matplotlib')"
python - <<'EOF'
import sys
sys.modules["triton"] = None  # as on a machine without triton: the import and the CPU path work
import torch
from grpo_kernels import GRPOLoss
out = GRPOLoss()(torch.randn(2, 3, 11, requires_grad=True), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3),
                 torch.tensor([1.0, -1.0]))
out.loss.backward()
print("without triton: the CPU path runs")
EOF
echo "wheel check: ok"
