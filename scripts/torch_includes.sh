# Sourced by the compile-check scripts: sets PYTHON (argument 1, else .venv/bin/python, else python3)
# and TORCH_INCLUDE_FLAGS, the -I flags for torch's C++ headers and Python's headers.
PYTHON="${1:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
elif [[ "$PYTHON" == -* ]] || ! command -v "$PYTHON" >/dev/null; then
  echo "error: python=$PYTHON: not an interpreter (usage: $(basename "$0") [python])" >&2
  exit 2
fi
TORCH_INCLUDE_FLAGS=(-I"$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
for dir in $("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))'); do
  TORCH_INCLUDE_FLAGS+=(-I"$dir")
done
