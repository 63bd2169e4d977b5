#!/bin/bash
mkdir -p /logs/verifier
expected="2026/DSC_10.png 2026/trip/Beach.jpg 2026/trip/map.png IMG_0001.jpg IMG_0002.jpeg notes.txt "
cd /app/photos 2>/dev/null && got=$(find . -type f | sed 's|^\./||' | LC_ALL=C sort | tr '\n' ' ')
ok=1
[ "$got" = "$expected" ] || ok=0
# contents kept: each file still says where it came from (its old name, case aside)
for f in $expected; do
  grep -qi "^content of $f\$" "/app/photos/$f" 2>/dev/null || ok=0
done
echo $ok > /logs/verifier/reward.txt
