# Checks of the figure scripts' settings (environment variables), sourced by scripts/*_figures.sh and
# scripts/glue_table.sh: every setting is checked before the first run starts (a sweep takes hours, and a typo
# found after it is hours lost), and a refusal is one `error:` line on stderr naming the variable, exit status 2.

refuse() { echo "error: $*" >&2; exit 2; }

# need_positive_int NAME: $NAME is 1, 2, ...
need_positive_int() {
  [[ ${!1} =~ ^[1-9][0-9]*$ ]] || refuse "$1=${!1}: must be a positive integer"
}

# need_flag NAME: $NAME is 0 or 1 (a `PLOT_ONLY=yes` would otherwise run every study)
need_flag() {
  [[ ${!1} == 0 || ${!1} == 1 ]] || refuse "$1=${!1}: must be 0 or 1"
}

# need_python: $PY runs Python (a path, or a command on PATH)
need_python() {
  command -v "$PY" >/dev/null 2>&1 && "$PY" -c "" 2>/dev/null ||
    refuse "PY=$PY: not a Python interpreter (run make install, or give PY=/path/to/python)"
}

# need_writable_dir NAME: $NAME is a folder that exists and can be written, or can be created
need_writable_dir() {
  local path=${!1} existing
  existing=$path
  while [ ! -e "$existing" ]; do existing=$(dirname "$existing"); done
  [ -d "$existing" ] || refuse "$1=$path: $existing is a file, not a folder"
  # tried, not guessed: `test -w` says yes to root under /proc and knows nothing of a read-only mount
  local probe
  probe=$(mktemp -d "$existing/.adls-probe-XXXXXX" 2>/dev/null) ||
    refuse "$1=$path: cannot write in $existing; give a folder you can write to"
  rmdir "$probe"
}

# need_no_arguments SCRIPT "$@": the script's settings are environment variables only
need_no_arguments() {
  local script=$1
  shift
  [ $# -eq 0 ] || refuse "$1: $script takes no arguments; its settings are environment variables (see its header)"
}
