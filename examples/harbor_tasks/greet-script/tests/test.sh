#!/bin/bash
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
script=/app/greet.sh
[ -x "$script" ] || { echo "greet.sh missing or not executable"; exit 0; }
[ "$("$script" Ada "Grace Hopper")" = "$(printf 'Hello, Ada!\nHello, Grace Hopper!')" ] || { echo "wrong greeting"; exit 0; }
out=$("$script" 2>/tmp/err); code=$?
[ "$code" = 2 ] && [ -z "$out" ] && grep -qx 'usage: greet.sh NAME...' /tmp/err || { echo "wrong usage error"; exit 0; }
echo 1 > /logs/verifier/reward.txt
