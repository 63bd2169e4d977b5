#!/bin/bash
cat > /app/greet.sh <<'SCRIPT'
#!/bin/bash
if [ $# -eq 0 ]; then
  echo "usage: greet.sh NAME..." >&2
  exit 2
fi
for name in "$@"; do
  printf 'Hello, %s!\n' "$name"
done
SCRIPT
chmod +x /app/greet.sh
