# Numba's compiled CPU kernels carried between GPU-machine calls (sourced by the *_run.sh scripts): a fresh machine
# spends ~4-5 minutes compiling them. restore_numba_cache unpacks what an earlier run saved (carried in .numba-cache/,
# one numba-cache.tgz or its pieces numba-cache.tgz.part.*) into $NUMBA_CACHE_DIR, unless that exists already; Numba
# recompiles whatever does not match this machine's CPU and the sources. save_numba_cache DIR writes the cache of this
# tree's kernels (kernels/cpu/numba_cache.py names its folder by a digest of their sources; folders of other trees
# are left behind) into DIR in pieces of 15 MiB (a file that comes back from the machine may have 16 MiB at most).
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba}

restore_numba_cache() {
  [ -d "$NUMBA_CACHE_DIR" ] && return 0
  local parts=(.numba-cache/numba-cache.tgz.part.*)
  if [ -e "${parts[0]}" ]; then
    mkdir -p "$NUMBA_CACHE_DIR" && cat "${parts[@]}" | tar xz -C "$NUMBA_CACHE_DIR"
  elif [ -f .numba-cache/numba-cache.tgz ]; then
    mkdir -p "$NUMBA_CACHE_DIR" && tar xzf .numba-cache/numba-cache.tgz -C "$NUMBA_CACHE_DIR"
  fi
}

save_numba_cache() {
  local folder
  folder=$(python3 -c "from kernels.cpu.numba_cache import source_digest; print('cpu-kernels-' + source_digest())")
  [ -d "$NUMBA_CACHE_DIR/$folder" ] || folder=.  # (a cache not laid out by numba_cache.py: all of it)
  tar czf - -C "$NUMBA_CACHE_DIR" "./${folder#./}" 2>/dev/null | split -b 15m -d -a 1 - "$1/numba-cache.tgz.part."
}
