# Sourced by the GPU scripts: `need_python_packages PYTHON MODULE...` installs from wheels/
# (scripts/gpu_wheels.sh fills it where pip reaches an index; carry it to the GPU machine) each
# named module that does not import: grain (the data pipeline), tyro (train.py's and decode.py's
# command lines). Returns non-zero, saying why, where one stays missing.
need_python_packages() {
    local py=$1 missing=() m
    shift
    for m in "$@"; do "$py" -c "import $m" 2>/dev/null || missing+=("$m"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ ! -d wheels ]; then
        echo "error: ${missing[*]} do(es) not import and wheels/ is missing: run scripts/gpu_wheels.sh where pip reaches an index and carry wheels/" >&2
        return 1
    fi
    "$py" -m pip install -q --no-index --find-links wheels "${missing[@]}" || {
        echo "error: pip could not install ${missing[*]} from wheels/" >&2; return 1; }
}
