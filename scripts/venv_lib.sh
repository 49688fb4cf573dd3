# Sourced by setup.sh and setup_sglang.sh: the one way this project builds its venvs.

# cached_venv REQUIREMENTS NAME [PIP_ARGS...]: build once, under
# ${WEIGHTSYNC_VENV_CACHE:-~/.cache/weightsync}/NAME-<hash of REQUIREMENTS>, a venv with those
# requirements (the heavy part, shared by every clone on the machine); sets $CACHED_VENV.
# A function named after_install, if defined, runs once after the install (with the venv's
# python as $1) and may fail the build.
cached_venv() {
  local req=$1 name=$2
  shift 2
  local key cache
  key=$(sha256sum "$req" | cut -c1-16)
  cache=${WEIGHTSYNC_VENV_CACHE:-$HOME/.cache/weightsync}
  CACHED_VENV="$cache/$name-$key"
  if [ ! -f "$CACHED_VENV/.complete" ]; then
    echo "setup: building $CACHED_VENV from $req (first run: minutes)" >&2
    local start
    start=$(date +%s)
    rm -rf "$CACHED_VENV"
    mkdir -p "$cache"
    "${WEIGHTSYNC_PYTHON:-python3.11}" -m venv "$CACHED_VENV"
    # pip warns about every missing local index folder; keep the log readable. The filter
    # must not hide pip's own failure (pipefail): a failed install is never marked complete.
    "$CACHED_VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel 2>&1 \
      | { grep -v "is ignored" >&2 || true; }
    "$CACHED_VENV/bin/python" -m pip install -q "$@" -r "$req" 2>&1 \
      | { grep -v "is ignored" >&2 || true; }
    if declare -F after_install >/dev/null; then
      after_install "$CACHED_VENV/bin/python"
    fi
    touch "$CACHED_VENV/.complete"
    echo "setup: built in $(( $(date +%s) - start )) s, $(du -sh "$CACHED_VENV" | cut -f1)" >&2
  fi
  # Earlier layouts installed a clone into the shared venv itself; that must not linger there.
  "$CACHED_VENV/bin/python" -m pip uninstall -q -y weightsync >/dev/null 2>&1 || true
}

# clone_venv CACHED DIR: make DIR a small venv of this clone that sees CACHED's packages (a
# .pth line) and has this checkout installed editable. The editable install must not live in
# the shared venv, or one clone's setup would point another clone's tests at its own code.
clone_venv() {
  local cached=$1 dir=$2 py site cached_site
  py=$("$cached/bin/python" -c 'import sys; print(sys.executable)')
  [ -L "$dir" ] && rm -f "$dir"
  if [ ! -x "$dir/bin/python" ] || ! cmp -s "$dir/.cached" <(echo "$cached"); then
    rm -rf "$dir"
    "$(readlink -f "$py")" -m venv --without-pip "$dir"
    echo "$cached" > "$dir/.cached"
  fi
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cached_site=$("$cached/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir (not a bare path) so the cached venv's own .pth files are processed too.
  echo "import site; site.addsitedir('$cached_site')" > "$site/_weightsync_cached_venv.pth"
  "$cached/bin/python" -m pip --python "$dir/bin/python" install -q --no-deps \
    --no-build-isolation -e . >/dev/null 2>&1 \
    || "$cached/bin/python" -m pip --python "$dir/bin/python" install --no-deps \
      --no-build-isolation -e .
}
