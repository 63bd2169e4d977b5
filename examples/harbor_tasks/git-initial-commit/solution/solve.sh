#!/bin/bash
set -e
cd /app/project
git init -q -b main
echo build.log > .gitignore
git add -A
git -c user.name=oracle -c user.email=oracle@example.com commit -q -m "Initial import"
