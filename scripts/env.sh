# Sourced by scripts/run and scripts/test: installs what a fresh machine lacks and sets up the
# build caches. Safe to source again: every step checks before it acts.

# A bare environment (no HOME, no cargo on PATH) still finds the toolchain that rustup installed.
if [ -z "${HOME:-}" ]; then
  HOME="$(getent passwd "$(id -u)" | cut -d: -f6)"
  export HOME
fi
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null 2>&1 || { echo "error: cargo not found; install Rust with rustup first" >&2; exit 1; }

need_apt=()
# rust-rocksdb builds RocksDB's C++ itself (Debian's librocksdb is too old) with clang (below)
# and runs bindgen, which needs libclang; sccache caches the workspace's Rust compilation.
# rdkafka builds its bundled librdkafka with make and links zlib.
# openssl makes the kube tests' certificates; iproute2's ip sets up their network namespace.
for pkg in libclang-dev clang sccache make pkg-config zlib1g-dev openssl iproute2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing ${need_apt[*]} (apt)" >&2
  if [ "$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# The C and C++ that crates build with `cc` (RocksDB above all, librdkafka, libFuzzer) compile
# with clang, faster than g++ at -O0 (RocksDB's files in about 60% of the time). Set CC and CXX
# to use others.
export CC="${CC:-clang}" CXX="${CXX:-clang++}"

# Build outside the checkout, so that every clone on this machine shares one warm target dir.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ebb/target}"
export CARGO_INCREMENTAL=0
# sccache caches the workspace's own crates, which a fresh clone compiles again (cargo goes by the
# files' times), as the workspace wrapper. Not every crate: the dependencies stay built in the
# target dir, a cold cache only slows a first build, and through RUSTC_WRAPPER `cc` would put the
# C and C++ through it too (RocksDB then took 11 minutes on 2 cores instead of 8.5, cold).
if command -v sccache >/dev/null 2>&1 && [ -z "${RUSTC_WRAPPER:-}" ]; then
  export RUSTC_WORKSPACE_WRAPPER="${RUSTC_WORKSPACE_WRAPPER:-sccache}"
  export SCCACHE_CACHE_SIZE="${SCCACHE_CACHE_SIZE:-20G}"
fi
