#!/usr/bin/env bash
# Headless Chromium for the docs env's browser check (tests/docs/test_site.py), from Debian's packages.
# Installs only when it is missing and this is root on a Debian-like system; otherwise says why and leaves the
# verdict to the test (it skips saying why, or fails when REQUIRE_BROWSER=1, as tox sets by default).
set -euo pipefail
for b in chromium chromium-browser google-chrome; do
    if command -v "$b" >/dev/null; then echo "browser: $(command -v "$b")"; exit 0; fi
done
if [ "$(id -u)" != 0 ]; then echo "browser: no chromium, and not root: not installing it"; exit 0; fi
if ! command -v apt-get >/dev/null; then echo "browser: no chromium, and no apt-get (not Debian): not installing it"; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium >/dev/null
echo "browser: installed $(command -v chromium)"
