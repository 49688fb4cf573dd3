# Sourced by setup.sh and setup_sglang.sh. clone_venv CACHED DIR: make DIR a small venv of this
# clone that sees CACHED's packages (a .pth line) and has this checkout installed editable.
# The heavy cached venv is shared by every clone on the machine; the editable install must not
# be, or one clone's setup would silently point another clone's tests at its own code.
clone_venv() {
  local cached=$1 dir=$2 py
  py=$("$cached/bin/python" -c 'import sys; print(sys.executable)')
  [ -L "$dir" ] && rm -f "$dir"
  if [ ! -x "$dir/bin/python" ] || ! cmp -s "$dir/.cached" <(echo "$cached"); then
    rm -rf "$dir"
    "$(readlink -f "$py")" -m venv --without-pip "$dir"
    echo "$cached" > "$dir/.cached"
  fi
  local site
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  local cached_site
  cached_site=$("$cached/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir (not a bare path) so the cached venv's own .pth files are processed too.
  echo "import site; site.addsitedir('$cached_site')" > "$site/_weightsync_cached_venv.pth"
  "$cached/bin/python" -m pip --python "$dir/bin/python" install -q --no-deps \
    --no-build-isolation -e . >/dev/null 2>&1 \
    || "$cached/bin/python" -m pip --python "$dir/bin/python" install --no-deps \
      --no-build-isolation -e .
}
