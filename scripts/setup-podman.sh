#!/usr/bin/env bash
# Optional: what `--sandbox podman --image .podman-rootfs` needs on a machine with no image registry in reach —
# rootful podman with runc (crun refuses hybrid cgroup machines), catatonit (its --init), and a Debian root file
# system made by debootstrap with bash and socat. tests/sandbox/test_podman.py runs when this has run, and is skipped
# (saying why) otherwise; scripts/test.sh does not call it (a few minutes and a Debian mirror).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOTFS=${POLAR_PODMAN_ROOTFS:-.podman-rootfs}
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-podman.sh: needs root and apt-get (Debian/Ubuntu)" >&2
    exit 1
fi
apt-get install -y -qq --no-install-recommends podman runc catatonit debootstrap >/dev/null
if [[ ! -x $ROOTFS/usr/bin/socat ]]; then
    debootstrap --variant=minbase --include=socat bookworm "$ROOTFS" >/dev/null
fi
chmod 755 "$ROOTFS/root"  # the toolchains under /root (pyenv) are bound below it: the session's user must pass
echo "setup-podman.sh: podman $(podman --version | cut -d' ' -f3), root file system at $ROOTFS"
