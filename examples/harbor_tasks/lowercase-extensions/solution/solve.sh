#!/bin/bash
find /app/photos -type f -name '*.*' | while read -r path; do
  ext=${path##*.}
  lower=$(printf '%s' "$ext" | tr '[:upper:]' '[:lower:]')
  [ "$ext" = "$lower" ] || mv "$path" "${path%.*}.$lower"
done
