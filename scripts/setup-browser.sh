#!/usr/bin/env bash
# Debian's Chromium for the report's page test (tests/report/test_browser.py drives it through Playwright; Playwright's
# own browser download is never used). Idempotent: nothing to do once `chromium` is on PATH.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-browser.sh: chromium not found and cannot apt-get install it here (root + apt needed);" \
         "tests/report/test_browser.py will fail" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
