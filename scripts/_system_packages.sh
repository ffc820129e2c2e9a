# Sourced by test.sh: Debian packages some tests need (headless Chromium for the status page test,
# ping for the network emulation test). Installed only when missing, only as root with apt-get;
# elsewhere the tests that need them say what is missing.

ensure_system_packages() {
  local missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
  command -v ping >/dev/null 2>&1 || missing+=(iputils-ping)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "note: system packages ${missing[*]} are missing (tests that need them will skip)" >&2
    return 0
  fi
  echo "installing system packages: ${missing[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
