#!/bin/bash
# reward 1: one commit on main, message "Initial import", all files but build.log, build.log ignored, clean tree.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /app/project || exit 0
git rev-parse --verify -q refs/heads/main >/dev/null || exit 0
[ "$(git rev-list --count main)" = 1 ] || exit 0
[ "$(git log -1 --format=%s main)" = "Initial import" ] || exit 0
files=$(git ls-tree -r --name-only main | sort | tr '\n' ' ')
[ "$files" = ".gitignore README.md src/main.py " ] || exit 0
git check-ignore -q build.log || exit 0
[ -z "$(git status --porcelain)" ] || exit 0
echo 1 > /logs/verifier/reward.txt
