#!/usr/bin/env bash
# Set up tier_utils in a Colab (or any Jupyter) runtime. Safe to run again: it updates, never re-clones.
#
#   bash colab_setup.sh                 # inside a checkout: installs that checkout
#   curl -fsSL <raw url>/colab_setup.sh | bash   # elsewhere: clones (or updates) the repository first
#   TIER_UTILS_QLORA=1 bash colab_setup.sh   # also the qlora extra (bitsandbytes: 4-bit bases, 8-bit AdamW)
#
# torch and numpy are never installed or upgraded: Colab's own builds stay, so no runtime restart.
# The package is installed without -e, so the running kernel imports it at once.
set -euo pipefail

# The one place the repository's address is written (the notebooks' Colab badges use the same owner/repo).
REPO_URL="${TIER_UTILS_REPO_URL:-https://github.com/OWNER/tier_utils}"
PYTHON="${PYTHON:-python3}"
KEEP=(torch numpy)  # installed by the runtime; replacing them corrupts a live Colab kernel

here="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" 2>/dev/null && pwd || pwd)"
if [[ -f "$here/pyproject.toml" && -d "$here/tier_utils" ]]; then
    repo="$here"
else
    repo="${TIER_UTILS_DIR:-$PWD/tier_utils}"
    if [[ -d "$repo/.git" ]]; then
        echo "updating $repo"
        git -C "$repo" pull -q --ff-only
    elif [[ -e "$repo" ]]; then
        echo "error: $repo exists but is not a git checkout; remove it or set TIER_UTILS_DIR" >&2
        exit 2
    else
        echo "cloning $REPO_URL into $repo"
        git clone -q --depth 1 "$REPO_URL" "$repo"
    fi
fi

pip install -q --no-deps "$repo"

# Runtime dependencies of the installed package that this environment lacks (or has too old),
# except torch and numpy; Colab already has most of them, so usually this is just optuna.
missing="$("$PYTHON" - "${KEEP[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, requires, version
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
keep = {k.lower() for k in sys.argv[1:]}
for line in requires("tier_utils") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an optional extra (tests), or not for this platform
    if req.name.lower() in keep:
        continue
    try:
        ok = req.specifier.contains(version(req.name), prereleases=True)
    except PackageNotFoundError:
        ok = False
    if not ok:
        print(str(req).replace(" ", ""))
EOF
)"
# Pin torch and numpy to the installed builds, so no dependency (ours, or the qlora extra's) pulls in a replacement.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$PYTHON" -c 'import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass' "${KEEP[@]}" > "$constraints"
if [[ -n "$missing" ]]; then
    # shellcheck disable=SC2086  # one requirement per word
    pip install -q -c "$constraints" $missing
fi

# The qlora extra when asked (QLoRA, --optimizer adamw8bit): bitsandbytes' wheel is about 40 MiB, so not by default.
# Its requirement is read from the installed package's metadata (pyproject.toml declares it once); torch and numpy
# stay pinned to the runtime's builds.
if [[ "${TIER_UTILS_QLORA:-0}" == "1" ]]; then
    qlora="$("$PYTHON" -c 'from importlib.metadata import requires
print(" ".join(r.split(";")[0].replace(" ", "") for r in requires("tier_utils") or [] if "qlora" in r.split(";", 1)[-1]))')"
    # shellcheck disable=SC2086  # one requirement per word
    pip install -q -c "$constraints" $qlora
fi

"$PYTHON" -m tier_utils info --no-progress
