# Sourced: ensure_apt_packages NAME PKG... installs the Debian packages that are missing (as root), else fails
# with the apt-get command to run. NAME prefixes the messages. Used by cluster/local/build-horovod.sh and
# cluster/local/install-browser.sh.

ensure_apt_packages() {
  local name=$1 missing=() p
  shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "$name: ERROR: missing system packages: ${missing[*]}" \
      "(install them as root: apt-get install -y ${missing[*]})" >&2
    return 1
  fi
  echo "$name: installing system packages: ${missing[*]}"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >/dev/null || {
    echo "$name: ERROR: apt-get could not install: ${missing[*]}" >&2
    return 1
  }
}
