#!/usr/bin/env bash
# Install the system and Python packages the Mooncake storage backend needs on a CPU host.
#
# Idempotent: a second run only confirms that everything is present. CI calls it
# before the tests, so tests/test_storage_backends.py runs against a real
# Mooncake master instead of skipping. Quiet on success, loud (non-zero exit,
# the failing command's output) on failure.
#
#   bash .ci/install_system_deps.sh
#
# What it installs:
#   libibverbs1                          runtime library the Mooncake transfer engine links against,
#                                        even when it only speaks TCP (the only one missing from a
#                                        fresh Debian 12 image of this kind)
#   libnuma1 libcurl4                    also linked by the Mooncake binaries; present on the image
#                                        today, listed so a slimmer image still works
#   mooncake-transfer-engine-non-cuda    Python client (mooncake.store) + the mooncake_master binary
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

APT_PACKAGES=(libibverbs1 libnuma1 libcurl4)
PIP_PACKAGE="mooncake-transfer-engine-non-cuda"

run_quiet() {
    # Keep the output of a successful step out of the CI log; show all of it when a step fails.
    local log
    log="$(mktemp)"
    if ! "$@" >"$log" 2>&1; then
        echo "install_system_deps: FAILED: $*" >&2
        cat "$log" >&2
        rm -f "$log"
        exit 1
    fi
    rm -f "$log"
}

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

missing_apt=()
for pkg in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing_apt+=("$pkg")
    fi
done
if [ "${#missing_apt[@]}" -gt 0 ]; then
    run_quiet $SUDO apt-get update
    run_quiet $SUDO apt-get install -y --no-install-recommends "${missing_apt[@]}"
fi

if ! python -c "from mooncake.store import MooncakeDistributedStore" >/dev/null 2>&1; then
    run_quiet python -m pip install -q "$PIP_PACKAGE"
fi

# Fail here, not in the middle of the test run, if the install did not give us a usable client.
if ! import_error="$(python -c "from mooncake.store import MooncakeDistributedStore" 2>&1)"; then
    echo "install_system_deps: mooncake.store is not importable after the install:" >&2
    echo "$import_error" >&2
    exit 1
fi
echo "install_system_deps: libibverbs1 and $PIP_PACKAGE are ready"
